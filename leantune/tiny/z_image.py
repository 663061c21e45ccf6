"""Tiny Z-Image components: the real classes with tiny configs, built offline.

`ZImageTransformer2DModel` 32 wide (2 heads of 16, rotary axes 4 + 6 + 6), one noise-refiner and
one context-refiner block and 2 main blocks, 16 latent channels patched 2x2 as the real one; the
Flux.1-style `AutoencoderKL` of leantune.tiny (8x, 16 channels, Flux's scaling and shift, which
Z-Image's VAE shares); a `Qwen3Model` text encoder 16 wide (the transformer's cap_feat_dim) of 3
layers, so the pipeline's `hidden_states[-2]` is a layer's own output and not the last one; the
Qwen3 tokenizer and chat template of FLUX.2 klein's tiny preset (tiny/flux2.py), whose thinking
switch ZImagePipeline turns on (`enable_thinking=True`: no empty <think> block). The scheduler is
Z-Image-Turbo's (static shift 3.0).

Zero-initialised parameters (the pad tokens, diffusers' zero inits) are randomised so the tiny
model is not degenerate: a pad token of zeros would hide a padding mix-up.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import _randomize_zero_inits, vae
from .flux2 import qwen3_tokenizer

TEXT_WIDTH = 16
# axes_lens: the text positions (1 .. its rows padded to 32) and the image's first axis (after
# them) stay below 128 for the tests' text lengths; rows and columns of up to 32 patches (512 px)
Z_IMAGE_TINY = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                    n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
                    cap_feat_dim=TEXT_WIDTH, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
                    axes_lens=[128, 32, 32])
QWEN3_TINY = dict(hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, rms_norm_eps=1e-6)


def z_image_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(**{**Z_IMAGE_TINY, **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def z_image_tokenizer():
    """Qwen3's special tokens and chat template (tiny/flux2.py's klein tokenizer), right padding."""
    return qwen3_tokenizer()


def z_image_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A Qwen3Model (model_index.json of Tongyi-MAI/Z-Image-Turbo loads the text encoder so)."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    ids = tokenizer.convert_tokens_to_ids
    cfg = Qwen3Config(**QWEN3_TINY, vocab_size=len(tokenizer), pad_token_id=ids("<|endoftext|>"),
                      eos_token_id=ids("<|im_end|>"))
    return Qwen3Model(cfg).to(dtype).eval()


def z_image_scheduler(shift: float = 3.0):
    """Z-Image-Turbo's scheduler_config.json (static shift 3.0; the base model's is 6.0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False)


def z_image_components(seed: int = 0, dtype: torch.dtype = torch.float32, **transformer_overrides) -> dict:
    tok = z_image_tokenizer()
    return dict(transformer=z_image_transformer(seed, dtype, **transformer_overrides), vae=vae(seed, dtype),
                text_encoder=z_image_text_encoder(tok, seed + 1, dtype), tokenizer=tok,
                scheduler=z_image_scheduler())


def z_image_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, **transformer_overrides):
    from diffusers import ZImagePipeline

    return ZImagePipeline(**z_image_components(seed, dtype, **transformer_overrides))


def save_z_image_folder(path: str | Path, seed: int = 0) -> Path:
    """Write a complete tiny Z-Image in the diffusers layout (ZImagePipeline.from_pretrained loads it)."""
    path = Path(path)
    z_image_pipeline(seed).save_pretrained(path, safe_serialization=True)
    return path


__all__ = ["z_image_transformer", "z_image_tokenizer", "z_image_text_encoder", "z_image_scheduler",
           "z_image_components", "z_image_pipeline", "save_z_image_folder"]
