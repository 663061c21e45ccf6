"""The FLUX.2 spec (dev, klein 4B, klein 9B share the transformer class): which modules are blocks,
which stay in the compute dtype, LoRA presets. Data only, so that the family module (flux2/__init__.py), its
loader (flux2/loading.py) and the single-file reader all read it without importing each other.

Flux2Transformer2DModel has two block lists, priced apart by the planner (their shapes and
activations differ): `transformer_blocks`, double-stream (dev: 8; an image and a text stream, joint
attention `attn.to_q/k/v/to_out.0` + `attn.add_q/k/v_proj`/`to_add_out`, one SwiGLU MLP per stream
`ff.linear_in/linear_out`, `ff_context.*`), and `single_transformer_blocks` (dev: 48; one fused
Linear `attn.to_qkv_mlp_proj` for q, k, v and the MLP's input, one `attn.to_out` for the attention
and MLP outputs together).

Unlike Flux.1, the adaLN modulation is SHARED: three Linears outside the blocks
(`double_stream_modulation_img`, `double_stream_modulation_txt`, `single_stream_modulation`) map the
timestep embedding to the scales, shifts and gates every block of a list uses. They are non-block
modules (never fp8, streamed with the embedders); the blocks hold no modulation Linear, so
`modulation` is empty and `fp8_skip` names only norms (the q/k RMSNorms; the LayerNorms have no
weights). Every Linear is bias-free.

A block's Linears are all attention or MLP, so "all" equals "attention_mlp" inside the blocks; the
single blocks' two fused Linears carry attention and MLP at once and are in every preset.
`all_linear` (spec.ALL_LINEAR) adds the non-block Linears, the shared modulation among them.

LoRA file names (`lora_keys`) come from flux2/lora_keys.py; the BFL/ComfyUI single-file layout
(`single_file`) from flux2/keys.py (read by flux2/single_file.py).
"""

from __future__ import annotations

from ...spec import BlockList, ModelSpec, SingleFileLayout
from .lora_keys import FLUX2_LORA_KEYS

# double blocks
_DOUBLE_ATTN = (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
                r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out")
_DOUBLE_MLP = (r"ff\.linear_in", r"ff\.linear_out", r"ff_context\.linear_in", r"ff_context\.linear_out")
# single blocks: fused attention + MLP Linears (`attn\.to_out` full-matches only the single blocks'
# Linear; the double blocks' `attn.to_out` is a ModuleList, which LoRA targeting skips)
_SINGLE = (r"attn\.to_qkv_mlp_proj", r"attn\.to_out")

MODULATION_MODULES = ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation")
NON_BLOCK_MODULES = ("pos_embed", "time_guidance_embed") + MODULATION_MODULES + (
    "x_embedder", "context_embedder", "norm_out", "proj_out")

BFL_DOUBLE, BFL_SINGLE = "double_blocks", "single_blocks"


def _to_bfl(state: dict, model) -> dict:
    from .keys import diffusers_to_bfl

    return diffusers_to_bfl(state)


def _bfl_metadata(model) -> dict:
    from .keys import native_metadata

    return native_metadata(model)


def make_spec(family: str) -> ModelSpec:
    """The spec under a family name (flux2-dev, flux2-klein-4b, flux2-klein-9b: the same blocks and
    LoRA names; code handed only a spec finds its family by the name)."""
    return ModelSpec(
        family=family,
        block_lists=(
            BlockList(attr="transformer_blocks", kind="double", kohya_prefix=BFL_DOUBLE),
            BlockList(attr="single_transformer_blocks", kind="single", kohya_prefix=BFL_SINGLE),
        ),
        fp8_skip=(r"(^|\.)norm",),
        non_block_modules=NON_BLOCK_MODULES,
        lora_presets={
            "attention": _DOUBLE_ATTN + _SINGLE,
            "attention_mlp": _DOUBLE_ATTN + _DOUBLE_MLP + _SINGLE,
            "all": _DOUBLE_ATTN + _DOUBLE_MLP + _SINGLE,
        },
        default_lora_preset="attention_mlp",
        lora_keys=FLUX2_LORA_KEYS,
        modulation=(),
        # BFL's flux2-dev.safetensors layout (flux2/keys.py), what a full fine-tune's comfyui export writes
        single_file=SingleFileLayout("BFL", "", _to_bfl, _bfl_metadata),
    )


FLUX2_DEV_SPEC = make_spec("flux2-dev")
FLUX2_KLEIN_4B_SPEC = make_spec("flux2-klein-4b")
FLUX2_KLEIN_9B_SPEC = make_spec("flux2-klein-9b")
SPECS = {s.family: s for s in (FLUX2_DEV_SPEC, FLUX2_KLEIN_4B_SPEC, FLUX2_KLEIN_9B_SPEC)}
