"""Key layouts of Qwen-Image-2.1 transformer single files, and the architecture from shapes.

Two layouts exist (diffusers 0.42.1 loaders/single_file_utils.py
`convert_qwen_image21_transformer_checkpoint_to_diffusers` is the reading of both that we follow):

- the official release's, whose names are diffusers' own (`transformer_blocks.N.attn.to_q`,
  `img_mlp.proj` / `img_mlp.gate_layer` / `img_mlp.out`, one shared `modulation.1`, `txt_in.*`,
  `norm_out.linear`, `proj_out`), with no prefix;
- ComfyUI's repackaged one: the same names under `model.diffusion_model.`, except that each
  block's SwiGLU gate and up projections are one fused Linear `img_mlp.gate_up` (gate rows first).

`to_diffusers_ops` maps a file's keys to KeyOps (the fused one split in two), `fuse_for_comfyui`
is its inverse for writing. `config_from_shapes` reads the diffusers config from the shapes; the
rotary split, epsilon and `causal_condition` are not in the weights: the released values
((16, 56, 56) at head 128, 1e-6, True) unless the file's `leantune.config` metadata says otherwise.
"""

from __future__ import annotations

import re

from ..weights import KeyOp

COMFY_PREFIX = "model.diffusion_model."
# What identifies a Qwen-Image-2.1 transformer: the zero-centred text norm before `txt_in`, next to
# one shared `modulation` Linear (Qwen-Image 1 has `txt_norm` / `txt_in.weight` and per-block
# modulation; Krea 2 `txt_in.norm`; Flux/FLUX.2 other names altogether).
ANCHORS = ("txt_in.text_norm.weight", "modulation.1.weight")
FUSED = "img_mlp.gate_up.weight"
_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.")
RELEASED_HEAD_DIM = 128
RELEASED_ROPE = (16, 56, 56)


def find_prefix(keys) -> str | None:
    """The prefix ("" or ComfyUI's) under which both anchors sit, or None: not Qwen-Image-2.1."""
    keys = set(keys)
    for prefix in ("", COMFY_PREFIX, "diffusion_model."):
        if all(prefix + a in keys for a in ANCHORS):
            return prefix
    return None


def to_diffusers_ops(key: str, name: str, shape: tuple[int, ...]) -> KeyOp:
    """The KeyOp reading file tensor `key` (named `name` once its prefix is stripped)."""
    if name.endswith(FUSED):
        if len(shape) != 2 or shape[0] % 2:
            raise ValueError(f"key {key!r} has shape {tuple(shape)}; a fused gate_up is (2 * hidden, width)")
        half = shape[0] // 2
        stem = name[: -len(FUSED)]
        return KeyOp(key, (stem + "img_mlp.gate_layer.weight", stem + "img_mlp.proj.weight"), split=(half, half))
    return KeyOp(key, (name,))


def fuse_for_comfyui(state: dict) -> dict:
    """A diffusers-named state dict -> ComfyUI's names (no prefix): gate_layer and proj fused."""
    import torch

    out = {}
    for name, t in state.items():
        if name.endswith("img_mlp.gate_layer.weight"):
            stem = name[: -len("img_mlp.gate_layer.weight")]
            out[stem + FUSED] = torch.cat([t, state[stem + "img_mlp.proj.weight"]], dim=0)
        elif not name.endswith("img_mlp.proj.weight"):
            out[name] = t
    return out


def rope_axes(head_dim: int, where: str) -> tuple[int, int, int]:
    if head_dim == RELEASED_HEAD_DIM:
        return RELEASED_ROPE
    raise ValueError(f"{where}: attention head size {head_dim} is not the released 128, and the file's metadata does "
                     f"not state axes_dims_rope (the rotary split is not in the weights)")


def config_from_shapes(shapes: dict[str, tuple[int, ...]], meta: dict, where: str) -> dict:
    """QwenImage21Transformer2DModel's config from diffusers-named shapes (KeyError: a key missing)."""
    inner, in_features = shapes["img_in.weight"]
    patch = int(meta.get("patch_size", 1))
    layers = {int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))}
    if not layers or sorted(layers) != list(range(max(layers) + 1)):
        raise ValueError(f"{where}: transformer_blocks are not numbered 0..N-1: {sorted(layers)[:8]}")
    head = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
    if inner % head:
        raise ValueError(f"{where}: width {inner} is not a multiple of the head size {head}")
    hidden = shapes["transformer_blocks.0.img_mlp.proj.weight"][0]
    if hidden % inner:
        raise ValueError(f"{where}: SwiGLU hidden size {hidden} is not a multiple of the width {inner}")
    config = dict(patch_size=patch, in_channels=in_features // (patch * patch),
                  out_channels=shapes["proj_out.weight"][0] // (patch * patch), num_layers=max(layers) + 1,
                  attention_head_dim=head, num_attention_heads=inner // head,
                  context_in_dim=shapes["txt_in.in_layer.weight"][1], mlp_ratio=hidden // inner,
                  eps=float(meta.get("eps", 1e-6)), causal_condition=bool(meta.get("causal_condition", True)))
    axes = meta.get("axes_dims_rope")
    # a list, as a diffusers config.json gives it
    config["axes_dims_rope"] = [int(a) for a in (axes if axes is not None else rope_axes(head, where))]
    if sum(config["axes_dims_rope"]) != head:
        raise ValueError(f"{where}: axes_dims_rope {config['axes_dims_rope']} do not add up to the head size {head}")
    return config


def metadata(model) -> dict:
    """What a file must state for `config_from_shapes` to rebuild this model's config exactly."""
    cfg = model.config
    extra = {}
    if tuple(cfg.axes_dims_rope) != RELEASED_ROPE or cfg.attention_head_dim != RELEASED_HEAD_DIM:
        extra["axes_dims_rope"] = [int(a) for a in cfg.axes_dims_rope]
    if float(cfg.eps) != 1e-6:
        extra["eps"] = float(cfg.eps)
    if not cfg.causal_condition:
        extra["causal_condition"] = False
    if int(cfg.patch_size) != 1:
        extra["patch_size"] = int(cfg.patch_size)
    return extra
