"""What a LoRA optimizer step allocates beside its parameters, gradients and state, per optimizer.

The planner prices the LoRA step's temporaries at twice the adapter's fp32 bytes for every
optimizer (planner/memory_model.py, "optimizer step"). This measures the real figure on the tiny
Flux (2 double + 2 single blocks, rank-4 LoRA on every block Linear): one warm-up step creates the
state, then the live bytes of a second step are tracked by memory/simulated.DeviceMemoryTracker (a
torch dispatch mode counting storages as an allocator without rounding sees them), with the
foreach choice torch makes on CUDA (memory/simulated.foreach_as_on_cuda). CPU kernels, so
bitsandbytes' 8-bit step is its CPU backend's.

    python bench/lora_step_temporaries.py

Prints one line per optimizer: its step's peak above what was live before it, and that over the
adapter's fp32 bytes (the planner's price is 2.0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leantune import tiny  # noqa: E402
from leantune.config import LoraConfig, TrainConfig  # noqa: E402
from leantune.memory.simulated import DeviceMemoryTracker, foreach_as_on_cuda  # noqa: E402
from leantune.models.flux import FLUX_SPEC  # noqa: E402
from leantune.train.lora import add_lora  # noqa: E402
from leantune.train.optim import build_optimizer  # noqa: E402

OPTIMIZERS = [("adamw", {}), ("adafactor", {}), ("adamw8bit", {}), ("prodigy", {"learning_rate": 1.0}),
              ("schedulefree_adamw", {}), ("came", {})]


def main() -> None:
    torch.manual_seed(0)
    model = tiny.flux_transformer(num_layers=2, num_single_layers=2).requires_grad_(False)
    params = add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="all"))
    adapter = sum(p.numel() * 4 for p in params)
    print(f"adapter: {len(params)} tensors, {adapter} bytes in fp32 (largest {max(p.numel() * 4 for p in params)})")
    for name, extra in OPTIMIZERS:
        for p in params:
            p.data.normal_()
            p.grad = torch.randn_like(p)
        opt = build_optimizer(params, TrainConfig(optimizer=name, **extra))
        opt.step()                                   # the state exists before the measured step
        tracker = DeviceMemoryTracker()
        with foreach_as_on_cuda(), tracker:
            for p in params:
                p.grad = torch.randn_like(p)
            tracker.reset_peak()
            before = dict(tracker.live)
            opt.step()
        extra_bytes = max((tracker.peak[d] - before.get(d, 0) for d in tracker.peak), default=0)
        print(f"{name:20s} step temporaries {extra_bytes:8d} bytes = {extra_bytes / adapter:.2f} x the adapter")


if __name__ == "__main__":
    main()
