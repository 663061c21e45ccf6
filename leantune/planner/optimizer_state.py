"""Device bytes of the optimizer state of trained tensors, per [train] optimizer, as each
implementation allocates it (read from its source; tests/test_optimizers_recipe.py compares these
numbers with the state the real optimizer holds after one step).

All of them keep fp32 state for fp32 trained tensors (LoRA adapters are fp32):
- adamw (torch): exp_avg and exp_avg_sq, 8 bytes per parameter. Its `step` counter is a 0-dim tensor
  torch keeps in host memory (not fused, not capturable): not device bytes, not counted.
- adafactor (torch): a row and a column vector per matrix (the full size for a vector).
- adamw8bit (bitsandbytes): train/full_model.bnb_state_bytes per tensor (uint8 moments with one
  fp32 absmax per 256 values; fp32 moments under 4096 values), plus the two 256-entry fp32
  quantization maps the optimizer shares between its tensors.
- prodigy (prodigyopt): exp_avg, exp_avg_sq, s (its d-estimate accumulator) and p0, a copy of the
  starting weights, 16 bytes per parameter. A tensor that starts at zero (a LoRA's B) keeps a
  one-value p0 instead; the planner does not know whether [lora] init_from loads a non-zero B, so
  it prices the copy (at most 4 bytes per parameter of B too many).
- schedulefree_adamw (schedulefree): z (the base sequence) and exp_avg_sq, 8 bytes per parameter.
- came (came-pytorch): exp_avg (4 bytes per parameter); for a matrix, row and column statistics
  of the squared gradient and of the instability (two vectors of each side); for a vector, a full
  exp_avg_sq; and a one-value RMS of the weights.
"""

from __future__ import annotations

import math

F32 = 4
BNB_QMAPS = 2 * 256 * F32      # bitsandbytes' dynamic quantization maps of the two moments


def tensor_state_bytes(optimizer: str, shape: tuple[int, ...], starts_at_zero: bool = False) -> int:
    """Device bytes `optimizer` keeps for one fp32 trained tensor of `shape` (shared maps excluded)."""
    from .full_model import bnb_state_bytes

    n = math.prod(shape)
    matrix = len(shape) >= 2
    if optimizer in ("adamw", "schedulefree_adamw"):
        return 2 * F32 * n
    if optimizer == "adafactor":
        return F32 * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:]) if matrix else n)
    if optimizer == "adamw8bit":
        return bnb_state_bytes(n)
    if optimizer == "prodigy":
        return 3 * F32 * n + (F32 if starts_at_zero else F32 * n)
    if optimizer == "came":
        sides = math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:]) if matrix else 0
        return F32 * n + 2 * F32 * sides + (0 if matrix else F32 * n) + F32
    if optimizer == "sgd":
        return 0
    raise ValueError(f"optimizer {optimizer!r}: no state layout known")


def state_bytes(optimizer: str, shapes, starts_at_zero=None) -> int:
    """Device bytes of the optimizer state of trained tensors of `shapes` (one optimizer over all of
    them); `starts_at_zero[i]`: tensor i is all zeros before the first step (Prodigy's p0)."""
    zeros = list(starts_at_zero) if starts_at_zero is not None else [False] * len(shapes)
    total = sum(tensor_state_bytes(optimizer, tuple(s), z) for s, z in zip(shapes, zeros))
    if optimizer == "adamw8bit":
        from .full_model import BNB_MIN_8BIT

        if any(math.prod(s) >= BNB_MIN_8BIT for s in shapes):
            total += BNB_QMAPS
    return total


def lora_shapes(adapters, rank: int, kind: str = "lora", factor: int = -1,
                decompose_both: bool = False) -> list[tuple[int, ...]]:
    """The trained tensors of rank-`rank` adapters of type `kind` ([lora] type) on `adapters`
    (weight_bytes' adapted Linears): for LoRA A (rank, in) and B (out, rank) of each; DoRA's
    magnitude (out,) besides; LoKr's and LoHa's factors as peft creates them (train/adapter_types.py)."""
    from ..train.adapter_types import adapter_shapes

    return [s for a in adapters
            for s in adapter_shapes(kind, a.in_features, a.out_features, rank, factor, decompose_both).values()]
