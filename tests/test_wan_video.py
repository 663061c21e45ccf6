"""Wan 2.2 trained on clips end to end: a folder of short mp4 clips (written with data/video_write.py)
and a still image, with same-stem captions, through prepare_caches and the trainer on the tiny Wan.
Clips are cached through the causal VAE as (16, T', h, w) entries and batched per clip bucket as
(B, 16, T', h, w); the still image is a one-frame clip (B, 16, h, w) packed to T' = 1; the
flow-matching loss runs over every frame; a LoRA lowers the loss of a fixed clip batch; a run
stopped and resumed equals the uninterrupted one bit for bit."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from moving_square_clips import moving_square, wan_run, write_media
from safetensors.torch import load_file

from leantune.config import load_config
from leantune.data import cache, video_vae
from leantune.models.family import get_family
from leantune.tiny.wan import save_wan_folder

FAM = get_family("wan2.2")
SIDE, FRAMES, FPS = 64, 9, 16            # 9 frames -> 3 latent frames of 8 x 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A one-transformer tiny Wan (Wan 2.1's layout: every noise level is the one model's)."""
    return save_wan_folder(tmp_path_factory.mktemp("wan") / "folder", experts=1)


def _frames(kind: int) -> np.ndarray:
    """FRAMES frames of a square that moves (kind 0: right, kind 1: down) over a flat colour."""
    return moving_square(kind, FRAMES, SIDE)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """data/: two captioned clips and a captioned still image."""
    return write_media(tmp_path_factory.mktemp("media") / "data", FRAMES, FPS, SIDE)




def _config(tmp_path, folder, media, out: str, steps: int = 4, lr: float = 1e-3, save_every: int = 2):
    return load_config(wan_run(tmp_path / f"{out}.toml", family="wan2.2", folder=folder, media=media,
                               cache=tmp_path / "cache", out=tmp_path / out, name="clips", steps=steps, lr=lr,
                               save_every=save_every, target_fps=16))


def _prepare(cfg):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cache.prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32)


def test_clips_and_a_still_are_cached_and_batched_by_bucket(tmp_path, folder, media):
    """Each clip's entry is the streamed causal VAE's latents of its 9 frames (16, 3, 8, 8); a batch
    holds one bucket: the clips' (64, 64, 9) as (2, 16, 3, 8, 8), the still's (64, 64) as (1, 16, 8, 8),
    which the family packs to one frame. A second pass reuses every entry."""
    cfg = _config(tmp_path, folder, media, "cache-run")
    data = _prepare(cfg)
    assert data.stats["clips"].misses == 2 and data.stats["latents"].misses == 1
    clips = [s for s in data.samples if isinstance(s, cache.ClipSample)]
    assert len(clips) == 2 and len(data.samples) == 3 and {s.bucket for s in clips} == {(SIDE, SIDE, FRAMES)}
    vae = FAM.video.load_vae(FAM.resolve_sources(cfg.model, cfg.base_dir), torch.float32, "cpu")
    for s in clips:
        want = video_vae.encode_clip(vae, s.item.path, target_fps=FPS, num_frames=FRAMES, size=(SIDE, SIDE))
        assert torch.equal(data.latent(s), want.to(cache.STORE_DTYPE))
    it = data.batches(seed=0)
    shapes = {tuple(b.bucket): tuple(b.latents.shape) for b in (next(it) for _ in range(4))}
    assert shapes == {(SIDE, SIDE, FRAMES): (2, 16, 3, 8, 8), (SIDE, SIDE): (1, 16, 8, 8)}
    assert FAM.pack_latents(torch.zeros(1, 16, 8, 8)).shape == (1, 16, 1, 8, 8)
    again = _prepare(cfg)
    assert (again.stats["clips"].hits, again.stats["clips"].misses, again.stats["latents"].hits) == (2, 0, 1)


def _fixed_loss(folder, lora_file, latents, embeds, sigmas=(0.3, 0.6, 0.9)) -> float:
    """The flow-matching loss of one clip batch at fixed noise and noise levels, through the tiny
    Wan transformer loaded as WanPipeline loads it, with the LoRA file (or none)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    if lora_file is not None:
        pipe.load_lora_weights(str(lora_file))
    model = pipe.transformer.eval()
    g = torch.Generator().manual_seed(11)
    total = 0.0
    with torch.no_grad():
        for level in sigmas:
            noise = torch.randn(latents.shape, generator=g)
            sigma = torch.full((latents.shape[0],), level)
            noisy = (1 - level) * latents + level * noise
            pred = FAM.predict(model, noisy, sigma, embeds, latents.shape[-2:])
            total += float(((pred - (noise - latents)) ** 2).mean())
    return total / len(sigmas)


def test_a_clip_lora_trains_over_every_frame_and_lowers_the_loss(tmp_path, folder, media, monkeypatch):
    """The trainer's steps noise (B, 16, 3, 8, 8) clip batches (and the still as one frame) and
    predict every frame; the LoRA it saves loads into WanPipeline and lowers the loss of the clips
    at fixed noise levels and noise."""
    from leantune.train import flow_matching as fm
    from leantune.trainer import train

    seen = []
    add_noise = fm.add_noise
    monkeypatch.setattr(fm, "add_noise", lambda x0, noise, sigma: seen.append(tuple(x0.shape)) or
                        add_noise(x0, noise, sigma))
    cfg = _config(tmp_path, folder, media, "lowers", steps=12, lr=1e-2, save_every=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(cfg, progress=False)
    assert result.final_step == 12 and all(np.isfinite(result.losses))
    assert (2, 16, 3, 8, 8) in seen and (1, 16, 8, 8) in seen and set(seen) == {(2, 16, 3, 8, 8), (1, 16, 8, 8)}
    data = _prepare(cfg)
    clips = [s for s in data.samples if isinstance(s, cache.ClipSample)]
    latents = torch.stack([data.latent(s) for s in clips]).float()                    # (2, 16, 3, 8, 8)
    embeds = data.prompt_embeds([s.item.caption for s in clips])
    before = _fixed_loss(folder, None, latents, embeds)
    after = _fixed_loss(folder, result.paths.lora_file("diffusers"), latents, embeds)
    assert after < 0.9 * before, (before, after)


def test_a_stopped_and_resumed_clip_run_equals_the_uninterrupted_run(tmp_path, folder, media):
    """4 steps straight (saving at 2) == 2 steps, stop, resume, 2 steps: the same losses and the same
    LoRA file, bit for bit (clip and image batches in the seeded order, noise over every frame)."""
    from leantune.trainer import train

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        straight = train(_config(tmp_path, folder, media, "straight"), progress=False)
        parts = _config(tmp_path, folder, media, "parts")
        assert train(parts, stop_after=2, progress=False).final_step == 2
        resumed = train(parts, resume=True, progress=False)
    assert resumed.final_step == 4 and resumed.losses == straight.losses and len(set(straight.losses)) == 4
    a = load_file(str(straight.paths.lora_file("diffusers")))
    b = load_file(str(resumed.paths.lora_file("diffusers")))
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- samples as videos ---------------------------------------------------------------------------------

PROMPTS, SAMPLE_SEED, SAMPLE_FRAMES = ["a square moving right", "a red square"], 3, 5


@pytest.fixture(scope="module")
def experts_folder(tmp_path_factory):
    """The tiny Wan 2.2 A14B layout: both experts and the boundary."""
    return save_wan_folder(tmp_path_factory.mktemp("wan2") / "folder")


def test_sampled_videos_are_wanpipelines_frames_bit_for_bit(experts_folder, tmp_path):
    """sample_during_training on both experts (the trainer's path: the memory handle's forward-only
    mode aside) draws 5-frame videos (2 latent frames) equal to WanPipeline's on the two-expert
    folder bit for bit in fp32: the same latents, the same uint8 frames (diffusers' rounding) for
    each prompt with its seed (one video per call, as the pipeline given one prompt), classifier-free
    guidance (the halves apart, as the pipeline runs them), steps across the boundary; the grid tiles
    the prompts' videos frame by frame; the mp4 and webp hold those frames."""
    from types import SimpleNamespace

    from diffusers import WanPipeline

    from leantune.config import ModelConfig
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import sample_during_training
    from leantune.infer.video import save_video
    from leantune.models.wan import load_experts

    src = FAM.resolve_sources(ModelConfig(path=str(experts_folder), family="wan2.2"), tmp_path)
    experts = load_experts(src, torch.float32).requires_grad_(False)
    vae = FAM.video.load_vae(src, torch.float32, "cpu").requires_grad_(False)
    encoders = FAM.load_text_encoders(src, torch.float32, "cpu")
    cond, uncond = encode_prompts_stage(encoders, PROMPTS, max_length=32, device="cpu", family=FAM,
                                        negative_prompts=[""])
    schedule = FAM.sampling.schedule(FAM.sampling.variant(experts), experts_folder)
    sample_cfg = SimpleNamespace(seed=SAMPLE_SEED, steps=4, guidance=5.0, width=SIDE, height=48)
    grid = sample_during_training(experts, vae, cond, sample_cfg, device="cpu", dtype=torch.float32,
                                  schedule=schedule, negative=uncond, family=FAM, frames=SAMPLE_FRAMES)
    assert grid.dtype == np.uint8 and grid.shape == (SAMPLE_FRAMES, 48, 2 * SIDE, 3)

    pipe = WanPipeline.from_pretrained(str(experts_folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe = type(pipe)(**{**pipe.components, "transformer": experts.high, "transformer_2": experts.low, "vae": vae},
                      boundary_ratio=pipe.config.boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    for i, prompt in enumerate(PROMPTS):
        out = pipe(prompt=prompt, negative_prompt="", height=48, width=SIDE, num_frames=SAMPLE_FRAMES,
                   num_inference_steps=4, guidance_scale=5.0, max_sequence_length=32,
                   generator=torch.Generator().manual_seed(SAMPLE_SEED + i), output_type="np").frames[0]
        want = (out * 255).round().astype(np.uint8)          # diffusers' numpy_to_pil rounding
        got = grid[:, :, i * SIDE:(i + 1) * SIDE]
        assert want.shape == got.shape == (SAMPLE_FRAMES, 48, SIDE, 3)
        assert np.array_equal(got, want), np.abs(got.astype(int) - want.astype(int)).max()
    assert not np.array_equal(grid[:, :, :SIDE], grid[:, :, SIDE:])     # two prompts, two videos
    assert not np.array_equal(grid[0], grid[-1])                        # frames differ: a video, not a still

    import av
    from PIL import Image

    mp4, webp = save_video(grid, tmp_path / "s.mp4", 16)
    with av.open(str(mp4)) as c:
        back = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    assert back.shape == grid.shape and np.abs(back.astype(int) - grid.astype(int)).mean() < 12
    with Image.open(webp) as im:
        assert im.n_frames == SAMPLE_FRAMES


def test_a_video_run_samples_mp4_and_webp_and_tensorboard_frames(tmp_path, folder, media):
    """[sample] every / frames = 5 in a clip run: each sample step writes samples/step-N.mp4 (the two
    prompts' videos side by side, 5 frames) and its webp preview, and TensorBoard's `samples` image
    is the contact sheet of those frames (the mp4's first frame as its first tile, up to codec loss)."""
    import av
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from leantune.trainer import train

    sample = ('\n[sample]\nevery = 2\nsteps = 2\nguidance = 4.0\nwidth = 64\nheight = 48\nframes = 5\n'
              + f"prompts = {PROMPTS!r}\n".replace("'", '"'))
    wan_run(tmp_path / "sampled.toml", family="wan2.2", folder=folder, media=media, cache=tmp_path / "cache",
            out=tmp_path / "sampled", name="clips", steps=2, save_every=0, target_fps=16, extra=sample)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(load_config(tmp_path / "sampled.toml"), progress=False)
    (mp4,) = result.sample_files
    assert mp4.name == "step-000002.mp4" and mp4.with_suffix(".webp").is_file()
    with av.open(str(mp4)) as c:
        back = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
    assert back.shape == (SAMPLE_FRAMES, 48, 2 * SIDE, 3)
    with Image.open(mp4.with_suffix(".webp")) as im:
        assert im.n_frames == SAMPLE_FRAMES and im.size == (2 * SIDE, 48)
    events = EventAccumulator(str(result.paths.tensorboard), size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("samples")
    assert image.step == 2 and (image.width, image.height) == (SAMPLE_FRAMES * 2 * SIDE, 48)
    import io

    sheet = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
    assert np.abs(sheet[:, :2 * SIDE].astype(int) - back[0].astype(int)).mean() < 12


def test_sample_frames_follow_the_config_and_are_checked():
    """Unset: [data] max_frames for a video family; a length the VAE cannot decode, or frames for an
    image family, is an error naming [sample] frames."""
    from types import SimpleNamespace

    from leantune.trainer import sample_frames

    def cfg(frames, max_frames=9):
        return SimpleNamespace(sample=SimpleNamespace(frames=frames), data=SimpleNamespace(max_frames=max_frames))

    assert sample_frames(cfg(None), FAM) == 9 and sample_frames(cfg(17), FAM) == 17 and sample_frames(cfg(1), FAM) == 1
    with pytest.raises(ValueError, match=r"\[sample\] frames = 6: 6 frames is not a length.*1 \+ 4k"):
        sample_frames(cfg(6), FAM)
    flux = get_family("flux")
    assert sample_frames(cfg(None), flux) == 1
    with pytest.raises(ValueError, match=r'\[sample\] frames = 5: family = "flux" samples images'):
        sample_frames(cfg(5), flux)


# -- leantune plan --frames ------------------------------------------------------------------------------

def test_plan_prices_frames_as_latent_frames_times_patches(tmp_path, folder, media, capsys):
    """`leantune plan RUN --frames N --resolution HxW` (no weights read): the workload's tokens are
    latent frames x patches (9 frames, the run's own max_frames: 3 latent frames of 4 x 6 patches at
    64x96; --frames 17: 5; --frames 1: an image), and the priced
    activations grow with the frames; an image model or a length the VAE cannot encode is refused
    naming --frames."""
    import json

    from leantune.cli import main
    from leantune.planner.workload import Workload

    toml = tmp_path / "plan.toml"
    wan_run(toml, family="wan2.2", folder=folder, media=media, cache=tmp_path / "cache", out=tmp_path / "o",
            name="clips", steps=1, save_every=0, target_fps=16)

    def plan(*flags):
        assert main(["plan", str(toml), "--vram", "8GiB", "--json", "--no-fp8", "--resolution", "64x96", *flags]) == 0
        out = json.loads(capsys.readouterr().out)
        (entry,) = out["plans"]
        return out["workload"], entry["plan"]["notes"]["per_bucket"]["64x96"]["activations"]

    image, image_act = plan("--frames", "1")
    clip, clip_act = plan()                  # the run's own: its clips' [data] max_frames = 9
    longer, longer_act = plan("--frames", "17")
    assert "latent frames" not in image and "96x64 x 3 latent frames" in clip and "x 5 latent frames" in longer
    assert Workload(buckets=((64, 96),), frames=3).image_tokens((64, 96)) == 3 * 4 * 6
    assert 2 * image_act < clip_act < longer_act     # three frames' tokens: well over twice one frame's
    assert main(["plan", str(toml), "--vram", "8GiB", "--frames", "8"]) == 2
    assert "--frames 8: 8 frames is not a length this VAE encodes: 1 + 4k" in capsys.readouterr().err
    assert main(["plan", "--model", "flux-dev", "--vram", "8GiB", "--frames", "9"]) == 2
    assert "--frames 9: flux trains on images; leave --frames out" in capsys.readouterr().err


def test_a_clip_runs_plan_prices_its_longest_frame_bucket(tmp_path, folder, media):
    """A run's config (the trainer's planner under a vram_budget): a video family's datasets with
    clips price [data] max_frames' latent frames (9 -> 3); the same run on stills alone prices one."""
    from PIL import Image

    from leantune.planner.from_config import workload_from_config

    assert workload_from_config(_config(tmp_path, folder, media, "w")).frames == 3
    stills = tmp_path / "stills"
    stills.mkdir()
    Image.fromarray(_frames(0)[0]).save(stills / "a.png")
    assert workload_from_config(_config(tmp_path, folder, stills, "s")).frames == 1
