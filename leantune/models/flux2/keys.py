"""Key layout of BFL / ComfyUI FLUX.2 transformer files, both ways, and the architecture from shapes.

BFL's reference code (flux2-dev.safetensors, flux-2-klein-*.safetensors) names FLUX.2 as it named
Flux.1 (`double_blocks`, `single_blocks`, `img_in`, `final_layer`), with three differences that make
the Flux.1 tables (flux/keys.py) wrong for it: the adaLN modulation is shared by all blocks of a kind
(`double_stream_modulation_img.lin`, `double_stream_modulation_txt.lin`,
`single_stream_modulation.lin`) instead of living in each block; the MLPs are SwiGLU
(`img_mlp.0` emits gate and value, 2 x 3 x width); and diffusers keeps a single block's fused
q/k/v/MLP-input projection fused (`attn.to_qkv_mlp_proj`), so only a double block's
`img_attn.qkv` / `txt_attn.qkv` is split into q, k, v. The final adaLN stores (shift, scale) in
BFL's files and (scale, shift) in diffusers, as for Flux.1. ComfyUI's repackaged files carry the
same names under `model.diffusion_model.`.

One table serves both directions, so `diffusers_to_bfl` (what a full fine-tune's export writes) is
the exact inverse of `bfl_to_diffusers_ops` (what the loader reads lazily). `config_from_shapes`
reads Flux2Transformer2DModel's config from diffusers key shapes; `variant_of` names the family a
config is (flux2-dev, flux2-klein-4b, flux2-klein-9b), `is_released` whether it is a released
architecture exactly. Only the rotary split is not
in the weights: FLUX.2's is four equal axes (32, 32, 32, 32) for heads of 128, and a file may
state another in its `leantune.config` metadata.
"""

from __future__ import annotations

import json

from ..bfl_layout import FLUX2_BFL_MARKERS as BFL_MARKERS
from ..bfl_layout import FLUX2_DIFFUSERS_MARKERS as DIFFUSERS_MARKERS
from ..bfl_layout import BflLayout, count_blocks, is_diffusers_flux2, is_flux2_bfl  # noqa: F401 (this family's names)
from ..bfl_layout import is_flux2_file as recognizes_keys

COMFY_PREFIX = "model.diffusion_model."

# Linear layers: (BFL module, diffusers module(s)); .weight and .bias are both mapped. Several
# diffusers modules: the BFL tensor is their concatenation along dim 0, in equal parts.
_DOUBLE_LINEARS = (
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ("img_attn.proj", ("attn.to_out.0",)),
    ("txt_attn.proj", ("attn.to_add_out",)),
    ("img_mlp.0", ("ff.linear_in",)),
    ("img_mlp.2", ("ff.linear_out",)),
    ("txt_mlp.0", ("ff_context.linear_in",)),
    ("txt_mlp.2", ("ff_context.linear_out",)),
)
_DOUBLE_NORMS = (
    ("img_attn.norm.query_norm.scale", "attn.norm_q.weight"),
    ("img_attn.norm.key_norm.scale", "attn.norm_k.weight"),
    ("txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"),
    ("txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"),
)
_SINGLE_LINEARS = (
    ("linear1", ("attn.to_qkv_mlp_proj",)),      # q, k, v and the SwiGLU input, kept fused by diffusers
    ("linear2", ("attn.to_out",)),
)
_SINGLE_NORMS = (
    ("norm.query_norm.scale", "attn.norm_q.weight"),
    ("norm.key_norm.scale", "attn.norm_k.weight"),
)
_TOP_LINEARS = (
    ("img_in", ("x_embedder",)),
    ("txt_in", ("context_embedder",)),
    ("time_in.in_layer", ("time_guidance_embed.timestep_embedder.linear_1",)),
    ("time_in.out_layer", ("time_guidance_embed.timestep_embedder.linear_2",)),
    ("guidance_in.in_layer", ("time_guidance_embed.guidance_embedder.linear_1",)),
    ("guidance_in.out_layer", ("time_guidance_embed.guidance_embedder.linear_2",)),
    ("double_stream_modulation_img.lin", ("double_stream_modulation_img.linear",)),
    ("double_stream_modulation_txt.lin", ("double_stream_modulation_txt.linear",)),
    ("single_stream_modulation.lin", ("single_stream_modulation.linear",)),
    ("final_layer.linear", ("proj_out",)),
    ("final_layer.adaLN_modulation.1", ("norm_out.linear",)),          # halves swapped
)
_SWAPPED = {"final_layer.adaLN_modulation.1"}
FLUX2_LAYOUT = BflLayout("FLUX.2", {"double": (_DOUBLE_LINEARS, _DOUBLE_NORMS), "single": (_SINGLE_LINEARS, _SINGLE_NORMS),
                                    "top": (_TOP_LINEARS, ())}, frozenset(_SWAPPED))

# Keys only FLUX.2 has (the shared modulation): the markers live with the shared BFL layout, since
# Flux.1's loader asks them too (to refuse a FLUX.2 file by name).


def find_prefix(keys) -> str | None:
    """The prefix FLUX.2's marker keys sit under ("", "model.diffusion_model.", ...), or None."""
    for k in keys:
        for m in BFL_MARKERS + DIFFUSERS_MARKERS:
            if k == m or k.endswith("." + m):
                return k[: len(k) - len(m)]
    return None


# -- both ways (bfl_layout.py): a double block's fused qkv splits in three equal row runs ----------------

bfl_to_diffusers_ops = FLUX2_LAYOUT.to_diffusers_ops
convert_bfl_state_dict = FLUX2_LAYOUT.convert_state_dict
bfl_name = FLUX2_LAYOUT.bfl_name
# fused double-block qkv, swapped final adaLN halves; works on one group (non-block modules, a block)
diffusers_to_bfl = FLUX2_LAYOUT.from_diffusers


def to_native(state: dict, model=None) -> dict:
    """SingleFileLayout.to_native: one group of a diffusers state dict in BFL names."""
    return diffusers_to_bfl(state)


def native_metadata(model) -> dict:
    """SingleFileLayout.metadata: the config a loader cannot read from the weights (the rotary
    split, the rope base, the norm eps), so a fine-tune of any width loads back the same."""
    from ..component_files import METADATA_CONFIG_KEY

    cfg = model.config
    return {METADATA_CONFIG_KEY: json.dumps({"axes_dims_rope": [int(a) for a in cfg.axes_dims_rope],
                                             "rope_theta": int(cfg.rope_theta), "eps": float(cfg.eps)})}


# -- architecture from shapes -------------------------------------------------------------------------

# The released architectures: name -> (width, double blocks, single blocks, text width, guidance embedder).
VARIANTS = {
    "flux2-dev": (6144, 8, 48, 15360, True),
    "flux2-klein-4b": (3072, 5, 20, 7680, False),
    "flux2-klein-9b": (4096, 8, 24, 12288, False),
}


def default_axes_dims_rope(head_dim: int) -> tuple[int, ...]:
    """FLUX.2's rotary split: four equal even axes (time, height, width, reference index), (32, 32,
    32, 32) for heads of 128."""
    if head_dim % 8:
        raise ValueError(f"head dim {head_dim} cannot be split into four equal even rotary axes; give "
                         f"axes_dims_rope in the file's leantune.config metadata")
    return (head_dim // 4,) * 4


def config_from_shapes(shapes: dict[str, tuple[int, ...]], meta: dict | None = None) -> dict:
    """A Flux2Transformer2DModel config from diffusers key shapes (BFL files: after
    `bfl_to_diffusers_ops`); `meta` (a file's leantune.config) fills what shapes cannot show.

    Raises KeyError naming the first anchor key that is missing, ValueError for shapes that fit
    no FLUX.2 transformer.
    """
    meta = dict(meta or {})

    def need(key):
        if key not in shapes:
            raise KeyError(key)
        return shapes[key]

    inner, in_channels = need("x_embedder.weight")
    double = count_blocks(shapes, "transformer_blocks.")
    single = count_blocks(shapes, "single_transformer_blocks.")
    where = "transformer_blocks.0" if double else "single_transformer_blocks.0"
    head_dim = need(f"{where}.attn.norm_q.weight")[0]
    if inner % head_dim:
        raise ValueError(f"width {inner} is not a multiple of the head dim {head_dim} (from {where}.attn.norm_q)")
    if double:
        hidden = need("transformer_blocks.0.ff.linear_in.weight")[0] // 2
    else:
        hidden = (need("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight")[0] - 3 * inner) // 2
    mlp_ratio = hidden / inner
    if hidden <= 0 or int(inner * mlp_ratio) != hidden:
        raise ValueError(f"MLP width {hidden} is not a width ratio of {inner}")
    axes = tuple(meta.get("axes_dims_rope") or default_axes_dims_rope(head_dim))
    if sum(axes) != head_dim:
        raise ValueError(f"axes_dims_rope {axes} does not sum to the head dim {head_dim}")
    out_rows = need("proj_out.weight")[0]
    config = dict(
        patch_size=1,
        in_channels=in_channels,
        out_channels=None if out_rows == in_channels else out_rows,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=head_dim,
        num_attention_heads=inner // head_dim,
        joint_attention_dim=need("context_embedder.weight")[1],
        timestep_guidance_channels=need("time_guidance_embed.timestep_embedder.linear_1.weight")[1],
        mlp_ratio=mlp_ratio,
        axes_dims_rope=list(axes),
        guidance_embeds="time_guidance_embed.guidance_embedder.linear_1.weight" in shapes,
    )
    config.update({k: v for k, v in meta.items() if k in ("rope_theta", "eps")})
    return config


def _get(config):
    return config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)


def _signature(config) -> tuple:
    get = _get(config)
    return (int(get("num_attention_heads")) * int(get("attention_head_dim")), int(get("num_layers")),
            int(get("num_single_layers")), int(get("joint_attention_dim")), bool(get("guidance_embeds")))


def is_released(config) -> bool:
    """True if a transformer config is one of the released architectures (VARIANTS) exactly; a tiny
    test model or a pruned one is not."""
    return _signature(config) in VARIANTS.values()


def variant_by_layout(guidance: bool, double_blocks: int, width: int | None = None) -> str:
    """The FLUX.2 family of a transformer that is not (or not known to be) a released architecture,
    from what tells the three apart: dev alone has the guidance embedder; klein 4B is 3072 wide with
    5 double blocks, 9B 4096 wide with 8. The width decides where it is known and is one of those
    (a pruned klein keeps its width), else the depth does (a file's tensor names show the depth,
    not the width)."""
    if guidance:
        return "flux2-dev"
    if width == VARIANTS["flux2-klein-4b"][0]:
        return "flux2-klein-4b"
    if width == VARIANTS["flux2-klein-9b"][0]:
        return "flux2-klein-9b"
    return "flux2-klein-4b" if double_blocks == VARIANTS["flux2-klein-4b"][1] else "flux2-klein-9b"


def variant_of(config) -> str:
    """The FLUX.2 family a Flux2Transformer2DModel config (a dict or a model's config) belongs to:
    "flux2-dev", "flux2-klein-4b" or "flux2-klein-9b". A released architecture is named exactly;
    any other (a tiny test model, a pruned one) by `variant_by_layout`. Klein's base and distilled
    checkpoints share an architecture, so they share a name (model_index.json's `is_distilled`
    tells them apart for sampling). This is the one answer to "which FLUX.2 is this": the loaders'
    checks, family_for_model, guess_family and the sampler's dev/klein all ask it."""
    sig = _signature(config)
    released = next((name for name, want in VARIANTS.items() if want == sig), None)
    return released or variant_by_layout(sig[4], sig[1], sig[0])
