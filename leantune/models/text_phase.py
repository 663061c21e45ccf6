"""The caching phase's text encoding, priced for `leantune plan` (ModelFamily.text_phase): a decoder-only
text encoder (FLUX.2-dev's Mistral Small 3.x, klein's Qwen3) run layer by layer on the device.

What the device holds: the resident parts (embedding table, final norm), two decoder layers (the
one running and the next arriving), one layer's activations for a batch of captions, and the hidden states the model returns when asked for
all of them (FLUX.2 stacks three intermediate layers, so the pipelines ask for every layer's
output: (layers + 1) x tokens x width). What host RAM holds depends on how the encoder is loaded:
- loaded whole (it fits the host-RAM budget): every tensor of the checkpoint, vision tower and LM
  head included, as the folder holds them;
- read from its files (streamed_encoder.py, when it does not fit): the tensor being read, at most
  the largest one (the embedding table, read once), on top of nothing else of the encoder.

The encoder is built on the meta device from a config (a [model] section's text_encoder/config.json,
else the packaged full-size one), so the numbers are the real tensors' sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .streamed_encoder import HOST_MARGIN


def meta_text_encoder(model_cls, config_cls, config: dict) -> torch.nn.Module:
    """`model_cls(config_cls(**config))` on the meta device (shapes only)."""
    cfg = config_cls(**{k: v for k, v in config.items() if not k.startswith("_")})
    with torch.device("meta"):
        return model_cls(cfg)


def folder_config(path: Path | None) -> dict | None:
    """A text encoder folder's config.json, or None when there is none to read."""
    if path is None:
        return None
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text(encoding="utf-8"))


def decoder_phase(model: torch.nn.Module, text_model: torch.nn.Module, *, tokens: int, hidden_states: int,
                  dtype_bytes: int = 2, layers_run: int | None = None) -> dict:
    """Predicted bytes of encoding `tokens` token rows (a batch of captions, padding included) with
    `text_model` (the module holding `layers`, `embed_tokens` and `norm`) streamed layer by layer;
    `hidden_states` of (tokens, width) kept alive until the encode returns (the model's
    output_hidden_states: layers + 1; 1 when only the last is read). `model` is the whole encoder
    as its folder stores it (what loading it whole puts in host RAM). `layers_run`: the decoder
    layers an encode runs when fewer than all (the later ones and the final norm are then neither
    placed nor read); `reads` is what one encode copies to the GPU or reads from the files."""
    cfg = text_model.config
    d, i = cfg.hidden_size, cfg.intermediate_size

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    layer = count(text_model.layers[0])
    total = len(text_model.layers)
    run = total if layers_run is None else min(layers_run, total)
    resident = count(text_model.embed_tokens) + (count(text_model.norm) if run == total else 0)
    largest = max(p.numel() for p in text_model.parameters())
    # the MLP's three (T, I) tensors alive at once (act(gate), up, their product) and the hidden
    # state, q/k/v and their rotary copies, attention output: about six (T, D); plus the kept states
    activations = (3 * tokens * i + 6 * tokens * d + hidden_states * tokens * d) * dtype_bytes
    # two layers on the device while one runs: the running one and the next, which the stream brings
    # meanwhile (memory/blockwise.py's prefetch; from the files as from host RAM)
    on_device = 2 if run > 1 else 1
    return {"device": (resident + on_device * layer) * dtype_bytes + activations, "resident": resident * dtype_bytes,
            "layer": layer * dtype_bytes, "activations": activations, "tokens": tokens,
            "host": count(model) * dtype_bytes, "host_streamed": largest * dtype_bytes,
            "layers": total, "layers_run": run, "reads": (resident + run * layer) * dtype_bytes}


def from_files(phase: dict, ram_budget: int | None) -> bool:
    """Whether the caching phase reads the encoder from its files under `ram_budget` (bytes; None:
    unknown, priced as loaded), as streamed_encoder.stream_from_files decides."""
    return ram_budget is not None and phase["host"] > HOST_MARGIN * ram_budget
