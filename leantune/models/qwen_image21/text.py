"""Qwen-Image-2.1's prompt (and reference) encoding: what QwenImage21Pipeline.encode_prompt gives.

The pipeline (diffusers 0.42.1 pipelines/qwenimage21/pipeline_qwenimage21.py `_get_qwen_prompt_embeds`)
writes a raw chat string, not a chat-template call: a fixed system message, then the user turn,
with one `<imageN><|vision_start|><|image_pad|><|vision_end|>` per reference before the prompt
(separated by a space), then `<|im_start|>assistant\\n`. Qwen3-VL's processor expands each
`<|image_pad|>` to one token per 2x2 group of 16-pixel patches of that image, and marks image
tokens in `mm_token_type_ids` (Qwen3-VL's 3-D rotary positions read it). References in RGBA are
composited over white for the vision tower only (the VAE reads all four channels). A batch is left
padded. The encoder's output is the last decoder layer's, *before* the final RMSNorm (the
checkpoint was trained on that; transformers 5 returns the normed one as hidden_states[-1], which
is why the pipeline hooks the norm): here the norm's input is captured by a forward pre-hook, and
the lm_head is never run. Each prompt keeps its unpadded rows minus the system message's tokens
(`drop_count`, derived from the template as the pipeline does), with a mask of which rows are image
slots: the transformer substitutes the references' latent tokens there.

On a device the language model runs layer by layer (streamed_encoder.placement) and so does the
vision tower: its units (`vision_units`: each block, each deepstack merger after the block it
reads, the final merger) are brought one at a time while the next one arrives, the patch embedding
and the position table staying on the device. At full size that is 0.11 GB of the tower's 1.15 GB
of bf16 weights on the device at once (text_phase.py prices it). The units run the same ops on the
same weights as the tower moved whole, so the encodings are the same bits.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"


@dataclass
class PromptEncoding:
    """One prompt's encoding: `embeds` (rows, width) and `image_slots` (rows,) bool."""

    embeds: torch.Tensor
    image_slots: torch.Tensor


def prompt_text(prompt: str, n_images: int = 0) -> str:
    """The raw template string the pipeline hands its processor."""
    prompt = prompt or " "                # Qwen has no bos token: an empty prompt leaves nothing to read
    vision = " ".join(f"<image{i}><|vision_start|>{IMAGE_PAD}<|vision_end|>" for i in range(1, n_images + 1))
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{vision}{prompt}<|im_end|>\n"
            f"<|im_start|>assistant\n")


def drop_count(tokenizer) -> int:
    """How many leading tokens the system message is: the chat template applied to it alone."""
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    text = tokenizer.apply_chat_template(message, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def caption_tokens(tokenizer, captions: list[str]) -> list[int]:
    """Each caption's rows as encode_prompts keeps them without references: its template's tokens
    after the system message (`drop_count`). None is cut (the pipeline applies no max_length); each
    reference adds its tags and image slots, which depend on its size."""
    drop = drop_count(tokenizer)
    return [len(i) - drop for i in tokenizer([prompt_text(c) for c in captions])["input_ids"]]


def flatten_alpha(image):
    """A PIL image as the vision tower sees it: RGBA composited over white, anything else as is."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    if image.mode == "RGBA":
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.getchannel("A"))
        return white
    return image


def processor_inputs(prompts: list[str], images: list | None, tokenizer, image_processor) -> dict:
    """What Qwen3-VL's processor returns for these prompts, each with the same references."""
    images = list(images or [])
    texts = [prompt_text(p, len(images)) for p in prompts]
    out = {}
    if images:
        flat = [flatten_alpha(im) for _ in prompts for im in images]
        vision = image_processor(images=flat, return_tensors="pt")
        merge = image_processor.merge_size ** 2
        counts = [int(g.prod()) // merge for g in vision["image_grid_thw"]]
        expanded = []
        for i, text in enumerate(texts):
            pieces = text.split(IMAGE_PAD)
            own = counts[i * len(images):(i + 1) * len(images)]
            expanded.append(pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(own, pieces[1:])))
        texts = expanded
        out.update(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"])
    tokens = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    ids = tokens.input_ids
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    video_id = tokenizer.convert_tokens_to_ids(VIDEO_PAD)
    out.update(input_ids=ids, attention_mask=tokens.attention_mask,
               mm_token_type_ids=(ids == image_id).long() + 2 * (ids == video_id).long())
    return out


def _on_meta(module) -> bool:
    return any(p.is_meta for p in module.parameters())


def _language_model(text_encoder):
    inner = getattr(text_encoder, "model", text_encoder)
    return getattr(inner, "language_model", inner), inner


_UNITS: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.ModuleList]" = weakref.WeakKeyDictionary()


def vision_units(visual) -> torch.nn.ModuleList:
    """The vision tower's streamed units in the order Qwen3VLVisionModel.forward runs them: each
    block, then the deepstack merger that reads that block's output (deepstack_visual_indexes),
    and the final merger last. The mergers are streamed too: at full size each is 40M parameters,
    more than two blocks. The patch embedding, the learned position table and the rotary table
    (4.4M parameters) stay on the device. One list per tower (kept, not rebuilt per call): a
    lock-step pass shares a placement by the identity of its list."""
    units = _UNITS.get(visual)
    if units is None:
        index = list(visual.deepstack_visual_indexes)
        order = []
        for i, block in enumerate(visual.blocks):
            order.append(block)
            if i in index:
                order.append(visual.deepstack_merger_list[index.index(i)])
        order.append(visual.merger)
        units = _UNITS[visual] = torch.nn.ModuleList(order)
    return units


@torch.no_grad()
def encode_prompts(prompts: list[str], encoders, images: list | None = None) -> list[PromptEncoding]:
    """Each prompt's rows (system message dropped) and image-slot mask, on the host in the
    encoder's dtype. `images`: the references (PIL, already at the size they are encoded at),
    the same for every prompt as in the pipeline. The language model runs where `encoders.device`
    says, streamed there layer by layer from host RAM or from its files (streamed_encoder.py); the
    vision tower, in host RAM, unit by unit (`vision_units`)."""
    tokenizer, model = encoders.tokenizer, encoders.text_encoder
    inputs = processor_inputs(list(prompts), images, tokenizer, encoders.image_processor)
    device = encoders.device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    language_model, inner = _language_model(model)
    if "pixel_values" in inputs and _on_meta(inner.visual):
        raise ValueError("the Qwen3-VL vision tower has no weights (it is on meta): references need it; "
                         "loading.load_text_encoders reads it into host RAM")
    from ..streamed_encoder import placement

    visual = inner.visual
    # the tower only where references are read; streamed as the language model is (module docstring)
    tower = placement(visual, vision_units(visual), device) if "pixel_values" in inputs else nullcontext()
    captured = []
    handle = language_model.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        with placement(language_model, language_model.layers, device), tower:
            # no key/value cache: the encode never generates, and a cache keeps every layer's keys and
            # values on the device until it returns (0.6 GiB for 8 captions of 528 rows at full size)
            inner(**inputs, use_cache=False)
    finally:
        handle.remove()
    hidden = captured[-1]
    drop = drop_count(tokenizer)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    out = []
    for row, mask, ids in zip(hidden, inputs["attention_mask"].bool(), inputs["input_ids"]):
        out.append(PromptEncoding(embeds=row[mask][drop:].cpu(), image_slots=(ids[mask] == image_id)[drop:].cpu()))
    return out


def pipeline_layout(encodings: list[PromptEncoding]):
    """(prompt_embeds, prompt_embeds_mask or None, image_pad_mask) stacked as encode_prompt returns
    them: rows zero-padded at the end, the mask None when nothing is padded."""
    longest = max(e.embeds.shape[0] for e in encodings)
    embeds = torch.stack([torch.cat([e.embeds, e.embeds.new_zeros(longest - e.embeds.shape[0], e.embeds.shape[1])])
                          for e in encodings])
    mask = torch.stack([torch.arange(longest) < e.embeds.shape[0] for e in encodings]).long()
    slots = torch.stack([torch.cat([e.image_slots, e.image_slots.new_zeros(longest - e.image_slots.shape[0])])
                         for e in encodings])
    return embeds, (None if bool(mask.all()) else mask), slots
