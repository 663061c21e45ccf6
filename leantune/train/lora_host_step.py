"""A LoRA's optimizer step on the host ([lora] optimizer_step = "host", or "auto" where the planner
chose it: Plan.optimizer_on_host in a LoRA run).

What it trades: the adapters' optimizer state (AdamW: two fp32 moments per parameter, 0.6-1.1 GiB
for a rank-32 LoRA of a 7-14B model) leaves the GPU, and so do the step's temporaries; in exchange
every optimizer step copies the adapters' gradients to the host and their updated weights back
(4 bytes per parameter each way over PCIe) and waits for the CPU's step, which cannot start before
backward has finished (a global-norm clip needs every gradient). A LoRA is small, so that wait is
tens of milliseconds on a desktop CPU; the planner prices it (planner/memory_model.py, timing at the
rate `measured_rate` times on the planning machine) and under "auto" takes it only where no
device-step plan fits or it is faster.

How it works: the host holds an fp32 copy of every trained adapter tensor (pinned when the adapters
live on a CUDA device) and the gradient staging beside it, and the run's optimizer
(train/optim.build_optimizer) is built over those host copies: the learning-rate schedule, the
optimizer's state_dict and exact resume are the optimizer's as in a device-step run. `step()`:
each device gradient is copied into its staging tensor (non-blocking, then one wait) and freed,
the gradients are clipped to [train] max_grad_norm by their global norm on the host, the optimizer
steps, and each updated host copy is copied back into its device adapter (non-blocking from pinned
memory: ordered before the next forward on the same stream, and the host copy is not written again
before the next step's gradient copy has waited on that stream).

The arithmetic: Adafactor is torch's on the host tensors; AdamW with fp32 adapters uses torch's
fused CPU AdamW (`AdamW(fused=True)`, the kernel the full fine-tune's host step uses for fp32
weights with fp32 moments, train/fused_optim.py), several times faster than torch's single-tensor
loop and within a few fp32 ulp of it (the rate the planner prices: docs/benchmarks.md). With
`fused=False` the host step is operation for operation the device step a CPU device runs, so on a
CPU device the two give bitwise the same adapters and losses (tests/test_lora_host_step.py).

How it differs from others: kohya's sd-scripts and ai-toolkit keep a LoRA's optimizer on the
GPU (their 8-bit optimizers shrink it); DeepSpeed's ZeRO-Offload steps on the CPU with its own
CPU Adam, for whole models and only under DeepSpeed.
"""

from __future__ import annotations

import math
import time

import torch

from ..config import LORA_HOST_STEP_OPTIMIZERS, TrainConfig
from .optim import build_optimizer


def _pinned(device_params: list[torch.nn.Parameter]) -> bool:
    return any(p.device.type == "cuda" for p in device_params) and torch.cuda.is_available()


def _host_device(device_params: list[torch.nn.Parameter]) -> torch.device:
    """The CPU, or the simulated GPU's host RAM for adapters on the simulated GPU
    (memory/simulated.py: its host is a second index of the fake backend)."""
    from ..memory.simulated import BACKEND, HOST

    if any(p.device.type == BACKEND for p in device_params):
        return torch.device(HOST)
    return torch.device("cpu")


# AdamW on the host through torch's fused CPU kernel (module docstring); False: the device step's
# single-tensor loop, bitwise a CPU device's step (tests set it so to compare bit for bit).
FUSED_ADAMW = True


def build_host_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, fused: bool | None = None):
    """The run's optimizer over host tensors: as train/optim.build_optimizer builds it, AdamW with
    torch's fused CPU kernel unless `fused` is False."""
    if cfg.optimizer not in LORA_HOST_STEP_OPTIMIZERS:
        raise ValueError(f"[lora] optimizer_step = \"host\": [train] optimizer = {cfg.optimizer!r} has no host step "
                         f"(one of {', '.join(LORA_HOST_STEP_OPTIMIZERS)})")
    if cfg.optimizer == "adamw" and (FUSED_ADAMW if fused is None else fused):
        return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay, fused=True)
    return build_optimizer(params, cfg)


class LoraHostStep:
    """The host copies of the trained adapters, their gradient staging, and the optimizer over them."""

    def __init__(self, device_params: list[torch.nn.Parameter], cfg: TrainConfig, fused: bool | None = None):
        self.device_params = list(device_params)
        pin = _pinned(self.device_params)
        host = _host_device(self.device_params)
        self.host_params = [torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device=host,
                                                           pin_memory=pin)) for p in self.device_params]
        self.staging = [torch.empty(p.shape, dtype=torch.float32, device=host, pin_memory=pin)
                        for p in self.device_params]
        self.pull_weights()
        self.optimizer = build_host_optimizer(self.host_params, cfg, fused)

    @property
    def host_bytes(self) -> int:
        """Host RAM of the copies and the staging (the optimizer's state comes on top)."""
        return sum(8 * p.numel() for p in self.host_params)

    def pull_weights(self) -> None:
        """Host copies := the device adapters (at set-up, and after a resume loaded them)."""
        with torch.no_grad():
            for d, h in zip(self.device_params, self.host_params):
                h.copy_(d.detach())

    def zero_grad(self) -> None:
        for d, h in zip(self.device_params, self.host_params):
            d.grad = None
            h.grad = None

    def step(self, max_grad_norm: float) -> None:
        """Gradients to the host, clip, the optimizer's step there, updated adapters back."""
        with torch.no_grad():
            on_cuda = False
            for d, h, g in zip(self.device_params, self.host_params, self.staging):
                if d.grad is None:          # a part whose adapter did not run this step: skipped, as on the device
                    h.grad = None
                    continue
                on_cuda |= d.grad.device.type == "cuda"
                g.copy_(d.grad, non_blocking=True)
                h.grad = g
                d.grad = None               # freed on the device: its copy is queued before any reuse
            if on_cuda:
                torch.cuda.current_stream().synchronize()
            stepped = [h for h in self.host_params if h.grad is not None]
            if max_grad_norm > 0 and stepped:
                torch.nn.utils.clip_grad_norm_(stepped, max_grad_norm)
            self.optimizer.step()
            for d, h in zip(self.device_params, self.host_params):
                d.copy_(h, non_blocking=pin_of(h))
            for h in self.host_params:
                h.grad = None


def pin_of(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_pinned()


# Parameters per second of the host step on this machine's CPU, per (optimizer, clip): measured once
# per process (planner/memory_model.py prices a LoRA host-step plan with it).
_RATE: dict[tuple[str, bool], float] = {}
RATE_TENSORS = (64, 32, 4096)         # 64 adapter matrices of rank 32 x 4096: 8.4 M elements, past the caches


def measured_rate(optimizer: str, clip: bool) -> float:
    """Parameters per second `LoraHostStep.step`'s CPU part (clipping, the optimizer's step) runs
    at on this machine: timed on RATE_TENSORS adapter-shaped tensors, best of 3 after a first
    step that creates the state (a few tens of milliseconds; only plans that step on the host ask)."""
    key = (optimizer, clip)
    if key not in _RATE:
        n, rows, cols = RATE_TENSORS
        g = torch.Generator().manual_seed(0)      # its own: the run's global RNG (adapter init, noise) stays as it was
        params = [torch.nn.Parameter(torch.empty(rows, cols).uniform_(-0.02, 0.02, generator=g)) for _ in range(n)]
        grads = [torch.empty(rows, cols).uniform_(-1e-3, 1e-3, generator=g) for _ in range(n)]
        cfg = TrainConfig(optimizer=optimizer)
        opt = build_host_optimizer(params, cfg, fused=True)

        def update() -> None:
            for p, g in zip(params, grads):
                p.grad = g
            if clip:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        update()
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            update()
            best = min(best, time.perf_counter() - t0)
        _RATE[key] = n * rows * cols / max(best, 1e-9)
    return _RATE[key]
