"""The Qwen-Image spec (Qwen-Image and Qwen-Image-Edit share the transformer): which modules are
blocks, which stay in the compute dtype, LoRA presets, LoRA file names, the ComfyUI single-file
layout. Data only, so that the family module (qwen_image/__init__.py) and its loader (qwen_image/loading.py)
both read it without importing each other.

QwenImageTransformer2DModel is one list of 60 dual-stream MMDiT blocks (`transformer_blocks`,
width 3072 = 24 heads of 128). Each block has an image and a text stream with their own adaLN
Linear (`img_mod.1`, `txt_mod.1`: 3072 -> 6 x 3072, one eighth of the model's parameters each,
read for one token per step), joint attention (`attn.to_q/k/v/to_out.0` for the image,
`attn.add_q/k/v_proj`/`to_add_out` for the text) and one GELU MLP per stream (`img_mlp`,
`txt_mlp`).

LoRA names: the reference implementation ComfyUI runs (and musubi-tuner, ai-toolkit and kohya-style
trainers write) names every Linear as diffusers does, so the native table is the identity, with
no fused q/k/v: `lora_unet_transformer_blocks_3_attn_to_q` is diffusers'
`transformer_blocks.3.attn.to_q`. The single-file layout is ComfyUI's repackaged
`qwen_image_bf16.safetensors`: diffusers' names under `model.diffusion_model.`.
"""

from __future__ import annotations

from ...spec import BlockList, ModelSpec, SingleFileLayout
from ..lora_keymap import LoraKeyMap

_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
         r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out")
_MLP = (r"img_mlp\.net\.0\.proj", r"img_mlp\.net\.2", r"txt_mlp\.net\.0\.proj", r"txt_mlp\.net\.2")
_MODULATION_NAMES = ("img_mod.1", "txt_mod.1")
_MODULATION = tuple(rf"(^|\.){n.replace('.', chr(92) + '.')}$" for n in _MODULATION_NAMES)

COMFY_PREFIX = "model.diffusion_model."

# In-block Linears, each its own native module (identity table: no fused q/k/v in Qwen-Image).
_BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                  "txt_mlp.net.0.proj", "txt_mlp.net.2") + _MODULATION_NAMES
_TOP_LINEARS = ("img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
                "time_text_embed.timestep_embedder.linear_2")

QWEN_IMAGE_LORA_KEYS = LoraKeyMap(
    family="qwen-image", display="Qwen-Image",
    block_lists=(("transformer_blocks", "transformer_blocks", {n: ((n,), (1,)) for n in _BLOCK_LINEARS}),),
    top={n: n for n in _TOP_LINEARS},
    # norm_out (AdaLayerNormContinuous) emits (scale, shift) in diffusers and ComfyUI alike: no swap
    swaps={},
    header={"ss_network_module": "networks.lora_qwen_image", "ss_base_model_version": "qwen_image"},
    header_hints=("qwen_image", "qwen-image"),
    # Qwen-Image is 3072 wide like Flux.1: the width cannot tell them apart, so it claims none (a
    # header-less file of attention-only diffusers names stays Flux's, as before; names only
    # Qwen-Image has, img_mlp / txt_mlp / img_mod / txt_mod, decide alone)
    widths=(),
)


def _to_comfy(state: dict, model) -> dict:
    """ComfyUI's names are diffusers' own (the prefix is added by the writer)."""
    return dict(state)


def _comfy_metadata(model) -> dict:
    """The rotary split where the weights cannot show it (heads other than Qwen-Image's 128), as
    loading.save_comfy_transformer writes it: a full fine-tune's export of such a model loads back."""
    import json

    from ..component_files import METADATA_CONFIG_KEY

    cfg = model.config
    if cfg.attention_head_dim == 128:
        return {}
    return {METADATA_CONFIG_KEY: json.dumps({"axes_dims_rope": list(cfg.axes_dims_rope)})}


QWEN_IMAGE_SPEC = ModelSpec(
    family="qwen-image",
    block_lists=(BlockList(attr="transformer_blocks", kind="joint", kohya_prefix="transformer_blocks"),),
    fp8_skip=_MODULATION + (r"(^|\.)norm",),
    non_block_modules=("pos_embed", "time_text_embed", "txt_norm", "img_in", "txt_in", "norm_out", "proj_out"),
    lora_presets={
        "attention": _ATTN,
        "attention_mlp": _ATTN + _MLP,
        "all": _ATTN + _MLP + tuple(n.replace(".", r"\.") for n in _MODULATION_NAMES),
    },
    default_lora_preset="attention_mlp",
    lora_keys=QWEN_IMAGE_LORA_KEYS,
    modulation=_MODULATION,
    single_file=SingleFileLayout("ComfyUI", COMFY_PREFIX, _to_comfy, _comfy_metadata),
)
