"""BflLayout: BFL's naming of a transformer (Flux.1, FLUX.2) against diffusers', both ways, from one table.

BFL's reference code names both generations alike: `double_blocks.N.` / `single_blocks.N.` for
diffusers' `transformer_blocks.N.` / `single_transformer_blocks.N.`, top-level modules by their own
names, and several diffusers Linears fused into one BFL tensor (q, k, v; a single block's q, k, v
and MLP input). What differs between generations is the table (which BFL module holds which
diffusers modules) — flux/keys.py holds Flux.1's, flux2/keys.py FLUX.2's — so the algorithms live
here once, and `from_diffusers` (what a full fine-tune's export writes) is the exact inverse of
`to_diffusers_ops` (what a loader applies lazily, tensor by tensor).

A table row is (BFL module, diffusers module(s)); both .weight and .bias are mapped. Several
diffusers modules for one BFL module: the BFL tensor is their concatenation along dim 0, split back
in equal row runs, except a four-way split (Flux.1's `linear1`: q, k, v, MLP input), whose first
three runs are the model width read from `inner_key`'s rows. Norms map one parameter to one.
Modules in `swapped` store the two halves of their output the other way round (the final adaLN:
(shift, scale) in BFL files, (scale, shift) in diffusers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .weights import KeyOp, apply_ops

_DIFFUSERS_BLOCK = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}
_BFL_BLOCK = {v: k for k, v in _DIFFUSERS_BLOCK.items()}
_BFL_BLOCK_RE = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")
_DIFFUSERS_BLOCK_RE = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class BflLayout:
    name: str                       # for messages: "Flux", "FLUX.2"
    tables: dict                    # "double" / "single" / "top" -> (linears, norms)
    swapped: frozenset = frozenset()
    inner_key: str | None = None    # a BFL key whose rows are the model width (needed by 4-way splits)

    # -- BFL -> diffusers -----------------------------------------------------------------------------

    def to_diffusers_ops(self, shapes: dict[str, tuple[int, ...]], prefix: str = "") -> tuple[list[KeyOp], list[str]]:
        """Ops turning BFL keys (given without `prefix`; the ops carry it) into diffusers keys.
        Returns (ops, unknown keys). An uneven split fails the loader's shape check, naming the key."""
        inner = None
        if self.inner_key is not None:
            if self.inner_key not in shapes:
                raise KeyError(self.inner_key)
            inner = shapes[self.inner_key][0]
        ops: list[KeyOp] = []
        unknown: list[str] = []
        for key, shape in shapes.items():
            kind, block, rest = _parse(key, _BFL_BLOCK_RE, _DIFFUSERS_BLOCK)
            op = self._op_for(kind, rest, block, shape[0] if shape else 1, inner)
            if op is None:
                unknown.append(prefix + key)
            else:
                ops.append(KeyOp(prefix + key, op.targets, op.split, op.swap_halves))
        return ops, unknown

    def _op_for(self, kind: str, rest: str, block: str, rows: int, inner: int | None) -> KeyOp | None:
        linears, norms = self.tables[kind]
        for bfl, diff in norms:
            if rest == bfl:
                return KeyOp(rest, (block + diff,))
        module, _, param = rest.rpartition(".")
        if param not in ("weight", "bias"):
            return None
        for bfl, diffs in linears:
            if module != bfl:
                continue
            n = len(diffs)
            if n == 1:
                split = None
            elif n == 4 and inner is not None:        # q, k, v (the width each) + the MLP input
                split = (inner, inner, inner, rows - 3 * inner)
            else:                                     # equal runs (an odd remainder fails the shape check)
                split = tuple([rows // n] * (n - 1) + [rows - (n - 1) * (rows // n)])
            return KeyOp(rest, tuple(f"{block}{d}.{param}" for d in diffs), split, swap_halves=bfl in self.swapped)
        return None

    def convert_state_dict(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole BFL state dict in diffusers keys, in memory (loaders apply the same ops lazily)."""
        ops, unknown = self.to_diffusers_ops({k: tuple(v.shape) for k, v in state_dict.items()})
        if unknown:
            raise KeyError(f"not BFL {self.name} keys: {unknown[:5]}")
        return apply_ops(ops, state_dict)

    def bfl_name(self, diffusers_key: str) -> str:
        """The BFL key holding a diffusers key (for messages about missing keys)."""
        kind, block, rest = _parse(diffusers_key, _DIFFUSERS_BLOCK_RE, _BFL_BLOCK)
        linears, norms = self.tables[kind]
        for bfl, diff in norms:
            if rest == diff:
                return block + bfl
        module, _, param = rest.rpartition(".")
        for bfl, diffs in linears:
            if module in diffs:
                return f"{block}{bfl}.{param}"
        return diffusers_key

    # -- diffusers -> BFL -----------------------------------------------------------------------------

    def from_diffusers(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A diffusers state dict, or one group of it (the non-block modules, one block), in BFL keys.
        Every key must have a BFL name (KeyError lists those that do not); a fused tensor needs all
        its parts (KeyError names the missing ones)."""
        out: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        groups: dict[tuple[str, str, str], None] = {("top", "", ""): None}
        for key in state_dict:
            kind, bblock, rest = _parse(key, _DIFFUSERS_BLOCK_RE, _BFL_BLOCK)
            if kind != "top":
                groups[(kind, key[:len(key) - len(rest)], bblock)] = None
        for kind, dblock, bblock in groups:
            linears, norms = self.tables[kind]
            for bfl, diff in norms:
                if dblock + diff in state_dict:
                    out[bblock + bfl] = state_dict[dblock + diff]
                    used.add(dblock + diff)
            for bfl, diffs in linears:
                for param in ("weight", "bias"):
                    names = [f"{dblock}{d}.{param}" for d in diffs]
                    present = [n for n in names if n in state_dict]
                    if not present:
                        continue
                    if len(present) != len(names):
                        raise KeyError(f"{bblock}{bfl}.{param} fuses {names}, but only {present} are given")
                    t = torch.cat([state_dict[n] for n in names], dim=0) if len(names) > 1 else state_dict[names[0]]
                    if bfl in self.swapped:
                        a, b = t.chunk(2, dim=0)
                        t = torch.cat([b, a], dim=0)
                    out[f"{bblock}{bfl}.{param}"] = t
                    used.update(names)
        left = [k for k in state_dict if k not in used]
        if left:
            raise KeyError(f"diffusers keys without a BFL {self.name} name: {left[:5]}")
        return out


def _parse(key: str, pattern: re.Pattern, renamed: dict[str, str]) -> tuple[str, str, str]:
    """(kind, the block's prefix in the other naming, the rest of the key) of a key matched by one
    naming's block `pattern`: "double" / "single" for a block, ("top", "", key) outside them."""
    m = pattern.match(key)
    if not m:
        return "top", "", key
    kind = "double" if m.group(1) in ("double_blocks", "transformer_blocks") else "single"
    return kind, f"{renamed[m.group(1)]}.{m.group(2)}.", m.group(3)


def count_blocks(keys, prefix: str) -> int:
    """How many blocks `prefix`N. the keys hold; blocks not numbered 0..N-1 are an error."""
    idx = {int(k[len(prefix):].split(".", 1)[0]) for k in keys if k.startswith(prefix)}
    if idx and idx != set(range(max(idx) + 1)):
        raise ValueError(f"blocks {prefix}N are not numbered 0..{max(idx)}: {sorted(idx)}")
    return len(idx)


# -- which generation a BFL-named file is ------------------------------------------------------------
# FLUX.2 kept Flux.1's block names (double_blocks / single_blocks) but shares one modulation over all
# blocks; these keys are FLUX.2's alone, without and with diffusers' names. Both families read them:
# FLUX.2 to claim a file, Flux.1 to refuse one by name.
FLUX2_BFL_MARKERS = ("single_stream_modulation.lin.weight", "double_stream_modulation_img.lin.weight")
FLUX2_DIFFUSERS_MARKERS = ("single_stream_modulation.linear.weight", "double_stream_modulation_img.linear.weight")


def is_flux2_bfl(keys) -> bool:
    """True if a key set (prefix removed) is a BFL-layout FLUX.2 transformer."""
    keys = set(keys)
    return any(m in keys for m in FLUX2_BFL_MARKERS)


def is_diffusers_flux2(keys) -> bool:
    keys = set(keys)
    return any(m in keys for m in FLUX2_DIFFUSERS_MARKERS)


def is_flux2_file(keys) -> bool:
    """A FLUX.2 transformer file in BFL, ComfyUI or diffusers names, any prefix (guess_family)."""
    markers = FLUX2_BFL_MARKERS + FLUX2_DIFFUSERS_MARKERS
    return any(k == m or k.endswith("." + m) for k in keys for m in markers)
