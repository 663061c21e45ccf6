"""Host RAM of a full fine-tune, checked before anything loads.

What this implementation holds in host RAM at its peak (set-up, before the memory plan moves the
resident part to the GPU): every weight as loaded, the optimizer state of every trained weight
(created next to it), fp32 master copies ([full] master_weights, bf16/fp16 weights only) and the fp32
gradient accumulators ([train] gradient_accumulation > 1). Streamed blocks keep their weights and
state in host RAM for the whole run, so this is also what a fully streamed run holds.

The numbers come from the transformer built on the meta device (no tensor is read), so a budget
that cannot hold them is refused in milliseconds, with what would fit instead.
"""

from __future__ import annotations

from ..config import ConfigError, FullConfig, TrainConfig, parse_size
from ..host import host_ram
from .fused_optim import state_bytes_per_param
from .trainable import select_trainable

GiB = 2**30
MARGIN = 2 * GiB          # interpreter, caches and allocator slack kept free of the budget


def full_host_parts(weights: int, trained: int, state: int, *, masters: bool, accumulation: int) -> dict[str, int]:
    """The host RAM parts of a full fine-tune from its sizes: the loaded `weights` (bytes), the
    `trained` parameter count and the optimizer `state` bytes; fp32 masters when `masters` (bf16/fp16
    weights with [full] master_weights), fp32 gradient accumulators when `accumulation` > 1. The
    planner (planner/full_model.py) prices the same parts with the exact state of each tensor."""
    return {"weights": weights, "optimizer state": int(state), "master weights": 4 * trained if masters else 0,
            "gradient accumulators": 4 * trained if accumulation > 1 else 0}


def host_bytes(train: TrainConfig, full: FullConfig, model) -> dict[str, int]:
    """Host RAM parts (bytes) of a full fine-tune of `model` (may be on the meta device) with the
    run's [train] and [full] settings."""
    trained = select_trainable(model, full.train, full.exclude)
    n = sum(p.numel() for p in trained.values())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    wide = any(p.element_size() < 4 for p in trained.values())
    parts = full_host_parts(weights, n, n * state_bytes_per_param(train.optimizer, full.state_dtype),
                            masters=full.master_weights and wide, accumulation=train.gradient_accumulation)
    return {**parts, "_trained": n}


def _budget(ram_budget: str | None) -> tuple[int, str]:
    if ram_budget is not None:
        return parse_size(ram_budget), "[memory] ram_budget"
    return max(0, host_ram()[1] - MARGIN), "available host RAM"


def check_host_ram(train: TrainConfig, full: FullConfig, ram_budget: str | None, model,
                   budget: tuple[int, str] | None = None) -> dict[str, int]:
    """Refuse a full fine-tune whose host RAM need exceeds the budget ([memory] `ram_budget`, else
    the available host RAM), naming the parts and the alternatives that would fit; returns the
    parts otherwise."""
    parts = host_bytes(train, full, model)
    n = parts.pop("_trained")
    need = sum(parts.values())
    limit, where = budget or _budget(ram_budget)
    if need <= limit:
        return parts
    lines = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in parts.items() if v)
    options = []
    base = need - parts["optimizer state"]
    for label, opt, dtype in (("[train] optimizer = \"adafactor\"", "adafactor", "fp32"),
                              ("[full] state_dtype = \"bf16\"", train.optimizer, "bf16")):
        alt = base + int(n * state_bytes_per_param(opt, dtype))
        if (opt, dtype) != (train.optimizer, full.state_dtype) and train.optimizer != "adafactor":
            options.append(f"{label}: {alt / GiB:.1f} GiB{' (fits)' if alt <= limit else ''}")
    if parts["master weights"]:
        options.append(f"[full] master_weights = false: saves {parts['master weights'] / GiB:.1f} GiB")
    if parts["gradient accumulators"]:
        options.append(f"[train] gradient_accumulation = 1: saves {parts['gradient accumulators'] / GiB:.1f} GiB")
    per_param = need and (need - parts["weights"]) / max(n, 1)
    spare = limit - parts["weights"]
    if per_param > 0 and spare > 0:
        options.append(f"a frozen part ([full] exclude): at most {spare / per_param / 1e9:.2f}B of the "
                       f"{n / 1e9:.2f}B parameters can train")
    raise ConfigError(f"[train] mode = \"full\": the run needs {need / GiB:.1f} GiB of host RAM ({lines}) but "
                      f"{where} is {limit / GiB:.1f} GiB. What would fit: " + "; ".join(options or ["a LoRA"]))
