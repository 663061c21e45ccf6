"""Stable Diffusion 3.5 (Large: 38 MMDiT joint blocks; Medium: MMDiT-X, dual attention in its first
blocks): latents, text encoding, the transformer call and the family's registration (the spec the
engine, LoRA targeting and the planner read is in sd3/spec.py).

We use diffusers' `SD3Transformer2DModel` as it is. What differs from Flux: one block list
(`transformer_blocks`, kohya prefix `joint_blocks`), latents enter unpacked (B, 16, h, w) (the
model patchifies them itself), the timestep is sigma * 1000 in float32 as StableDiffusion3Pipeline
passes it, there is no guidance input (SD3.5 samples with real classifier-free guidance: `Sampling`
at the end of this module, the scheduler's own spacing with shift 3.0), and the text sequence is
CLIP-L + CLIP-G penultimate states (padded to the T5 width) followed by the T5 sequence, with the
two CLIP pooled outputs concatenated (B, 2048).

Loading (diffusers folder, Stability single files) lives in sd3/loading.py (which this module
imports, never the reverse), the Stability key mapping in sd3/keys.py. The family registers itself as `get_family("sd3")` at the end of this module.

Text sequence and trimming: SD3 attends to every text token (there is no attention mask), and T5's
padding positions carry non-zero states, so dropping them changes the prediction (tests/
test_sd3_loading.py measures it). The cache therefore keeps the whole sequence, 77 CLIP rows plus
`max_text_length` T5 rows (default 256 for SD3, StableDiffusion3Pipeline's max_sequence_length), so
training sees exactly the conditioning the pipeline builds at inference.
"""

from __future__ import annotations

import torch

from . import loading as sd3_loading
from ..family import PromptEmbeds
from ..schedule import FlowSchedule
from .spec import SD3_SPEC

VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 16
TIMESTEP_SCALE = 1000.0     # StableDiffusion3Pipeline passes sigma * num_train_timesteps
CLIP_MAX_LENGTH = 77
DEFAULT_TEXT_LENGTH = 256   # T5 tokens: StableDiffusion3Pipeline's max_sequence_length


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """SD3 takes latents as they are (B, 16, h, w): its pos_embed patchifies them."""
    return latents


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return latents


def image_tokens(h: int, w: int) -> int:
    """Image tokens of an h x w latent: 2x2 patches."""
    return (h // 2) * (w // 2)


def _clip_states(tokenizer, encoder, prompts: list[str], max_length: int, device):
    """One CLIP's penultimate hidden states (B, 77, D) and projected pooled output (B, P)."""
    ids = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                    return_tensors="pt").input_ids
    out = encoder(ids.to(device), output_hidden_states=True)
    return out.hidden_states[-2], out[0]


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = DEFAULT_TEXT_LENGTH,
                   device=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """Encode prompts as StableDiffusion3Pipeline.encode_prompt does (one prompt for all encoders,
    no clip_skip): CLIP-L and CLIP-G penultimate states side by side (B, 77, 768 + 1280), zero-padded
    to T5's width and followed by the T5 sequence (B, max_length, 4096), or by zeros of that shape
    without T5; pooled = CLIP-L and CLIP-G projected pooled outputs side by side (B, 2048).

    Returns the embeddings and per-prompt lengths equal to the whole sequence (77 + max_length):
    nothing is trimmed, because SD3 attends to padding too (module docstring).
    """
    device = device or encoders.text_encoder.device
    clip_len = min(CLIP_MAX_LENGTH, encoders.tokenizer.model_max_length)
    dtype = encoders.text_encoder.dtype
    seq_l, pooled_l = _clip_states(encoders.tokenizer, encoders.text_encoder, prompts, clip_len, device)
    seq_g, pooled_g = _clip_states(encoders.tokenizer_2, encoders.text_encoder_2, prompts, clip_len, device)
    clip = torch.cat([seq_l.to(dtype), seq_g.to(dtype)], dim=-1)                  # (B, 77, D_l + D_g)
    if encoders.text_encoder_3 is None:
        t5 = torch.zeros(len(prompts), max_length, encoders.t5_width, device=device, dtype=dtype)
    else:
        ids = encoders.tokenizer_3(prompts, padding="max_length", max_length=max_length, truncation=True,
                                   add_special_tokens=True, return_tensors="pt").input_ids
        t5 = encoders.text_encoder_3(ids.to(device))[0]                             # (B, L, D_t5)
    if clip.shape[-1] > t5.shape[-1]:
        raise ValueError(f"CLIP-L + CLIP-G width {clip.shape[-1]} exceeds the T5 width {t5.shape[-1]}")
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))      # (B, 77, D_t5)
    seq = torch.cat([clip.to(t5.dtype), t5], dim=-2)                              # (B, 77 + L, D_t5)
    pooled = torch.cat([pooled_l, pooled_g.to(pooled_l.dtype)], dim=-1)           # (B, P_l + P_g)
    lengths = torch.full((len(prompts),), seq.shape[1], dtype=torch.long)
    return PromptEmbeds(t5=seq, pooled=pooled), lengths


def predict(transformer, noisy: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
            latent_hw: tuple[int, int], guidance=None) -> torch.Tensor:
    """One transformer call: noisy latents (B, 16, h, w) at sigma (B,) -> velocity (B, 16, h, w).

    `guidance` is accepted for the family interface and ignored: SD3.5 has no guidance input.
    """
    dtype, device = noisy.dtype, noisy.device
    return transformer(
        hidden_states=noisy,
        encoder_hidden_states=embeds.t5.to(device=device, dtype=dtype),
        pooled_projections=embeds.pooled.to(device=device, dtype=dtype),
        # float32, as StableDiffusion3Pipeline and diffusers' SD3 training pass it (the model's
        # sinusoidal embedding runs in float32; a bf16 timestep would round 999 to 1000)
        timestep=sigma.to(device=device, dtype=torch.float32) * TIMESTEP_SCALE,
        return_dict=False,
    )[0]


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (same shapes as predict)."""
    def meta(*shape, dtype=dtype):
        return torch.empty(*shape, device="meta", dtype=dtype)

    return {"hidden_states": meta(batch, config.in_channels, *latent_hw),
            "encoder_hidden_states": meta(batch, text_length, config.joint_attention_dim),
            "pooled_projections": meta(batch, config.pooled_projection_dim), "timestep": meta(batch),
            "return_dict": False}


# -- the family object: what trainer, cache, planner and sampler call (see family.py) -----------------

def _loader(name: str):
    """sd3_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(sd3_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _padding_side(encoders) -> str:
    return "right"        # lengths cover the whole sequence: nothing is trimmed from either end


def _variant(transformer) -> str:
    """'medium' for MMDiT-X (dual-attention layers), else 'large'."""
    return "medium" if tuple(getattr(transformer.config, "dual_attention_layers", None) or ()) else "large"


def _schedule(variant: str, folder=None):
    """SD3.5's schedule (shift 3.0, 28 steps, CFG 7.0 as StableDiffusion3Pipeline), or the folder's."""
    return FlowSchedule.from_model_folder(folder, FlowSchedule.sd3())


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The float32 sigma itself: `predict` feeds sigma * 1000 in float32, the scheduler's timestep.

    A fill from a host number, not a copy of the host tensor: that copy would make the host wait
    for every queued kernel once per denoising step on CUDA (same float32 value either way)."""
    return torch.full((batch,), float(sigma), dtype=torch.float32, device=device)


def _text_modules(encoders):
    """CLIP-L and CLIP-G move whole; T5-XXL (absent with [model] t5 = false) may run block by block."""
    return [encoders.text_encoder, encoders.text_encoder_2], encoders.text_encoder_3


def _recognizes_keys(keys) -> bool:
    """A Stability or diffusers SD3 transformer file (any prefix; an all-in-one file too)."""
    return any(".joint_blocks." in f".{k}" or k.endswith("pos_embed.proj.weight") for k in keys)


def _register():
    from ..family import ModelFamily, Sampling, register

    return register(ModelFamily(
        name="sd3", spec=SD3_SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=_loader("load_transformer"),
        load_text_encoders=_loader("load_text_encoders"), load_vae=_loader("load_vae"),
        text_sources=("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3"),
        encode_prompts=encode_prompts, padding_side=_padding_side,
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_loader("describe"),
        sampling=Sampling(guidance="cfg", variant=_variant, schedule=_schedule, timestep=_timestep),
        text_modules=_text_modules,
        transformer_classes=("SD3Transformer2DModel",), recognizes_keys=_recognizes_keys,
        text_rows=lambda max_length: CLIP_MAX_LENGTH + max_length,
        timestep_sampling="shift",      # logit-normal, then shifted by [train] shift (3.0)
    ))


SD3 = _register()
