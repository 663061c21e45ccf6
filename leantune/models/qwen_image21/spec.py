"""The Qwen-Image-2.1 spec: which modules are blocks, which stay in the compute dtype, LoRA
presets, LoRA file names (lora_keys.py), the ComfyUI single-file layout. Data only, read by the
loader and the family module.

QwenImage21Transformer2DModel is one list of 32 single-stream blocks (`transformer_blocks`, width
4096 = 32 heads of 128): text, reference-image and target tokens share each block's attention
(`attn.to_q/k/v`, `attn.to_out.0`, q/k RMSNorms) and SwiGLU MLP (`img_mlp.gate_layer/proj/out`).
A block holds no modulation Linear: the model's one `modulation` Linear outside the blocks gives
every block its scales and gates, so `modulation` here is empty and fp8 storage takes every block
Linear (the norms stay in the compute dtype).

Outside the blocks: the rotary table, time embedding, text projection, image embedder, the shared
modulation and the final norm/projection, streamed as one group.

LoRA presets: "attention" is the four attention Linears, "attention_mlp" (the default) adds the
three SwiGLU Linears; "all" is the same inside blocks (there is no other Linear there).
"""

from __future__ import annotations

from ...spec import BlockList, ModelSpec, SingleFileLayout
from .lora_keys import QWEN_IMAGE21_LORA_KEYS

_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0")
_MLP = (r"img_mlp\.gate_layer", r"img_mlp\.proj", r"img_mlp\.out")
NON_BLOCK_MODULES = ("pos_embed", "time_text_embed", "txt_in", "img_in", "modulation", "norm_out", "proj_out")


def _to_comfyui(state: dict, model) -> dict:
    from .keys import fuse_for_comfyui

    return fuse_for_comfyui(state)


def _file_metadata(model) -> dict:
    import json

    from ..component_files import METADATA_CONFIG_KEY
    from .keys import metadata

    extra = metadata(model)
    return {METADATA_CONFIG_KEY: json.dumps(extra)} if extra else {}


QWEN_IMAGE21_SPEC = ModelSpec(
    family="qwen-image-2.1",
    block_lists=(BlockList(attr="transformer_blocks", kind="single", kohya_prefix="transformer_blocks"),),
    fp8_skip=(r"(^|\.)norm",),
    non_block_modules=NON_BLOCK_MODULES,
    lora_presets={"attention": _ATTN, "attention_mlp": _ATTN + _MLP, "all": _ATTN + _MLP},
    default_lora_preset="attention_mlp",
    lora_keys=QWEN_IMAGE21_LORA_KEYS,
    modulation=(),
    # ComfyUI's repackaged layout (keys.py): diffusers names under model.diffusion_model., the
    # SwiGLU gate and up fused.
    single_file=SingleFileLayout("ComfyUI", "model.diffusion_model.", _to_comfyui, _file_metadata),
)
