"""Tiny Krea 2 components: the real classes with tiny configs, built offline.

`Krea2Transformer2DModel` with 2 blocks of 2 query heads of 16 and one key/value head (width 32,
grouped-query attention as the real 48 / 12), a text fusion of the real 2 layerwise + 2 refiner
blocks over 3 tapped text layers 32 wide, and the rotary split Krea 2's own code derives from the
head size (krea-ai/krea-2 mmdit.py SingleStreamDiT: head - 12 * (head // 16), then 6 * (head // 16)
twice: (4, 6, 6) here, (32, 48, 48) at 128). The VAE is Qwen-Image's tiny one (Krea 2 uses the
Qwen-Image VAE); the text encoder a `Qwen3VLModel` whose text model is 32 wide with 4 layers, of
which the pipeline taps hidden states (1, 2, 3) — the last layer's output is not tapped, as the real
(2, 5, ..., 35) leave Qwen3-VL-4B's 36th out — with a one-block vision tower (never run for text).

The tokenizer is Qwen-Image's tiny byte-level BPE: Krea 2's prompt template is Qwen-Image's, so the
system part tokenizes to 34 tokens and the suffix `<|im_end|>\\n<|im_start|>assistant\\n` to 5, as
with the real tokenizer; Krea2Pipeline's fixed `prompt_template_encode_start_idx = 34` and
`prompt_template_encode_num_suffix_tokens = 5` then hold here too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import _randomize_zero_inits
from .qwen_image import _token_id, qwen_tokenizer, qwen_vae

KREA2_TINY = dict(
    in_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
    intermediate_size=48, timestep_embed_dim=32, text_hidden_dim=32, num_text_layers=3,
    text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=48,
    num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(4, 6, 6), rope_theta=1000.0,
)
SELECT_LAYERS = (1, 2, 3)          # the tiny pipeline's text_encoder_select_layers (hidden_states indices)
QWEN3_VL_TEXT_TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                           "mrope_section": [2, 3, 3], "mrope_interleaved": True})
QWEN3_VL_VISION_TINY = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32,
                            patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                            deepstack_visual_indexes=[0])


def krea2_transformer(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """The tiny Krea2Transformer2DModel; diffusers zero-initialises the norms' scales and the
    modulation tables (their effective value is 1 + weight, or the table added to the time vector),
    so they are randomised: a zero table would hide a mix-up of its six rows."""
    from diffusers import Krea2Transformer2DModel

    torch.manual_seed(seed)
    model = Krea2Transformer2DModel(**{**KREA2_TINY, **overrides})
    _randomize_zero_inits(model, seed)
    return model.to(dtype).eval()


def qwen3_vl_text_encoder(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny Qwen3VLModel (text 32 wide, 4 layers; a one-block vision tower), the class
    Krea2Pipeline's text_encoder is."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    torch.manual_seed(seed)
    pad = _token_id(tokenizer, "<|endoftext|>")
    cfg = Qwen3VLConfig(
        text_config=dict(QWEN3_VL_TEXT_TINY, vocab_size=len(tokenizer), bos_token_id=pad,
                         eos_token_id=_token_id(tokenizer, "<|im_end|>"), pad_token_id=pad),
        vision_config=dict(QWEN3_VL_VISION_TINY),
        image_token_id=_token_id(tokenizer, "<|image_pad|>"), video_token_id=_token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=_token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=_token_id(tokenizer, "<|vision_end|>"),
    )
    return Qwen3VLModel(cfg).to(dtype).eval()


def krea2_scheduler():
    """Krea2Pipeline's scheduler: exponential time shift with mu from the image tokens, 0.5 at 256
    to 1.15 at 6400 (krea-ai/krea-2 sampling.py `timesteps`: y1 0.5, y2 1.15 between 256 and 1280
    pixels at 16 pixels a token), as the pipeline's docstring asks of its scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=6400, time_shift_type="exponential")


def krea2_components(seed: int = 0, dtype: torch.dtype = torch.float32, **transformer_overrides) -> dict:
    """All model components of a tiny Krea2Pipeline, keyed as its constructor expects."""
    tok = qwen_tokenizer()
    return dict(transformer=krea2_transformer(seed, dtype, **transformer_overrides), vae=qwen_vae(seed, dtype),
                text_encoder=qwen3_vl_text_encoder(tok, seed + 1, dtype), tokenizer=tok, scheduler=krea2_scheduler())


def krea2_pipeline(seed: int = 0, distilled: bool = False, **transformer_overrides):
    """The tiny Krea2Pipeline (`distilled`: the Turbo's model_index, fixed mu 1.15)."""
    from diffusers import Krea2Pipeline

    return Krea2Pipeline(**krea2_components(seed, **transformer_overrides), text_encoder_select_layers=SELECT_LAYERS,
                         is_distilled=distilled)


def save_krea2_folder(path: str | Path, seed: int = 0, distilled: bool = False) -> Path:
    """Write a complete tiny Krea 2 (Raw; `distilled`: Turbo) in the diffusers layout."""
    path = Path(path)
    krea2_pipeline(seed, distilled).save_pretrained(path, safe_serialization=True)
    return path


__all__ = ["krea2_transformer", "qwen3_vl_text_encoder", "krea2_scheduler", "krea2_components", "krea2_pipeline",
           "save_krea2_folder", "KREA2_TINY", "SELECT_LAYERS"]
