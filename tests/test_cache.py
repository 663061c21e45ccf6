"""Latent and text-embedding caches on the tiny Flux folder: keys, reuse, corruption, batches, CLI."""

from __future__ import annotations

import argparse
import gc
import json
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from leantune.config import load_config, validate
from leantune.data.cache import CacheWarning, prepare_caches, sample_prompts
from leantune.io import load_safetensors, save_safetensors
from leantune.models.flux import encode_prompts

DTYPE = torch.float32
MAX_LEN = 32


class Loaders:
    """Real loaders of the tiny folder's components that remember how often they ran and what they built."""

    def __init__(self):
        self.vae_calls = 0
        self.text_calls = 0
        self.last_vae = None
        self.last_t5 = None

    def load_vae(self, sources, dtype, device):
        from diffusers import AutoencoderKL

        self.vae_calls += 1
        vae = AutoencoderKL.from_pretrained(sources.vae, torch_dtype=dtype).to(device)
        self.last_vae = weakref.ref(vae)
        return vae

    def load_text_encoders(self, sources, dtype, device):
        from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

        self.text_calls += 1
        t5 = T5EncoderModel.from_pretrained(sources.text_encoder_2, torch_dtype=dtype).to(device)
        self.last_t5 = weakref.ref(t5)
        return SimpleNamespace(
            tokenizer=AutoTokenizer.from_pretrained(sources.tokenizer),
            text_encoder=CLIPTextModel.from_pretrained(sources.text_encoder, torch_dtype=dtype).to(device),
            tokenizer_2=AutoTokenizer.from_pretrained(sources.tokenizer_2),
            text_encoder_2=t5,
        )

    def prepare(self, cfg, **kw):
        return self.prepare_on("cpu", cfg, **kw)

    def prepare_on(self, device, cfg, extra_prompts=()):
        return prepare_caches(cfg.data, cfg.model, cfg.base_dir, device, DTYPE, load_vae=self.load_vae,
                              load_text_encoders=self.load_text_encoders,
                              extra_prompts=[*sample_prompts(cfg.sample), *extra_prompts])


def _image(path: Path, size, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    w, h = size
    arr = np.full((h, w, 3), rng.integers(0, 255, 3), dtype=np.uint8)
    arr[h // 4: 3 * h // 4, w // 4: 3 * w // 4] = rng.integers(0, 255, 3)     # a coloured rectangle
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


@pytest.fixture
def dataset(tmp_path):
    d = tmp_path / "images"
    _image(d / "square.png", (64, 64), 0)
    (d / "square.txt").write_text("a red circle on a white background")
    _image(d / "tall.png", (48, 80), 1)                    # exactly the 48x80 bucket at 64
    (d / "tall.txt").write_text("a green triangle")
    _image(d / "wide.png", (160, 96), 2)
    (d / "wide.txt").write_text("a blue square")
    _image(d / "nested" / "wide2.png", (90, 50), 3)        # no caption file: default caption
    return d


def _cfg(tmp_path, flux_dir, dataset_dir, **data):
    raw = {
        "model": {"path": str(flux_dir), "dtype": "fp32"},
        "data": {"datasets": [{"path": str(dataset_dir), "default_caption": "a yellow star",
                               "min_size": 0}],      # 48x80 at 128 is upscaled 2.2x: kept here
                 "resolutions": [64], "max_text_length": MAX_LEN, "cache_dir": "cache", "batch_size": 2, **data},
        "sample": {"prompts": ["a cyan cross"]},
    }
    return validate(raw, base_dir=tmp_path), raw


def _entries(cache: Path, kind: str) -> list[Path]:
    return sorted((cache / kind).glob("*.safetensors"))


def test_miss_then_full_hit_without_loading_encoders(tmp_path, tiny_flux_dir, dataset):
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    first = Loaders()
    data = first.prepare(cfg)
    # 4 images at one resolution; captions: 4 distinct + "" + the sample prompt.
    assert (first.vae_calls, first.text_calls) == (1, 1)
    assert vars(data.stats["latents"]) == {"hits": 0, "misses": 4, "recomputed": 0}
    assert vars(data.stats["text"]) == {"hits": 0, "misses": 6, "recomputed": 0}
    assert len(_entries(tmp_path / "cache", "latents")) == 4 and len(_entries(tmp_path / "cache", "text")) == 6
    gc.collect()
    assert first.last_vae() is None and first.last_t5() is None     # released, not kept by the cache
    before = [(b.latents, b.embeds.t5, b.embeds.pooled) for b in _batches(data, 4)]

    again = Loaders()
    data2 = again.prepare(cfg)
    assert (again.vae_calls, again.text_calls) == (0, 0)
    assert vars(data2.stats["latents"]) == {"hits": 4, "misses": 0, "recomputed": 0}
    assert vars(data2.stats["text"]) == {"hits": 6, "misses": 0, "recomputed": 0}
    after = [(b.latents, b.embeds.t5, b.embeds.pooled) for b in _batches(data2, 4)]
    for x, y in zip(before, after):
        assert all(torch.equal(a, b) for a, b in zip(x, y))


def _batches(data, n, seed=0):
    it = data.batches(seed=seed)
    return [next(it) for _ in range(n)]


def test_changed_caption_or_image_is_reencoded(tmp_path, tiny_flux_dir, dataset):
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    Loaders().prepare(cfg)

    (dataset / "tall.txt").write_text("a magenta diamond on grey")
    loaders = Loaders()
    data = loaders.prepare(cfg)
    assert (loaders.vae_calls, loaders.text_calls) == (0, 1)
    assert vars(data.stats["text"]) == {"hits": 5, "misses": 1, "recomputed": 0}
    t5, _ = data.text_entry("a magenta diamond on grey")
    assert t5.shape[0] > 1

    _image(dataset / "wide.png", (160, 96), seed=42)         # same size and name, new pixels
    loaders = Loaders()
    data = loaders.prepare(cfg)
    assert (loaders.vae_calls, loaders.text_calls) == (1, 0)
    assert vars(data.stats["latents"]) == {"hits": 3, "misses": 1, "recomputed": 0}


def test_corrupt_entries_are_reported_and_recomputed(tmp_path, tiny_flux_dir, dataset):
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    Loaders().prepare(cfg)
    cache = tmp_path / "cache"
    lat = _entries(cache, "latents")
    txt = _entries(cache, "text")
    # Copies: loaded tensors may map the file, and the corruption below rewrites files in place.
    originals = {p: ({k: v.clone() for k, v in t.items()}, m)
                 for p, (t, m) in ((p, load_safetensors(p)) for p in lat[:3] + txt[:2])}

    data = lat[0].read_bytes()
    lat[0].write_bytes(data[: len(data) // 2])                                   # truncated
    lat[1].write_bytes(b"\x00garbage" * 40)                                      # garbage
    tensors, meta = originals[lat[2]]
    save_safetensors({"latent": tensors["latent"][:, :-2]}, lat[2], meta)        # wrong shape
    tensors, meta = originals[txt[0]]
    bad = tensors["t5"].clone()
    bad[0, 0] = float("nan")
    save_safetensors({"t5": bad, "pooled": tensors["pooled"]}, txt[0], meta)     # NaN
    tensors, meta = originals[txt[1]]
    save_safetensors({"t5": tensors["t5"][:-1] if tensors["t5"].shape[0] > 1 else tensors["t5"].repeat(2, 1),
                      "pooled": tensors["pooled"]}, txt[1], meta)               # length disagrees with header
    tensors, meta = load_safetensors(txt[2])
    save_safetensors({"t5": tensors["t5"][:, :16].clone(), "pooled": tensors["pooled"]}, txt[2], meta)  # width

    loaders = Loaders()
    with pytest.warns(CacheWarning) as record:
        result = loaders.prepare(cfg)
    messages = "\n".join(str(w.message) for w in record if issubclass(w.category, CacheWarning))
    for p in lat[:3] + txt[:3]:
        assert str(p) in messages
    assert "NaN" in messages and "expected (16," in messages and "differ from the other entries" in messages
    assert len([w for w in record if issubclass(w.category, CacheWarning)]) == 2    # one per kind
    assert vars(result.stats["latents"]) == {"hits": 1, "misses": 0, "recomputed": 3}
    assert vars(result.stats["text"]) == {"hits": 3, "misses": 0, "recomputed": 3}
    for p, (tensors, _) in originals.items():
        fresh, _ = load_safetensors(p)
        assert all(torch.equal(fresh[k], tensors[k]) for k in tensors)         # recomputed to the same values


def test_bf16_storage_trimmed_t5_and_padded_batches(tmp_path, tiny_flux_dir, dataset):
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset, shuffle=False, batch_size=4)
    loaders = Loaders()
    data = loaders.prepare(cfg)
    parts = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
    enc = loaders.load_text_encoders(SimpleNamespace(**{n: tiny_flux_dir / n for n in parts}), DTYPE, "cpu")
    captions = ["a red circle on a white background", "a green triangle", ""]
    full, lengths = encode_prompts(captions, enc.tokenizer, enc.text_encoder, enc.tokenizer_2, enc.text_encoder_2,
                                   max_length=MAX_LEN)                     # t5 (3, 32, 32), padded
    expect_len = [len(enc.tokenizer_2(c).input_ids) for c in captions]    # tokens + end token
    assert lengths.tolist() == expect_len and expect_len[2] == 1
    for i, c in enumerate(captions):
        t5, pooled = data.text_entry(c)
        assert t5.dtype == pooled.dtype == torch.bfloat16
        assert t5.shape == (expect_len[i], 32)
        assert torch.equal(t5, full.t5[i, : expect_len[i]].to(torch.bfloat16))
        assert torch.equal(pooled, full.pooled[i].to(torch.bfloat16))
    for p in _entries(tmp_path / "cache", "latents"):
        assert load_safetensors(p)[0]["latent"].dtype == torch.bfloat16

    # Batches pad T5 with zeros to the longest prompt of the batch; buckets never mix.
    for batch in _batches(data, 6):
        w, h = batch.bucket
        assert batch.latents.shape == (len(batch.captions), 16, h // 8, w // 8)
        assert batch.latents.dtype == torch.float32
        longest = int(batch.t5_lengths.max())
        assert batch.embeds.t5.shape == (len(batch.captions), longest, 32)
        for i, c in enumerate(batch.captions):
            n = int(batch.t5_lengths[i])
            t5, pooled = data.text_entry(c)
            assert torch.equal(batch.embeds.t5[i, :n], t5.float())
            assert not batch.embeds.t5[i, n:].any()
            assert torch.equal(batch.embeds.pooled[i], pooled.float())


def test_cached_latents_equal_a_direct_vae_encode(tmp_path, tiny_flux_dir, dataset):
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    loaders = Loaders()
    data = loaders.prepare(cfg)
    (tall,) = [s for s in data.samples if s.item.path.name == "tall.png"]
    assert tall.bucket == (48, 80)                           # the image is exactly this bucket's size

    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_flux_dir / "vae", torch_dtype=DTYPE)
    pixels = torch.from_numpy(np.asarray(Image.open(dataset / "tall.png").convert("RGB")).copy())
    x = pixels.permute(2, 0, 1)[None].float() / 127.5 - 1.0              # (1, 3, 80, 48)
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean                          # (1, 16, 10, 6)
    direct = (mean[0] - vae.config.shift_factor) * vae.config.scaling_factor
    cached = data.latent(tall)
    assert cached.shape == (16, 10, 6)
    assert torch.equal(cached, direct.to(torch.bfloat16))
    # A cropped image (wide.png, 160x96 -> nearest bucket 80x48) still yields its bucket's latent shape.
    (wide,) = [s for s in data.samples if s.item.path.name == "wide.png"]
    assert wide.bucket == (80, 48) and data.latent(wide).shape == (16, 6, 10)


def test_resumed_batches_equal_and_dropout_uses_empty_caption(tmp_path, tiny_flux_dir, dataset):
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset, resolutions=[64, 128])
    data = Loaders().prepare(cfg)
    assert data.num_items == 8                                # every image at both resolutions
    assert {r for r in (s.resolution for s in data.samples)} == {64, 128}

    it = data.batches(seed=5)
    for _ in range(3):
        next(it)
    saved = json.loads(json.dumps(it.state_dict()))
    expected = [next(it) for _ in range(data.batches_per_epoch + 2)]
    resumed = data.batches(seed=5, state=saved)
    for a, b in zip(expected, [next(resumed) for _ in range(len(expected))]):
        assert a.bucket == b.bucket and a.captions == b.captions
        assert torch.equal(a.latents, b.latents) and torch.equal(a.embeds.t5, b.embeds.t5)

    cfg_drop, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    cfg_drop = cfg_drop.model_copy(update={"data": cfg_drop.data.model_copy(
        update={"datasets": [cfg_drop.data.datasets[0].model_copy(update={"caption_dropout": 1.0})]})})
    data = Loaders().prepare(cfg_drop)
    empty_t5, empty_pooled = data.text_entry("")
    for batch in _batches(data, 3):
        assert batch.captions == [""] * len(batch.captions)
        assert torch.equal(batch.embeds.pooled, empty_pooled.float().expand(len(batch.captions), -1))
        assert batch.embeds.t5.shape[1] == empty_t5.shape[0] == 1


def test_sample_prompts_encoded_in_the_same_pass(tmp_path, tiny_flux_dir, dataset):
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    loaders = Loaders()
    data = loaders.prepare(cfg, extra_prompts=["two shapes, a circle and a square"])
    assert loaders.text_calls == 1
    embeds = data.prompt_embeds(["a cyan cross", "two shapes, a circle and a square"])
    t5_a, pooled_a = data.text_entry("a cyan cross")
    t5_b, _ = data.text_entry("two shapes, a circle and a square")
    assert embeds.t5.shape == (2, max(t5_a.shape[0], t5_b.shape[0]), 32)
    assert torch.equal(embeds.t5[0, : t5_a.shape[0]], t5_a.float()) and torch.equal(embeds.pooled[0], pooled_a.float())
    with pytest.raises(KeyError, match="never encoded"):
        data.prompt_embeds(["never encoded"])


def test_cache_command_reports_counts(tmp_path, tiny_flux_dir, dataset, capsys):
    from leantune.commands import cache as command

    toml = tmp_path / "run.toml"
    toml.write_text(
        f'[model]\npath = "{tiny_flux_dir}"\ndtype = "fp32"\n[data]\nresolutions = [64]\nmax_text_length = {MAX_LEN}\n'
        f'cache_dir = "cache"\n[[data.datasets]]\npath = "{dataset}"\ndefault_caption = "a yellow star"\n'
        f'[sample]\nprompts = ["a cyan cross"]\n')
    loaders = Loaders()
    loaders.prepare(load_config(toml))                        # fill with the test's loaders first

    (dataset / "square.txt").unlink()                         # now uses the default caption: already cached
    parser = argparse.ArgumentParser()
    command.configure(parser)
    assert command.run(parser.parse_args([str(toml), "--set", "data.batch_size=4"])) == 0
    out = capsys.readouterr().out
    assert "latents: 4 hits, 0 misses, 0 recomputed" in out
    assert "text: 5 hits, 0 misses, 0 recomputed" in out
    assert "4 samples in 3 bucket(s), 3 batches per epoch" in out

    assert command.run(parser.parse_args([str(toml), "--set", f"model.path={tmp_path / 'nowhere'}"])) == 1
    assert f"{tmp_path / 'nowhere'}: no such file" in capsys.readouterr().err

    for p in (tmp_path / "images").rglob("*.png"):
        p.unlink()
    assert command.run(parser.parse_args([str(toml)])) == 1
    assert "no usable image" in capsys.readouterr().err


def test_default_loaders_fill_the_cache_like_the_injected_ones(tmp_path, tiny_flux_dir, dataset):
    """Without injected loaders the [model] components are loaded by flux_loading; same entries result."""
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", DTYPE, extra_prompts=sample_prompts(cfg.sample))
    assert vars(data.stats["latents"]) == {"hits": 0, "misses": 4, "recomputed": 0}
    assert vars(data.stats["text"]) == {"hits": 0, "misses": 6, "recomputed": 0}
    other = tmp_path / "other"
    cfg2 = cfg.model_copy(update={"data": cfg.data.model_copy(update={"cache_dir": str(other)})})
    reference = Loaders().prepare(cfg2)
    for kind in ("latents", "text"):
        names = [p.name for p in _entries(tmp_path / "cache", kind)]
        assert names == [p.name for p in _entries(other, kind)]
        for name in names:
            a, _ = load_safetensors(tmp_path / "cache" / kind / name)
            b, _ = load_safetensors(other / kind / name)
            assert all(torch.equal(a[k], b[k]) for k in a)
    assert reference.num_items == data.num_items


@pytest.mark.gpu
def test_cuda_pass_frees_the_encoders_and_matches_cpu(tmp_path, tiny_flux_dir, dataset):
    """On CUDA the encoders' memory is returned before training, and entries agree with a CPU pass."""
    cfg, _ = _cfg(tmp_path, tiny_flux_dir, dataset)
    # cuBLAS and cuBLASLt keep a workspace per stream from their first matmul on (32 + 1 MiB on an
    # H100, through the caching allocator): created here, so the baseline holds it.
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.ones(16, 16, device="cuda", dtype=dtype)
        torch.nn.functional.linear(x, x, x[0])
        x @ x
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    gpu = Loaders().prepare_on("cuda", cfg)
    assert torch.cuda.memory_allocated() == baseline
    other = cfg.model_copy(update={"data": cfg.data.model_copy(update={"cache_dir": str(tmp_path / "cpu")})})
    cpu = Loaders().prepare(other)
    for s in cpu.samples:
        torch.testing.assert_close(gpu.latent(s).float(), cpu.latent(s).float(), atol=2e-2, rtol=2e-2)
