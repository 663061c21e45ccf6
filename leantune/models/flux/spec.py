"""The Flux.1 spec: which modules are blocks, which stay in the compute dtype, LoRA presets, the BFL
single-file layout. Data only, so that both the family module (flux/__init__.py) and its loader
(flux/loading.py) read it without importing each other: flux/__init__.py imports flux_loading, never the
other way round.
"""

from __future__ import annotations

from ...spec import BlockList, ModelSpec, SingleFileLayout
from .lora_keys import FLUX_LORA_KEYS

_DOUBLE_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
                r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out")
_SINGLE_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"proj_out")
_MLP = (r"ff\.net\.0\.proj", r"ff\.net\.2", r"ff_context\.net\.0\.proj", r"ff_context\.net\.2", r"proj_mlp")
_MODULATION = (r"norm1\.linear", r"norm1_context\.linear", r"norm\.linear")


def _unique(*groups: tuple[str, ...]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for g in groups:
        for item in g:
            seen[item] = None
    return tuple(seen)


def _to_bfl(state: dict, model) -> dict:
    from .keys import diffusers_to_bfl

    return diffusers_to_bfl(state)


def _bfl_metadata(model) -> dict:
    """The rotary split, which BFL files do not show (so other widths load too)."""
    import json

    from ..component_files import METADATA_CONFIG_KEY

    return {METADATA_CONFIG_KEY: json.dumps({"axes_dims_rope": list(model.config.axes_dims_rope)})}


FLUX_SPEC = ModelSpec(
    family="flux",
    block_lists=(
        BlockList(attr="transformer_blocks", kind="double", kohya_prefix="double_blocks"),
        BlockList(attr="single_transformer_blocks", kind="single", kohya_prefix="single_blocks"),
    ),
    fp8_skip=(r"(^|\.)norm1\.linear$", r"(^|\.)norm1_context\.linear$", r"(^|\.)norm\.linear$", r"(^|\.)norm"),
    non_block_modules=("pos_embed", "time_text_embed", "context_embedder", "x_embedder", "norm_out", "proj_out"),
    lora_presets={
        "attention": _unique(_DOUBLE_ATTN, _SINGLE_ATTN),
        "attention_mlp": _unique(_DOUBLE_ATTN, _SINGLE_ATTN, _MLP),
        "all": _unique(_DOUBLE_ATTN, _SINGLE_ATTN, _MLP, _MODULATION),
    },
    default_lora_preset="attention_mlp",
    lora_keys=FLUX_LORA_KEYS,
    modulation=(r"(^|\.)norm1\.linear$", r"(^|\.)norm1_context\.linear$", r"(^|\.)norm\.linear$"),
    single_file=SingleFileLayout("BFL", "", _to_bfl, _bfl_metadata),
)
