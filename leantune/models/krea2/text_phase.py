"""Krea 2's text-encoding phase priced for `leantune plan` (ModelFamily.text_phase): Qwen3-VL-4B's
language model run layer by layer in the caching phase, loaded whole or read from its files
(text_phase.py says what each holds).

Krea2Pipeline pads every caption to `max_length` tokens after the 34-token system template (the
template's 5-token suffix after the padding) and asks for every hidden state, so a batch of
captions costs batch x (text_rows + 34) token rows whatever the captions' lengths; the encode runs
every layer (krea2/text.py says why) and keeps every hidden state.
"""

from __future__ import annotations

from pathlib import Path

from ..text_phase import decoder_phase, folder_config, meta_text_encoder
from .text import TEMPLATE_DROP

PACKAGED = "qwen3_vl_4b"


def text_encoding_phase(text_rows: int = 512, batch: int = 8, dtype_bytes: int = 2, model_cfg=None,
                        base_dir=None) -> dict:
    """Predicted bytes of the caching phase's text encoding (text_phase.decoder_phase), from the
    [model] section's text_encoder/config.json and model_index.json's taps when there are, else the
    packaged Qwen3-VL-4B-Instruct config (models/configs/qwen3_vl_4b.json) and the pipeline's taps."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from ..component_files import packaged_config
    from .loading import DEFAULT_SELECT_LAYERS

    sources = _sources(model_cfg, base_dir)
    own = folder_config(sources.text_encoder) if sources is not None else None
    config = own or packaged_config(PACKAGED)
    model = meta_text_encoder(Qwen3VLModel, Qwen3VLConfig, config)
    text = model.language_model
    select = sources.select_layers if sources is not None else DEFAULT_SELECT_LAYERS
    if max(select) > len(text.layers):
        raise ValueError(f"the text encoder has {len(text.layers)} layers, the pipeline taps hidden state {max(select)}")
    phase = decoder_phase(model, text, tokens=batch * (text_rows + TEMPLATE_DROP),
                          hidden_states=len(text.layers) + 1, dtype_bytes=dtype_bytes)
    phase["encoder"] = "the config's text_encoder/config.json" if own else f"models/configs/{PACKAGED}.json"
    return phase


def _sources(model_cfg, base_dir):
    from . import loading as krea2_loading

    if model_cfg is None:
        return None
    try:
        return krea2_loading.resolve_sources(model_cfg, Path(base_dir or "."))
    except Exception:
        return None
