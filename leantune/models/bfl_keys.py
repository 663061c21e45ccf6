"""Key layout of BFL (Black Forest Labs / ComfyUI) Flux transformer files, both ways.

BFL files fuse what diffusers keeps apart: a double block's q, k, v are one `img_attn.qkv` (and
`txt_attn.qkv`), a single block's q, k, v and MLP input are one `linear1`, and the final adaLN
stores (shift, scale) where diffusers stores (scale, shift). diffusers' own converter
(`convert_flux_transformer_checkpoint_to_diffusers`) hard-codes the inner width 3072 when it splits
`linear1`, so it only works for full-size Flux; here the width is read from `img_in.weight`, which
makes tiny and other-width checkpoints load too. The mapping is one table used in both directions,
so `diffusers_to_bfl` (writing BFL files) is the exact inverse of `bfl_to_diffusers_ops`.

The architecture (depth, width, heads, guidance embedder) is read from the checkpoint's own keys
and shapes by `flux_config_from_shapes`; only the rotary split `axes_dims_rope` is not in the
weights (see `default_axes_dims_rope`).
"""

from __future__ import annotations

import re

import torch

from .weights import KeyOp, apply_ops

# Linear layers: (BFL module, diffusers module(s)); both .weight and .bias are mapped.
# Several diffusers modules for one BFL module = the BFL tensor is their concatenation along dim 0.
_DOUBLE_LINEARS = (
    ("img_mod.lin", ("norm1.linear",)),
    ("txt_mod.lin", ("norm1_context.linear",)),
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ("img_attn.proj", ("attn.to_out.0",)),
    ("txt_attn.proj", ("attn.to_add_out",)),
    ("img_mlp.0", ("ff.net.0.proj",)),
    ("img_mlp.2", ("ff.net.2",)),
    ("txt_mlp.0", ("ff_context.net.0.proj",)),
    ("txt_mlp.2", ("ff_context.net.2",)),
)
# Norm scales: (BFL key, diffusers key), single tensors.
_DOUBLE_NORMS = (
    ("img_attn.norm.query_norm.scale", "attn.norm_q.weight"),
    ("img_attn.norm.key_norm.scale", "attn.norm_k.weight"),
    ("txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"),
    ("txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"),
)
_SINGLE_LINEARS = (
    ("modulation.lin", ("norm.linear",)),
    ("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),   # split (D, D, D, mlp)
    ("linear2", ("proj_out",)),
)
_SINGLE_NORMS = (
    ("norm.query_norm.scale", "attn.norm_q.weight"),
    ("norm.key_norm.scale", "attn.norm_k.weight"),
)
_TOP_LINEARS = (
    ("img_in", ("x_embedder",)),
    ("txt_in", ("context_embedder",)),
    ("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1",)),
    ("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2",)),
    ("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
    ("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
    ("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1",)),
    ("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2",)),
    ("final_layer.linear", ("proj_out",)),
    ("final_layer.adaLN_modulation.1", ("norm_out.linear",)),          # halves swapped
)
_SWAPPED = {"final_layer.adaLN_modulation.1"}

_BLOCK_RE = re.compile(r"^(double_blocks|single_blocks)\.(\d+)\.(.+)$")
_DIFFUSERS_BLOCK = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}
_BFL_BLOCK = {v: k for k, v in _DIFFUSERS_BLOCK.items()}


def _table(kind: str):
    """(linears, norms) of a block kind: "double", "single" or "top"."""
    return {"double": (_DOUBLE_LINEARS, _DOUBLE_NORMS), "single": (_SINGLE_LINEARS, _SINGLE_NORMS),
            "top": (_TOP_LINEARS, ())}[kind]


def is_bfl(keys) -> bool:
    """True if a key set (prefix removed) is a BFL-layout Flux transformer."""
    keys = set(keys)
    return "img_in.weight" in keys and any(k.startswith(("double_blocks.", "single_blocks.")) for k in keys)


def is_diffusers_flux(keys) -> bool:
    keys = set(keys)
    return "x_embedder.weight" in keys and any(k.startswith("single_transformer_blocks.") for k in keys)


def bfl_to_diffusers_ops(shapes: dict[str, tuple[int, ...]], prefix: str = "") -> tuple[list[KeyOp], list[str]]:
    """Ops turning BFL keys (given without `prefix`; ops carry it) into diffusers keys.

    Returns (ops, unknown keys). The inner width comes from `img_in.weight` (D, in_channels); a
    single block's `linear1` is split (D, D, D, rest), the rest being the MLP width.
    """
    if "img_in.weight" not in shapes:
        raise KeyError("img_in.weight")
    inner = shapes["img_in.weight"][0]
    ops: list[KeyOp] = []
    unknown: list[str] = []
    for key, shape in shapes.items():
        m = _BLOCK_RE.match(key)
        if m:
            kind = "double" if m.group(1) == "double_blocks" else "single"
            block = f"{_DIFFUSERS_BLOCK[m.group(1)]}.{m.group(2)}."
            rest = m.group(3)
        else:
            kind, block, rest = "top", "", key
        op = _op_for(kind, rest, block, shape, inner)
        if op is None:
            unknown.append(prefix + key)
        else:
            ops.append(KeyOp(prefix + key, op.targets, op.split, op.swap_halves))
    return ops, unknown


def _op_for(kind: str, rest: str, block: str, shape, inner: int) -> KeyOp | None:
    linears, norms = _table(kind)
    for bfl, diff in norms:
        if rest == bfl:
            return KeyOp(rest, (block + diff,))
    module, _, param = rest.rpartition(".")
    if param not in ("weight", "bias"):
        return None
    for bfl, diffs in linears:
        if module != bfl:
            continue
        targets = tuple(f"{block}{d}.{param}" for d in diffs)
        split = None
        rows = shape[0] if shape else 1
        if len(diffs) == 3:          # fused q, k, v of equal size (an odd remainder fails the shape check)
            split = (rows // 3, rows // 3, rows - 2 * (rows // 3))
        elif len(diffs) == 4:        # q, k, v (inner each) + MLP input
            split = (inner, inner, inner, rows - 3 * inner)
        return KeyOp(rest, targets, split, swap_halves=bfl in _SWAPPED)
    return None


def bfl_name(diffusers_key: str) -> str:
    """The BFL key holding a diffusers key (for messages about missing keys)."""
    m = re.match(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$", diffusers_key)
    kind, block, rest = ("top", "", diffusers_key) if not m else (
        "double" if m.group(1) == "transformer_blocks" else "single", f"{_BFL_BLOCK[m.group(1)]}.{m.group(2)}.",
        m.group(3))
    linears, norms = _table(kind)
    for bfl, diff in norms:
        if rest == diff:
            return block + bfl
    module, _, param = rest.rpartition(".")
    for bfl, diffs in linears:
        if module in diffs:
            return f"{block}{bfl}.{param}"
    return diffusers_key


def convert_bfl_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole BFL state dict in diffusers keys (in memory; the loader uses the ops lazily instead)."""
    ops, unknown = bfl_to_diffusers_ops({k: tuple(v.shape) for k, v in state_dict.items()})
    if unknown:
        raise KeyError(f"not BFL Flux keys: {unknown[:5]}")
    return apply_ops(ops, state_dict)


def diffusers_to_bfl(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers FluxTransformer2DModel state dict in BFL keys (fused qkv / linear1, swapped final adaLN)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    blocks: dict[tuple[str, str], None] = {}
    for key in state_dict:
        m = re.match(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.", key)
        if m:
            blocks[(m.group(1), m.group(2))] = None
    groups = [("top", "", "")] + [("double" if a == "transformer_blocks" else "single", f"{a}.{i}.",
                                   f"{_BFL_BLOCK[a]}.{i}.") for a, i in blocks]
    for kind, dblock, bblock in groups:
        linears, norms = _table(kind)
        for bfl, diff in norms:
            if dblock + diff in state_dict:
                out[bblock + bfl] = state_dict[dblock + diff]
                used.add(dblock + diff)
        for bfl, diffs in linears:
            for param in ("weight", "bias"):
                names = [f"{dblock}{d}.{param}" for d in diffs]
                if not all(n in state_dict for n in names):
                    continue
                t = torch.cat([state_dict[n] for n in names], dim=0) if len(names) > 1 else state_dict[names[0]]
                if bfl in _SWAPPED:
                    a, b = t.chunk(2, dim=0)
                    t = torch.cat([b, a], dim=0)
                out[f"{bblock}{bfl}.{param}"] = t
                used.update(names)
    left = [k for k in state_dict if k not in used]
    if left:
        raise KeyError(f"diffusers keys without a BFL equivalent: {left[:5]}")
    return out


# -- architecture from shapes ------------------------------------------------------------------------

def default_axes_dims_rope(head_dim: int) -> tuple[int, int, int]:
    """A rotary split of `head_dim` over (index, row, col): Flux's (16, 56, 56) for 128.

    Each axis needs an even size; the two spatial axes get 7/32 of the head each, rounded down to
    even, the index axis the rest: 128 -> (16, 56, 56), 64 -> (8, 28, 28), 16 -> (4, 6, 6).
    """
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head dim {head_dim} cannot be split into three even rotary axes")
    spatial = 2 * ((head_dim * 7) // 32)
    return (head_dim - 2 * spatial, spatial, spatial)


def _count(keys, prefix: str) -> int:
    idx = {int(k[len(prefix):].split(".", 1)[0]) for k in keys if k.startswith(prefix)}
    if idx and idx != set(range(max(idx) + 1)):
        raise ValueError(f"blocks {prefix}N are not numbered 0..{max(idx)}: {sorted(idx)}")
    return len(idx)


def flux_config_from_shapes(shapes: dict[str, tuple[int, ...]], axes_dims_rope=None) -> dict:
    """A FluxTransformer2DModel config from diffusers key shapes (BFL files: after `bfl_to_diffusers_ops`).

    Raises KeyError naming the first anchor key that is missing.
    """
    def need(key):
        if key not in shapes:
            raise KeyError(key)
        return shapes[key]

    inner, in_channels = need("x_embedder.weight")
    norm_key = ("transformer_blocks.0.attn.norm_q.weight" if "transformer_blocks.0.attn.norm_q.weight" in shapes
                else "single_transformer_blocks.0.attn.norm_q.weight")
    head_dim = need(norm_key)[0]
    if inner % head_dim:
        raise ValueError(f"width {inner} is not a multiple of the head dim {head_dim} (from {norm_key})")
    axes = tuple(axes_dims_rope) if axes_dims_rope else default_axes_dims_rope(head_dim)
    if sum(axes) != head_dim:
        raise ValueError(f"axes_dims_rope {axes} does not sum to the head dim {head_dim}")
    out_channels = need("proj_out.weight")[0]
    return dict(
        patch_size=1,
        in_channels=in_channels,
        out_channels=None if out_channels == in_channels else out_channels,
        num_layers=_count(shapes, "transformer_blocks."),
        num_single_layers=_count(shapes, "single_transformer_blocks."),
        attention_head_dim=head_dim,
        num_attention_heads=inner // head_dim,
        joint_attention_dim=need("context_embedder.weight")[1],
        pooled_projection_dim=need("time_text_embed.text_embedder.linear_1.weight")[1],
        guidance_embeds="time_text_embed.guidance_embedder.linear_1.weight" in shapes,
        axes_dims_rope=list(axes),
    )
