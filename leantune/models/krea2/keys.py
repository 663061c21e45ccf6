"""Key layout of Krea 2's official transformer files, both ways, and the architecture from shapes.

krea-ai/krea-2's own model (mmdit.py `SingleStreamDiT`, the names of the published
Krea-2-Raw / Krea-2-Turbo safetensors) names its modules tersely: the 28 blocks are `blocks.N`
(attention `attn.wq/wk/wv/wo/gate`, q/k norms `attn.qknorm.qnorm/knorm.scale`, SwiGLU `mlp.gate/up/down`,
`prenorm/postnorm.scale`, and the block's six modulation vectors flattened into one (6 * width,)
`mod.lin`); the image embedder is `first`, the time MLP `tmlp.0/.2` and its shared projection
`tproj.1`, the text projection `txtmlp.0` (an RMSNorm scale) `.1` `.3`, the text fusion `txtfusion.*`
(its blocks named like the main ones, without modulation), the final layer `last.linear`,
`last.norm.scale`, `last.modulation.lin` (2, width). ComfyUI's repackaged files carry the same names
under `model.diffusion_model.` (ComfyUI's Krea2 model is the official class).

diffusers' Krea2Transformer2DModel renames every one of them
(loaders/single_file_utils.convert_krea2_transformer_checkpoint_to_diffusers is its reading of
this layout); `to_diffusers` / `to_native` below are one table read both ways, so a full
fine-tune's export is the exact inverse of what the loader reads. Nothing is fused or split: only
the block modulation changes shape, (6 * width,) <-> (6, width).

`config_from_shapes` reads the diffusers config from the shapes alone. Only the rotary base and
the norms' epsilon are not in the weights: both are the official code's constants (theta 1000, eps
1e-5), and the rotary split is the official code's rule from the head size
(`rope_axes`); a file may state other values in its `leantune.config` metadata.
"""

from __future__ import annotations

import re

COMFY_PREFIX = "model.diffusion_model."
NATIVE_ANCHOR = "txtfusion.projector.weight"        # what ComfyUI and diffusers detect a Krea 2 file by
DIFFUSERS_ANCHOR = "text_fusion.projector.weight"
FUSION_KINDS = ("layerwise_blocks", "refiner_blocks")

# (native, diffusers) name pieces inside a block (main and text-fusion blocks alike)
BLOCK_LINEARS = (("attn.wq", "attn.to_q"), ("attn.wk", "attn.to_k"), ("attn.wv", "attn.to_v"),
                 ("attn.wo", "attn.to_out.0"), ("attn.gate", "attn.to_gate"), ("mlp.gate", "ff.gate"),
                 ("mlp.up", "ff.up"), ("mlp.down", "ff.down"))
_BLOCK_OTHER = (("attn.qknorm.qnorm.scale", "attn.norm_q.weight"), ("attn.qknorm.knorm.scale", "attn.norm_k.weight"),
                ("prenorm.scale", "norm1.weight"), ("postnorm.scale", "norm2.weight"))
_MODULATION = ("mod.lin", "scale_shift_table")          # main blocks only; (6 * D,) <-> (6, D)
TOP_LINEARS = (("first", "img_in"), ("tmlp.0", "time_embed.linear_1"), ("tmlp.2", "time_embed.linear_2"),
               ("tproj.1", "time_mod_proj"), ("txtmlp.1", "txt_in.linear_1"), ("txtmlp.3", "txt_in.linear_2"),
               ("txtfusion.projector", "text_fusion.projector"), ("last.linear", "final_layer.linear"))
_TOP_OTHER = (("txtmlp.0.scale", "txt_in.norm.weight"), ("last.norm.scale", "final_layer.norm.weight"),
              ("last.modulation.lin", "final_layer.scale_shift_table"))


def _inner_pairs(modulation: bool) -> list[tuple[str, str]]:
    pairs = [(f"{n}.{p}", f"{d}.{p}") for n, d in BLOCK_LINEARS for p in ("weight", "bias")]
    pairs += list(_BLOCK_OTHER)
    if modulation:
        pairs.append(_MODULATION)
    return pairs


_MAIN = dict(_inner_pairs(True))
_FUSION = dict(_inner_pairs(False))
_TOP = {**{f"{n}.{p}": f"{d}.{p}" for n, d in TOP_LINEARS for p in ("weight", "bias")}, **dict(_TOP_OTHER)}
_MAIN_BACK = {d: n for n, d in _MAIN.items()}
_FUSION_BACK = {d: n for n, d in _FUSION.items()}
_TOP_BACK = {d: n for n, d in _TOP.items()}

_NATIVE_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_NATIVE_FUSION = re.compile(r"txtfusion\.(layerwise_blocks|refiner_blocks)\.(\d+)\.(.+)")
_DIFFUSERS_BLOCK = re.compile(r"transformer_blocks\.(\d+)\.(.+)")
_DIFFUSERS_FUSION = re.compile(r"text_fusion\.(layerwise_blocks|refiner_blocks)\.(\d+)\.(.+)")


def to_diffusers(native: str) -> str | None:
    """An official (krea-ai) tensor name, no prefix -> its Krea2Transformer2DModel name, or None."""
    if native in _TOP:
        return _TOP[native]
    if m := _NATIVE_FUSION.fullmatch(native):
        inner = _FUSION.get(m.group(3))
        return None if inner is None else f"text_fusion.{m.group(1)}.{m.group(2)}.{inner}"
    if m := _NATIVE_BLOCK.fullmatch(native):
        inner = _MAIN.get(m.group(2))
        return None if inner is None else f"transformer_blocks.{m.group(1)}.{inner}"
    return None


def to_native(name: str) -> str | None:
    """A Krea2Transformer2DModel tensor name -> its official name, or None."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    if m := _DIFFUSERS_FUSION.fullmatch(name):
        inner = _FUSION_BACK.get(m.group(3))
        return None if inner is None else f"txtfusion.{m.group(1)}.{m.group(2)}.{inner}"
    if m := _DIFFUSERS_BLOCK.fullmatch(name):
        inner = _MAIN_BACK.get(m.group(2))
        return None if inner is None else f"blocks.{m.group(1)}.{inner}"
    return None


def is_block_modulation(diffusers_name: str) -> bool:
    """A main block's modulation table: (6, D) in diffusers, flattened (6 * D,) in the official files."""
    return bool(_DIFFUSERS_BLOCK.fullmatch(diffusers_name)) and diffusers_name.endswith(".scale_shift_table")


def native_state(state: dict) -> dict:
    """A diffusers-named state dict (or a group of it) in the official names, block modulation
    flattened: what a full fine-tune's export writes."""
    out = {}
    for name, t in state.items():
        native = to_native(name)
        if native is None:
            raise KeyError(f"{name!r} is not a Krea2Transformer2DModel tensor with an official name")
        out[native] = t.reshape(-1) if is_block_modulation(name) else t
    return out


def find_prefix(keys) -> tuple[str, str] | None:
    """(prefix, "native" or "diffusers") of a Krea 2 transformer file, or None."""
    for k in keys:
        for anchor, layout in ((NATIVE_ANCHOR, "native"), (DIFFUSERS_ANCHOR, "diffusers")):
            if k.endswith(anchor) and (k == anchor or k[: -len(anchor)].endswith(".")):
                return k[: -len(anchor)], layout
    return None


def recognizes_keys(keys) -> bool:
    """Whether a file's tensor names are a Krea 2 transformer's (any prefix, either layout)."""
    return find_prefix(keys) is not None


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """The rotary split of krea-ai/krea-2 mmdit.py SingleStreamDiT.__init__ for heads of `head_dim`:
    (head - 12 * (head // 16), 6 * (head // 16), 6 * (head // 16)); (32, 48, 48) for 128."""
    six = 6 * (head_dim // 16)
    return (head_dim - 2 * six, six, six)


def _count(shapes, pattern: str) -> int:
    found = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
    if found and found != set(range(max(found) + 1)):
        raise ValueError(f"block indices {sorted(found)} are not 0..{max(found)}")
    return max(found) + 1 if found else 0


def config_from_shapes(shapes: dict, meta: dict) -> dict:
    """Krea2Transformer2DModel's config from diffusers-named shapes (a KeyError names a missing key)."""
    hidden, in_channels = shapes["img_in.weight"]
    head = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    text_dim = shapes["txt_in.norm.weight"][0]
    text_head = shapes["text_fusion.refiner_blocks.0.attn.norm_q.weight"][0]
    config = {
        "_class_name": "Krea2Transformer2DModel",
        "in_channels": in_channels,
        "num_layers": _count(shapes, r"transformer_blocks\.(\d+)\."),
        "attention_head_dim": head,
        "num_attention_heads": hidden // head,
        "num_key_value_heads": shapes["transformer_blocks.0.attn.to_k.weight"][0] // head,
        "intermediate_size": shapes["transformer_blocks.0.ff.gate.weight"][0],
        "timestep_embed_dim": shapes["time_embed.linear_1.weight"][1],
        "text_hidden_dim": text_dim,
        "num_text_layers": shapes["text_fusion.projector.weight"][1],
        "text_num_attention_heads": text_dim // text_head,
        "text_num_key_value_heads": shapes["text_fusion.refiner_blocks.0.attn.to_k.weight"][0] // text_head,
        "text_intermediate_size": shapes["text_fusion.refiner_blocks.0.ff.gate.weight"][0],
        "num_layerwise_text_blocks": _count(shapes, r"text_fusion\.layerwise_blocks\.(\d+)\."),
        "num_refiner_text_blocks": _count(shapes, r"text_fusion\.refiner_blocks\.(\d+)\."),
        "axes_dims_rope": rope_axes(head),
        "rope_theta": 1000.0,
        "norm_eps": 1e-5,
    }
    if hidden % head:
        raise ValueError(f"width {hidden} is not a multiple of the head size {head}")
    config.update(meta)
    if "axes_dims_rope" in meta:
        config["axes_dims_rope"] = tuple(meta["axes_dims_rope"])
    return config
