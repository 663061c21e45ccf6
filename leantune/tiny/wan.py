"""Tiny Wan 2.2 components: the real classes with tiny configs, built offline.

`WanTransformer3DModel` 32 wide (2 heads of 16: Wan's rotary split gives the frame axis 8 and
height and width 4 each, as the real 128 gives 44 / 42 / 42), 2 blocks, the real (1, 2, 2) patch
over 16 latent channels, the cross-attention norm and q/k norms across heads of the T2V models;
the Wan 2.1 `AutoencoderKLWan` (16 channels, 8x spatial and 4x temporal compression, per-channel
latent mean and std) 4 wide; transformers' `UMT5EncoderModel` 32 wide (the transformer's
text_dim) with leantune.tiny's offline T5 tokenizer (T5's pad / eos / unk ids, as umT5's).

Wan 2.2 A14B is two experts of one architecture: `transformer` denoises the high-noise steps and
`transformer_2` the low-noise ones, split at `boundary_ratio` * 1000 (WanPipeline's config; the
T2V model's 0.875). The tiny folder has both (different seeds), so the two-expert path is what
the tests exercise; `experts=1` writes the one-transformer layout of Wan 2.1 (boundary_ratio None).

The scheduler is FlowMatchEulerDiscreteScheduler with Wan's shift 3.0 (static): WanPipeline takes
it, and it is the Euler step leantune's sampler takes. (The released folders ship
UniPCMultistepScheduler with the same flow shift.)
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import _randomize_zero_inits, t5_tokenizer

TEXT_WIDTH = 32
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
                text_dim=TEXT_WIDTH, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
WAN_VAE_TINY = dict(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                    temperal_downsample=[False, True, True])
UMT5_TINY = dict(d_model=TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                 relative_attention_max_distance=16, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
                 use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
TEXT_LENGTH = 32             # the tiny tokenizer's model_max_length ([data] max_text_length in the tests)
BOUNDARY_RATIO = 0.875       # Wan 2.2 T2V-A14B's model_index.json
FLOW_SHIFT = 3.0
SECOND_EXPERT_SEED = 2       # transformer_2 is built with seed + this


def wan_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**WAN_TINY, **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def wan_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**WAN_VAE_TINY).to(dtype).eval()


def wan_tokenizer():
    """leantune.tiny's T5 Unigram tokenizer (umT5's pad 0, eos 1, unk 2), built offline."""
    return t5_tokenizer(TEXT_LENGTH)


def wan_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    return UMT5EncoderModel(UMT5Config(**UMT5_TINY, vocab_size=len(tokenizer))).to(dtype).eval()


def wan_scheduler(shift: float = FLOW_SHIFT):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False)


def wan_components(seed: int = 0, dtype: torch.dtype = torch.float32, experts: int = 2) -> dict:
    """WanPipeline's components and settings: both experts and the boundary (experts=2), or one."""
    if experts not in (1, 2):
        raise ValueError(f"experts must be 1 or 2, got {experts}")
    tok = wan_tokenizer()
    two = experts == 2
    return dict(transformer=wan_transformer(seed, dtype), vae=wan_vae(seed, dtype),
                text_encoder=wan_text_encoder(tok, seed + 1, dtype), tokenizer=tok, scheduler=wan_scheduler(),
                transformer_2=wan_transformer(seed + SECOND_EXPERT_SEED, dtype) if two else None,
                boundary_ratio=BOUNDARY_RATIO if two else None)


def wan_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, experts: int = 2):
    from diffusers import WanPipeline

    return WanPipeline(**wan_components(seed, dtype, experts))


def save_wan_folder(path: str | Path, seed: int = 0, experts: int = 2) -> Path:
    """Write a complete tiny Wan 2.2 in the diffusers layout (WanPipeline.from_pretrained loads it)."""
    path = Path(path)
    wan_pipeline(seed, experts=experts).save_pretrained(path, safe_serialization=True)
    return path


# -- Wan 2.2 TI2V-5B: one transformer over the Wan 2.2 VAE's 48 channels ------------------------------
#
# The same transformer class at 48 input / output channels, and the Wan 2.2 AutoencoderKLWan: residual
# down / up sampling (`is_residual`), a 2 x 2 patchify of the pixels before the encoder (12 input
# channels), so 16x spatial compression, 4x temporal, 48 latent channels with a per-channel mean and
# std (made-up values here, 48 of each, so that normalisation is not the identity). WanPipeline
# samples it with expand_timesteps (per-token timesteps), as TI2V-5B's model_index.json says.

TI2V_CHANNELS = 48
TI2V_VAE_TINY = dict(base_dim=4, decoder_base_dim=4, z_dim=TI2V_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                     attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                     out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                     latents_mean=[round(0.05 * (i % 7) - 0.15, 4) for i in range(TI2V_CHANNELS)],
                     latents_std=[round(0.8 + 0.1 * (i % 5), 4) for i in range(TI2V_CHANNELS)])
TI2V_FLOW_SHIFT = 5.0        # TI2V-5B's flow_shift


def wan_ti2v_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    return wan_transformer(seed, dtype, **{"in_channels": TI2V_CHANNELS, "out_channels": TI2V_CHANNELS, **overrides})


def wan22_vae(seed: int = 0, dtype: torch.dtype = torch.float32):
    """The Wan 2.2 VAE (TI2V-5B's) at width 4."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**TI2V_VAE_TINY).to(dtype).eval()


def wan_ti2v_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32):
    """WanPipeline(expand_timesteps=True) of the tiny TI2V-5B."""
    from diffusers import WanPipeline

    tok = wan_tokenizer()
    return WanPipeline(transformer=wan_ti2v_transformer(seed, dtype), vae=wan22_vae(seed, dtype),
                       text_encoder=wan_text_encoder(tok, seed + 1, dtype), tokenizer=tok,
                       scheduler=wan_scheduler(TI2V_FLOW_SHIFT), expand_timesteps=True)


def save_wan_ti2v_folder(path: str | Path, seed: int = 0) -> Path:
    """A complete tiny Wan 2.2 TI2V-5B in the diffusers layout (WanPipeline.from_pretrained loads it)."""
    path = Path(path)
    wan_ti2v_pipeline(seed).save_pretrained(path, safe_serialization=True)
    return path


# -- Wan 2.1 I2V: the first frame's CLIP image embedding ------------------------------------------------
#
# A 36-channel transformer (as I2V-A14B's experts) with an image embedder (`image_dim`, the CLIP width)
# and image keys and values in every cross-attention (`added_kv_proj_dim`, the model's width, as the
# released 5120), and transformers' CLIPVisionModel 16 wide, 3 layers (so its penultimate hidden state,
# which the pipeline keeps, is not its last), 32 px images in 8 px patches: 17 rows (the released
# ViT-H/14's 257 at 224 px), with a CLIPImageProcessor that resizes and crops to 32 px. One
# transformer, boundary_ratio None: WanImageToVideoPipeline feeds the embedding only then.

CLIP_VISION_TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                        image_size=32, patch_size=8, projection_dim=16)
WAN21_I2V_TEXT_LENGTH = 512  # the transformer takes the last 512 context rows as text (WanAttnProcessor)


def wan21_i2v_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    width = WAN_TINY["num_attention_heads"] * WAN_TINY["attention_head_dim"]
    return wan_transformer(seed, dtype, **{"in_channels": 36, "out_channels": 16,
                                           "image_dim": CLIP_VISION_TINY["hidden_size"],
                                           "added_kv_proj_dim": width, **overrides})


def clip_vision_encoder(seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    return CLIPVisionModel(CLIPVisionConfig(**CLIP_VISION_TINY)).to(dtype).eval()


def clip_image_processor():
    from transformers import CLIPImageProcessor

    side = CLIP_VISION_TINY["image_size"]
    return CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def wan21_i2v_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32):
    """WanImageToVideoPipeline of the tiny Wan 2.1 I2V (one transformer, image_encoder + image_processor)."""
    from diffusers import WanImageToVideoPipeline

    tok = wan_tokenizer()
    return WanImageToVideoPipeline(
        tokenizer=tok, text_encoder=wan_text_encoder(tok, seed + 1, dtype), vae=wan_vae(seed, dtype),
        scheduler=wan_scheduler(), transformer=wan21_i2v_transformer(seed, dtype),
        image_encoder=clip_vision_encoder(seed + 3, dtype), image_processor=clip_image_processor())


def save_wan21_i2v_folder(path: str | Path, seed: int = 0) -> Path:
    """A complete tiny Wan 2.1 I2V in the diffusers layout (WanImageToVideoPipeline.from_pretrained loads it)."""
    path = Path(path)
    wan21_i2v_pipeline(seed).save_pretrained(path, safe_serialization=True)
    return path


__all__ = ["wan_transformer", "wan_vae", "wan_tokenizer", "wan_text_encoder", "wan_scheduler", "wan_components",
           "wan_pipeline", "save_wan_folder", "wan_ti2v_transformer", "wan22_vae",
           "wan_ti2v_pipeline", "save_wan_ti2v_folder", "wan21_i2v_transformer", "clip_vision_encoder",
           "clip_image_processor", "wan21_i2v_pipeline", "save_wan21_i2v_folder"]
