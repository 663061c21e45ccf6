"""Z-Image's text-encoding phase priced for `leantune plan` (ModelFamily.text_phase): Qwen3-4B run layer
by layer in the caching phase, loaded whole or read from its files (models/text_phase.py says what
each holds).

ZImagePipeline pads every caption to `max_length` tokens, so a batch of captions costs batch x
max_length token rows whatever the captions' lengths. The encode runs the layers up to the
second-to-last (z_image_text.layers_run: 35 of 36) and keeps only its last hidden state (1).
"""

from __future__ import annotations

from ..text_phase import decoder_phase, folder_config, meta_text_encoder

TEXT_ENCODER = "qwen3_4b"          # models/configs/qwen3_4b.json


def text_encoding_phase(text_rows: int = 512, batch: int = 8, dtype_bytes: int = 2, model_cfg=None,
                        base_dir=None) -> dict:
    """Predicted bytes of the caching phase's text encoding (text_phase.decoder_phase), from the
    [model] section's text_encoder/config.json when there is one, else Qwen3-4B's packaged config.
    `batch`: the cache's captions per encoder call."""
    from transformers import Qwen3Config, Qwen3Model

    from ..component_files import packaged_config
    from .text import layers_run

    own = _config_of(model_cfg, base_dir)
    model = meta_text_encoder(Qwen3Model, Qwen3Config, own or packaged_config(TEXT_ENCODER))
    run = layers_run(len(model.layers))
    phase = decoder_phase(model, model, tokens=batch * text_rows, hidden_states=1, dtype_bytes=dtype_bytes,
                          layers_run=run)
    phase["encoder"] = "the config's text_encoder/config.json" if own else f"models/configs/{TEXT_ENCODER}.json"
    return phase


def _config_of(model_cfg, base_dir) -> dict | None:
    """The text encoder's config.json of a [model] section (None: none given, or not a folder)."""
    from pathlib import Path

    from . import loading as z_image_loading

    if model_cfg is None:
        return None
    try:
        sources = z_image_loading.resolve_sources(model_cfg, Path(base_dir or "."))
    except Exception:
        return None
    return folder_config(sources.text_encoder)
