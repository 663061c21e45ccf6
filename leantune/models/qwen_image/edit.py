"""Qwen-Image-Edit (2509 / 2511, "Plus": one or more reference images): Qwen-Image's transformer
conditioned on reference images, as QwenImageEditPlusPipeline conditions it.

Two things see the references (docs/reference-images.md describes the seam every family uses):

- the text encoder: each prompt goes into the Edit template after one "Picture N: <|vision_start|>
  <|image_pad|><|vision_end|>" per reference, and Qwen2.5-VL's vision tower reads the references
  resized to 384x384 pixels of area (the pipeline's CONDITION_IMAGE_SIZE, aspect kept, sides
  multiples of 32). The first 64 rows (the template's system part) are dropped; the Edit pipeline
  cuts nothing else (no max_sequence_length cut);
- the transformer: each reference's VAE latents, packed into 2x2 patches, follow the noisy target's
  tokens in one image sequence (`img_shapes` lists every grid, so each gets its own rotary
  positions); the prediction is the target's part.

For sampling, references are resized to 1024x1024 pixels of area for the VAE (VAE_IMAGE_SIZE) as
the pipeline does; for training the cache encodes them at the target's bucket area with their own
aspect (`reference_size`), so a 1024 px run conditions exactly as the pipeline samples.

Everything else (loading, latents, schedule, true CFG, LoRA names) is Qwen-Image's (qwen_image/__init__.py).
"""

from __future__ import annotations

import math

import torch

from .. import qwen_image as qi
from ..family import PromptEmbeds

EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency "
                 "with the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
EDIT_DROP = 64                     # the Edit pipelines' prompt_template_encode_start_idx
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
CONDITION_AREA = 384 * 384         # what the text encoder's vision tower sees of a reference
VAE_AREA = 1024 * 1024             # what the pipeline VAE-encodes of a reference
MAX_REFERENCES = 4
# The most text-sequence rows one reference adds (vision tokens after the 2x2 merge of 14 px patches,
# 384^2 px of area, plus the picture tags): the cache's bound on an entry.
ROWS_PER_REFERENCE = 200


def dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of `area` pixels at aspect `ratio` = w / h, sides rounded to multiples of 32
    (the Edit pipeline's calculate_dimensions)."""
    width = math.sqrt(area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def reference_size(ref_width: int, ref_height: int, bucket: tuple[int, int]) -> tuple[int, int]:
    """(width, height) a reference is VAE-encoded at for training in `bucket` (width, height):
    the bucket's area at the reference's own aspect."""
    return dimensions(bucket[0] * bucket[1], ref_width / ref_height)


def _image_processor():
    from diffusers.image_processor import VaeImageProcessor

    return VaeImageProcessor(vae_scale_factor=qi.VAE_SCALE_FACTOR * 2)


def condition_images(images) -> list:
    """The references as the text encoder sees them (PIL, resized as the pipeline resizes them)."""
    proc = _image_processor()
    out = []
    for img in images:
        w, h = dimensions(CONDITION_AREA, img.size[0] / img.size[1])
        out.append(proc.resize(img, h, w))
    return out


@torch.no_grad()
def encode_reference_latents(vae, images, area: int = VAE_AREA) -> list[torch.Tensor]:
    """Each reference's normalised latents (1, 16, h, w), preprocessed and encoded as the Edit
    pipeline does at sampling (`area` pixels, aspect kept). `vae` is a qwen_image.QwenVAE."""
    proc = _image_processor()
    out = []
    for img in images:
        w, h = dimensions(area, img.size[0] / img.size[1])
        pixels = proc.preprocess(img, h, w).to(device=vae.device, dtype=vae.dtype)      # (1, 3, H, W)
        out.append(vae.encode(pixels).latent_dist.mean)                                  # (1, 16, H/8, W/8)
    return out


def _placement(encoders, device: torch.device, with_vision: bool):
    """Qwen-Image's placement (the language model streamed layer by layer onto a device that does
    not hold it), plus the vision tower moved whole for prompts with references (0.7B parameters).
    In the cache's lock-step pass both are entered once for the pass (streamed_encoder.py), not
    once per prompt."""
    from contextlib import ExitStack

    from ..streamed_encoder import moved_whole

    stack = ExitStack()
    stack.enter_context(qi._placement(encoders, device))
    if with_vision:
        stack.enter_context(moved_whole(encoders.text_encoder.model.visual, device))
    return stack


def _model_inputs(encoders, text: str, images) -> dict:
    """What Qwen2.5-VL's processor gives the Edit pipeline for one prompt: the image processor's
    pixel patches and grids, and the text with each <|image_pad|> repeated once per merged patch of
    its image, tokenized."""
    pad = "<|image_pad|>"
    out = {}
    if images:
        proc = encoders.image_processor
        pixels = proc(images=images, return_tensors="pt")
        out.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        merge = proc.merge_size ** 2
        head, *rest = text.split(pad)
        text = head + "".join(pad * int(g.prod() // merge) + part for g, part in zip(pixels["image_grid_thw"], rest))
    tokens = encoders.tokenizer([text], padding=True, return_tensors="pt")
    out.update(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
    return out


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, max_length: int = qi.DEFAULT_TEXT_LENGTH, device=None,
                   images=None) -> tuple[PromptEmbeds, torch.Tensor]:
    """Encode prompts as QwenImageEditPlusPipeline.encode_prompt does. `images`: per prompt, its
    reference images (PIL; resized here to the condition size), or None for none. One prompt per
    encoder call, as the pipeline encodes (batch 1). `max_length` is not applied: the Edit
    pipeline keeps every row."""
    from ...memory.lockstep import lanes

    device = torch.device(device or encoders.device)
    images = images if images is not None else [None] * len(prompts)

    def one(prompt: str, refs) -> torch.Tensor:
        refs = condition_images(refs) if refs else None
        tags = "".join(PICTURE.format(i + 1) for i in range(len(refs or ())))
        inputs = _model_inputs(encoders, EDIT_TEMPLATE.format(tags + prompt), refs)
        with _placement(encoders, device, with_vision=refs is not None):
            out = encoders.text_encoder.model(
                input_ids=inputs["input_ids"].to(device), attention_mask=inputs["attention_mask"].to(device),
                pixel_values=None if refs is None else inputs["pixel_values"].to(device),
                image_grid_thw=None if refs is None else inputs["image_grid_thw"].to(device), use_cache=False)
        hidden = out.last_hidden_state[0]                                            # (L_tok, D)
        return hidden[inputs["attention_mask"][0].to(hidden.device).bool()][EDIT_DROP:]

    # one after another; in the cache's lock-step pass each prompt is a lane of its own, so the
    # prompts go through each language-model layer together (memory/lockstep.py)
    rows = lanes([lambda p=prompt, r=refs: one(p, r) for prompt, refs in zip(prompts, images)])
    longest = max(r.shape[0] for r in rows)
    seq = torch.stack([torch.cat([r, r.new_zeros(longest - r.shape[0], r.shape[1])]) for r in rows])
    seq = seq.to(dtype=encoders.text_encoder.dtype)
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(len(prompts), 0)), lengths


def caption_tokens(tokenizer, captions: list[str]) -> list[int]:
    """Each caption's rows as encode_prompts keeps them without references: the templated tokens
    after the 64 dropped. None is cut (the Edit pipeline applies no max_length); each reference
    adds its picture tags and image tokens, which depend on its size (ROWS_PER_REFERENCE at most)."""
    ids = tokenizer([EDIT_TEMPLATE.format(c) for c in captions])["input_ids"]
    return [len(i) - EDIT_DROP for i in ids]


def predict(transformer, noisy_packed: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds,
            latent_hw: tuple[int, int], guidance=None, references=None) -> torch.Tensor:
    """One transformer call with reference latents: `references` is a list of (B, 16, h_r, w_r)
    normalised latents (none: plain Qwen-Image). Their packed tokens follow the target's; the
    prediction returned is the target's (B, N, 64)."""
    if not references:
        return qi.predict(transformer, noisy_packed, sigma, embeds, latent_hw)
    dtype, device = noisy_packed.dtype, noisy_packed.device
    b, n = noisy_packed.shape[:2]
    refs = [qi.pack_latents(r.to(device=device, dtype=dtype).expand(b, -1, -1, -1)) for r in references]
    seq, mask = qi.text_mask(embeds.t5)
    out = transformer(
        hidden_states=torch.cat([noisy_packed, *refs], dim=1),
        timestep=sigma.to(device=device, dtype=dtype),
        encoder_hidden_states=seq.to(device=device, dtype=dtype),
        encoder_hidden_states_mask=None if mask is None else mask.to(device),
        img_shapes=qi.img_shapes(b, latent_hw, [tuple(r.shape[-2:]) for r in references]),
        return_dict=False,
    )[0]
    return out[:, :n]


def probe_inputs(config, batch: int, latent_hw: tuple[int, int], text_length: int, dtype: torch.dtype) -> dict:
    """The planner's probe inputs with one reference at the target's size: its tokens double the
    image sequence (what an edit step at that bucket runs)."""
    inputs = qi.probe_inputs(config, batch, latent_hw, text_length, dtype)
    hs = inputs["hidden_states"]
    inputs["hidden_states"] = torch.empty(hs.shape[0], 2 * hs.shape[1], hs.shape[2], device="meta", dtype=hs.dtype)
    inputs["img_shapes"] = qi.img_shapes(batch, latent_hw, [latent_hw])
    return inputs


def _encoders_loader(sources, dtype=torch.bfloat16, device="cpu"):
    """Qwen-Image's text encoder and tokenizer, plus Qwen2-VL's image processor that reads the
    references: from the folder's processor/ (preprocessor_config.json, as the published Edit
    repositories have it, or processor_config.json's "image_processor" section, as newer
    transformers write it), else Qwen2-VL's defaults, which the Edit repositories ship unchanged."""
    enc = qi.qwen_image_loading.load_text_encoders(sources, dtype, device)
    folder = sources.tokenizer.parent / "processor" if sources.tokenizer is not None else None
    enc.image_processor = _image_processor_from(folder)
    return enc


def _image_processor_from(folder):
    import json

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if folder is not None and (folder / "preprocessor_config.json").is_file():
        return Qwen2VLImageProcessorPil.from_pretrained(str(folder), local_files_only=True)
    combined = None if folder is None else folder / "processor_config.json"
    if combined is not None and combined.is_file():
        try:
            section = json.loads(combined.read_text(encoding="utf-8")).get("image_processor")
        except (OSError, ValueError) as e:
            raise ValueError(f"{combined}: not a readable processor config ({e})") from None
        if isinstance(section, dict):
            return Qwen2VLImageProcessorPil.from_dict(section)
    return Qwen2VLImageProcessorPil()


def _register():
    from dataclasses import replace

    from ..family import ReferenceConditioning, register

    base = qi.QWEN_IMAGE
    # Its own spec object (the same blocks and LoRA names) so that code handed only the spec (the
    # planner's probe: family_of_spec) finds this family's probe inputs, with the reference tokens.
    spec = replace(base.spec, family="qwen-image-edit")
    return register(replace(
        base, name="qwen-image-edit", spec=spec, load_text_encoders=_encoders_loader, encode_prompts=encode_prompts,
        predict=predict, probe_inputs=probe_inputs, text_rows=lambda max_length: max_length + EDIT_DROP + MAX_REFERENCES * ROWS_PER_REFERENCE,
        # the same class: family_for_model tells a loaded one "qwen-image" (registered first)
        transformer_classes=("QwenImageTransformer2DModel",),
        # guess_family: an Edit-2509/2511 folder (its model_index.json) is this family, not Qwen-Image
        pipeline_classes=("QwenImageEditPlusPipeline",),
        recognizes_keys=lambda keys: False, caption_tokens=caption_tokens, cuts_text=False,
        references=ReferenceConditioning(size=reference_size, text_sees_images=True, most=MAX_REFERENCES,
                                        sampling_latents=encode_reference_latents),
    ))


QWEN_IMAGE_EDIT = _register()
