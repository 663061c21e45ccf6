"""The Krea 2 spec (Raw and Turbo share the architecture): which modules are blocks, which stay in
the compute dtype, LoRA presets, LoRA file names, the official single-file layout. Data only, so
that the family module (krea2/__init__.py) and its loader (krea2/loading.py) both read it without
importing each other.

Krea2Transformer2DModel is one list of 28 single-stream blocks (`transformer_blocks`, width 6144 =
48 query heads of 128, 12 key/value heads): text and image tokens share each block's attention
(`attn.to_q/k/v`, a sigmoid output gate `attn.to_gate`, `attn.to_out.0`) and SwiGLU MLP
(`ff.gate/up/down`). A block has no modulation Linear: one shared `time_mod_proj` outside the blocks
maps the time embedding to six vectors, and each block adds its own learned (6, width)
`scale_shift_table` (a parameter, kept in the compute dtype with the norms). So `modulation` is
empty and fp8 storage takes every block Linear.

Outside the blocks: the embedders, the shared modulation, the text fusion (2 + 2 small transformer
blocks over the text encoder's 12 tapped layers, run once per step on the text rows) and the final
layer, streamed as one group.

LoRA presets: "attention" is the five attention Linears (the gate included: it multiplies the
attention output), "attention_mlp" (the default) adds the MLP, "all" is the same inside blocks (no
other Linear there); `all_linear` adds every Linear outside them, the text fusion's included.
"""

from __future__ import annotations

from ...spec import BlockList, ModelSpec, SingleFileLayout
from .lora_keys import KREA2_LORA_KEYS

_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_gate", r"attn\.to_out\.0")
_MLP = (r"ff\.gate", r"ff\.up", r"ff\.down")
NON_BLOCK_MODULES = ("img_in", "time_embed", "time_mod_proj", "text_fusion", "txt_in", "rotary_emb", "final_layer")


def _to_native(state: dict, model) -> dict:
    from .keys import native_state

    return native_state(state)


def _native_metadata(model) -> dict:
    """The rotary split and base where they are not what the loader derives from the shapes (the
    official rule), so any width loads back with the same config."""
    import json

    from ..component_files import METADATA_CONFIG_KEY
    from .keys import rope_axes

    cfg = model.config
    extra = {}
    if tuple(cfg.axes_dims_rope) != rope_axes(cfg.attention_head_dim):
        extra["axes_dims_rope"] = list(cfg.axes_dims_rope)
    if float(cfg.rope_theta) != 1000.0:
        extra["rope_theta"] = float(cfg.rope_theta)
    if float(cfg.norm_eps) != 1e-5:
        extra["norm_eps"] = float(cfg.norm_eps)
    return {METADATA_CONFIG_KEY: json.dumps(extra)} if extra else {}


KREA2_SPEC = ModelSpec(
    family="krea2",
    block_lists=(BlockList(attr="transformer_blocks", kind="single", kohya_prefix="blocks"),),
    fp8_skip=(r"(^|\.)norm",),
    non_block_modules=NON_BLOCK_MODULES,
    lora_presets={"attention": _ATTN, "attention_mlp": _ATTN + _MLP, "all": _ATTN + _MLP},
    default_lora_preset="attention_mlp",
    lora_keys=KREA2_LORA_KEYS,
    modulation=(),
    # krea-ai's own layout (what Krea-2-Raw.safetensors holds, no prefix); ComfyUI's repackaged
    # files are the same names under model.diffusion_model.
    single_file=SingleFileLayout("krea-ai", "", _to_native, _native_metadata),
)
