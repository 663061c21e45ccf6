"""Wan 2.2 (Wan-AI; T2V-A14B's two 14B experts, I2V-A14B's (first-frame conditioning: wan/i2v.py),
and Wan 2.1 T2V and I2V, the same classes; Wan 2.1 I2V's first frame also as a CLIP image embedding,
wan/i2v.py and loading.load_image_encoder): latents, the transformer call, sampling and
the family's registration (`wan2.2`). The spec is in wan/spec.py, loading in wan/loading.py, text
encoding in wan/text.py, the two experts in wan/experts.py, image-to-video's first-frame condition
in wan/i2v.py; this module imports them, none imports it but wan/ti2v.py, which registers TI2V-5B
(48 latent channels of the Wan 2.2 VAE, per-token timesteps) as family `wan2.2-ti2v` from this
module's shared parts.

Everything follows WanPipeline (diffusers) exactly:

- Latents: AutoencoderKLWan's 16 channels per 4 frames (the first frame alone) at 1/8 of the
  pixels, normalised per channel ((z - mean) / std; the pipeline decodes z * std + mean, through
  models/qwen_vae.QwenVAE, which is that arithmetic on a video VAE). The transformer takes
  (B, 16, F, h, w) and patchifies (1, 2, 2) itself. An image is a video of one frame: the
  family's 4-D latents (B, 16, h, w), which the cache, the trainer and the sampler hold, are packed
  to F = 1 (`pack_latents`), and a 5-D video latent passes as it is. Tokens per frame are h/2 * w/2.
  Clips (4k+1 frames) are cached through the causal VAE itself (`video`: data/video_vae.py) as
  (16, k+1, h, w) and batched per clip bucket; samples during training are videos of [sample] frames.
- Text: umT5's last hidden state, zero-padded to max_sequence_length rows, all of which the
  transformer attends to (wan/text.py).
- Time: the transformer takes the scheduler's timestep sigma * 1000 in float32, and returns the
  flow velocity (noise - x0), so the trainer's target and the sampler's Euler step are the other
  families'.
- Sampling: FlowMatchEulerDiscreteScheduler's own spacing (the pipeline passes no sigmas) with a
  static shift (a folder's scheduler config decides: `shift`, or UniPC's `flow_shift`; the published
  T2V-A14B's 12.0 otherwise). Guidance is classifier-free, the two halves one after the other, for
  scales above 1, the empty negative prompt by default. A two-expert model samples through
  `WanExperts` (wan/experts.py), which switches at the pipeline's boundary. The released folders'
  UniPCMultistepScheduler is another solver than the Euler step the sampler takes: only the Euler
  scheduler's samples equal the pipeline's.
- Image-to-video (I2V-A14B): the transformer takes 36 channels, the noisy latents and the first
  frame's condition, which WanImageToVideoPipeline builds once per video and concatenates at every
  step; here it is the sample's one reference (`predict(references=)`, wan/i2v.py): built from the
  first-frame image when sampling, from each clip's own first frame in the caching phase. Wan 2.1
  I2V's transformer also takes that frame's CLIP image embedding (`encoder_hidden_states_image`),
  the second reference (ReferenceConditioning.frame_embedding), built and cached the same ways.
- Training noise levels: "shift", the logit-normal shifted by [train] shift (3.0 by default), inside
  the trained expert's range for a two-expert model (`training_sigmas`).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from . import experts as wan_experts, i2v as wan_i2v, loading as wan_loading, text as wan_text
from .keys import input_channels, recognizes_keys
from .spec import WAN_SPEC
from ..qwen_vae import QwenVAE
from ..schedule import FlowSchedule

NAME = "wan2.2"
VAE_SCALE_FACTOR = 8
LATENT_CHANNELS = 16
PATCH = 2
NUM_TRAIN_TIMESTEPS = 1000
TEMPORAL_FACTOR = 4          # AutoencoderKLWan: the first frame alone, then 4 frames per latent frame
SAMPLE_FPS = 16.0            # Wan 2.2 A14B's rate (Wan-AI's sample_fps): sampled videos are written at it
IMAGE_EMBEDDING_ROWS = 257   # Wan 2.1 I2V's CLIP ViT-H/14 at 224 px: the class token and 16 x 16 patches


# -- latents -------------------------------------------------------------------------------------------

def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, 16, h, w) images -> (B, 16, 1, h, w) one-frame videos; (B, 16, F, h, w) stays as it is."""
    return latents.unsqueeze(2) if latents.dim() == 4 else latents


def unpack_latents(packed: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The transformer's (B, 16, F, h, w) back: one frame as the image (B, 16, h, w), else the video."""
    return packed.squeeze(2) if packed.dim() == 5 and packed.shape[2] == 1 else packed


def image_tokens(h: int, w: int) -> int:
    """Tokens of one latent frame of h x w."""
    return (h // PATCH) * (w // PATCH)


# -- the forward call ---------------------------------------------------------------------------------------

def model_time(sigma: torch.Tensor) -> torch.Tensor:
    """The transformer's timestep for noise level sigma: the scheduler's float32 sigma * 1000."""
    return sigma.to(torch.float32) * NUM_TRAIN_TIMESTEPS


def predict(transformer, noisy: torch.Tensor, sigma: torch.Tensor, embeds, latent_hw: tuple[int, int],
            guidance=None, references=None) -> torch.Tensor:
    """One transformer call: noisy latents (B, 16, F, h, w) at sigma (B,) -> the flow velocity in the
    same layout. `guidance` is ignored: Wan has no guidance input. `references`: an image-to-video
    model's first-frame condition [(1 or B, 20, F, h, w)], concatenated after the latents, and for Wan
    2.1 I2V its first frame's CLIP image embedding after it [(1 or B, 257, 1280)], the transformer's
    `encoder_hidden_states_image` (wan/i2v.py)."""
    text = embeds.t5.to(device=noisy.device, dtype=noisy.dtype)
    hidden = wan_i2v.with_condition(noisy, references[:1] if references else references, transformer.config.in_channels)
    image = wan_i2v.image_states(references, transformer.config, noisy.shape[0], text.shape[1], noisy.dtype,
                                 noisy.device)
    extra = {} if image is None else {"encoder_hidden_states_image": image}
    return transformer(hidden_states=hidden, timestep=model_time(sigma.to(noisy.device)), encoder_hidden_states=text,
                       return_dict=False, **extra)[0]


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype,
                 frames: int = 1) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (as predict feeds them):
    `frames` latent frames (1: an image; the planner prices images today). A model with an image
    embedder (Wan 2.1 I2V) gets its first frame's CLIP embedding too: the released encoder's 257 rows,
    which its cross-attention reads beside the text."""
    h, w = latent_hw
    inputs = {"hidden_states": torch.empty(batch, config.in_channels, frames, h, w, device="meta", dtype=dtype),
              "timestep": torch.empty(batch, device="meta", dtype=torch.float32),
              "encoder_hidden_states": torch.empty(batch, text_length, config.text_dim, device="meta", dtype=dtype),
              "return_dict": False}
    image_dim = getattr(config, "image_dim", None)
    if image_dim is not None:
        inputs["encoder_hidden_states_image"] = torch.empty(batch, IMAGE_EMBEDDING_ROWS, image_dim, device="meta",
                                                            dtype=dtype)
    return inputs


# -- sampling ----------------------------------------------------------------------------------------------

def published_schedule() -> FlowSchedule:
    """Wan 2.2 T2V-A14B's (Wan-AI's wan_t2v_A14B.py): static shift 12.0, 40 steps, guidance 4.0 (the
    high-noise expert's; the low-noise one's 3.0 is not a separate setting here), the scheduler's own
    timestep spacing. A folder's scheduler config takes precedence for the shift."""
    return FlowSchedule(use_dynamic_shifting=False, shift=12.0, default_steps=40, default_guidance=4.0,
                        pipeline_sigmas=False)


def _schedule(variant: str, folder=None, published: FlowSchedule | None = None) -> FlowSchedule:
    """The folder's scheduler: FlowMatchEulerDiscreteScheduler's config as it is; the released folders'
    UniPCMultistepScheduler states its shift as `flow_shift`. `published`: the model's own without a
    folder (T2V-A14B's by default; TI2V-5B's: wan/ti2v.py)."""
    schedule = FlowSchedule.from_model_folder(folder, published or published_schedule())
    path = None if folder is None else Path(folder) / "scheduler" / "scheduler_config.json"
    if path is not None and path.is_file():
        config = json.loads(path.read_text(encoding="utf-8"))
        if "shift" not in config and config.get("flow_shift") is not None:
            from dataclasses import replace

            schedule = replace(schedule, shift=float(config["flow_shift"]), use_dynamic_shifting=False)
    return schedule


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """What predict gets as sigma: the float32 sigma itself (predict computes the pipeline's timestep)."""
    return torch.full((batch,), float(sigma), dtype=torch.float32, device=device)


def load_vae(sources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> QwenVAE:
    """AutoencoderKLWan seen as an image VAE with normalised 4-D latents (one frame)."""
    return QwenVAE(wan_loading.load_raw_vae(sources, dtype, device))


def load_experts(sources, dtype: torch.dtype = torch.bfloat16, device="cpu", **options):
    """Both experts of a two-expert model as one sampling transformer (wan/experts.WanExperts); a
    one-transformer model's transformer as it is."""
    ratio = wan_loading.boundary_ratio(sources)
    high = wan_loading.load_transformer(sources, dtype, device, expert="high", **options)
    if ratio is None or sources.transformer_2 is None:
        return high
    low = wan_loading.load_transformer(sources, dtype, device, expert="low", **options)
    return wan_experts.WanExperts(high, low, ratio)


# -- training one expert ------------------------------------------------------------------------------------

@lru_cache(maxsize=8)
def trained_expert(sources) -> tuple[str, float] | None:
    """(expert, boundary_ratio) of the expert a run trains, or None when the model is one transformer
    that denoises every level: [model] expert "auto" on a folder without transformer_2/ or on a single
    file (which cannot say it is an expert: Wan 2.1). "auto" on a two-expert folder is its
    high-noise expert; an expert named on a single file takes the released boundary of its kind."""
    if sources.expert in wan_experts.EXPERTS:
        return sources.expert, wan_loading.boundary_ratio(sources, wan_loading.transformer_config(sources))
    if sources.transformer_2 is not None and sources.boundary_ratio is not None:
        return "high", sources.boundary_ratio
    return None


def training_sigmas(sigma: torch.Tensor, sources, method: str, train_cfg) -> torch.Tensor:
    """The noise levels a step trains on: the trained expert's share of the drawn ones
    (experts.restrict_sigmas), or as drawn for a one-transformer model (and without sources: the
    simulated device's runs, which price memory only)."""
    if sources is not None and sources.expert == "both":     # one expert per call (experts.one_expert_sigmas)
        return wan_experts.one_expert_sigmas(sigma, sources.boundary_ratio, method,
                                             sigmoid_scale=train_cfg.sigmoid_scale, shift=train_cfg.shift)
    chosen = None if sources is None else trained_expert(sources)
    if chosen is None:
        return sigma
    expert, ratio = chosen
    return wan_experts.restrict_sigmas(sigma, expert, ratio, method, sigmoid_scale=train_cfg.sigmoid_scale,
                                       shift=train_cfg.shift)


# -- the family object ----------------------------------------------------------------------------------------

def _loader(name: str):
    """wan_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(wan_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _register():
    from ..family import ModelFamily, ReferenceConditioning, Sampling, VideoLatents, register

    return register(ModelFamily(
        name=NAME, spec=WAN_SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=_loader("load_transformer"),
        load_text_encoders=_loader("load_text_encoders"), load_vae=load_vae,
        text_sources=("text_encoder", "tokenizer"),
        encode_prompts=wan_text.encode_prompts, padding_side=wan_text.padding_side,
        latent_channels=LATENT_CHANNELS, vae_scale_factor=VAE_SCALE_FACTOR,
        pack_latents=pack_latents, unpack_latents=unpack_latents, image_tokens=image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_loader("describe"),
        sampling=Sampling(guidance="cfg", variant=lambda transformer: NAME, schedule=_schedule, timestep=_timestep,
                          cfg_batched=False),
        text_modules=wan_text.text_modules,
        transformer_classes=(wan_loading.TRANSFORMER_CLASS, "WanExperts"),
        pipeline_classes=("WanPipeline", wan_i2v.I2V_PIPELINE),
        recognizes_keys=recognizes_keys, text_rows=wan_text.text_rows, timestep_sampling="shift",
        recognizes_config=_not_ti2v,
        recognizes_shapes=lambda shapes: input_channels(shapes) != wan_loading.TI2V_CHANNELS,
        text_width=lambda config: config.text_dim, training_sigmas=training_sigmas, split_blocks=split_blocks,
        video=VideoLatents(temporal_factor=TEMPORAL_FACTOR, load_vae=_loader("load_raw_vae"), fps=SAMPLE_FPS),
        # an image-to-video model's first frame (wan/i2v.py); a text-to-video one takes no reference
        references=ReferenceConditioning(size=_first_frame_size, most=1, sampling_latents=wan_i2v.sampling_condition,
                                         first_frame=wan_loading.takes_first_frame,
                                         clip_condition=wan_i2v.clip_condition,
                                         frame_embedding=_loader("frame_embedding")),
    ))


def split_blocks(transformer) -> None:
    """ModelFamily.split_blocks: the blocks become wan/block.py's split class, TI2V-5B's per-token
    modulation applied per latent frame (imported on use: diffusers)."""
    from .block import split_blocks as swap

    swap(transformer)


def _not_ti2v(config, index=None) -> bool:
    """Every Wan transformer but TI2V-5B's 48-channel one (family "wan2.2-ti2v", wan/ti2v.py)."""
    channels = wan_loading.TI2V_CHANNELS
    get = (lambda k: None) if config is None else config.get if hasattr(config, "get") else \
        (lambda k: getattr(config, k, None))
    return (get("in_channels"), get("out_channels")) != (channels, channels)


def _first_frame_size(ref_width: int, ref_height: int, bucket) -> tuple[int, int]:
    """An image-to-video model's first frame is a clip's own, at the clip's bucket."""
    return tuple(bucket[:2])


WAN = _register()
