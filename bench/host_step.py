"""Micro-benchmark: the optimizer step on the host CPU ([full] streamed_step = "host"), per setting.

    python bench/host_step.py                          # one 3072 x 12288 weight (a Flux MLP Linear)
    python bench/host_step.py --out bench/results/host_step.json
    python bench/host_step.py --compare                # beside torch's fused CPU AdamW (and DeepSpeed's
                                                       # CPU Adam where its op is already built)
    python bench/host_step.py --compare --rows 1024 --cols 1024 --repeat 9   # a quick check that it runs

What it times: the host step (per-parameter clipping to norm 1, then FusedOptimizer.step_param) on
one weight held in host memory, as it runs for each trained tensor of a streamed block, --repeat
times after a first step that creates the state and one untimed round of every optimizer, in the
two forms a run has:
- the headline (`seconds`, `ratio_vs_torch_fused=`): a GPU run without gradient accumulation, where
  the device takes the clipping norm before the gradient's copy (trainable_streaming.step_on_host)
  and the host clips by it: here that norm is taken once, outside the timing;
- `host norm` (`ratio_host_norm=`): the host takes the norm itself (gradient accumulation > 1, whose
  host accumulator is added first; a CPU compute device): one more pass over the gradient.
With --compare the peers are torch's `AdamW(fused=True)` step on fp32 tensors of the same size (the
fused CPU kernel: fp32 weights, grads and moments) and DeepSpeed's CPU Adam (bf16 or fp32 params,
fp32 moments) when its op is already built (it is never built here: minutes of compiling).

How (the machine may be loaded by others): within a setting, each repetition times every
optimizer once, in turn (leantune, leantune with the host norm, then each peer), the order rotated
by one per repetition so that none always goes first; each ratio is taken per repetition, between
timings a few milliseconds apart, and the report gives the median of the per-repetition values
with their range (min-max). Seconds and parameters per second are medians too (the best time is
kept as `seconds_min`). Before, each row kept each optimizer's best of --repeat and divided the
bests, so one lucky timing of either side under load moved a ratio by 2x or more.
Reported per setting: seconds, parameters per second, and what that rate makes of one step of
Flux-dev's 11.9 B weights; the host's instruction set (the CPU flags avx2 / avx512f / avx512bw /
avx512_bf16 / amx_bf16) heads the output and the JSON: rates depend on it (DeepSpeed's CPU Adam
steps bf16 parameters with AVX-512 only, on an AVX2 host it falls back to a scalar loop). The
planner times the same update on a smaller tensor (planner/full_model.host_step_rate), printed
beside it, so a plan's predicted host-step time can be checked against this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # time this checkout's leantune

FLUX_DEV_PARAMS = 11.9e9
SETTINGS = [  # (label, weight dtype, optimizer, state dtype, master weights)
    ("bf16 weights, AdamW bf16 moments", torch.bfloat16, "adamw", "bf16", False),
    ("bf16 weights, AdamW fp32 moments", torch.bfloat16, "adamw", "fp32", False),
    ("bf16 weights, AdamW fp32 moments + fp32 masters", torch.bfloat16, "adamw", "fp32", True),
    ("bf16 weights, Adafactor", torch.bfloat16, "adafactor", "fp32", False),
    ("fp32 weights, AdamW fp32 moments", torch.float32, "adamw", "fp32", False),
    ("fp32 weights, AdamW bf16 moments", torch.float32, "adamw", "bf16", False),
    ("fp32 weights, Adafactor", torch.float32, "adafactor", "fp32", False),
]


def leantune_step(shape, dtype, optimizer, state_dtype, master):
    """Two callables running one host step (clipping + FusedOptimizer.step_param) on a host weight:
    with the clipping norm handed over (as from the device), and with the host taking it."""
    from leantune.train.fused_optim import FusedOptimizer
    from leantune.train.in_backward import InBackwardStep

    lin = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    opt = FusedOptimizer(lin, {"weight": lin.weight}, optimizer, lr=1e-4, state_dtype=state_dtype,
                         stochastic_rounding=True, master_weights=master)
    stepper = InBackwardStep(opt, [], max_grad_norm=1.0)
    grad = (torch.randn(shape) * 1e-3).to(dtype)
    norm = float(torch.linalg.vector_norm(grad, dtype=torch.float32))     # what the device hands over
    with torch.no_grad():
        stepper._update(lin.weight, grad)      # state created
    return (lambda: stepper._step(lin.weight, grad, grad_norm=norm)), (lambda: stepper._update(lin.weight, grad))


def torch_fused_step(shape):
    """torch's AdamW(fused=True) on fp32 CPU tensors of this shape."""
    p = torch.nn.Parameter(torch.randn(shape) * 0.02)
    p.grad = torch.randn(shape) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    return opt.step


def deepspeed_step(shape, dtype):
    """DeepSpeed's CPU Adam on this dtype's params, or None where its op is not built already."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        if not CPUAdamBuilder().is_compatible() or not _built(CPUAdamBuilder()):
            return None
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001  (not installed, or not built here)
        return None
    p = torch.nn.Parameter((torch.randn(shape) * 0.02).to(dtype))
    p.grad = (torch.randn(shape) * 1e-3).to(dtype)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
    opt.step()
    return opt.step


def _built(builder) -> bool:
    import glob

    from torch.utils.cpp_extension import _get_build_directory

    d = _get_build_directory(builder.name, verbose=False)
    return bool(glob.glob(os.path.join(d, "*.so")))


def host_isa() -> str:
    """The instruction-set flags that decide these rates, from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    have = [f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16") if f in flags]
    return " ".join(have) if have else "none of avx2/avx512f/avx512bw/avx512_bf16/amx_bf16"


def interleaved(fns: list, repeat: int) -> list[list[float]]:
    """Seconds of each callable in each repetition: repetition r calls every callable once, in
    turn, starting at callable r % len(fns) (rotating order), after one untimed round of them all
    (the first call after another setting's allocations pays for cold pages and caches).
    Returns times[callable][repetition]."""
    k = len(fns)
    times = [[0.0] * repeat for _ in fns]
    with torch.no_grad():
        for fn in fns:
            fn()
        for r in range(repeat):
            for j in range(k):
                i = (r + j) % k
                t0 = time.perf_counter()
                fns[i]()
                times[i][r] = time.perf_counter() - t0
    return times


def spread(values: list[float]) -> dict:
    """Median and range of per-repetition values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--compare", action="store_true", help="time torch's fused AdamW (and DeepSpeed's) beside it")
    ap.add_argument("--only", default="", help="time only the settings whose label contains this text")
    a = ap.parse_args(argv)
    from leantune.planner.full_model import host_step_rate
    from leantune.train import host_kernels

    torch.manual_seed(0)
    shape = (a.rows, a.cols)
    n = a.rows * a.cols
    isa = host_isa()
    load_start = os.getloadavg()
    print(f"shape {shape}, {torch.get_num_threads()} threads, load {load_start}, ISA: {isa}, host kernels: "
          f"{'built' if host_kernels.library() else host_kernels.unavailable_reason()}", flush=True)
    peers = {}
    if a.compare:
        peers["torch_fused"] = torch_fused_step(shape)
        for dt, label in ((torch.bfloat16, "deepspeed_cpu_adam_bf16"), (torch.float32, "deepspeed_cpu_adam_fp32")):
            ds = deepspeed_step(shape, dt)
            if ds is not None:
                peers[label] = ds
        if len(peers) == 1:
            print("DeepSpeed CPU Adam: not timed (its op is not built on this machine)", flush=True)
    print(f"each value: the median of {a.repeat} interleaved repetitions (rotating order); ratios per "
          f"repetition, median (min-max)", flush=True)
    rows = []
    for label, dtype, optimizer, state_dtype, master in SETTINGS:
        if a.only not in label:
            continue
        ours, ours_host_norm = leantune_step(shape, dtype, optimizer, state_dtype, master)
        times = interleaved([ours, ours_host_norm, *peers.values()], a.repeat)
        secs, secs_host = statistics.median(times[0]), statistics.median(times[1])
        planner = host_step_rate(optimizer, dtype, state_dtype, True, master, True, norm_from_device=True)
        row = {"setting": label, "seconds": secs, "seconds_min": min(times[0]), "params_per_s": n / secs,
               "planner_params_per_s": planner, "seconds_host_norm": secs_host,
               "flux_dev_step_s": FLUX_DEV_PARAMS / (n / secs), "seconds_per_repetition": times[0],
               "seconds_host_norm_per_repetition": times[1]}
        for (name, _), t in zip(peers.items(), times[2:]):
            row[f"{name}_params_per_s"] = n / statistics.median(t)
            row[f"{name}_seconds_per_repetition"] = t
        line = (f"{label:50s} {secs * 1e3:7.1f} ms  {n / secs / 1e6:6.1f} M/s  (host norm {secs_host * 1e3:6.1f} ms; "
                f"planner's timing: {planner / 1e6:6.1f} M/s)  Flux-dev step {row['flux_dev_step_s']:6.0f} s")
        if peers:
            fused = times[2]
            ratios = {"ratio_vs_torch_fused": spread([f / o for f, o in zip(fused, times[0])]),
                      "ratio_host_norm": spread([f / o for f, o in zip(fused, times[1])])}
            for (name, _), t in list(zip(peers.items(), times[2:]))[1:]:      # DeepSpeed against torch's
                ratios[f"{name}_vs_torch_fused"] = spread([f / d for f, d in zip(fused, t)])
            for key, r in ratios.items():
                row[key] = r["median"]
                row[f"{key}_range"] = [r["min"], r["max"]]
            line += "  " + "  ".join(f"{k}={row[f'{k}_params_per_s'] / 1e6:.1f} M/s" for k in peers)
            line += "  " + "  ".join(f"{k}={r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
                                     for k, r in ratios.items())
        rows.append(row)
        print(line, flush=True)
    if a.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        meta = {"date": datetime.date.today().isoformat(), "commit": commit, "command": " ".join(sys.argv),
                "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                "load_start": load_start, "isa": isa, "shape": list(shape), "repeat": a.repeat,
                "estimator": "median of interleaved repetitions (rotating order); ratios per repetition, "
                             "median and range"}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
