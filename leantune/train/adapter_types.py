"""The adapter types of `[lora] type`: plain LoRA, DoRA, LoKr and LoHa, as peft builds them.

Facts only (no peft, no torch modules): the parameter shapes peft creates on a Linear for each
type, so that the planner prices the adapter from the shapes training will really have
(planner/weight_bytes.py) without importing peft, and the file code can tell whether peft's own
construction reproduces a file's factors (lora_formats.py). Tests hold every shape here to what peft
creates (tests/test_adapter_types.py).

- lora  (peft LoraConfig): down (r, in), up (out, r); delta = alpha / r * up @ down.
- dora  (LoraConfig(use_dora=True)): LoRA plus a magnitude vector (out,), initialised to the row
  norms of the base weight; the layer computes m / ||W + delta||_row * (W + delta), per output row.
- lokr  (LoKrConfig): delta = alpha / r * kron(w1, w2), with out = a * b and in = c * d split by
  peft's (LyCORIS') `factorization` (`[lora] factor`; -1: the split nearest the square root);
  w1 (a, c) is whole unless `[lora] decompose_both` and r < max(a, c) / 2 (then w1_a (a, r) @
  w1_b (r, c)); w2 (b, d) is whole when r >= max(b, d) / 2, else w2_a (b, r) @ w2_b (r, d).
- loha  (LoHaConfig): delta = alpha / r * (w1_a @ w1_b) * (w2_a @ w2_b) (Hadamard product), each
  pair (out, r) @ (r, in).
"""

from __future__ import annotations

ADAPTER_TYPES = ("lora", "dora", "lokr", "loha")
LYCORIS_TYPES = ("lokr", "loha")


def factorization(dimension: int, factor: int = -1) -> tuple[int, int]:
    """(m, n), m <= n, m * n = dimension: how LyCORIS and peft split a Linear side for LoKr.

    With `factor` > 0 dividing the dimension, (factor, dimension / factor) (not reordered, as
    peft's); otherwise the pair of divisors whose sum is smallest, searched upwards from 1 and
    never above `factor` when one is given (-1: no bound, so the pair nearest the square root)."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    bound = dimension if factor == -1 else factor
    m, n = 1, dimension
    limit = m + n                    # peft compares with the first pair's sum, never updated
    while m < n:
        cand = m + 1
        while dimension % cand:
            cand += 1
        other = dimension // cand
        if cand + other > limit or cand > bound:
            break
        m, n = cand, other
    return (n, m) if m > n else (m, n)


def lokr_layout(in_features: int, out_features: int, rank: int, factor: int = -1,
                decompose_both: bool = False) -> dict[str, tuple[int, int]]:
    """The LoKr parameters peft creates on a Linear(in, out): name -> shape ('w1' or 'w1_a'/'w1_b',
    'w2' or 'w2_a'/'w2_b')."""
    a, b = factorization(out_features, factor)
    c, d = factorization(in_features, factor)
    out: dict[str, tuple[int, int]] = {}
    if decompose_both and rank < max(a, c) / 2:
        out["w1_a"], out["w1_b"] = (a, rank), (rank, c)
    else:
        out["w1"] = (a, c)
    if rank < max(b, d) / 2:
        out["w2_a"], out["w2_b"] = (b, rank), (rank, d)
    else:
        out["w2"] = (b, d)
    return out


def adapter_shapes(kind: str, in_features: int, out_features: int, rank: int, factor: int = -1,
                   decompose_both: bool = False) -> dict[str, tuple[int, ...]]:
    """The trainable tensors peft creates for one adapted Linear, by kind: name -> shape."""
    if kind == "lora":
        return {"down": (rank, in_features), "up": (out_features, rank)}
    if kind == "dora":
        return {"down": (rank, in_features), "up": (out_features, rank), "magnitude": (out_features,)}
    if kind == "lokr":
        return dict(lokr_layout(in_features, out_features, rank, factor, decompose_both))
    if kind == "loha":
        return {"w1_a": (out_features, rank), "w1_b": (rank, in_features),
                "w2_a": (out_features, rank), "w2_b": (rank, in_features)}
    raise ValueError(f"unknown adapter type {kind!r}; one of {ADAPTER_TYPES}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def adapter_numel(kind: str, in_features: int, out_features: int, rank: int, factor: int = -1,
                  decompose_both: bool = False) -> int:
    """Trainable elements of one adapted Linear."""
    return sum(_numel(s) for s in adapter_shapes(kind, in_features, out_features, rank, factor,
                                                 decompose_both).values())


def adafactor_numel(kind: str, in_features: int, out_features: int, rank: int, factor: int = -1,
                    decompose_both: bool = False) -> int:
    """Elements Adafactor keeps for one adapted Linear: a row and a column statistic per matrix, the
    whole tensor for a vector (DoRA's magnitude)."""
    total = 0
    for shape in adapter_shapes(kind, in_features, out_features, rank, factor, decompose_both).values():
        total += sum(shape) if len(shape) == 2 else _numel(shape)
    return total
