"""Wan image-to-video (wan/i2v.py) on a tiny Wan 2.2 I2V-A14B built offline from diffusers' classes
(two 36-channel experts, boundary_ratio 0.9, no image encoder), against WanImageToVideoPipeline:

- the first-frame condition (mask + latents of [first frame, zeros...]) equals the pipeline's
  `prepare_latents` condition, and a mask laid out otherwise than the pipeline's is told apart;
- `leantune sample --reference FIRST.png --frames 5` writes the pipeline's videos bit for bit
  (fp32), with and without a LoRA;
- the caching phase stores each clip's condition from its own first frame, in an entry keyed apart
  from the clip's latents (and from a text-to-video run's entries), and the training forward feeds
  the transformer [noisy latents, condition] as the pipeline's denoising step does;
- a missing or unreadable first-frame image is an error naming the file; an image-to-video model
  without one, and a text-to-video one given one, say so.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from leantune.models.family import get_family
from leantune.tiny.wan import (SECOND_EXPERT_SEED, save_wan_folder, wan_scheduler, wan_text_encoder,
                               wan_tokenizer, wan_transformer, wan_vae)

FAM = get_family("wan2.2")
SIDE, HEIGHT, FRAMES, SEED = 64, 48, 5, 7
I2V_BOUNDARY = 0.9           # Wan 2.2 I2V-A14B's model_index.json
PROMPTS = ["a square moving right"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(autouse=True)
def _prompt_clean_without_ftfy(monkeypatch):
    """diffusers 0.42's pipeline_wan_i2v calls ftfy.fix_text whether or not ftfy is installed (its
    pipeline_wan guards it with is_ftfy_available); without ftfy here, the i2v pipeline takes
    pipeline_wan's prompt_clean, the same cleaning with that guard (what leantune's wan/text.py uses)."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)


def i2v_pipeline(seed: int = 0, experts: int = 2):
    """WanImageToVideoPipeline with two tiny 36-channel experts (16 noisy + 4 mask + 16 condition
    channels) and no image encoder, as Wan 2.2 I2V-A14B's folder is (experts=1: one transformer,
    every noise level its own)."""
    from diffusers import WanImageToVideoPipeline

    tok = wan_tokenizer()
    two = experts == 2
    return WanImageToVideoPipeline(
        tokenizer=tok, text_encoder=wan_text_encoder(tok, seed + 1), vae=wan_vae(seed), scheduler=wan_scheduler(),
        transformer=wan_transformer(seed, in_channels=36, out_channels=16),
        transformer_2=wan_transformer(seed + SECOND_EXPERT_SEED, in_channels=36, out_channels=16) if two else None,
        boundary_ratio=I2V_BOUNDARY if two else None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A one-transformer image-to-video folder (leantune sample runs one expert of a two-expert one)."""
    path = tmp_path_factory.mktemp("wan-i2v") / "folder"
    i2v_pipeline(experts=1).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def two_experts(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan-i2v2") / "folder"
    i2v_pipeline().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def t2v_folder(tmp_path_factory):
    return save_wan_folder(tmp_path_factory.mktemp("wan-t2v") / "folder", experts=1)


def _first_frame_image(side=SIDE, height=HEIGHT):
    """A first frame unlike noise: a bright square on a flat colour (not of the sample's size, so the
    pipeline's resize is part of what is compared)."""
    from PIL import Image

    img = np.full((height + 16, side + 8, 3), (30, 60, 200), np.uint8)
    img[10:34, 12:40] = 250
    return Image.fromarray(img)


@pytest.fixture(scope="module")
def first_png(tmp_path_factory):
    path = tmp_path_factory.mktemp("first") / "first.png"
    _first_frame_image().save(path)
    return path


def _sources(folder):
    from leantune.config import ModelConfig

    return FAM.resolve_sources(ModelConfig(path=str(folder), family="wan2.2", dtype="fp32"), folder)


# -- the condition --------------------------------------------------------------------------------

def test_the_condition_is_the_pipelines_and_a_wrong_mask_layout_is_told_apart(folder, first_png):
    """sampling_condition's (1, 20, T', h, w) equals WanImageToVideoPipeline.prepare_latents'
    condition for the same image, size and length; the mask's temporal packing is the pipeline's
    (the first frame's 1 repeated 4 times, then 4 pixel frames per latent frame on the channels):
    packing the per-frame mask without that repeat, or on the other axis, differs from it."""
    from PIL import Image

    from leantune.models.wan import i2v

    pipe = i2v_pipeline()
    image = Image.open(first_png).convert("RGB")
    for frames in (1, 5, 9):
        pixels = pipe.video_processor.preprocess(image, height=HEIGHT, width=SIDE).to(torch.float32)
        _, want = pipe.prepare_latents(pixels, 1, 16, HEIGHT, SIDE, frames, torch.float32, "cpu",
                                       torch.Generator().manual_seed(0))
        (got,) = i2v.sampling_condition(pipe.vae, [image], width=SIDE, height=HEIGHT, frames=frames)
        assert got.shape == want.shape == (1, 20, 1 + (frames - 1) // 4, HEIGHT // 8, SIDE // 8)
        assert torch.equal(got, want)
        assert got[:, 4:].abs().sum() > 0 and (frames == 1 or got[:, 4:, 1:].abs().sum() > 0)   # zeros are not 0
    mask = i2v.first_frame_mask(9, 6, 8)
    assert torch.equal(mask, want[:, :4]) and mask[0, :, 0].eq(1).all() and mask[0, :, 1:].eq(0).all()
    # the same 9 per-frame values packed another way: no first-frame repeat (frame 0 alone as
    # latent frame 0, padded), and frames -> channels without the transpose
    flat = torch.zeros(1, 1, 9, 6, 8)
    flat[:, :, 0] = 1
    no_repeat = torch.cat([flat, torch.zeros(1, 1, 3, 6, 8)], 2).view(1, 3, 4, 6, 8).transpose(1, 2)
    no_transpose = torch.cat([flat[:, :, :1].repeat(1, 1, 4, 1, 1), flat[:, :, 1:]], 2).view(1, 4, 3, 6, 8)
    for wrong in (no_repeat, no_transpose):
        assert wrong.shape == mask.shape and not torch.equal(wrong, want[:, :4])


def test_the_forward_concatenates_the_condition_as_the_pipeline_and_refuses_a_missing_one():
    """predict feeds [noisy (16), condition (20)] on the channels, the condition broadcast over the
    batch; an image-to-video transformer without a condition, and a text-to-video one with one,
    are refused naming the channels."""
    transformer = wan_transformer(0, in_channels=36, out_channels=16)
    seen = []
    transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"]), with_kwargs=True)
    noisy, cond = torch.randn(2, 16, 2, 6, 8), torch.randn(1, 20, 2, 6, 8)
    embeds = type("E", (), {"t5": torch.randn(2, 7, 32)})()
    out = FAM.predict(transformer, noisy, torch.tensor([0.95, 0.95]), embeds, (6, 8), references=[cond])
    assert out.shape == noisy.shape
    assert torch.equal(seen[0], torch.cat([noisy, cond.expand(2, -1, -1, -1, -1)], dim=1))
    with pytest.raises(ValueError, match=r"image-to-video model \(36 input channels\).*first-frame image"):
        FAM.predict(transformer, noisy, torch.tensor([0.5, 0.5]), embeds, (6, 8))
    with pytest.raises(ValueError, match=r"20 channels for a Wan transformer of 16 input channels"):
        FAM.predict(wan_transformer(0), noisy, torch.tensor([0.5, 0.5]), embeds, (6, 8), references=[cond])


# -- sampling -------------------------------------------------------------------------------------

def _sample(folder, out, *flags) -> int:
    from leantune.cli import main

    return main(["sample", "--model", str(folder), "--family", "wan2.2", "--prompt", PROMPTS[0], "--width",
                 str(SIDE), "--height", str(HEIGHT), "--steps", "3", "--guidance", "5.0", "--seed", str(SEED),
                 "--device", "cpu", "--out", str(out), "--set", "model.dtype=fp32",
                 "--set", "max_text_length=32", *flags])


def _aligned(pipe) -> None:
    """Every weight copied to fresh memory (from_pretrained leaves them at unaligned mmap offsets,
    which the CPU's kernels round differently; leantune's loader copies them): test_wan_sample_video.py."""
    with torch.no_grad():
        for name in ("transformer", "transformer_2", "vae", "text_encoder"):
            for p in getattr(pipe, name).parameters() if getattr(pipe, name) is not None else ():
                p.data = p.data.clone()


def _lora_file(folder, path):
    """A rank-2 LoRA of the high-noise expert's attention (non-zero up weights), in diffusers' names."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    sd = {}
    for b in range(2):
        for proj in ("to_q", "to_v"):
            stem = f"transformer.blocks.{b}.attn1.{proj}"
            sd[f"{stem}.lora_A.weight"] = torch.randn(2, 32, generator=g) * 0.3
            sd[f"{stem}.lora_B.weight"] = torch.randn(32, 2, generator=g) * 0.3
    save_file(sd, str(path))
    return path


def test_sample_with_a_first_frame_writes_the_pipelines_videos(folder, first_png, tmp_path, monkeypatch, capsys):
    """cfg 5, 5 frames of 64x48 from a 72x64 first frame: the frames handed to the writer are
    WanImageToVideoPipeline's bit for bit, with a LoRA too."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from leantune.infer import video

    written = []
    save_video = video.save_video
    monkeypatch.setattr(video, "save_video", lambda frames, path, fps: written.append(frames.copy()) or
                        save_video(frames, path, fps))
    lora = _lora_file(folder, tmp_path / "lora.safetensors")
    assert _sample(folder, tmp_path / "out", "--frames", str(FRAMES), "--reference", str(first_png)) == 0
    assert _sample(folder, tmp_path / "out", "--frames", str(FRAMES), "--reference", str(first_png),
                   "--lora", str(lora)) == 0
    assert [p.rsplit("/", 1)[-1] for p in capsys.readouterr().out.split()] == [f"00000-{SEED}.mp4",
                                                                               f"00001-{SEED}.mp4"]
    image = Image.open(first_png).convert("RGB")
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    _aligned(pipe)
    wants = []
    for with_lora in (False, True):
        if with_lora:
            pipe.load_lora_weights(str(lora))
        out = pipe(image=image, prompt=PROMPTS[0], negative_prompt="", height=HEIGHT, width=SIDE, num_frames=FRAMES,
                   num_inference_steps=3, guidance_scale=5.0, max_sequence_length=32,
                   generator=torch.Generator().manual_seed(SEED), output_type="np").frames[0]
        wants.append((out * 255).round().astype(np.uint8))             # diffusers' numpy_to_pil rounding
    for got, want in zip(written, wants):
        assert got.shape == want.shape == (FRAMES, HEIGHT, SIDE, 3)
        assert np.array_equal(got, want), np.abs(got.astype(int) - want.astype(int)).max()
    assert not np.array_equal(wants[0], wants[1])                       # the LoRA changes the video


def test_a_bad_or_missing_first_frame_is_an_error_naming_it(folder, t2v_folder, first_png, tmp_path, capsys):
    """A missing file and an unreadable one are named; an image-to-video model without a first frame
    and a text-to-video one given one say so; nothing is written."""
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not a png")
    gone = re.escape(str(tmp_path))
    cases = [((folder, "--reference", str(tmp_path / "gone.png")), rf"references: {gone}/gone\.png: "
              r"no such image file"),
             ((folder, "--reference", str(bad)), r"references: .*broken\.png: not a readable image"),
             ((folder,), r"references: .*folder/transformer is an image-to-video model: every video starts from a "
              r"first-frame image"),
             ((t2v_folder, "--reference", str(first_png)), r"references: .* is a text-to-video model; it takes no "
              r"first-frame image")]
    for (model, *flags), said in cases:
        assert _sample(model, tmp_path / "none", "--frames", str(FRAMES), *flags) == 2, said
        assert re.search(said, capsys.readouterr().err), said
    assert not (tmp_path / "none").exists()


def test_both_experts_sample_the_pipelines_latents(two_experts, first_png):
    """The staged sampler on both experts (wan.load_experts, switching at I2V-A14B's 0.9) with the
    first frame's condition: WanImageToVideoPipeline's latents bit for bit (fp32, cfg, 5 frames),
    each step on the pipeline's expert."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.references import reference_latents
    from leantune.infer.sampler import denoise
    from leantune.models.wan import load_experts
    from leantune.models.wan.experts import WanExperts

    src = _sources(two_experts)
    assert FAM.references.takes_first_frame(src)
    experts = load_experts(src, torch.float32).requires_grad_(False)
    assert isinstance(experts, WanExperts) and experts.boundary_ratio == I2V_BOUNDARY
    vae = FAM.load_vae(src, torch.float32, "cpu")
    encoders = FAM.load_text_encoders(src, torch.float32, "cpu")
    pipe = WanImageToVideoPipeline.from_pretrained(str(two_experts), local_files_only=True)
    pipe = type(pipe)(**{**pipe.components, "transformer": experts.high, "transformer_2": experts.low,
                         "vae": vae.vae, "text_encoder": encoders.text_encoder}, boundary_ratio=I2V_BOUNDARY)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    for name, m in (("high", experts.high), ("low", experts.low)):
        m.register_forward_pre_hook(lambda mod, a, kw, name=name: calls.append(name), with_kwargs=True)
    image = Image.open(first_png).convert("RGB")
    steps = 4
    want = pipe(image=image, prompt=PROMPTS[0], negative_prompt="", height=HEIGHT, width=SIDE, num_frames=FRAMES,
                num_inference_steps=steps, guidance_scale=5.0, max_sequence_length=32,
                generator=torch.Generator().manual_seed(SEED), output_type="latent").frames
    pipe_calls, calls[:] = list(calls), []
    assert "high" in pipe_calls and "low" in pipe_calls
    cond, uncond = encode_prompts_stage(encoders, PROMPTS, max_length=32, device="cpu", family=FAM,
                                        negative_prompts=[""])
    refs = reference_latents(vae, [image], FAM, width=SIDE, height=HEIGHT, frames=FRAMES)
    schedule = FAM.sampling.schedule(FAM.sampling.variant(experts), two_experts)
    got = denoise(experts, cond, [SEED], width=SIDE, height=HEIGHT, steps=steps, guidance=5.0, schedule=schedule,
                  device="cpu", family=FAM, negative=uncond, cfg_batched=False, references=refs, frames=FRAMES)
    assert calls == pipe_calls
    assert got.shape == want.shape == (1, 16, 2, HEIGHT // 8, SIDE // 8)
    assert torch.equal(got, want), (got - want).abs().max()


# -- training ---------------------------------------------------------------------------------------

CLIP_FRAMES, FPS = 9, 16                 # 9 frames -> 3 latent frames of 8 x 8



@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """data/: two captioned clips and a captioned still image (tests/moving_square_clips.py)."""
    from moving_square_clips import write_media

    return write_media(tmp_path_factory.mktemp("media") / "data", CLIP_FRAMES, FPS, SIDE)


def _config(tmp_path, folder, media, name: str, extra: str = ""):
    from leantune.config import load_config

    from moving_square_clips import wan_run

    return load_config(wan_run(tmp_path / f"{name}.toml", family="wan2.2", folder=folder, media=media,
                               cache=tmp_path / "cache", out=tmp_path / name, name="i2v", target_fps=16,
                               extra=extra))


def _prepare(cfg, **kw):
    from leantune.data import cache

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = cache.prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32, **kw)
    return data, [str(w.message) for w in caught]


def test_clip_conditions_are_cached_keyed_apart_and_fed_to_the_forward(tmp_path, folder, t2v_folder, media):
    """An image-to-video run caches each clip's condition from the clip's own first frame (the
    pipeline's prepare_latents of that frame at the clip's length), as an entry of its own kind;
    the still is skipped by name; a text-to-video run over the same clips (one cache folder) has
    no such entry and its batches no condition. The trainer's forward feeds the transformer
    [noisy latents, condition] as the pipeline's denoising step does."""
    from types import SimpleNamespace

    from leantune.data import cache
    from leantune.data.video_vae import iter_clip_frames
    from leantune.trainer import forward_backward

    t2v, _ = _prepare(_config(tmp_path, t2v_folder, media, "t2v"))
    assert all(not s.reference_keys for s in t2v.samples) and "first_frames" not in t2v.stats
    cfg = _config(tmp_path, folder, media, "i2v")
    data, said = _prepare(cfg)
    assert any(re.search(r"image-to-video.*1 still image\(s\) skipped: .*still\.png", w) for w in said), said
    clips = data.samples
    assert len(clips) == 2 and all(isinstance(s, cache.ClipSample) and len(s.reference_keys) == 1 for s in clips)
    assert data.stats["first_frames"].misses == 2
    # the conditions' keys are none of the clips' latent entries (the t2v run's included)
    assert not {s.reference_keys[0] for s in clips} & {s.latent_key for s in clips + t2v.samples}

    pipe = i2v_pipeline(experts=1)
    for s in clips:
        entry = data.latent_entry(s.reference_keys[0])
        first = next(iter_clip_frames(s.item.path, target_fps=FPS, num_frames=1, size=(SIDE, SIDE)))
        # the frame the clip's own latent entry starts from (its 9-frame window's first)
        assert torch.equal(first, next(iter_clip_frames(s.item.path, target_fps=FPS, num_frames=CLIP_FRAMES,
                                                        size=(SIDE, SIDE))))
        _, want = pipe.prepare_latents(first[None], 1, 16, SIDE, SIDE, CLIP_FRAMES, torch.float32, "cpu",
                                       torch.Generator().manual_seed(0))
        assert entry.shape == (20, 3, 8, 8) and entry.dtype == cache.STORE_DTYPE
        assert torch.equal(entry, want[0].to(cache.STORE_DTYPE))
    again, _ = _prepare(cfg)
    assert (again.stats["first_frames"].hits, again.stats["first_frames"].misses) == (2, 0)

    batch = next(data.batches(seed=0))
    assert batch.latents.shape == (2, 16, 3, 8, 8) and batch.references[0].shape == (2, 20, 3, 8, 8)
    transformer = FAM.load_transformer(_sources(folder), torch.float32)
    seen = []
    transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].detach()), with_kwargs=True)
    t = SimpleNamespace(device=torch.device("cpu"), generator=torch.Generator().manual_seed(0),
                        sources=_sources(folder), transformer=transformer, dtype=torch.float32, mode=None,
                        last_bucket=None)
    loss = forward_backward(t, cfg, batch)
    assert np.isfinite(loss) and seen[0].shape == (2, 36, 3, 8, 8)
    assert torch.equal(seen[0][:, 16:], batch.references[0].float())   # the condition after the noisy latents
    assert not torch.equal(seen[0][:, :16], batch.latents)              # the noisy latents first


def test_an_i2v_run_samples_from_its_first_frame_and_needs_one(tmp_path, folder, media, first_png):
    """Two LoRA steps and a 5-frame sample during training from [sample] references' first frame
    (cached as the condition at the samples' width x height x frames); an image-to-video run over
    still images alone, and one that samples without a first frame, are refused by name."""
    from leantune.data.dataset import DataError
    from leantune.models.wan import i2v
    from leantune.trainer import train
    from PIL import Image

    stills = tmp_path / "stills"
    stills.mkdir()
    (stills / "still.png").write_bytes((media / "still.png").read_bytes())
    with pytest.raises(DataError, match=r"image-to-video model trains on clips.*hold none \(only still images: "
                                        r".*still\.png\)"):
        _prepare(_config(tmp_path, folder, stills, "stills"))
    with pytest.raises(DataError, match=r"\[sample\] references: .* is an image-to-video model"):
        _prepare(_config(tmp_path, folder, media, "no-first", '\n[sample]\nprompts = ["a square"]\n'),
                 sample_references=[], sample_shape=(SIDE, HEIGHT, FRAMES))
    extra = (f'\n[sample]\nevery = 2\nsteps = 2\nguidance = 4.0\nwidth = {SIDE}\nheight = {HEIGHT}\nframes = {FRAMES}\n'
             f'prompts = ["a square"]\nreferences = ["{first_png}"]\n')
    cfg = _config(tmp_path, folder, media, "sampled", extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(cfg, progress=False)
    (mp4,) = result.sample_files
    assert mp4.suffix == ".mp4" and mp4.is_file()
    data, _ = _prepare(cfg, sample_references=[str(first_png)], sample_shape=(SIDE, HEIGHT, FRAMES))
    (cond,) = data.sample_reference_latents()
    vae = FAM.load_vae(_sources(folder), torch.float32, "cpu")
    (want,) = i2v.sampling_condition(vae, [Image.open(first_png).convert("RGB")], width=SIDE, height=HEIGHT,
                                     frames=FRAMES)
    assert torch.equal(cond, want.to(cond.dtype))


def test_which_models_take_a_first_frame(tmp_path, folder, two_experts, t2v_folder):
    """The i2v folders (model_index WanImageToVideoPipeline, 36 input channels) and a single 36-channel
    file in Wan-AI's names take a first frame, the file's experts switching at I2V-A14B's 0.9; a
    text-to-video folder does not; Wan 2.1 FLF2V's two-frame image embedding is refused by name (Wan
    2.1 I2V's one-frame embedding: tests/test_wan21_i2v.py)."""
    from pathlib import Path

    from safetensors.torch import save_file

    from leantune.models.wan.keys import diffusers_to_native, native_metadata
    from leantune.models.wan.loading import WanSources, boundary_ratio, check_text_to_video
    from leantune.models.weights import LoadError

    takes = FAM.references.takes_first_frame
    assert takes(_sources(folder)) and takes(_sources(two_experts))
    assert not takes(_sources(t2v_folder))
    model = wan_transformer(0, in_channels=36, out_channels=16)
    path = tmp_path / "wan2.2_i2v_high_noise_14B.safetensors"
    save_file(diffusers_to_native(model.state_dict()), str(path), metadata=native_metadata(model))
    src = WanSources(transformer=path, transformer_2=None, text_encoder=None, tokenizer=None, vae=None)
    assert takes(src) and boundary_ratio(src) == I2V_BOUNDARY
    assert FAM.load_transformer(src, torch.float32).config.in_channels == 36
    check_text_to_video({"in_channels": 36, "out_channels": 16, "image_dim": 1280}, Path("x.json"))
    with pytest.raises(LoadError, match=r"x\.json: a Wan first-last-frame transformer \(Wan 2\.1 FLF2V"):
        check_text_to_video({"in_channels": 36, "out_channels": 16, "image_dim": 1280, "pos_embed_seq_len": 514},
                            Path("x.json"))
