"""Key layout of Wan's native single files (Wan-AI's own checkpoint names, which ComfyUI's
repackaged wan2.2_*.safetensors keep under `model.diffusion_model.` or bare), both ways, and the
architecture from shapes.

Wan-AI's names differ from diffusers' WanTransformer3DModel by renames only (no tensor is fused or
split; diffusers' `convert_wan_transformer_to_diffusers` performs the same renames):

- in a block (`blocks.N.`): `self_attn` / `cross_attn` are diffusers' `attn1` / `attn2`, their
  `q k v o` are `to_q to_k to_v to_out.0` (`norm_q` / `norm_k` keep their names); Wan 2.1 I2V's
  image keys `cross_attn.k_img / v_img / norm_k_img` are `attn2.add_k_proj / add_v_proj /
  norm_added_k`; the MLP `ffn.0 / ffn.2` is `ffn.net.0.proj / ffn.net.2`; the per-block
  `modulation` is `scale_shift_table`; and the affine norm before the cross-attention is native
  `norm3` but diffusers' `norm2` (the two unaffine norms hold no tensors);
- at the top: `text_embedding.0 / .2`, `time_embedding.0 / .2` and `time_projection.1` are the
  condition embedder's `text_embedder.linear_1 / linear_2`, `time_embedder.linear_1 / linear_2` and
  `time_proj`; `head.head` is `proj_out` and `head.modulation` the model's `scale_shift_table`;
  Wan 2.1 I2V's `img_emb.proj.0 / 1 / 3 / 4` the image embedder's `norm1 / ff.net.0.proj /
  ff.net.2 / norm2`; `patch_embedding` keeps its name.

One table serves both directions: `diffusers_name` (what the loader applies, tensor by tensor) and
`native_name` (what a full fine-tune's export writes) are exact inverses.

The weights show the width, depth, patch, channels, MLP width, text and time widths, the norms and
the image branch; the head size, the norm eps and the rotary table's length are not in the weights:
they default to the released models' (models/configs/wan22_a14b.json: 128-wide heads in every Wan
2.1 / 2.2 size) and a file may state others in its `leantune.config` metadata.
"""

from __future__ import annotations

import json
import re

COMFY_PREFIX = "model.diffusion_model."
BLOCK_LIST = "blocks"
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(.+)$")

# in-block: native parameter path prefix -> diffusers', longest first where one contains another
_IN_BLOCK = (
    ("self_attn.q.", "attn1.to_q."), ("self_attn.k.", "attn1.to_k."), ("self_attn.v.", "attn1.to_v."),
    ("self_attn.o.", "attn1.to_out.0."), ("self_attn.norm_q.", "attn1.norm_q."),
    ("self_attn.norm_k.", "attn1.norm_k."),
    ("cross_attn.q.", "attn2.to_q."), ("cross_attn.k.", "attn2.to_k."), ("cross_attn.v.", "attn2.to_v."),
    ("cross_attn.o.", "attn2.to_out.0."), ("cross_attn.norm_q.", "attn2.norm_q."),
    ("cross_attn.norm_k.", "attn2.norm_k."),
    ("cross_attn.k_img.", "attn2.add_k_proj."), ("cross_attn.v_img.", "attn2.add_v_proj."),
    ("cross_attn.norm_k_img.", "attn2.norm_added_k."),
    ("norm3.", "norm2."),
    ("ffn.0.", "ffn.net.0.proj."), ("ffn.2.", "ffn.net.2."),
)
_IN_BLOCK_WHOLE = (("modulation", "scale_shift_table"),)
_TOP = (
    ("text_embedding.0.", "condition_embedder.text_embedder.linear_1."),
    ("text_embedding.2.", "condition_embedder.text_embedder.linear_2."),
    ("time_embedding.0.", "condition_embedder.time_embedder.linear_1."),
    ("time_embedding.2.", "condition_embedder.time_embedder.linear_2."),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.head.", "proj_out."),
    ("img_emb.proj.0.", "condition_embedder.image_embedder.norm1."),
    ("img_emb.proj.1.", "condition_embedder.image_embedder.ff.net.0.proj."),
    ("img_emb.proj.3.", "condition_embedder.image_embedder.ff.net.2."),
    ("img_emb.proj.4.", "condition_embedder.image_embedder.norm2."),
    ("patch_embedding.", "patch_embedding."),
)
_TOP_WHOLE = (("head.modulation", "scale_shift_table"),)

# Tensors that say "Wan transformer" in each naming (any prefix): the native time projection and
# head, or diffusers' condition embedder's time_proj next to a 3-D patch embedding.
NATIVE_MARKERS = ("time_projection.1.weight", "head.head.weight", "blocks.0.self_attn.q.weight")
DIFFUSERS_MARKERS = ("condition_embedder.time_proj.weight", "blocks.0.attn1.to_q.weight", "patch_embedding.weight")


def _has(keys, name: str) -> bool:
    return any(k == name or k.endswith("." + name) for k in keys)


def recognizes_keys(keys) -> bool:
    """A Wan transformer file (Wan-AI / ComfyUI or diffusers names, any prefix)."""
    keys = list(keys)
    return all(_has(keys, m) for m in NATIVE_MARKERS) or all(_has(keys, m) for m in DIFFUSERS_MARKERS)


def input_channels(shapes: dict) -> int | None:
    """The latent channels a single file's transformer takes (its 3-D patch embedding's inputs, any
    prefix; None without one): what tells a TI2V-5B file (48) from an A14B or Wan 2.1 one, whose
    tensor names are the same."""
    prefix = find_prefix(shapes)
    shape = None if prefix is None else shapes.get(prefix + "patch_embedding.weight")
    return None if shape is None or len(shape) != 5 else int(shape[1])


def find_prefix(keys) -> str | None:
    """The prefix the transformer's keys sit under ("", "model.diffusion_model.", ...), or None."""
    for anchor in ("patch_embedding.weight",):
        for k in keys:
            if k == anchor or k.endswith("." + anchor):
                return k[: len(k) - len(anchor)]
    return None


def is_native(names) -> bool:
    """True for Wan-AI's names, False for diffusers'."""
    return any(k.startswith("head.head.") or ".self_attn." in k for k in names)


def _rename(name: str, pairs, whole) -> str | None:
    for src, dst in whole:
        if name == src:
            return dst
    for src, dst in pairs:
        if name.startswith(src):
            return dst + name[len(src):]
    return None


def diffusers_name(native: str) -> str:
    """The diffusers key of a native key (an unknown name is returned as it is: the loader then
    names it as unexpected)."""
    m = _BLOCK_RE.match(native)
    if m:
        inner = _rename(m.group(2), _IN_BLOCK, _IN_BLOCK_WHOLE)
        return native if inner is None else f"blocks.{m.group(1)}.{inner}"
    top = _rename(native, _TOP, _TOP_WHOLE)
    return native if top is None else top


def _flip(pairs):
    return tuple((d, n) for n, d in pairs)


def native_name(diffusers: str) -> str:
    """The native key of a diffusers key (for exports and for messages naming a missing key)."""
    m = _BLOCK_RE.match(diffusers)
    if m:
        inner = _rename(m.group(2), _flip(_IN_BLOCK), _flip(_IN_BLOCK_WHOLE))
        return diffusers if inner is None else f"blocks.{m.group(1)}.{inner}"
    top = _rename(diffusers, _flip(_TOP), _flip(_TOP_WHOLE))
    return diffusers if top is None else top


def diffusers_to_native(state: dict) -> dict:
    """A diffusers state dict, or one group of it (the non-block modules, one block), in Wan-AI's names."""
    return {native_name(k): v for k, v in state.items()}


def native_metadata(model) -> dict:
    """SingleFileLayout.metadata: the config the weights cannot show, so a model of any head size
    loads back with its own config."""
    from ..component_files import METADATA_CONFIG_KEY

    cfg = model.config
    return {METADATA_CONFIG_KEY: json.dumps({k: cfg[k] for k in UNSEEN})}


# -- architecture from shapes -------------------------------------------------------------------------

# What the weights cannot show (the released models' values: models/configs/wan22_a14b.json).
UNSEEN = ("attention_head_dim", "eps", "rope_max_seq_len")


def count_blocks(shapes) -> int:
    idx = {int(m.group(1)) for k in shapes if (m := _BLOCK_RE.match(k))}
    if idx and idx != set(range(max(idx) + 1)):
        raise ValueError(f"blocks.N are not numbered 0..{max(idx)}: {sorted(idx)}")
    return len(idx)


def config_from_shapes(shapes: dict[str, tuple[int, ...]], released: dict, meta: dict | None = None) -> dict:
    """A WanTransformer3DModel config from diffusers key shapes (a native file's after renaming);
    `released` gives what the weights cannot show, `meta` (a file's leantune.config) overrides it.

    Raises KeyError naming the first anchor key that is missing, ValueError for shapes that fit
    no Wan transformer."""
    meta = dict(meta or {})

    def need(key):
        if key not in shapes:
            raise KeyError(key)
        return shapes[key]

    patch = need("patch_embedding.weight")
    if len(patch) != 5:
        raise ValueError(f"patch_embedding.weight has shape {tuple(patch)}, not a 3-D convolution's (Wan's)")
    inner, in_channels, *patch_size = patch
    out_rows = need("proj_out.weight")[0]
    cells = patch_size[0] * patch_size[1] * patch_size[2]
    if out_rows % cells:
        raise ValueError(f"proj_out gives {out_rows} outputs, not whole {tuple(patch_size)} patches")
    layers = count_blocks(shapes)
    if not layers:
        raise KeyError("blocks.0.attn1.to_q.weight")
    head = int(meta.get("attention_head_dim") or released["attention_head_dim"])
    if inner % head:
        raise ValueError(f"width {inner} is not a multiple of the head size {head}; give attention_head_dim in "
                         f"the file's leantune.config metadata")
    image = shapes.get("condition_embedder.image_embedder.norm1.weight")
    added = shapes.get("blocks.0.attn2.add_k_proj.weight")
    pos = shapes.get("condition_embedder.image_embedder.pos_embed")
    config = dict(
        patch_size=list(patch_size), num_attention_heads=inner // head, in_channels=in_channels,
        out_channels=out_rows // cells, text_dim=need("condition_embedder.text_embedder.linear_1.weight")[1],
        freq_dim=need("condition_embedder.time_embedder.linear_1.weight")[1],
        ffn_dim=need("blocks.0.ffn.net.0.proj.weight")[0], num_layers=layers,
        cross_attn_norm="blocks.0.norm2.weight" in shapes,
        qk_norm="rms_norm_across_heads" if "blocks.0.attn1.norm_q.weight" in shapes else None,
        image_dim=None if image is None else image[0], added_kv_proj_dim=None if added is None else added[1],
        pos_embed_seq_len=None if pos is None else pos[1],
    )
    config.update({k: released[k] for k in UNSEEN})
    config.update({k: v for k, v in meta.items() if k in UNSEEN})
    config["attention_head_dim"] = head
    return config
