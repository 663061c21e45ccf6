"""Qwen-Image-2.1 (7B block-causal single-stream DiT, 32 blocks; Qwen3-VL-8B encoder on the prompt
and up to ten reference images; a 64-channel RGBA VAE): the family object, registered as
`qwen-image-2.1` ([model] family; issue 35). The spec is in spec.py, loading in loading.py, text
encoding in text.py, latents in latents.py, the transformer call in forward.py, the references'
preparation in references.py; this module imports them, none imports it.

Everything follows QwenImage21Pipeline (diffusers 0.42.1):

- Latents: 64 channels at 1/16 of the pixels, normalised per channel, one token per latent pixel
  (latents.py); the VAE reads and writes RGBA (vae.py: an RGB image gets an opaque alpha, as the
  pipeline converts it).
- Where the image-slot mask travels. The text encoder's output has one row per token, and the rows
  of a reference's `<|image_pad|>` tokens are *slots*: the transformer overwrites them with that
  reference's latent tokens (2x2 per slot), so their values are never read. `encode_prompts`
  therefore writes those rows as zeros, and the mask travels in `PromptEmbeds.t5` itself: a zero
  row before a prompt's last real row is a slot, trailing zero rows are padding (a Qwen3-VL hidden
  state row is never all zeros; the template's closing tokens always follow the slots). This needs
  no new field on the seam: the cache (which trims each prompt to its rows and pads batches with
  zeros), the sampler's batching and CFG padding, dtype casts and the simulated device carry it
  unchanged, and a cached 2.1 caption is still one tensor of the size the pipeline's embeddings
  have. The transformer sees exactly the pipeline's inputs (the slot rows' projected values are
  replaced before the first block; the other rows' projection is per row).
- Text padding: as Qwen-Image, `predict` cuts a batch to its longest prompt and passes the padding
  mask only when some row is padding (the pipeline's None when every row is real).
- References (ReferenceConditioning): the pipeline resizes each reference once, to
  `output_resolution`² pixels (1024²) at its own aspect, sides multiples of 32, and gives that one
  image to the vision encoder (alpha over white) and the VAE (all four channels); training encodes
  them at that size too, whatever the bucket, because the text encoder's slot count is fixed by the
  size it saw and the cache keys a caption's text by its references' content alone.
- The timestep is sigma (the pipeline's t.to(latent dtype) / 1000, as Flux rounds it); the
  schedule is linspace(1, 1/steps) shifted by mu on the line 0.5 at 256 to 1.15 at 4096 tokens (the
  scheduler config), 40 steps; guidance is plain true CFG (neg + s (pos - neg)) above 1, off by
  default (the pipeline's true_cfg_scale 1.0: "meant to be sampled without guidance"), the two
  halves run one after the other.
- Training noise levels: "shift", as Qwen-Image (logit-normal shifted by [train] shift).

The planner prices the stock 7B (`leantune plan --model qwen-image-2.1`, built on meta with
meta_model.py's class), its reference images (probe_inputs' `references`: their slots in the text,
their latent tokens before the target's) and the caching phase (text_phase.py: Qwen3-VL-8B with its
vision tower, both streamed).

Sampling keeps the pipeline's prefix KV cache (Sampling.prefix_cache: the text and references'
keys and values from the first step, only the target's rows computed after), priced in the
sampler's plan (prefix_cache_bytes). Images train with their alpha (ModelFamily.rgba: targets and
references cached as RGBA latents; the vision encoder sees them over white, text.flatten_alpha).
"""

from __future__ import annotations

import dataclasses

import torch

from . import forward, latents as lat, loading as qwen_image21_loading, references as refs_mod, text
from .keys import find_prefix
from .spec import QWEN_IMAGE21_SPEC
from ..family import PromptEmbeds
from ..schedule import FlowSchedule, model_timestep

NAME = "qwen-image-2.1"
MAX_REFERENCES = 10
DEFAULT_STEPS = 40                 # QwenImage21Pipeline.__call__'s num_inference_steps
# Text rows a caption adds beyond its tokens: the user turn's tags and the closing template
# (`<|im_end|>\n<|im_start|>assistant\n`), and per reference its tags and at most 32 x 32 slots
# (1024² pixels of area at any aspect: sides multiples of 32, so at most (1024/32)² + a row).
TEMPLATE_ROWS = 16
REFERENCE_TAG_ROWS = refs_mod.TAG_ROWS
ROWS_PER_REFERENCE = 32 * 33 + REFERENCE_TAG_ROWS


# -- latents -------------------------------------------------------------------------------------------

def load_vae(sources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    from .vae import QwenImage21VAE

    return QwenImage21VAE(qwen_image21_loading.load_vae(sources, dtype, device))


# -- text ----------------------------------------------------------------------------------------------

def _slots_zeroed(enc: text.PromptEncoding) -> torch.Tensor:
    rows = enc.embeds.clone()
    rows[enc.image_slots] = 0
    return rows


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = 512, device=None,
                   images=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """Encode prompts as QwenImage21Pipeline.encode_prompt does, the image slots as zero rows (see
    the module docstring). `images`: per prompt its references (PIL, any size: resized here as the
    pipeline resizes them), or None. Prompts without references are encoded as one batch (the
    pipeline's left padding); a prompt with references on its own (the pipeline conditions a whole
    batch on one set). `max_length` is not applied: the pipeline cuts nothing."""
    if device is not None:
        encoders = dataclasses.replace(encoders, device=torch.device(device))
    per_prompt = images if images is not None else [None] * len(prompts)
    encodings: list = [None] * len(prompts)
    plain = [i for i, r in enumerate(per_prompt) if not r]
    if plain:
        for i, enc in zip(plain, text.encode_prompts([prompts[i] for i in plain], encoders)):
            encodings[i] = enc
    for i, r in enumerate(per_prompt):
        if r:
            resized, _ = refs_mod.prepare(r)
            encodings[i] = text.encode_prompts([prompts[i]], encoders, images=resized)[0]
    rows = [_slots_zeroed(e) for e in encodings]
    longest = max(r.shape[0] for r in rows)
    seq = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(len(prompts), 0)), lengths


def text_layout(seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(B, L, D) rows as encode_prompts writes them -> (rows cut to the longest prompt, the padding
    mask (B, L') or None when every row is real, the image-slot mask (B, L') bool): zero rows
    before a prompt's last real row are slots, the ones after it padding. Rows without values (the
    simulated device's fake tensors, the planner's meta ones) read as all real, no slot, unless the
    simulation marked the rows with the values they stand for (simulated.stands_for: a cached
    caption with references), whose layout is then read from those."""
    from ...memory.simulated import values_of

    values = values_of(seq)
    if values is not None:
        from .meta_model import host

        with host():        # the layout from the values; the fake rows cut as they are
            _, mask, slots = text_layout(values)
        if mask is not None:             # the padding mask as a tensor of the rows' kind
            mask = torch.empty(mask.shape, dtype=mask.dtype, device=seq.device).copy_(mask)
        return seq[:, :slots.shape[1]], mask, slots
    real = (seq != 0).any(dim=-1)                                                 # (B, L)
    if not real.numel() or int(real.sum()) == 0:
        from .meta_model import host

        b, n = seq.shape[:2]
        with host():             # a real host mask even on the simulated device (meta_model.py)
            return seq, None, torch.zeros(b, n, dtype=torch.bool)
    positions = torch.arange(seq.shape[1], device=seq.device)
    length = torch.where(real, positions + 1, 0).amax(dim=1)                      # (B,) last real row + 1
    n = int(length.max())
    seq, real = seq[:, :n], real[:, :n]
    inside = positions[:n][None, :] < length[:, None]
    slots = inside & ~real
    return seq, (None if bool(inside.all()) else inside.to(torch.long)), slots.cpu()


def text_rows(max_length: int) -> int:
    """The planner's text length: a caption of `max_length` tokens in the template. References add
    their slot rows in the probe itself (probe_inputs' `references`), not here."""
    return max_length + TEMPLATE_ROWS


def text_modules(encoders):
    """Nothing moves whole: the vision tower (0.6B of the 8B; it reads the references) runs unit by
    unit wherever the encode runs (text.encode_prompts streams it, text.vision_units), and the
    language model may run layer by layer (text.encode_prompts places it)."""
    return [], encoders.text_encoder.model.language_model


# -- the forward call ---------------------------------------------------------------------------------------

def predict(transformer, noisy_packed: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
            latent_hw: tuple[int, int], guidance=None, references=None, prefix_cache=None) -> torch.Tensor:
    """One transformer call: packed noisy target latents (B, h*w, 64) at sigma (B,) -> the target's
    velocity. `references`: normalised latents (B or 1, 64, h_r, w_r) per reference slot, in the
    order the text encoder saw them; `guidance` is ignored (true CFG in sampling). `prefix_cache`:
    (a prefix_cache(), first step): the text and references' keys and values are stored at the
    first step and only the target's rows are computed after, as QwenImage21Pipeline's
    use_kv_cache does."""
    h, w = latent_hw
    if h % 2 or w % 2:
        raise ValueError(f"Qwen-Image-2.1 takes images whose sides are multiples of 32 pixels (one vision slot "
                         f"per 2x2 latent tokens of 16 px); got {16 * w}x{16 * h} (QwenImage21Pipeline floors "
                         f"such a size to a multiple of 32 itself)")
    seq, mask, slots = text_layout(embeds.t5)
    b = noisy_packed.shape[0]
    refs = [r.expand(b, -1, -1, -1) for r in references] if references else None
    cache, mode = (None, None) if prefix_cache is None else (prefix_cache[0], "extract" if prefix_cache[1] else "cached")
    return forward.predict(transformer, noisy_packed, sigma, seq, mask, slots, latent_hw, references=refs,
                           kv_cache=cache, kv_mode=mode)


def prefix_cache(transformer):
    """A fresh QwenImage21KVCache for one denoising run, or None for a transformer without
    `causal_condition` (its prefix is modulated at each step's t, so nothing can be reused),
    exactly where QwenImage21Pipeline enables its cache."""
    config = getattr(transformer, "config", None)
    if not getattr(config, "causal_condition", False):
        return None
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    return QwenImage21KVCache(len(transformer.transformer_blocks))


def prefix_cache_bytes(config, batch: int, text_rows: int, reference_hw: list[tuple[int, int]],
                       dtype: torch.dtype) -> int:
    """What one prefix cache holds on the device: keys and values (batch, prefix, heads, head_dim)
    of every block in the compute dtype, the prefix being the text rows without their image slots
    (one per 2x2 latent tokens of a reference) plus the references' latent tokens."""
    if not config.get("causal_condition", False):
        return 0
    ref_tokens = sum(h * w for h, w in reference_hw)                 # one token per latent cell
    prefix = text_rows - sum(lat.slots(h, w) for h, w in reference_hw) + ref_tokens
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return 2 * config["num_layers"] * batch * prefix * width * torch.empty((), dtype=dtype).element_size()


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype,
                 references: int = 0) -> dict:
    """Forward kwargs on the meta device for the planner's activation probe (predict's shapes).
    `references`: that many references at the pipeline's reference size for a square image (1024²
    pixels: 32 x 32 slots in the text, 64 x 64 latent tokens each), laid out as forward.predict lays
    them: each reference's tag rows and slots in the text before the caption (the text grows by
    both), its packed latents before the target's. The slot mask is a host tensor: the transformer reads
    the layout from it."""
    def meta(*shape):
        return torch.empty(*shape, device="meta", dtype=dtype)

    h, w = latent_hw
    side = refs_mod.DEFAULT_RESOLUTION // lat.VAE_SCALE_FACTOR
    ref_slots = lat.slots(side, side)
    per = REFERENCE_TAG_ROWS + ref_slots
    text = torch.zeros(batch, text_length + references * per, dtype=torch.bool)
    for i in range(references):                   # [tags | slots] per reference, the caption after
        start = i * per + REFERENCE_TAG_ROWS
        text[:, start:start + ref_slots] = True
    hidden = references * lat.image_tokens(side, side) + lat.image_tokens(h, w)
    return {"hidden_states": meta(batch, hidden, config.in_channels),
            "encoder_hidden_states": meta(batch, text.shape[1], config.context_in_dim),
            "timestep": meta(batch), "img_shapes": [[(1, side, side)] * references + [(1, h, w)]] * batch,
            "img_mask": torch.cat([text, torch.ones(batch, lat.slots(h, w), dtype=torch.bool)], dim=1),
            "return_dict": False}


def text_width(config) -> int:
    return int(config.context_in_dim)


# -- sampling ----------------------------------------------------------------------------------------------

def published_schedule() -> FlowSchedule:
    """QwenImage21Pipeline: linspace(1, 1/steps) (no sample_sigmas), mu on the scheduler's line
    (0.5 at 256 to 1.15 at 4096 tokens), 40 steps, no guidance (true_cfg_scale 1.0)."""
    return FlowSchedule(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                        max_image_seq_len=4096, default_steps=DEFAULT_STEPS, default_guidance=1.0)


def _schedule(variant: str, folder=None) -> FlowSchedule:
    return FlowSchedule.from_model_folder(folder, published_schedule())


def _timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    return model_timestep(sigma, batch, dtype, device)


def reference_size(ref_width: int, ref_height: int, bucket: tuple[int, int]) -> tuple[int, int]:
    """(width, height) a reference is VAE-encoded at for training: the pipeline's size (1024² of
    area at its aspect) whatever the bucket (module docstring: the text encoder saw that size)."""
    return refs_mod.dimensions(refs_mod.DEFAULT_RESOLUTION ** 2, ref_width / ref_height)


def _sampling_latents(vae, images):
    return refs_mod.sampling_latents(getattr(vae, "vae", vae), images)


# -- the family object ----------------------------------------------------------------------------------------

def _loader(name: str):
    """qwen_image21_loading's `name`, looked up on each call (so a test may replace it)."""
    def call(*args, **kwargs):
        return getattr(qwen_image21_loading, name)(*args, **kwargs)
    call.__name__ = name
    return call


def recognizes_keys(keys) -> bool:
    return find_prefix(keys) is not None


def _register():
    from ..family import ModelFamily, ReferenceConditioning, Sampling, register

    return register(ModelFamily(
        name=NAME, spec=QWEN_IMAGE21_SPEC,
        resolve_sources=_loader("resolve_sources"), load_transformer=_loader("load_transformer"),
        load_text_encoders=_loader("load_text_encoders"), load_vae=load_vae,
        text_sources=("text_encoder", "processor"),
        encode_prompts=encode_prompts, padding_side=lambda encoders: "right",
        latent_channels=lat.LATENT_CHANNELS, vae_scale_factor=lat.VAE_SCALE_FACTOR,
        pack_latents=lat.pack_latents, unpack_latents=lat.unpack_latents, image_tokens=lat.image_tokens,
        predict=predict, probe_inputs=probe_inputs, describe=_loader("describe"),
        sampling=Sampling(guidance="cfg", variant=lambda transformer: NAME, schedule=_schedule,
                          timestep=_timestep, prefix_cache=prefix_cache, prefix_cache_bytes=prefix_cache_bytes),
        text_modules=text_modules,
        transformer_classes=(qwen_image21_loading.TRANSFORMER_CLASS,), pipeline_classes=("QwenImage21Pipeline",),
        meta_transformer_class=_meta_class, text_phase=_text_phase,
        recognizes_keys=recognizes_keys, text_rows=text_rows, timestep_sampling="shift",
        references=ReferenceConditioning(size=reference_size, text_sees_images=True, most=MAX_REFERENCES,
                                        sampling_latents=_sampling_latents),
        text_width=text_width, rgba=True, caption_tokens=text.caption_tokens, cuts_text=False,
        split_blocks=_split_blocks,
    ))


def _split_blocks(transformer) -> None:
    """ModelFamily.split_blocks: the blocks become block.py's split class (imported on use: diffusers)."""
    from .block import split_blocks

    split_blocks(transformer)


def _text_phase(rows, model_cfg=None, base_dir=None, references: int = 0):
    from .text_phase import text_encoding_phase

    return text_encoding_phase(rows, model_cfg=model_cfg, base_dir=base_dir, references=references)


def _meta_class():
    """The planner's and the simulated device's class (meta_model.py: a forward that runs without values)."""
    from .meta_model import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel


QWEN_IMAGE21 = _register()
