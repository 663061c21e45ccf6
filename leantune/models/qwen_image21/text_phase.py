"""Qwen-Image-2.1's text-encoding phase priced for `leantune plan` (ModelFamily.text_phase): Qwen3-VL-8B
in the caching phase, per caption with its reference count.

What one encode holds (text.encode_prompts):
- captions without references are encoded as one batch (left padded to the longest; priced at
  `text_rows` each): the language model streamed layer by layer (models/text_phase.decoder_phase),
  the last layer's input kept (the norm's pre-hook) beside the model's own output;
- a caption with references is encoded alone (the references differ per target): each reference
  at the pipeline's size (1024² pixels of area, sides multiples of 32: a square one is 64 x 64
  patches of 16 px, 32 x 32 tokens after the 2x2 merge) lengthens the caption by its tags and one
  token per merged patch, and the vision tower runs first. The vision tower is streamed as the
  language model is (text.vision_units: each block, each deepstack merger, the final merger, one
  at a time with the next arriving; the patch embedding and position table stay), so the device
  holds its resident parts and the two largest consecutive units, 0.11 GB of its 1.15 GB at full
  size, beside the language model's resident parts (entered first). The tower runs over all the
  caption's patches at once: per block the hidden state, q/k/v and the MLP's two 4304-wide
  tensors of every patch (no attention matrix: transformers attends per image with SDPA, whose
  flash and memory-efficient kernels keep none), then the merger's and the three deepstack
  mergers' outputs, which stay alive until the language model's first layers add them. While the
  language model runs, the tower's resident parts and its last unit (a lock-step pass keeps the
  unit it moved to until the pass ends) are still there.
The device peak is the larger of the encodes and the tower's run. Host RAM: the encoder loaded
whole, or, read from its files, the largest language-model tensor plus the vision tower whole
(loading.py reads it into host RAM when references need it; its units are copied from there).
"""

from __future__ import annotations

from pathlib import Path

from ..text_phase import decoder_phase, folder_config, meta_text_encoder
from .references import TAG_ROWS

PACKAGED = "qwen3_vl_8b"
BATCH = 8                          # captions a plain encode takes at once (the caching phase's batch)


def text_encoding_phase(text_rows: int = 528, batch: int = BATCH, dtype_bytes: int = 2, model_cfg=None,
                        base_dir=None, references: int = 0) -> dict:
    """Predicted bytes of the caching phase's text encoding for captions of `text_rows` rows (the
    template included, family.text_rows) with `references` references each (0: text to image),
    from the [model] section's text_encoder/config.json when there is one, else the packaged
    Qwen3-VL-8B-Instruct config (models/configs/qwen3_vl_8b.json)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from ..component_files import packaged_config

    own = folder_config(_text_encoder(model_cfg, base_dir))
    config = own or packaged_config(PACKAGED)
    model = meta_text_encoder(Qwen3VLForConditionalGeneration, Qwen3VLConfig, config)
    text, visual = model.model.language_model, model.model.visual
    plain = decoder_phase(model, text, tokens=batch * text_rows, hidden_states=2, dtype_bytes=dtype_bytes)
    plain["encoder"] = "the config's text_encoder/config.json" if own else f"models/configs/{PACKAGED}.json"
    plain["references"] = references
    if not references:
        return plain
    vision = vision_phase(visual, references, dtype_bytes)
    tokens = text_rows + references * (vision["tokens_per_reference"] + TAG_ROWS)
    edit = decoder_phase(model, text, tokens=tokens, hidden_states=2, dtype_bytes=dtype_bytes)
    # while the language model runs: the tower's resident parts and last unit, and its outputs
    edit_device = edit["device"] + vision["held_after"] + vision["outputs"]
    # while the tower runs: the language model's resident parts (its placement is entered first)
    # and, in a lock-step pass, the layer it holds
    tower_device = vision["device"] + edit["resident"] + edit["layer"]
    phase = dict(plain)
    # a pass mixing captions with and without references: the plain batch beside the tower's held parts
    plain_device = plain["device"] + vision["held_after"]
    phase.update(device=max(plain_device, edit_device, tower_device), vision=vision,
                 edit={"tokens": tokens, "device": edit_device, "activations": edit["activations"],
                       "tower_device": tower_device},
                 host_streamed=plain["host_streamed"] + vision["weights"],
                 reads=plain["reads"] + vision["weights"])
    return phase


def vision_phase(visual, references: int, dtype_bytes: int = 2) -> dict:
    """Device bytes of the vision tower encoding `references` square references at the pipeline's
    size (module docstring), streamed unit by unit as text.encode_prompts runs it: its resident
    parts and the two largest consecutive units (`streamed_weights`; `weights` is the whole
    tower, what host RAM holds), its largest block's activations over every patch, and the outputs
    kept for the language model (the merged embeddings and the deepstack features)."""
    from .references import DEFAULT_RESOLUTION, dimensions
    from .text import vision_units

    cfg = visual.config
    width, height = dimensions(DEFAULT_RESOLUTION ** 2, 1.0)
    patches_per = (height // cfg.patch_size) * (width // cfg.patch_size)
    merged_per = patches_per // cfg.spatial_merge_size ** 2
    p, d, i = references * patches_per, cfg.hidden_size, cfg.intermediate_size

    def count(module) -> int:
        return sum(t.numel() for t in module.parameters()) * dtype_bytes

    weights = count(visual)
    units = [count(u) for u in vision_units(visual)]
    resident = weights - sum(units)
    # the unit running and the next arriving (memory/blockwise.py's prefetch)
    pair = max((a + b for a, b in zip(units, units[1:])), default=units[0] if units else 0)
    streamed = resident + pair
    pixels = p * cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2 * dtype_bytes
    # hidden state and its norm, q, k, v and the attention output, the residual: ~6 (P, D); the
    # MLP's fc1 output and its activation: 2 (P, I)
    block = (6 * p * d + 2 * p * i) * dtype_bytes
    kept = references * merged_per * cfg.out_hidden_size * (1 + len(cfg.deepstack_visual_indexes)) * dtype_bytes
    # the running stream (P, D) and the deepstack features gathered so far, beside the busiest block
    device = streamed + pixels + block + p * d * dtype_bytes + kept
    return {"weights": weights, "streamed_weights": streamed, "resident": resident, "units": len(units),
            "largest_pair": pair, "held_after": resident + (units[-1] if units else 0),
            "patches": p, "tokens_per_reference": merged_per, "activations": block,
            "outputs": kept, "device": device, "blocks": len(visual.blocks)}


def _text_encoder(model_cfg, base_dir) -> Path | None:
    from . import loading

    if model_cfg is None:
        return None
    try:
        return loading.resolve_sources(model_cfg, Path(base_dir or ".")).text_encoder
    except Exception:
        return None
