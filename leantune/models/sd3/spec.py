"""The SD3.5 spec (Large and Medium): which modules are blocks, which stay in the compute dtype, LoRA
presets, the Stability single-file layout. Data only, so that both the family module (sd3/__init__.py) and
its loader (sd3/loading.py) read it without importing each other: sd3/__init__.py imports sd3_loading, never
the other way round.
"""

from __future__ import annotations

from ...spec import BlockList, BlockVariant, ModelSpec, SingleFileLayout
from .lora_keys import SD3_LORA_KEYS

_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
         r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
         # MMDiT-X (Medium): the second, image-only attention of the dual-attention blocks
         r"attn2\.to_q", r"attn2\.to_k", r"attn2\.to_v", r"attn2\.to_out\.0")
_MLP = (r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2")
_MODULATION = (r"norm1\.linear", r"norm1_context\.linear")

def _to_stability(state: dict, model) -> dict:
    from .keys import diffusers_to_stability

    return diffusers_to_stability(state, num_layers=model.config.num_layers)   # a group: tell the depth


def _stability_metadata(model) -> dict:
    """sample_size and the head size, which Stability files do not show (so other widths load too)."""
    import json

    from ..component_files import METADATA_CONFIG_KEY

    cfg = model.config
    return {METADATA_CONFIG_KEY: json.dumps({"sample_size": cfg.sample_size, "attention_head_dim": cfg.attention_head_dim})}


SD3_SPEC = ModelSpec(
    family="sd3",
    block_lists=(BlockList(attr="transformer_blocks", kind="joint", kohya_prefix="joint_blocks"),),
    fp8_skip=(r"(^|\.)norm1\.linear$", r"(^|\.)norm1_context\.linear$", r"(^|\.)norm"),
    non_block_modules=("pos_embed", "time_text_embed", "context_embedder", "norm_out", "proj_out"),
    lora_presets={
        "attention": _ATTN,
        "attention_mlp": _ATTN + _MLP,
        "all": _ATTN + _MLP + _MODULATION,
    },
    default_lora_preset="attention_mlp",
    lora_keys=SD3_LORA_KEYS,
    modulation=(r"(^|\.)norm1\.linear$", r"(^|\.)norm1_context\.linear$"),
    single_file=SingleFileLayout("Stability", "model.diffusion_model.", _to_stability, _stability_metadata),
    # MMDiT-X (Medium): the joint blocks with the second attention keep ~1.5x the activations of the
    # others (1024 px, LoRA r16: 537 against 367 MiB) and do ~1.5x their FLOPs.
    block_variants=(BlockVariant(attr="transformer_blocks", kind="joint_dual", config_key="dual_attention_layers"),),
)
