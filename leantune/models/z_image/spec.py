"""The Z-Image spec (Turbo and base share the transformer): which modules are blocks, which stay in
the compute dtype, LoRA presets, LoRA file names, the original single-file layout. Data only, so
that the family module (z_image/__init__.py) and its loader (z_image/loading.py) both read it
without importing each other.

ZImageTransformer2DModel is a single-stream DiT with three block lists, run in this order:
`noise_refiner` (2 blocks over the image tokens alone, adaLN-modulated by the timestep),
`context_refiner` (2 blocks over the text tokens alone, no modulation) and `layers` (30 blocks
over the joined image + text sequence, modulated). Every block is one attention
(`attention.to_q/k/v`, `attention.to_out.0`, q/k RMSNorms) and one SwiGLU MLP
(`feed_forward.w1/w2/w3`), with RMSNorms around both; a modulated block's adaLN is one Linear
`adaLN_modulation.0` (256 -> 4 x 3840: a fifth of a block's parameters, read for one token), kept
in the compute dtype under fp8 storage unless the plan asks for fp8 modulation.

The non-block modules are the timestep MLP, the caption embedder (RMSNorm + Linear), the patch
embedder and the final layer (`all_x_embedder` / `all_final_layer`: one entry per patch size,
the released models have one). The two pad tokens are parameters of the model itself.
"""

from __future__ import annotations

from ...spec import BlockList, ModelSpec, SingleFileLayout
from .lora_keys import Z_IMAGE_LORA_KEYS

_ATTN = (r"attention\.to_q", r"attention\.to_k", r"attention\.to_v", r"attention\.to_out\.0")
_MLP = (r"feed_forward\.w1", r"feed_forward\.w2", r"feed_forward\.w3")
_MODULATION = (r"(^|\.)adaLN_modulation\.0$",)

NON_BLOCK_MODULES = ("t_embedder", "all_x_embedder", "cap_embedder", "all_final_layer")


def _to_native(state: dict, model) -> dict:
    from .keys import diffusers_to_native

    return diffusers_to_native(state)


def _native_metadata(model) -> dict:
    from .keys import native_metadata

    return native_metadata(model)


Z_IMAGE_SPEC = ModelSpec(
    family="z-image",
    block_lists=(
        BlockList(attr="noise_refiner", kind="noise_refiner", kohya_prefix="noise_refiner"),
        BlockList(attr="context_refiner", kind="context_refiner", kohya_prefix="context_refiner"),
        BlockList(attr="layers", kind="main", kohya_prefix="layers"),
    ),
    fp8_skip=_MODULATION + (r"(^|\.)norm",),
    non_block_modules=NON_BLOCK_MODULES,
    lora_presets={
        "attention": _ATTN,
        "attention_mlp": _ATTN + _MLP,
        "all": _ATTN + _MLP + (r"adaLN_modulation\.0",),
    },
    default_lora_preset="attention_mlp",
    lora_keys=Z_IMAGE_LORA_KEYS,
    modulation=_MODULATION,
    # the original checkpoint's names (Tongyi-MAI's single file, ComfyUI's z_image_turbo_bf16), bare
    single_file=SingleFileLayout("Z-Image original", "", _to_native, _native_metadata),
)
