"""SD3.5 loading and text encoding on tiny real components: the diffusers folder layout, T5 left
out ([model] t5 = false), prompt encoding equal to StableDiffusion3Pipeline.encode_prompt, the
VAE's SD3 latent statistics, the family registration, and why the T5 padding is kept."""

# Checks moved to the conformance suite (issue 33):
# - test_family_is_registered, trimmed to SD3 (its spec, and the family object a tiny SD3 is told as):
#   "a tiny Flux transformer is told as flux" moved to
#   tests/families/test_conformance.py::test_builds_from_its_tiny_preset[flux-dev]
# - test_diffusers_folder_matches_the_tiny_model, trimmed to the SD3 specifics (sources, description,
#   VAE latent statistics, CLIP-with-projection encoders, T5 width, encoding): the transformer's
#   weights moved to tests/families/test_conformance.py::test_builds_from_its_tiny_preset[sd3.5-large],
#   the VAE's and the three text encoders' weights to
#   tests/families/test_conformance.py::test_loads_its_diffusers_folder_as_diffusers_does[sd3.5-large],
#   the meta build (no data, the real load's shapes and dtypes) to
#   tests/families/test_conformance.py::test_builds_from_its_tiny_preset[sd3.5-large]

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from leantune.config import ConfigError, ModelConfig, validate
from leantune.models import sd3
from leantune import tiny
from leantune.models.family import PromptEmbeds, family_for_model, get_family
from leantune.models.sd3.loading import LoadError, SD3TextEncoders

PROMPTS = ["a photo of a cat", "a red circle on a white background next to a small orange ellipse and a cyan cross"]


def _encoders(parts: dict, width: int = 64) -> SD3TextEncoders:
    return SD3TextEncoders(parts["tokenizer"], parts["text_encoder"], parts["tokenizer_2"], parts["text_encoder_2"],
                           parts["tokenizer_3"], parts["text_encoder_3"], t5_width=width)


@pytest.mark.parametrize("t5", [True, False], ids=["t5", "no_t5"])
def test_encode_equals_the_pipeline(t5):
    parts = tiny.sd3_components("large", t5=t5)
    pipe = StableDiffusion3Pipeline(**parts)
    with torch.no_grad():     # as the pipeline's __call__ (T5's attention rounds differently with autograd on)
        seq, neg_seq, pooled, neg_pooled = pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=True,
                                                              max_sequence_length=16)
    got, lengths = sd3.encode_prompts(PROMPTS, _encoders(parts), max_length=16)
    assert got.t5.shape == (2, 77 + 16, 64) and got.pooled.shape == (2, 32)
    assert torch.equal(got.t5, seq) and torch.equal(got.pooled, pooled)
    assert lengths.tolist() == [93, 93]           # nothing trimmed
    # The empty prompt (caption dropout, CFG's unconditional) is the pipeline's negative embedding.
    empty, _ = sd3.encode_prompts(["", ""], _encoders(parts), max_length=16)
    assert torch.equal(empty.t5, neg_seq) and torch.equal(empty.pooled, neg_pooled)
    if not t5:
        assert not empty.t5[:, 77:].any()         # zeros of T5's shape


def test_family_is_registered():
    """The registered family carries the module's SD3_SPEC (the spec test_sd3_spec.py and test_sd3_lora.py
    test), and a tiny SD3 model is told as that very family object."""
    fam = get_family("sd3")
    assert fam.name == "sd3" and fam.spec is sd3.SD3_SPEC
    assert family_for_model(tiny.sd3_transformer("medium")) is fam


def test_diffusers_folder_matches_the_tiny_model(tiny_sd3_dir):
    fam = get_family("sd3")
    refs = tiny.sd3_components("large")
    sources = fam.resolve_sources(ModelConfig(path=str(tiny_sd3_dir), family="sd3"), Path("/"))
    assert sources.text_encoder_3 == tiny_sd3_dir / "text_encoder_3" and sources.t5

    # (The weights of every component, and the meta build: tests/families, see the top of this file.)
    tr = fam.load_transformer(sources, dtype=torch.float32)
    assert fam.describe(tr) == "SD3.5 Large-style (2 joint blocks, width 32)"
    vae = fam.load_vae(sources, dtype=torch.float32)
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (1.5305, 0.0609)   # SD3's latents, not Flux's

    enc = fam.load_text_encoders(sources, dtype=torch.float32)
    assert type(enc.text_encoder).__name__ == type(enc.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    assert enc.t5_width == 64
    got, _ = fam.encode_prompts(PROMPTS, enc, max_length=16)
    want, _ = sd3.encode_prompts(PROMPTS, _encoders(refs), max_length=16)
    assert torch.equal(got.t5, want.t5) and torch.equal(got.pooled, want.pooled)


def test_without_t5(tiny_sd3_dir):
    fam = get_family("sd3")
    sources = fam.resolve_sources(ModelConfig(path=str(tiny_sd3_dir), family="sd3", t5=False), Path("/"))
    assert sources.text_encoder_3 is None and sources.tokenizer_3 is None
    enc = fam.load_text_encoders(sources, dtype=torch.float32)
    assert enc.text_encoder_3 is None and enc.tokenizer_3 is None
    parts = tiny.sd3_components("large", t5=False)
    with torch.no_grad():
        seq, _, pooled, _ = StableDiffusion3Pipeline(**parts).encode_prompt(
            PROMPTS, None, None, do_classifier_free_guidance=False, max_sequence_length=16)
    got, _ = fam.encode_prompts(PROMPTS, enc, max_length=16)
    assert torch.equal(got.t5, seq) and torch.equal(got.pooled, pooled)


def test_missing_t5_names_the_keys(tiny_sd3_dir, tmp_path):
    folder = tmp_path / "no_t5"
    folder.mkdir()
    for name in ("transformer", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae"):
        (folder / name).symlink_to(tiny_sd3_dir / name)
    fam = get_family("sd3")
    sources = fam.resolve_sources(ModelConfig(path=str(folder), family="sd3"), Path("/"))
    with pytest.raises(LoadError, match=r"text_encoder_3.*t5 = false"):
        fam.load_text_encoders(sources, dtype=torch.float32)
    with pytest.raises(LoadError, match="not a SD3 transformer: it looks like a VAE"):
        fam.load_transformer(fam.resolve_sources(ModelConfig(path=str(tiny_sd3_dir / "vae" /
                                                                      "diffusion_pytorch_model.safetensors"),
                                                             family="sd3"), Path("/")))


def test_t5_padding_changes_the_prediction():
    """Why SD3 keeps T5's padding: trimming it (as the Flux cache does) changes the transformer's
    output by far more than rounding, so a trimmed cache would train on other conditioning than
    StableDiffusion3Pipeline samples with."""
    parts = tiny.sd3_components("large")
    enc = _encoders(parts)
    full, _ = sd3.encode_prompts(PROMPTS[:1], enc, max_length=16)
    real = 77 + int(parts["tokenizer_3"](PROMPTS[0]).attention_mask.__len__())
    assert real < full.t5.shape[1]
    trimmed = PromptEmbeds(full.t5[:, :real], full.pooled)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8, 8, generator=g)
    with torch.no_grad():
        a = sd3.predict(parts["transformer"], x, torch.tensor([0.5]), full, (8, 8))
        b = sd3.predict(parts["transformer"], x, torch.tensor([0.5]), trimmed, (8, 8))
    rel = ((a - b).norm() / a.norm()).item()
    assert rel > 1e-3, rel


def _cfg(model: dict, data: dict | None = None, lora: dict | None = None) -> dict:
    out = {"model": {"path": "m", **model}, "data": {"datasets": [{"path": "d"}], **(data or {})}}
    if lora:
        out["lora"] = lora
    return out


def test_config_keys():
    cfg = validate(_cfg({"family": "sd3", "t5": False}))
    assert cfg.model.family == "sd3" and not cfg.model.t5
    assert cfg.data.max_text_length == 256                      # the pipeline's T5 length
    assert validate(_cfg({"family": "sd3"}, {"max_text_length": 77})).data.max_text_length == 77
    assert validate(_cfg({})).data.max_text_length == 512       # Flux unchanged
    assert validate(_cfg({"family": "sd3"}, lora={"blocks": {"joint": [0, 1]}})).lora.blocks == {"joint": [0, 1]}
    for model, lora, match in (({"t5": False}, None, r"\[model\] t5 = false: Flux"),
                               ({"text_encoder_3": "x"}, None, r"\[model\] text_encoder_3: Flux"),
                               ({"family": "sd3", "variant": "dev"}, None, r"\[model\] variant"),
                               ({"family": "sd3", "t5": False, "tokenizer_3": "x"}, None, r"tokenizer_3.*t5 = false"),
                               ({"family": "sd3"}, {"blocks": {"double": [0]}}, r"\[lora\] blocks: 'double'"),
                               ({}, {"blocks": {"joint": [0]}}, r"\[lora\] blocks: 'joint'")):
        with pytest.raises(ConfigError, match=match):
            validate(_cfg(model, lora=lora))
