"""FLUX.2's text-encoding phase priced for `leantune plan` (ModelFamily.text_phase): dev's Mistral Small
3.x 24B or klein's Qwen3-4B / Qwen3-8B, run layer by layer in the caching phase, loaded whole or read
from its files (text_phase.py says what each holds).

Both pipelines pad every caption to `max_length` tokens and ask the text model for every hidden
state (three of them are stacked), so a batch of captions costs batch x max_length token rows,
whatever the captions' lengths. The encode runs only the layers up to the deepest stacked one
(flux2_text.layers_run: dev 30 of 40, klein 27 of 36), so it keeps that many + 1 hidden states and
reads that many layers.
"""

from __future__ import annotations

from ..text_phase import decoder_phase, folder_config, meta_text_encoder

# family -> (the packaged config of its text encoder, its kind)
TEXT_ENCODER = {"flux2-dev": ("mistral_small_3_24b", "mistral3"), "flux2-klein-4b": ("qwen3_4b", "qwen3"),
                "flux2-klein-9b": ("qwen3_8b", "qwen3")}


def text_encoding_phase(family: str, text_rows: int = 512, batch: int = 8, dtype_bytes: int = 2,
                        model_cfg=None, base_dir=None) -> dict:
    """Predicted bytes of the caching phase's text encoding for `family` (text_phase.decoder_phase),
    from the [model] section's text_encoder/config.json when there is one, else the packaged
    full-size config. `batch`: the cache's captions per encoder call."""
    from ..component_files import packaged_config

    name, kind = TEXT_ENCODER[family]
    own = _config_of(model_cfg, base_dir)
    config = own or packaged_config(name)
    if kind == "mistral3":
        from transformers import Mistral3Config, Mistral3ForConditionalGeneration

        model = meta_text_encoder(Mistral3ForConditionalGeneration, Mistral3Config, config)
        text = model.model.language_model
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = meta_text_encoder(Qwen3ForCausalLM, Qwen3Config, config)
        text = model.model
    from .text import layers_run

    run = layers_run(kind, len(text.layers))
    phase = decoder_phase(model, text, tokens=batch * text_rows, hidden_states=run + 1, dtype_bytes=dtype_bytes,
                          layers_run=run)
    phase["encoder"] = "the config's text_encoder/config.json" if own else f"models/configs/{name}.json"
    return phase


def _config_of(model_cfg, base_dir) -> dict | None:
    """The text encoder's config.json of a [model] section (None: none given, or not a folder)."""
    from pathlib import Path

    from . import loading as flux2_loading

    if model_cfg is None:
        return None
    try:
        sources = flux2_loading.resolve_sources(model_cfg, Path(base_dir or "."))
    except Exception:
        return None
    return folder_config(sources.text_encoder)
