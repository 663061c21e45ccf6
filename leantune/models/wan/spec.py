"""The Wan spec (Wan 2.2 A14B's experts, TI2V-5B, Wan 2.1: one class; the family reads the text-to-video
ones, wan/loading.check_text_to_video): which modules are
blocks, which stay in the compute dtype, LoRA presets, LoRA file names, the native single-file
layout. Data only, so that the family module (wan/__init__.py) and its loader (wan/loading.py)
both read it without importing each other.

WanTransformer3DModel has one list of blocks, `blocks`, each a self-attention over the video
tokens (`attn1.to_q/k/v`, `attn1.to_out.0`, q/k RMSNorms across heads, 3-D rotary positions), a
cross-attention to the umT5 text rows (`attn2.*`; Wan 2.1 I2V adds image keys and values
`add_k_proj / add_v_proj`), and a GELU MLP (`ffn.net.0.proj`, `ffn.net.2`). A block has no
modulation Linear: its adaLN is a learned `scale_shift_table` (6 x width) added to the shared
time projection, which lives outside the blocks (`condition_embedder.time_proj`). The norms are
LayerNorms (the cross-attention's affine), kept in fp32 by the model itself.

The non-block modules are the rotary table, the 3-D patch embedding, the condition embedder (time,
text and image embedders, the time projection), the output norm and projection; the output's
`scale_shift_table` is a parameter of the model itself.
"""

from __future__ import annotations

from ...spec import BlockList, ModelSpec, SingleFileLayout
from .lora_keys import WAN_LORA_KEYS

_ATTN = tuple(rf"attn{i}\.{p}" for i in (1, 2) for p in (r"to_q", r"to_k", r"to_v", r"to_out\.0"))
_IMAGE_KV = (r"attn2\.add_k_proj", r"attn2\.add_v_proj")
_MLP = (r"ffn\.net\.0\.proj", r"ffn\.net\.2")

NON_BLOCK_MODULES = ("rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out")


def _to_native(state: dict, model) -> dict:
    from .keys import diffusers_to_native

    return diffusers_to_native(state)


def _native_metadata(model) -> dict:
    from .keys import native_metadata

    return native_metadata(model)


WAN_SPEC = ModelSpec(
    family="wan2.2",
    block_lists=(BlockList(attr="blocks", kind="main", kohya_prefix="blocks"),),
    fp8_skip=(r"(^|\.)norm",),
    non_block_modules=NON_BLOCK_MODULES,
    lora_presets={
        "attention": _ATTN,
        "attention_mlp": _ATTN + _MLP,
        "all": _ATTN + _IMAGE_KV + _MLP,
    },
    default_lora_preset="attention_mlp",
    lora_keys=WAN_LORA_KEYS,
    modulation=(),
    # Wan-AI's checkpoint names (its own files; ComfyUI's repackaged ones under model.diffusion_model.)
    single_file=SingleFileLayout("Wan-AI", "", _to_native, _native_metadata),
)
