"""The caching phase with a text encoder left in its files (models/streamed_encoder.py): when the
encoder does not fit the host-RAM budget, the cache's text entries are the same as with the encoder
loaded whole (Qwen-Image's Qwen2.5-VL, FLUX.2-dev's Mistral3, FLUX.2-klein's Qwen3, Krea 2's
Qwen3-VL); a run whose
entries are all present never loads it."""

from __future__ import annotations

import pytest
import torch

from leantune.config import load_config
from leantune.data.cache import prepare_caches
from leantune.demo import draw_shapes
from leantune.tiny import flux2 as tf
from leantune.tiny import krea2 as tk
from leantune.tiny import qwen_image as tq

RUN = """
[model]
family = "{family}"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "{cache}"
max_text_length = 64

[[data.datasets]]
path = "{images}"
trigger_word = "lnt"
"""


FAMILIES = {   # family -> (writes a tiny diffusers folder, the transformers class of its text encoder)
    "qwen-image": (lambda p: tq.save_qwen_image_folder(p), "Qwen2_5_VLForConditionalGeneration"),
    "flux2-dev": (lambda p: tf.save_flux2_folder(p, "dev"), "Mistral3ForConditionalGeneration"),
    "flux2-klein-4b": (lambda p: tf.save_flux2_folder(p, "klein"), "Qwen3ForCausalLM"),
    "krea2": (lambda p: tk.save_krea2_folder(p), "Qwen3VLModel"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("streamed")
    model = FAMILIES[request.param][0](root / "tiny")
    draw_shapes(root / "images", count=4, size=64, seed=5)
    return root, model, request.param


def config(root, model, family, cache):
    p = root / f"{cache}.toml"
    p.write_text(RUN.format(model=model, images=root / "images", cache=cache, family=family))
    return load_config(p, [])


def entries(data, prompts):
    return {p: data.text_entry(p) for p in prompts}


def test_file_streamed_encoder_fills_the_cache_as_the_loaded_one(setup, monkeypatch):
    import transformers

    root, model, family = setup
    prompts = ["", "a red circle, lnt", "two blue squares on a long grey table by a window"]
    loaded = prepare_caches(*_args(config(root, model, family, "whole")), extra_prompts=prompts)

    def refuse(*a, **k):
        raise AssertionError("the encoder was loaded into host RAM despite a host-RAM budget it does not fit")

    monkeypatch.setattr(getattr(transformers, FAMILIES[family][1]), "from_pretrained", refuse)
    cfg = config(root, model, family, "files")
    streamed = prepare_caches(*_args(cfg), extra_prompts=prompts, ram_budget=1)   # 1 byte: nothing fits
    assert streamed.stats["text"].misses == loaded.stats["text"].misses > 0
    want, got = entries(loaded, prompts), entries(streamed, prompts)
    for p in prompts:
        assert torch.equal(got[p][0], want[p][0]) and torch.equal(got[p][1], want[p][1]), p

    def no_encoder(*a, **k):
        raise AssertionError("a cache hit loaded the text encoder")

    again = prepare_caches(*_args(cfg), extra_prompts=prompts, ram_budget=1, load_text_encoders=no_encoder)
    assert again.stats["text"].misses == 0 and again.stats["text"].hits == streamed.stats["text"].misses


def _args(cfg):
    return cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32


def test_sampling_encode_stage_reads_a_file_backed_encoder(setup):
    """Sampling's encode stage (infer/encode.py) with the encoder left in its files gives the
    embeddings of the loaded encoder, the stage placing nothing of it itself."""
    from leantune.infer.encode import encode_prompts_stage
    from leantune.models.family import get_family
    from leantune.models.streamed_encoder import is_file_backed, text_encoder_ram_budget

    root, model, family_name = setup
    family = get_family(family_name)
    cfg = config(root, model, family_name, "stage")
    sources = family.resolve_sources(cfg.model, cfg.base_dir)
    prompts = ["a red circle", ""]
    loaded = family.load_text_encoders(sources, torch.float32, "cpu")
    with text_encoder_ram_budget(1):
        lazy = family.load_text_encoders(sources, torch.float32, "cpu")
    _, module = family.text_modules(lazy)
    assert is_file_backed(module)
    want = encode_prompts_stage(loaded, prompts, max_length=64, family=family)
    got = encode_prompts_stage(lazy, prompts, max_length=64, family=family, stream_t5=True)
    for a, b in zip(want, got):
        assert torch.equal(a.t5, b.t5) and torch.equal(a.pooled, b.pooled)
