"""Key layout of Stability's SD3 / SD3.5 transformer files (`sd3.5_large.safetensors`), both ways.

Stability's MMDiT code (and ComfyUI, kohya sd-scripts) names a joint block's two streams
`x_block` (image) and `context_block` (text) and fuses q, k, v into one `attn.qkv`; diffusers'
`SD3Transformer2DModel` keeps them apart (`attn.to_q`, `attn.add_q_proj`, ...). Two adaLN
projections store (shift, scale) where diffusers stores (scale, shift): the final layer's, and the
last joint block's text-stream one (that block is "context pre-only": its text stream ends after
attention, so its modulation is a continuous layer norm like the final layer's).

One table maps module names in both directions, so `diffusers_to_stability` (writing files,
exporting full fine-tunes) is the exact inverse of `stability_to_diffusers_ops` (loading):

    stability_to_diffusers_ops(shapes, prefix) -> (ops, unknown keys)   # for weights.load_into_empty
    stability_to_diffusers(state_dict)         -> diffusers state dict (in memory)
    diffusers_to_stability(state_dict)         -> Stability state dict (no prefix)
    stability_module(name, num_layers)         -> StabilityModule: where a diffusers Linear lives
                                                  in a Stability file (LoRA key mapping)

The architecture is read from the checkpoint's keys and shapes by `sd3_config_from_shapes`
(diffusers names): depth, width, head size (from the qk-norm scales; 64 when there is no qk-norm,
as in every SD3 release), dual-attention layers (MMDiT-X), qk-norm, pos_embed_max_size. diffusers'
own converter (`convert_sd3_transformer_checkpoint_to_diffusers`) maps the same keys at any width,
but `from_single_file` takes the config from a hub repository picked by full-size shapes
(9216-wide adaLN, 36864 / 147456 position rows, a 38th joint block), so another width cannot load
there; tests/test_sd3_loading.py checks our mapping against its converter at a non-default width.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..weights import KeyOp, apply_ops

# Modules inside joint block i: (diffusers module, Stability module, part, parts). parts > 1: the
# Stability tensor is the concatenation of `parts` equal row blocks along dim 0, this one is `part`.
_BLOCK = (
    ("attn.to_q", "x_block.attn.qkv", 0, 3),
    ("attn.to_k", "x_block.attn.qkv", 1, 3),
    ("attn.to_v", "x_block.attn.qkv", 2, 3),
    ("attn.add_q_proj", "context_block.attn.qkv", 0, 3),
    ("attn.add_k_proj", "context_block.attn.qkv", 1, 3),
    ("attn.add_v_proj", "context_block.attn.qkv", 2, 3),
    ("attn.norm_q", "x_block.attn.ln_q", 0, 1),
    ("attn.norm_k", "x_block.attn.ln_k", 0, 1),
    ("attn.norm_added_q", "context_block.attn.ln_q", 0, 1),
    ("attn.norm_added_k", "context_block.attn.ln_k", 0, 1),
    ("attn.to_out.0", "x_block.attn.proj", 0, 1),
    ("attn.to_add_out", "context_block.attn.proj", 0, 1),
    # MMDiT-X (SD3.5 Medium): a second, image-only attention in the dual-attention blocks
    ("attn2.to_q", "x_block.attn2.qkv", 0, 3),
    ("attn2.to_k", "x_block.attn2.qkv", 1, 3),
    ("attn2.to_v", "x_block.attn2.qkv", 2, 3),
    ("attn2.norm_q", "x_block.attn2.ln_q", 0, 1),
    ("attn2.norm_k", "x_block.attn2.ln_k", 0, 1),
    ("attn2.to_out.0", "x_block.attn2.proj", 0, 1),
    ("norm1.linear", "x_block.adaLN_modulation.1", 0, 1),
    ("norm1_context.linear", "context_block.adaLN_modulation.1", 0, 1),   # halves swapped in the last block
    ("ff.net.0.proj", "x_block.mlp.fc1", 0, 1),
    ("ff.net.2", "x_block.mlp.fc2", 0, 1),
    ("ff_context.net.0.proj", "context_block.mlp.fc1", 0, 1),
    ("ff_context.net.2", "context_block.mlp.fc2", 0, 1),
)
_TOP = (
    ("pos_embed.proj", "x_embedder.proj"),
    ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
    ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
    ("context_embedder", "context_embedder"),
    ("proj_out", "final_layer.linear"),
    ("norm_out.linear", "final_layer.adaLN_modulation.1"),               # halves swapped
)
_POS_EMBED = ("pos_embed.pos_embed", "pos_embed")                         # a tensor, not a module
_LAST_BLOCK_SWAPPED = "norm1_context.linear"
_TOP_SWAPPED = "norm_out.linear"
_PARAMS = ("weight", "bias")
HEAD_DIM = 64          # every SD3 / SD3.5 release; read from the qk-norm scales when present

_D_BLOCK = {d: (s, part, parts) for d, s, part, parts in _BLOCK}
_S_BLOCK: dict[str, list[tuple[str, int, int]]] = {}
for _d, _s, _part, _parts in _BLOCK:
    _S_BLOCK.setdefault(_s, []).append((_d, _part, _parts))
_D_TOP = dict(_TOP)
_S_TOP = {s: d for d, s in _TOP}

_S_BLOCK_RE = re.compile(r"^joint_blocks\.(\d+)\.(.+)\.(weight|bias)$")
_D_BLOCK_RE = re.compile(r"^transformer_blocks\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class StabilityModule:
    """Where a diffusers module's weight sits in a Stability file: `module` ("joint_blocks.3.x_block.
    attn.qkv"), rows `part` of `parts` equal row blocks, with (shift, scale) halves swapped if `swapped`."""

    module: str
    part: int = 0
    parts: int = 1
    swapped: bool = False


def is_stability(keys) -> bool:
    """True if a key set (prefix removed) is a Stability-layout SD3 transformer."""
    keys = set(keys)
    return "x_embedder.proj.weight" in keys and any(k.startswith("joint_blocks.") for k in keys)


def is_diffusers_sd3(keys) -> bool:
    """True if a key set (prefix removed) is a diffusers-layout SD3 transformer."""
    keys = set(keys)
    return "pos_embed.proj.weight" in keys and "transformer_blocks.0.attn.to_q.weight" in keys


def _num_layers(keys, pattern: re.Pattern) -> int:
    idx = {int(m.group(1)) for k in keys if (m := pattern.match(k))}
    return max(idx) + 1 if idx else 0


def stability_module(name: str, num_layers: int) -> StabilityModule:
    """The Stability module a diffusers module name maps to ("transformer_blocks.3.attn.to_q" ->
    joint_blocks.3.x_block.attn.qkv, part 0 of 3). KeyError for a name outside the table."""
    m = re.match(r"^transformer_blocks\.(\d+)\.(.+)$", name)
    if m:
        i, rel = int(m.group(1)), m.group(2)
        s, part, parts = _D_BLOCK[rel]
        return StabilityModule(f"joint_blocks.{i}.{s}", part, parts,
                               swapped=rel == _LAST_BLOCK_SWAPPED and i == num_layers - 1)
    return StabilityModule(_D_TOP[name], swapped=name == _TOP_SWAPPED)


def stability_to_diffusers_ops(shapes: dict[str, tuple[int, ...]], prefix: str = "") -> tuple[list[KeyOp], list[str]]:
    """KeyOps from a Stability file's key shapes (prefix removed; the ops name the keys with `prefix`)
    to diffusers keys, and the keys that belong to no SD3 transformer module."""
    n = _num_layers(shapes, _S_BLOCK_RE)
    ops, unknown = [], []
    for key, shape in shapes.items():
        if key == _POS_EMBED[1]:
            ops.append(KeyOp(prefix + key, (_POS_EMBED[0],)))
            continue
        m = _S_BLOCK_RE.match(key)
        if m:
            i, module, param = int(m.group(1)), m.group(2), m.group(3)
            targets = _S_BLOCK.get(module)
            if targets is None:
                unknown.append(prefix + key)
                continue
            names = tuple(f"transformer_blocks.{i}.{d}.{param}" for d, _, _ in sorted(targets, key=lambda t: t[1]))
            parts = targets[0][2]
            split = None
            if parts > 1:     # equal row blocks; a row count that does not divide fails KeyOp.check, naming the key
                rows = shape[0] if shape else 0
                split = (rows // parts,) * parts if rows % parts == 0 else (rows,)
            swap = module == _D_BLOCK[_LAST_BLOCK_SWAPPED][0] and i == n - 1
            ops.append(KeyOp(prefix + key, names, split=split, swap_halves=swap))
            continue
        module, _, param = key.rpartition(".")
        if module in _S_TOP and param in _PARAMS:
            d = _S_TOP[module]
            ops.append(KeyOp(prefix + key, (f"{d}.{param}",), swap_halves=d == _TOP_SWAPPED))
        else:
            unknown.append(prefix + key)
    return ops, unknown


def stability_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Stability-layout SD3 transformer state dict (no prefix) in diffusers keys."""
    ops, unknown = stability_to_diffusers_ops({k: tuple(t.shape) for k, t in state_dict.items()})
    if unknown:
        raise KeyError(f"not part of an SD3 transformer: {unknown[:5]}")
    return apply_ops(ops, state_dict)


def _swap(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def diffusers_to_stability(state_dict: dict[str, torch.Tensor], num_layers: int | None = None,
                           ) -> dict[str, torch.Tensor]:
    """A diffusers SD3Transformer2DModel state dict in Stability keys (no prefix; add
    "model.diffusion_model." for a ComfyUI checkpoint). Exact inverse of the loading direction:
    q/k/v concatenated in that order, the swapped adaLN halves swapped back. `num_layers`: the
    model's depth when `state_dict` is only part of it (one block at a time, as a streamed export
    writes), since the last block's text adaLN is the swapped one; default: read from the keys."""
    n = _num_layers(state_dict.keys(), _D_BLOCK_RE) if num_layers is None else num_layers
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for key, t in state_dict.items():
        if key == _POS_EMBED[0]:
            out[_POS_EMBED[1]] = t
            continue
        module, _, param = key.rpartition(".")
        try:
            where = stability_module(module, n)
        except KeyError:
            raise KeyError(f"{key!r} is not part of an SD3 transformer") from None
        skey = f"{where.module}.{param}"
        if where.swapped:
            t = _swap(t)
        if where.parts == 1:
            out[skey] = t
        else:
            fused.setdefault(skey, {})[where.part] = t
    for skey, parts in fused.items():
        if sorted(parts) != [0, 1, 2]:
            raise KeyError(f"{skey}: q, k and v are not all in the state dict (have parts {sorted(parts)})")
        out[skey] = torch.cat([parts[i] for i in range(3)], dim=0)
    return out


def sd3_config_from_shapes(shapes: dict[str, tuple[int, ...]], meta: dict | None = None) -> dict:
    """An SD3Transformer2DModel config from diffusers-named shapes; `meta` (a file's leantune.config
    metadata) overrides what the weights cannot show (sample_size, or the head size without qk-norm).
    KeyError names a missing key."""
    meta = dict(meta or {})
    num_layers = _num_layers(shapes, _D_BLOCK_RE)
    inner, in_channels, patch, _ = shapes["pos_embed.proj.weight"]
    qk = shapes.get("transformer_blocks.0.attn.norm_q.weight")
    head_dim = int(meta.get("attention_head_dim", qk[0] if qk else HEAD_DIM))
    if inner % head_dim:
        raise ValueError(f"width {inner} is not a multiple of the head size {head_dim}")
    positions = shapes["pos_embed.pos_embed"][1]
    side = math.isqrt(positions)
    if side * side != positions:
        raise ValueError(f"pos_embed has {positions} positions, not a square grid")
    caption_out, joint_dim = shapes["context_embedder.weight"]
    qk_norm = None
    if qk:
        qk_norm = "layer_norm" if "transformer_blocks.0.attn.norm_q.bias" in shapes else "rms_norm"
    config = dict(
        sample_size=128, patch_size=patch, in_channels=in_channels, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=inner // head_dim, joint_attention_dim=joint_dim,
        caption_projection_dim=caption_out,
        pooled_projection_dim=shapes["time_text_embed.text_embedder.linear_1.weight"][1],
        out_channels=shapes["proj_out.weight"][0] // (patch * patch), pos_embed_max_size=side,
        dual_attention_layers=tuple(i for i in range(num_layers)
                                    if f"transformer_blocks.{i}.attn2.to_q.weight" in shapes),
        qk_norm=qk_norm,
    )
    config.update({k: v for k, v in meta.items() if k in config})
    return config
