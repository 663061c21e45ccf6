"""A full-size model on the simulated GPU, any family: does the planner's plan fit its budget, and
how close is the planner's predicted peak to the bytes the real engine keeps on the device?

The same measurement as bench/simulate_flux.py (read its docstring), for `--model flux-dev |
sd3.5-large | sd3.5-medium`: the architecture is built on meta through its family from the config
shipped in leantune/models/configs/, the trainer's step and the sampler's denoise run through the
family's `predict`, with its text rows (Flux: 512 T5 tokens; SD3.5: 77 CLIP rows + 256 T5 tokens)
and latents. Sampling a family with classifier-free guidance (SD3.5) plans, as `leantune sample`
does, for the doubled batch (negative and positive prompt in one forward) and runs it so; where no
plan fits that, for one half at a time (the "CFG" column says which ran).

    python bench/simulate.py --model sd3.5-large --out bench/results/simulate_sd35_large.json
    python bench/simulate.py --model sd3.5-large --budgets 8 24 --cases train1024 sample1024
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from simulate_flux import _commit, _gib  # noqa: E402  (bench/ is a folder of scripts, not a package)

GiB = 2**30
CASES = {"train1024": ("train", 1024), "train512": ("train", 512), "sample1024": ("sample", 1024)}
MODELS = ("flux-dev", "sd3.5-large", "sd3.5-medium")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="flux-dev")
    p.add_argument("--budgets", type=float, nargs="+", default=[4, 6, 8, 12, 16, 24], help="GiB")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--out", type=Path, default=None, help="JSON results (written after every case)")
    args = p.parse_args(argv)

    from leantune.memory.simulated import SimulatedDeviceUnavailable, enable

    try:
        enable()                      # before anything runs a backward (see simulated.enable)
    except SimulatedDeviceUnavailable as e:
        print(f"simulate: the simulated device is unavailable here: {e}", file=sys.stderr)
        return 2
    from leantune.memory.simulated_run import planned_case

    meta = {"date": datetime.date.today().isoformat(), "commit": _commit(), "command": " ".join(sys.argv),
            "model": args.model, "device": "simulated GPU on CPU (fake tensors)"}
    rows = []
    for case in args.cases:
        for budget in args.budgets:
            what, size = CASES[case]
            t0 = time.perf_counter()
            row = planned_case(what, size, int(budget * GiB), model_name=args.model)
            row["case"], row["wall_s"] = case, time.perf_counter() - t0
            rows.append(row)
            print(_line(row), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    print()
    print(markdown(sorted(rows, key=lambda r: (list(CASES).index(r["case"]), r["budget"]))))
    return 0


def _line(r: dict) -> str:
    head = f"{r['model']} {r['case']:>10} {r['budget'] / GiB:5.1f} GiB: "
    if "infeasible" in r:
        return head + f"no plan fits (needs {_gib(r['needed'])} GiB)"
    cfg = "" if r.get("cfg_batched") is None else f", CFG {'batched' if r['cfg_batched'] else 'halves'}"
    return head + (f"{r['plan']}{cfg}; predicted {_gib(r['predicted'] - r['workspace'])} GiB "
                   f"(+{_gib(r['workspace'])} workspace), simulated {_gib(r['simulated'])} GiB, "
                   f"ratio {r['ratio']:.3f} ({r['wall_s']:.0f} s)")


def markdown(rows: list[dict]) -> str:
    """The docs/benchmarks.md table."""
    out = ["| case | budget GiB | plan chosen by the planner | CFG | predicted GiB (tensors) | + workspace | "
           "allocator margin | simulated peak GiB | predicted / simulated | simulated + workspace ≤ budget |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "infeasible" in r:
            out.append(f"| {r['case']} | {r['budget'] / GiB:g} | no plan fits: needs {_gib(r['needed'])} GiB | | | | "
                       f"{_gib(r['margin'])} | | | |")
            continue
        plan = r["plan"]            # Plan.describe(): streamed blocks, fp8 (+ modulation), checkpointing, ring
        cfg = {None: "", True: "batched (x2)", False: "halves"}[r.get("cfg_batched")]
        fits = "yes" if r["simulated"] + r["workspace"] <= r["budget"] else "**no**"
        out.append(f"| {r['case']} | {r['budget'] / GiB:g} | {plan} | {cfg} | {_gib(r['predicted'] - r['workspace'])} "
                   f"| {_gib(r['workspace'])} | {_gib(r['margin'])} | {_gib(r['simulated'])} | {r['ratio']:.3f} "
                   f"| {fits} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
