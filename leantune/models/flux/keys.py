"""Key layout of BFL (Black Forest Labs / ComfyUI) Flux transformer files, both ways.

BFL files fuse what diffusers keeps apart: a double block's q, k, v are one `img_attn.qkv` (and
`txt_attn.qkv`), a single block's q, k, v and MLP input are one `linear1`, and the final adaLN
stores (shift, scale) where diffusers stores (scale, shift). diffusers' own converter
(`convert_flux_transformer_checkpoint_to_diffusers`) hard-codes the inner width 3072 when it splits
`linear1`, so it only works for full-size Flux; here the width is read from `img_in.weight`, which
makes tiny and other-width checkpoints load too. The mapping is one table used in both directions,
so `diffusers_to_bfl` (writing BFL files) is the exact inverse of `bfl_to_diffusers_ops`.

The architecture (depth, width, heads, guidance embedder) is read from the checkpoint's own keys
and shapes by `flux_config_from_shapes`; only the rotary split `axes_dims_rope` is not in the
weights (see `default_axes_dims_rope`).
"""

from __future__ import annotations

from ..bfl_layout import BflLayout, count_blocks

# Linear layers: (BFL module, diffusers module(s)); both .weight and .bias are mapped.
# Several diffusers modules for one BFL module = the BFL tensor is their concatenation along dim 0.
_DOUBLE_LINEARS = (
    ("img_mod.lin", ("norm1.linear",)),
    ("txt_mod.lin", ("norm1_context.linear",)),
    ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
    ("img_attn.proj", ("attn.to_out.0",)),
    ("txt_attn.proj", ("attn.to_add_out",)),
    ("img_mlp.0", ("ff.net.0.proj",)),
    ("img_mlp.2", ("ff.net.2",)),
    ("txt_mlp.0", ("ff_context.net.0.proj",)),
    ("txt_mlp.2", ("ff_context.net.2",)),
)
# Norm scales: (BFL key, diffusers key), single tensors.
_DOUBLE_NORMS = (
    ("img_attn.norm.query_norm.scale", "attn.norm_q.weight"),
    ("img_attn.norm.key_norm.scale", "attn.norm_k.weight"),
    ("txt_attn.norm.query_norm.scale", "attn.norm_added_q.weight"),
    ("txt_attn.norm.key_norm.scale", "attn.norm_added_k.weight"),
)
_SINGLE_LINEARS = (
    ("modulation.lin", ("norm.linear",)),
    ("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),   # split (D, D, D, mlp)
    ("linear2", ("proj_out",)),
)
_SINGLE_NORMS = (
    ("norm.query_norm.scale", "attn.norm_q.weight"),
    ("norm.key_norm.scale", "attn.norm_k.weight"),
)
_TOP_LINEARS = (
    ("img_in", ("x_embedder",)),
    ("txt_in", ("context_embedder",)),
    ("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1",)),
    ("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2",)),
    ("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
    ("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
    ("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1",)),
    ("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2",)),
    ("final_layer.linear", ("proj_out",)),
    ("final_layer.adaLN_modulation.1", ("norm_out.linear",)),          # halves swapped
)
_SWAPPED = {"final_layer.adaLN_modulation.1"}

FLUX1_LAYOUT = BflLayout("Flux", {"double": (_DOUBLE_LINEARS, _DOUBLE_NORMS), "single": (_SINGLE_LINEARS, _SINGLE_NORMS),
                                   "top": (_TOP_LINEARS, ())}, frozenset(_SWAPPED), inner_key="img_in.weight")


def is_bfl(keys) -> bool:
    """True if a key set (prefix removed) is a BFL-layout Flux transformer."""
    keys = set(keys)
    return "img_in.weight" in keys and any(k.startswith(("double_blocks.", "single_blocks.")) for k in keys)


def is_diffusers_flux(keys) -> bool:
    keys = set(keys)
    return "x_embedder.weight" in keys and any(k.startswith("single_transformer_blocks.") for k in keys)


# The inner width comes from `img_in.weight` (D, in_channels): a single block's `linear1` is split
# (D, D, D, rest), the rest being the MLP width.
bfl_to_diffusers_ops = FLUX1_LAYOUT.to_diffusers_ops
bfl_name = FLUX1_LAYOUT.bfl_name
convert_bfl_state_dict = FLUX1_LAYOUT.convert_state_dict
diffusers_to_bfl = FLUX1_LAYOUT.from_diffusers       # fused qkv / linear1, swapped final adaLN


# -- architecture from shapes ------------------------------------------------------------------------

def default_axes_dims_rope(head_dim: int) -> tuple[int, int, int]:
    """A rotary split of `head_dim` over (index, row, col): Flux's (16, 56, 56) for 128.

    Each axis needs an even size; the two spatial axes get 7/32 of the head each, rounded down to
    even, the index axis the rest: 128 -> (16, 56, 56), 64 -> (8, 28, 28), 16 -> (4, 6, 6).
    """
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head dim {head_dim} cannot be split into three even rotary axes")
    spatial = 2 * ((head_dim * 7) // 32)
    return (head_dim - 2 * spatial, spatial, spatial)


def flux_config_from_shapes(shapes: dict[str, tuple[int, ...]], axes_dims_rope=None) -> dict:
    """A FluxTransformer2DModel config from diffusers key shapes (BFL files: after `bfl_to_diffusers_ops`).

    Raises KeyError naming the first anchor key that is missing.
    """
    def need(key):
        if key not in shapes:
            raise KeyError(key)
        return shapes[key]

    inner, in_channels = need("x_embedder.weight")
    norm_key = ("transformer_blocks.0.attn.norm_q.weight" if "transformer_blocks.0.attn.norm_q.weight" in shapes
                else "single_transformer_blocks.0.attn.norm_q.weight")
    head_dim = need(norm_key)[0]
    if inner % head_dim:
        raise ValueError(f"width {inner} is not a multiple of the head dim {head_dim} (from {norm_key})")
    axes = tuple(axes_dims_rope) if axes_dims_rope else default_axes_dims_rope(head_dim)
    if sum(axes) != head_dim:
        raise ValueError(f"axes_dims_rope {axes} does not sum to the head dim {head_dim}")
    out_channels = need("proj_out.weight")[0]
    return dict(
        patch_size=1,
        in_channels=in_channels,
        out_channels=None if out_channels == in_channels else out_channels,
        num_layers=count_blocks(shapes, "transformer_blocks."),
        num_single_layers=count_blocks(shapes, "single_transformer_blocks."),
        attention_head_dim=head_dim,
        num_attention_heads=inner // head_dim,
        joint_attention_dim=need("context_embedder.weight")[1],
        pooled_projection_dim=need("time_text_embed.text_embedder.linear_1.weight")[1],
        guidance_embeds="time_text_embed.guidance_embedder.linear_1.weight" in shapes,
        axes_dims_rope=list(axes),
    )
