"""Full-size Flux.1-dev on the simulated GPU: does the planner's plan fit its budget, and how close
is the planner's predicted peak to the bytes the real engine keeps on the device?

For each VRAM budget and case (a LoRA training step at 512 and at 1024 px, a sampling step at
1024 px) the planner chooses a plan as `leantune train` / `leantune sample` would (assumed GPU
rates, a 64 GiB host-RAM budget), the real engine runs it on fake tensors
(leantune/memory/simulated.py: streaming, slots, fp8, checkpointing, offload, LoRA, AdamW, the
trainer's step and the sampler's denoise), and the peak bytes live on the simulated GPU over one
step are recorded (training: with the optimizer's states already created, i.e. a steady-state
step). Each case takes 1-4 minutes and about 0.5 GiB of RAM on a 2-core CPU.

The comparison leaves out what the simulation cannot see: the planner's workspace term (cuBLAS /
attention workspaces) is listed apart, and so is the budget's margin for the CUDA caching allocator
(rounding, fragmentation), which this simulation does not model; nor does it see the CUDA context.

    python bench/simulate_flux.py --out bench/results/simulate_flux.json
    python bench/simulate_flux.py --budgets 8 --cases train1024     # one cell
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

GiB = 2**30
CASES = {"train1024": ("train", 1024), "train512": ("train", 512), "sample1024": ("sample", 1024)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[4, 6, 8, 12, 16, 24], help="GiB")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--out", type=Path, default=None, help="JSON results (written after every case)")
    args = p.parse_args(argv)

    from leantune.memory.simulated import SimulatedDeviceUnavailable, enable

    try:
        enable()                      # before anything runs a backward (see simulated.enable)
    except SimulatedDeviceUnavailable as e:
        print(f"simulate_flux: the simulated device is unavailable here: {e}", file=sys.stderr)
        return 2
    from leantune.memory.simulated_run import planned_case

    meta = {"date": datetime.date.today().isoformat(), "commit": _commit(), "command": " ".join(sys.argv),
            "device": "simulated GPU on CPU (fake tensors)"}
    rows = []
    for budget in args.budgets:
        for case in args.cases:
            what, size = CASES[case]
            t0 = time.perf_counter()
            row = planned_case(what, size, int(budget * GiB))
            row["case"], row["wall_s"] = case, time.perf_counter() - t0
            rows.append(row)
            print(_line(row), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    print()
    print(markdown(sorted(rows, key=lambda r: (list(CASES).index(r["case"]), r["budget"]))))
    return 0


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _line(r: dict) -> str:
    head = f"{r['case']:>10} {r['budget'] / GiB:5.1f} GiB: "
    if "infeasible" in r:
        return head + f"no plan fits (needs {_gib(r['needed'])} GiB)"
    return head + (f"{r['plan']}; predicted {_gib(r['predicted'] - r['workspace'])} GiB (+{_gib(r['workspace'])} "
                   f"workspace), simulated {_gib(r['simulated'])} GiB, ratio {r['ratio']:.3f} ({r['wall_s']:.0f} s)")


def markdown(rows: list[dict]) -> str:
    """The docs/benchmarks.md table."""
    out = ["| case | budget GiB | plan chosen by the planner | predicted GiB (tensors) | + workspace | "
           "allocator margin | simulated peak GiB | predicted / simulated | simulated ≤ budget |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "infeasible" in r:
            out.append(f"| {r['case']} | {r['budget'] / GiB:g} | no plan fits: needs {_gib(r['needed'])} GiB | | | "
                       f"{_gib(r['margin'])} | | | |")
            continue
        plan = (f"{r['streamed']} blocks streamed{' + non-blocks' if r['stream_non_blocks'] else ''}, "
                f"ring {r['ring']}, fp8 {'on' if r['fp8'] else 'off'}"
                f"{' + modulation' if r.get('fp8_modulation') else ''}, checkpointing {r['checkpointing']}")
        fits = "yes" if r["simulated"] <= r["budget"] else "**no**"
        out.append(f"| {r['case']} | {r['budget'] / GiB:g} | {plan} | {_gib(r['predicted'] - r['workspace'])} | "
                   f"{_gib(r['workspace'])} | {_gib(r['margin'])} | {_gib(r['simulated'])} | {r['ratio']:.3f} | {fits} |")
    return "\n".join(out)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
