"""Wan 2.2 TI2V-5B (family "wan2.2-ti2v") on its tiny preset: the 48-channel transformer over the Wan
2.2 VAE, sampled by WanPipeline(expand_timesteps=True). Loading and detection (the diffusers folder,
Wan-AI's / ComfyUI's single file with A14B's key set, told apart by its shapes; each Wan family
refuses the other's model by name), the chunked VAE's clip latents and decode equal to
AutoencoderKLWan's own calls, videos equal to the pipeline's bit for bit in fp32, the per-token
timesteps the transformer gets, and a clip LoRA run at the family's 24 fps that learns and resumes
exactly."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from leantune.config import ModelConfig, load_config
from leantune.models.family import family_for_model, get_family, guess_family
from leantune.models.weights import LoadError
from leantune.tiny.wan import save_wan_folder, save_wan_ti2v_folder, wan22_vae, wan_ti2v_transformer

FAM = get_family("wan2.2-ti2v")
WIDTH, HEIGHT, FRAMES, SEED = 96, 64, 5, 7          # sides multiples of 32: the VAE's 16x and 2 x 2 patches
PROMPTS = ["a square moving right", "a red square"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_wan_ti2v_folder(tmp_path_factory.mktemp("ti2v") / "folder")


def _sources(path, root, family: str = "wan2.2-ti2v", **model):
    return get_family(family).resolve_sources(ModelConfig(path=str(path), family=family, **model), root)


def _assert_same_weights(got, want):
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in b)


# -- loading and detection --------------------------------------------------------------------------------

def test_the_folder_and_the_single_file_load_and_are_told_from_a14b(folder, tmp_path):
    """The diffusers folder and Wan-AI's names in one file (bare and under ComfyUI's prefix) load the
    tiny TI2V transformer (48 channels in and out, read from the shapes) and are told as
    "wan2.2-ti2v"; an A14B file of the same key set is "wan2.2". Each family refuses the other's
    transformer naming the family to set; a Wan 2.1 VAE (16 channels) is refused for TI2V."""
    from leantune.models.wan.keys import COMFY_PREFIX, diffusers_to_native, native_metadata

    tiny = wan_ti2v_transformer(0)
    assert guess_family(folder) == "wan2.2-ti2v"
    model = FAM.load_transformer(_sources(folder, tmp_path), dtype=torch.float32)
    _assert_same_weights(model, tiny)
    assert (model.config.in_channels, model.config.out_channels) == (48, 48)
    assert family_for_model(model).name == "wan2.2-ti2v"

    native = diffusers_to_native(tiny.state_dict())
    a14b = diffusers_to_native(wan_ti2v_transformer(0, in_channels=16, out_channels=16).state_dict())
    assert native.keys() == a14b.keys()                         # only the shapes tell them apart
    for prefix in ("", COMFY_PREFIX):
        path = tmp_path / f"ti2v{len(prefix)}.safetensors"
        save_file({prefix + k: v.contiguous() for k, v in native.items()}, str(path), metadata=native_metadata(tiny))
        assert guess_family(path) == "wan2.2-ti2v"
        got = FAM.load_transformer(_sources(path, tmp_path), dtype=torch.float32)
        _assert_same_weights(got, tiny)
        with pytest.raises(LoadError, match=rf'{path.name}.*TI2V-5B.*\[model\] family = "wan2.2-ti2v"'):
            get_family("wan2.2").load_transformer(_sources(path, tmp_path, "wan2.2"), dtype=torch.float32)
    other = tmp_path / "a14b.safetensors"
    save_file({COMFY_PREFIX + k: v.contiguous() for k, v in a14b.items()}, str(other), metadata=native_metadata(tiny))
    assert guess_family(other) == "wan2.2"
    with pytest.raises(LoadError, match=r'a14b\.safetensors.*16 input.*\[model\] family = "wan2.2"'):
        FAM.load_transformer(_sources(other, tmp_path), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expert = 'low'.*one transformer"):
        _sources(folder, tmp_path, expert="low")

    wan21 = save_wan_folder(tmp_path / "wan21", experts=1)
    with pytest.raises(LoadError, match=r"\[model\] vae: .*16 latent channels.*48"):
        FAM.load_vae(_sources(folder, tmp_path, vae=str(wan21 / "vae")), torch.float32, "cpu")


def test_the_stock_architecture_builds_as_released():
    """models/configs/wan22_ti2v_5b.json builds WanTransformer3DModel on meta: 30 blocks, width 3072
    (24 heads of 128), ffn 14336, 48 channels, about 5B parameters."""
    from diffusers import WanTransformer3DModel

    from leantune.models.component_files import packaged_config

    config = packaged_config("wan22_ti2v_5b")
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(config)
    assert len(model.blocks) == 30 and model.blocks[0].ffn.net[2].in_features == 14336
    assert model.patch_embedding.weight.shape == (3072, 48, 1, 2, 2)
    assert 4.9e9 < sum(p.numel() for p in model.parameters()) < 5.1e9


# -- the VAE ----------------------------------------------------------------------------------------------

def _clip(frames: int = 9, side: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, frames, side, side, generator=g) * 2 - 1


def test_clip_latents_and_decode_equal_the_vaes_own_calls(folder, tmp_path):
    """The Wan 2.2 VAE driven a chunk at a time (data/video_vae.py, with its patchify) gives the
    whole-clip encode's posterior mode, (48, 3, 4, 4) for 9 frames of 64 x 64, normalised as the
    pipelines normalise it; its chunked decode is the whole decode's frames."""
    from leantune.data import video_vae

    vae = FAM.video.load_vae(_sources(folder, tmp_path), torch.float32, "cpu")
    _assert_same_weights(vae, wan22_vae(0))
    x = _clip()
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mode()
    got = video_vae.encode_frames(vae, x[0].unbind(1)).mode()
    assert got.shape == (1, 48, 3, 4, 4) and torch.equal(got, want)
    mean = torch.tensor(vae.config.latents_mean).view(1, 48, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 48, 1, 1, 1)
    assert torch.allclose(video_vae.normalize(vae, got), (want - mean) / std, atol=1e-6)
    with torch.no_grad():
        frames = vae.decode(want).sample
    chunks = torch.cat(list(video_vae.decode_chunks(vae, want)), dim=2)
    assert chunks.shape == x.shape and torch.equal(chunks, frames)


# -- sampling ---------------------------------------------------------------------------------------------

def test_per_token_timesteps_as_the_pipeline_passes_them(folder, tmp_path):
    """predict gives the transformer (B, F * h/2 * w/2) timesteps, each token its sample's sigma * 1000,
    as WanPipeline(expand_timesteps=True) does; odd latent sides are refused."""
    from leantune.models.family import PromptEmbeds

    model = wan_ti2v_transformer(0)
    seen = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(k["timestep"]), with_kwargs=True)
    x = torch.randn(2, 48, 3, 4, 6)
    embeds = PromptEmbeds(torch.randn(2, 7, 32), torch.zeros(2, 0))
    with torch.no_grad():
        FAM.predict(model, x, torch.tensor([0.25, 0.75]), embeds, (4, 6))
    (t,) = seen
    assert t.shape == (2, 3 * 2 * 3) and t.dtype == torch.float32
    assert torch.equal(t[0], torch.full((18,), 250.0)) and torch.equal(t[1], torch.full((18,), 750.0))
    with pytest.raises(ValueError, match="multiples of 32"):
        FAM.predict(model, torch.randn(1, 48, 1, 3, 4), torch.tensor([0.5]), embeds, (3, 4))


def _sample(folder, out, *flags) -> int:
    from leantune.cli import main

    return main(["sample", "--model", str(folder), "--family", "wan2.2-ti2v", "--prompt", PROMPTS[0], "--prompt",
                 PROMPTS[1], "--width", str(WIDTH), "--height", str(HEIGHT), "--steps", "3", "--guidance", "5.0",
                 "--seed", str(SEED), "--device", "cpu", "--out", str(out), "--set", "model.dtype=fp32",
                 "--set", "max_text_length=32", *flags])


def _pipeline(folder):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():        # fresh, aligned memory as leantune's loader gives (test_wan_sample_video.py)
        for name in ("transformer", "vae", "text_encoder"):
            for p in getattr(pipe, name).parameters():
                p.data = p.data.clone()
    return pipe


def test_sampled_videos_are_wanpipeline_expand_timesteps_frames_bit_for_bit(folder, tmp_path, monkeypatch):
    """`leantune sample --frames 5` at 96x64, 3 steps, CFG 5: each video's uint8 frames (before the
    codec) are WanPipeline(expand_timesteps=True)'s for its prompt and seed, written at 24 fps; the
    denoised latents equal the pipeline's output_type="latent" bit for bit."""
    from leantune.infer import run, video

    written = {}
    save_video = video.save_video
    monkeypatch.setattr(video, "save_video", lambda frames, path, fps: written.setdefault(path.name, (
        frames.copy(), fps)) and save_video(frames, path, fps))
    latents = []
    denoise = run.denoise
    monkeypatch.setattr(run, "denoise", lambda *a, **k: latents.append(denoise(*a, **k)) or latents[-1])
    assert _sample(folder, tmp_path / "out", "--frames", str(FRAMES)) == 0
    pipe = _pipeline(folder)
    assert pipe.config.expand_timesteps
    for i, (prompt, (got, fps)) in enumerate(zip(PROMPTS, written.values())):
        kw = dict(prompt=prompt, negative_prompt="", height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                  num_inference_steps=3, guidance_scale=5.0, max_sequence_length=32)
        out = pipe(**kw, generator=torch.Generator().manual_seed(SEED + i), output_type="np").frames[0]
        want = (out * 255).round().astype(np.uint8)
        assert fps == 24.0 and got.shape == want.shape == (FRAMES, HEIGHT, WIDTH, 3)
        assert np.array_equal(got, want), np.abs(got.astype(int) - want.astype(int)).max()
        assert not np.array_equal(got[0], got[-1])
        lat = pipe(**kw, generator=torch.Generator().manual_seed(SEED + i), output_type="latent").frames
        ours = torch.cat(latents)[i:i + 1]
        assert ours.shape == lat.shape == (1, 48, 2, 4, 6) and torch.equal(ours, lat)
    assert not np.array_equal(*[f for f, _ in written.values()])


def test_image_to_video_samples_are_the_i2v_pipelines_frames_bit_for_bit(folder, tmp_path, monkeypatch):
    """`leantune sample --reference FIRST.png --frames 5`: WanImageToVideoPipeline(expand_timesteps=True)
    on the same components (no image encoder) gives the same uint8 frames for the same first frame
    (80 x 72, resized to the video's 96 x 64), prompt and seed: the first latent frame kept as the
    first frame's clean latents, its tokens at timestep 0, and put back after the last step."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
    from PIL import Image

    from leantune.infer import video

    # diffusers 0.42's pipeline_wan_i2v calls ftfy.fix_text unguarded; pipeline_wan's prompt_clean is
    # the same cleaning with its is_ftfy_available guard (tests/test_wan_i2v.py)
    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)

    rng = np.random.default_rng(5)
    first = tmp_path / "first.png"
    Image.fromarray(rng.integers(0, 255, (72, 80, 3), dtype=np.uint8)).save(first)
    written = {}
    save_video = video.save_video
    monkeypatch.setattr(video, "save_video", lambda frames, path, fps: written.setdefault(str(path), frames.copy())
                        is not None and save_video(frames, path, fps))
    assert _sample(folder, tmp_path / "out", "--frames", str(FRAMES), "--reference", str(first)) == 0
    assert _sample(folder, tmp_path / "t2v", "--frames", str(FRAMES)) == 0
    pipe = _pipeline(folder)
    i2v = WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                  scheduler=pipe.scheduler, transformer=pipe.transformer, expand_timesteps=True)
    i2v.set_progress_bar_config(disable=True)
    got = list(written.values())
    for i, prompt in enumerate(PROMPTS):
        out = i2v(image=Image.open(first).convert("RGB"), prompt=prompt, negative_prompt="", height=HEIGHT,
                  width=WIDTH, num_frames=FRAMES, num_inference_steps=3, guidance_scale=5.0, max_sequence_length=32,
                  generator=torch.Generator().manual_seed(SEED + i), output_type="np").frames[0]
        want = (out * 255).round().astype(np.uint8)
        assert got[i].shape == want.shape == (FRAMES, HEIGHT, WIDTH, 3)
        assert np.array_equal(got[i], want), np.abs(got[i].astype(int) - want.astype(int)).max()
        assert not np.array_equal(got[i][0], got[i + 2][0])        # the first frame follows the image (not t2v's)


# -- training on clips ------------------------------------------------------------------------------------

SIDE, CLIP_FRAMES, CLIP_FPS = 64, 9, 24


def _frames(kind: int, width: int = SIDE) -> np.ndarray:
    """tests/moving_square_clips.py's square, on a frame `width` wide (the 96 x 64 clip)."""
    from moving_square_clips import moving_square

    if width == SIDE:
        return moving_square(kind, CLIP_FRAMES, SIDE)
    out = np.empty((CLIP_FRAMES, SIDE, width, 3), np.uint8)
    out[:] = moving_square(kind, CLIP_FRAMES, SIDE)[:, :1, :1]          # the flat colour
    out[:, :, :SIDE] = moving_square(kind, CLIP_FRAMES, SIDE)
    return out


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Three captioned 24 fps clips of 9 frames: 9 frames (3 latent frames) at 24 fps, 5 at 16; the
    third 96 x 64, whose nearest 16-pixel bucket at 64 would be 80 x 48 (a latent side of 3)."""
    from leantune.data.video_write import write_mp4

    d = tmp_path_factory.mktemp("media") / "data"
    d.mkdir()
    for i, caption in enumerate(("a square moving right", "a square moving down")):
        write_mp4(d / f"clip{i}.mp4", _frames(i), CLIP_FPS)
        (d / f"clip{i}.txt").write_text(caption)
    write_mp4(d / "wide.mp4", _frames(0, width=96), CLIP_FPS)
    (d / "wide.txt").write_text("a wide square moving right")
    return d




def _config(tmp_path, folder, media, out: str, steps: int = 4, lr: float = 1e-3, save_every: int = 2,
            model_extra: str = "", extra: str = ""):
    from moving_square_clips import wan_run

    return load_config(wan_run(tmp_path / f"{out}.toml", family="wan2.2-ti2v", folder=folder, media=media,
                               cache=tmp_path / "cache", out=tmp_path / out, name="ti2v", steps=steps, lr=lr,
                               save_every=save_every, model_extra=model_extra, extra=extra))


def _fixed_loss(folder, lora_file, latents, embeds, sigmas=(0.3, 0.6, 0.9), first_frame: bool = False) -> float:
    """The clips' flow-matching loss at fixed noise; `first_frame`: image-to-video's, each clip's clean
    first latent frame the condition and the loss on the other frames."""
    pipe = _pipeline(folder)
    if lora_file is not None:
        pipe.load_lora_weights(str(lora_file))
    g = torch.Generator().manual_seed(11)
    total = 0.0
    refs = {"references": [latents[:, :, :1]]} if first_frame else {}
    with torch.no_grad():
        for level in sigmas:
            noise = torch.randn(latents.shape, generator=g)
            noisy = (1 - level) * latents + level * noise
            pred = FAM.predict(pipe.transformer.eval(), noisy, torch.full((latents.shape[0],), level), embeds,
                               latents.shape[-2:], **refs)
            err = (pred - (noise - latents)) ** 2
            total += float((err[:, :, 1:] if first_frame else err).mean())
    return total / len(sigmas)


def test_a_clip_lora_trains_at_24_fps_lowers_the_loss_and_resumes_exactly(tmp_path, folder, media, monkeypatch):
    """[data] target_fps unset: the clips are resampled at the family's 24 fps (9 frames: 3 latent
    frames of 48 x 4 x 4), each in a bucket of sides divisible by 32 (the wide one too); the
    trainer's steps noise (2, 48, 3, 4, 4) batches; the LoRA it saves
    loads into WanPipeline and lowers the clips' loss at fixed noise; 4 steps straight equal 2, stop,
    resume, 2 bit for bit."""
    from leantune.data import cache
    from leantune.train import flow_matching as fm
    from leantune.trainer import train

    seen = []
    add_noise = fm.add_noise
    monkeypatch.setattr(fm, "add_noise", lambda x0, noise, sigma: seen.append(tuple(x0.shape)) or
                        add_noise(x0, noise, sigma))
    cfg = _config(tmp_path, folder, media, "lowers", steps=12, lr=2e-2, save_every=0)
    assert "target_fps" not in cfg.data.model_fields_set
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(cfg, progress=False)
        data = cache.prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32)
    assert result.final_step == 12 and all(np.isfinite(result.losses))
    assert (2, 48, 3, 4, 4) in seen and set(seen) <= {(2, 48, 3, 4, 4), (1, 48, 3, 4, 4)}
    clips = [s for s in data.samples if isinstance(s, cache.ClipSample)]
    # 16 fps would give 5 frames; 16-pixel buckets would put the wide clip at 80 x 48
    assert len(clips) == 3 and {s.bucket for s in clips} == {(SIDE, SIDE, CLIP_FRAMES)}
    latents = torch.stack([data.latent(s) for s in clips]).float()
    embeds = data.prompt_embeds([s.item.caption for s in clips])
    before = _fixed_loss(folder, None, latents, embeds)
    after = _fixed_loss(folder, result.paths.lora_file("diffusers"), latents, embeds)
    assert after < 0.9 * before, (before, after)

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



def test_training_buckets_have_sides_the_vae_and_patches_divide():
    """TI2V-5B's buckets step and round by 32 (the 16x VAE's latents in 2 x 2 patches): a 1280x960
    clip at resolution 960 trains at sides divisible by 32, where the 16-pixel buckets of the 8x
    families give it 1104 x 832 (a latent side of 69, which the transformer cannot patch)."""
    from types import SimpleNamespace

    from leantune.data.buckets import bucket_sizes
    from leantune.data.cache import clip_bucket

    clip = SimpleNamespace(width=1280, height=960, num_frames=121)
    assert FAM.side_multiple == 32 and get_family("wan2.2").side_multiple == 16
    w, h, frames = clip_bucket(clip, 960, FAM.side_multiple)
    assert w % 32 == 0 and h % 32 == 0 and frames == 121 and 1.25 < w / h < 1.45
    assert clip_bucket(clip, 960)[:2] == (1104, 832)
    assert all(w % 32 == 0 and h % 32 == 0 for w, h in bucket_sizes(704, multiple=32))
    with pytest.raises(ValueError, match="resolution 720 must be a multiple of 32"):
        bucket_sizes(720, multiple=32)


# -- image-to-video training ([model] image_to_video) ------------------------------------------------------

I2V = "image_to_video = true\n"


@pytest.fixture(scope="module")
def first_png(tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("first") / "first.png"
    Image.fromarray(np.random.default_rng(9).integers(0, 255, (56, 72, 3), dtype=np.uint8)).save(path)
    return path


def _spy_training_calls(monkeypatch) -> tuple[list, list]:
    """(noised, calls): each fm.add_noise's (x0, noise, sigma) and each training forward's (hidden_states,
    timestep, output) as the transformer receives and returns them (previews run in eval mode)."""
    from diffusers import WanTransformer3DModel

    from leantune.train import flow_matching as fm

    noised, calls = [], []
    add_noise = fm.add_noise
    monkeypatch.setattr(fm, "add_noise", lambda x0, noise, sigma: noised.append((x0.clone(), noise.clone(),
                                                                                 sigma.clone()))
                        or add_noise(x0, noise, sigma))
    forward = WanTransformer3DModel.forward

    def spy(self, *args, **kw):
        out = forward(self, *args, **kw)
        if self.training:
            calls.append((kw["hidden_states"].detach().clone(), kw["timestep"].detach().clone(),
                          out[0].detach().clone()))
        return out

    monkeypatch.setattr(WanTransformer3DModel, "forward", spy)
    return noised, calls


def test_image_to_video_training_keeps_the_first_frame_clean_at_timestep_0_and_leaves_it_out_of_the_loss(
        tmp_path, folder, media, monkeypatch):
    """[model] image_to_video = true: each step's transformer input has the clip's clean first latent
    frame (not its noised one) and the noised rest, the first frame's tokens at timestep 0 and the
    others at sigma * 1000, and the step's loss is the mean squared error over the other latent frames
    only (DiffSynth-Studio's FlowMatchSFTLoss with first_frame_latents)."""
    from leantune.trainer import train

    noised, calls = _spy_training_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(_config(tmp_path, folder, media, "i2v", steps=2, save_every=0, model_extra=I2V), progress=False)
    assert result.final_step == 2 and len(noised) == len(calls) == 2
    for (x0, noise, sigma), (hidden, timestep, pred), loss in zip(noised, calls, result.losses):
        assert x0.shape[2] == 3 and hidden.shape == x0.shape
        noisy = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * noise
        assert torch.equal(hidden[:, :, 0], x0[:, :, 0])                       # clean, not noised
        assert not torch.allclose(hidden[:, :, 0], noisy[:, :, 0])
        assert torch.allclose(hidden[:, :, 1:], noisy[:, :, 1:], atol=1e-6)
        per_frame = x0.shape[-2] * x0.shape[-1] // 4                           # the 2 x 2 patches of one frame
        assert timestep.shape == (x0.shape[0], 3 * per_frame)
        assert torch.equal(timestep[:, :per_frame], torch.zeros_like(timestep[:, :per_frame]))
        assert torch.allclose(timestep[:, per_frame:], (sigma * 1000)[:, None].expand(-1, 2 * per_frame))
        err = (pred - (noise - x0)) ** 2
        assert loss == pytest.approx(float(err[:, :, 1:].mean()), rel=1e-5)
        assert loss != pytest.approx(float(err.mean()), rel=1e-3)              # the first frame is left out


def test_an_image_to_video_lora_lowers_its_loss_resumes_exactly_and_previews_as_the_pipeline(
        tmp_path, folder, media, first_png, monkeypatch):
    """12 image-to-video steps lower the clips' image-to-video loss at fixed noise (the LoRA loaded into
    WanPipeline); the preview drawn at the last step from [sample] references' first frame is
    WanImageToVideoPipeline(expand_timesteps=True)'s uint8 frames with that LoRA; 4 steps straight
    equal 2, stop, resume, 2 bit for bit."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v
    from PIL import Image

    from leantune.data import cache
    from leantune.infer import video
    from leantune.trainer import train

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)
    written = []
    save_video = video.save_video
    monkeypatch.setattr(video, "save_video", lambda frames, path, fps: written.append(frames.copy()) or
                        save_video(frames, path, fps))
    preview = (f'\n[sample]\nevery = 12\nsteps = 3\nguidance = 5.0\nwidth = {WIDTH}\nheight = {HEIGHT}\n'
               f'frames = {FRAMES}\nseed = {SEED}\nprompts = ["{PROMPTS[0]}"]\nreferences = ["{first_png}"]\n')
    cfg = _config(tmp_path, folder, media, "i2v-lowers", steps=12, lr=2e-2, save_every=0, model_extra=I2V,
                  extra=preview)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(cfg, progress=False)
        data = cache.prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32,
                                    extra_prompts=[PROMPTS[0]])
    assert result.final_step == 12 and all(np.isfinite(result.losses))
    clips = [s for s in data.samples if isinstance(s, cache.ClipSample)]
    latents = torch.stack([data.latent(s) for s in clips]).float()
    embeds = data.prompt_embeds([s.item.caption for s in clips])
    lora = result.paths.lora_file("diffusers")
    before = _fixed_loss(folder, None, latents, embeds, first_frame=True)
    after = _fixed_loss(folder, lora, latents, embeds, first_frame=True)
    assert after < 0.9 * before, (before, after)

    pipe = _pipeline(folder)
    pipe.load_lora_weights(str(lora))
    i2v = WanImageToVideoPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                                  scheduler=pipe.scheduler, transformer=pipe.transformer, expand_timesteps=True)
    i2v.set_progress_bar_config(disable=True)
    # the previews read the cache's entries, stored in bf16 (data/cache.STORE_DTYPE): the prompts and the
    # first frame's normalised latents; the pipeline is given them rounded so (its prepare_latents' condition
    # through bf16), so the frames compare its denoising, first frame and decode with the preview's
    prompt, negative = (data.prompt_embeds([p]).t5.float() for p in (PROMPTS[0], ""))
    prepare = i2v.prepare_latents

    def rounded(*args, **kw):
        latents, condition, mask = prepare(*args, **kw)
        return latents, condition.to(torch.bfloat16).to(condition.dtype), mask

    i2v.prepare_latents = rounded
    out = i2v(image=Image.open(first_png).convert("RGB"), prompt_embeds=prompt, negative_prompt_embeds=negative,
              height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=3, guidance_scale=5.0,
              generator=torch.Generator().manual_seed(SEED), output_type="np").frames[0]
    want = (out * 255).round().astype(np.uint8)
    (got,) = written
    assert got.shape == want.shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert np.array_equal(got, want), np.abs(got.astype(int) - want.astype(int)).max()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        straight = train(_config(tmp_path, folder, media, "i2v-straight", model_extra=I2V), progress=False)
        parts = _config(tmp_path, folder, media, "i2v-parts", model_extra=I2V)
        assert train(parts, stop_after=2, progress=False).final_step == 2
        resumed = train(parts, resume=True, progress=False)
    assert resumed.final_step == 4 and resumed.losses == straight.losses and len(set(straight.losses)) == 4
    a = load_file(str(straight.paths.lora_file("diffusers")))
    b = load_file(str(resumed.paths.lora_file("diffusers")))
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_image_to_video_is_chosen_by_name_and_its_previews_need_a_first_frame(tmp_path, folder, media, first_png):
    """[model] image_to_video is TI2V-5B's alone (another family refuses it by name); a run that
    samples needs [sample] references' first frame with it and refuses one without it, naming the key."""
    from leantune.data import cache
    from leantune.data.dataset import DataError

    with pytest.raises(ValueError, match=r"image_to_video = true: family = 'wan2.2' .*only family = \"wan2.2-ti2v\""):
        ModelConfig(path=str(folder), family="wan2.2", image_to_video=True)
    sample = f'\n[sample]\nevery = 2\nwidth = {WIDTH}\nheight = {HEIGHT}\nframes = {FRAMES}\nprompts = ["a square"]\n'
    cases = ((I2V, sample, r"\[sample\] references: \[model\] image_to_video = true trains an image-to-video"),
             ("", sample + f'references = ["{first_png}"]\n',
              r"\[sample\] references: this run trains .* text-to-video.* set \[model\] image_to_video = true"))
    for i, (model_extra, extra, message) in enumerate(cases):
        cfg = _config(tmp_path, folder, media, f"refused{i}", model_extra=model_extra, extra=extra)
        with pytest.raises(DataError, match=message):
            cache.prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32,
                                 sample_references=cache.sample_references(cfg.sample),
                                 sample_shape=cache.sample_shape(cfg.sample, cfg.data))
