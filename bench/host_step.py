"""Micro-benchmark: the optimizer step on the host CPU ([full] streamed_step = "host"), per setting.

    python bench/host_step.py                          # one 3072 x 12288 weight (a Flux MLP Linear)
    python bench/host_step.py --out bench/results/host_step.json

What it times: `InBackwardStep._update` (per-parameter clipping, then FusedOptimizer.step_param) on
one weight held in host memory, as the host step runs it for each trained tensor of a streamed
block, best of --repeat after a first step that creates the state. Reported per setting: seconds,
parameters per second, and what that rate makes of one step of Flux-dev's 11.9 B weights. The
planner times the same update on a smaller tensor (planner/full_model.host_step_rate), printed
beside it, so a plan's predicted host-step time can be checked against this.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

FLUX_DEV_PARAMS = 11.9e9
SETTINGS = [  # (label, weight dtype, optimizer, state dtype, master weights)
    ("bf16 weights, AdamW bf16 moments", torch.bfloat16, "adamw", "bf16", False),
    ("bf16 weights, AdamW fp32 moments", torch.bfloat16, "adamw", "fp32", False),
    ("bf16 weights, AdamW fp32 moments + fp32 masters", torch.bfloat16, "adamw", "fp32", True),
    ("bf16 weights, Adafactor", torch.bfloat16, "adafactor", "fp32", False),
    ("fp32 weights, AdamW fp32 moments", torch.float32, "adamw", "fp32", False),
]


def time_update(shape, dtype, optimizer, state_dtype, master, repeat: int) -> float:
    from leantune.train.fused_optim import FusedOptimizer
    from leantune.train.in_backward import InBackwardStep

    lin = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    opt = FusedOptimizer(lin, {"weight": lin.weight}, optimizer, lr=1e-4, state_dtype=state_dtype,
                         stochastic_rounding=True, master_weights=master)
    stepper = InBackwardStep(opt, [], max_grad_norm=1.0)
    grad = (torch.randn(shape) * 1e-3).to(dtype)
    best = math.inf
    with torch.no_grad():
        stepper._update(lin.weight, grad)
        for _ in range(repeat):
            t0 = time.perf_counter()
            stepper._update(lin.weight, grad)
            best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=12288)
    ap.add_argument("--cols", type=int, default=3072)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    from leantune.planner.full_model import host_step_rate

    torch.manual_seed(0)
    shape = (a.rows, a.cols)
    n = a.rows * a.cols
    rows = []
    for label, dtype, optimizer, state_dtype, master in SETTINGS:
        secs = time_update(shape, dtype, optimizer, state_dtype, master, a.repeat)
        planner = host_step_rate(optimizer, dtype, state_dtype, True, master, True)
        row = {"setting": label, "seconds": secs, "params_per_s": n / secs, "planner_params_per_s": planner,
               "flux_dev_step_s": FLUX_DEV_PARAMS / (n / secs)}
        rows.append(row)
        print(f"{label:50s} {secs * 1e3:7.0f} ms  {n / secs / 1e6:6.1f} M/s  (planner's timing: {planner / 1e6:6.1f} M/s)"
              f"  Flux-dev step {row['flux_dev_step_s']:6.0f} s", flush=True)
    if a.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        meta = {"date": datetime.date.today().isoformat(), "commit": commit, "command": " ".join(sys.argv),
                "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                "shape": list(shape)}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
