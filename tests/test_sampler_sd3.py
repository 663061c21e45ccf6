"""The staged sampler on SD3.5 against diffusers' StableDiffusion3Pipeline, on tiny real components:
classifier-free guidance with a negative prompt, SD3's schedule (shift 3.0, the scheduler's own
spacing), the VAE's latent scaling and shift, LoRAs, and the memory engine under sampling.

Parity is exact (max |diff| 0) in fp32 wherever the computation is the same; the pipeline's VAE
decodes image by image (`use_slicing`) as stage 3 does.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from leantune import tiny

PROMPTS = ["a photo of a cat", "a green triangle"]
NEGATIVE = "blurry, low quality"
SEEDS = [3, 7]
W, H = 96, 64          # latent 12 x 8: a non-square size catches height / width mix-ups
MAX_LEN = 16           # T5 tokens after the 77 CLIP rows


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def comps():
    return tiny.sd3_components("large", seed=0)


def _pipe(components):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.use_slicing = True
    return pipe


def _reference(pipe, prompts=PROMPTS, seeds=SEEDS, steps=4, guidance=7.0, negative=NEGATIVE, **kw):
    return pipe(prompts, negative_prompt=None if negative is None else [negative] * len(prompts), height=H, width=W,
                num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=MAX_LEN,
                generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="np", **kw).images


def _encoders(c):
    return SimpleNamespace(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], tokenizer_2=c["tokenizer_2"],
                           text_encoder_2=c["text_encoder_2"], tokenizer_3=c["tokenizer_3"],
                           text_encoder_3=c["text_encoder_3"], t5_width=c["transformer"].config.joint_attention_dim)


def _encode(c, prompts=PROMPTS, negative=NEGATIVE, **kw):
    from leantune.infer.encode import encode_prompts_stage
    from leantune.models.family import get_family

    return encode_prompts_stage(_encoders(c), prompts, max_length=MAX_LEN, device="cpu", family=get_family("sd3"),
                                negative_prompts=[negative] * len(prompts), **kw)


def _ours(c, prompts=PROMPTS, seeds=SEEDS, steps=4, guidance=7.0, negative=NEGATIVE, transformer=None, **kw):
    from leantune.infer.sampler import sample_images

    embeds, neg = _encode(c, prompts, negative)
    images = sample_images(transformer or c["transformer"], c["vae"], embeds, seeds, width=W, height=H, steps=steps,
                           guidance=guidance, device="cpu", negative=neg, **kw)
    return np.stack([np.asarray(im) for im in images])


def _u8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


def test_sd3_schedule_equals_the_pipelines_timesteps():
    """SD3.5's scheduler (shift 3.0, no sigmas passed by the pipeline): the same sigmas and timesteps."""
    from leantune.models.schedule import FlowSchedule
    from leantune.models.family import get_family

    sched = tiny.sd3_scheduler()
    ours = get_family("sd3").sampling.schedule("large", None)
    assert ours == FlowSchedule.sd3() and (ours.default_steps, ours.default_guidance) == (28, 7.0)
    for steps in (1, 4, 28, 40):
        sched.set_timesteps(steps)
        sigmas = ours.sigmas(steps, 4096)
        assert torch.equal(sigmas, sched.sigmas)
        assert torch.equal(sigmas[:-1] * 1000, sched.timesteps)      # what the transformer is fed
    # A folder's scheduler_config.json wins over the published values.
    assert FlowSchedule.from_scheduler_config({"shift": 2.0}, FlowSchedule.sd3()).shift == 2.0


def test_sd3_sampler_equals_pipeline_with_cfg_and_negative_prompt(comps):
    ref = _reference(_pipe(comps))                              # (2, H, W, 3) float in [0, 1]
    ours = _ours(comps)
    assert ours.shape == (2, H, W, 3)
    assert np.array_equal(ours, _u8(ref))

    # The float images too, before rounding to 8 bits, and with the halves one after the other
    # (what a tight memory plan picks): the same up to float reassociation of a smaller batch.
    from leantune.infer.decode import decode_latents
    from leantune.infer.sampler import denoise
    from leantune.models.schedule import FlowSchedule

    embeds, neg = _encode(comps)
    schedule = FlowSchedule.sd3()
    lat = denoise(comps["transformer"], embeds, SEEDS, width=W, height=H, steps=4, guidance=7.0, schedule=schedule,
                  device="cpu", negative=neg)
    floats = decode_latents(comps["vae"], lat, "cpu").permute(0, 2, 3, 1).numpy()
    assert np.abs(floats - ref).max() == 0.0
    seq = denoise(comps["transformer"], embeds, SEEDS, width=W, height=H, steps=4, guidance=7.0, schedule=schedule,
                  device="cpu", negative=neg, cfg_batched=False)
    assert (seq - lat).abs().max() < 1e-4 * lat.abs().max()

    # The guidance scale and the negative prompt both matter; scale 1 is no guidance (one forward),
    # as in the pipeline.
    assert np.abs(_ours(comps, guidance=3.0).astype(int) - ours.astype(int)).max() > 10
    assert np.abs(_ours(comps, negative="").astype(int) - ours.astype(int)).max() > 10
    no_cfg = _ours(comps, guidance=1.0)
    assert np.array_equal(no_cfg, _u8(_reference(_pipe(comps), guidance=1.0)))


def test_sd3_sampler_equals_pipeline_bf16():
    """bf16 weights and activations: still the pipeline's images, because the transformer gets the
    float32 timestep the pipeline gives it (sigma * 1000 rounded to bf16 would be another number)."""
    c = tiny.sd3_components("large", seed=2, dtype=torch.bfloat16)
    ref = _reference(_pipe(c), steps=3, guidance=5.0)
    assert np.array_equal(_ours(c, steps=3, guidance=5.0), _u8(ref))


def test_sd3_default_negative_is_the_empty_prompt_and_medium_style(comps):
    """No negative prompt means the empty one (the pipeline's default), on MMDiT-X with a dual-attention block."""
    c = tiny.sd3_components("medium", seed=1)
    ref = _reference(_pipe(c), negative=None, steps=3, guidance=4.5)
    assert np.array_equal(_ours(c, negative="", steps=3, guidance=4.5), _u8(ref))


# -- LoRAs ------------------------------------------------------------------------------------------

def _random_lora(transformer, seed: int):
    """A LoRA on every joint-block Linear (attention, MLP, adaLN), nonzero as after training."""
    from leantune.config import LoraConfig
    from leantune.models.sd3 import SD3_SPEC
    from leantune.train.lora import add_lora, lora_weights_from_model

    model = copy.deepcopy(transformer)
    params = add_lora(model, SD3_SPEC, LoraConfig(rank=4, alpha=8, targets="all"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return lora_weights_from_model(model)


@pytest.fixture(scope="module")
def lora_files(comps, tmp_path_factory):
    from leantune.train.lora import save_lora

    folder = tmp_path_factory.mktemp("sd3_loras")
    w = _random_lora(comps["transformer"], seed=5)
    return {fmt: save_lora(w, folder / f"{fmt}.safetensors", fmt) for fmt in ("diffusers", "comfyui")}


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_loras_in_each_format_equal_the_pipeline(comps, lora_files, strength):
    """leantune's unmerged LoRA, from the diffusers file and from the kohya/ComfyUI file (q/k/v fused,
    split again on reading), against StableDiffusion3Pipeline.load_lora_weights of the diffusers file
    at the same adapter weight. (diffusers has no kohya SD3 reader: the two files hold the same
    deltas, which tests/test_sd3_lora.py checks through diffusers' Stability converter.)"""
    from leantune.infer.loras import apply_loras

    pipe = _pipe(dict(comps, transformer=copy.deepcopy(comps["transformer"])))
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.set_adapters(["style"], [strength])
    ref = _u8(_reference(pipe, steps=3))
    for fmt, path in lora_files.items():
        t = copy.deepcopy(comps["transformer"])
        apply_loras(t, [(path, strength)])
        assert np.array_equal(_ours(comps, transformer=t, steps=3), ref), fmt
    # The LoRA matters at this strength: without it the images differ.
    assert np.abs(_ours(comps, steps=3).astype(int) - ref.astype(int)).max() > 10


# -- `leantune sample` on an SD3.5 folder ---------------------------------------------------------------

def _request(folder, out, **kw):
    from leantune.infer.request import validate_request

    data = {"model": {"path": str(folder), "family": "sd3", "dtype": "fp32"}, "prompts": PROMPTS, "seed": 3,
            "steps": 3, "width": W, "height": H, "max_text_length": MAX_LEN, "out": str(out), **kw}
    return validate_request(data, "test request")


def _images(result):
    from PIL import Image

    return np.stack([np.asarray(Image.open(f)) for f in result.files])


def test_run_sampling_sd3_folder_equals_pipeline_and_streams(tiny_sd3_dir, lora_files, tmp_path):
    """Loading from the diffusers folder, the negative prompt encoded in stage 1, CFG at the
    pipeline's default scale (7.0), a kohya-format LoRA at 0.7, PNG metadata; equal to
    StableDiffusion3Pipeline.from_pretrained with the same LoRA. Then every block and the non-block
    group streamed, with and without fp8 storage."""
    from diffusers import StableDiffusion3Pipeline

    from leantune.infer.images import read_png_metadata
    from leantune.infer.run import run_sampling

    lora = [{"path": str(lora_files["comfyui"]), "strength": 0.7}]
    result = run_sampling(_request(tiny_sd3_dir, tmp_path / "out", negative_prompt=NEGATIVE, lora=lora))
    assert [f.name for f in result.files] == ["00000-3.png", "00001-4.png"]
    assert result.cfg_batched is True and result.plan.streamed_blocks == ()
    meta = read_png_metadata(result.files[1])
    assert meta["prompt"] == PROMPTS[1] and meta["negative_prompt"] == NEGATIVE and meta["seed"] == "4"
    assert meta["guidance"] == "7" and meta["steps"] == "3" and meta["variant"] == "large"
    assert meta["loras"] == f"{lora_files['comfyui']}:0.7"

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.use_slicing = True
    pipe.load_lora_weights(str(lora_files["diffusers"]), adapter_name="style")
    pipe.set_adapters(["style"], [0.7])
    ref = _u8(_reference(pipe, seeds=[3, 4], steps=3))
    plain = _images(result)
    assert np.array_equal(plain, ref)

    # Streaming moves the same bytes (poisoned slots: a stale weight would turn the image to NaN):
    # identical images.
    stream = {"streamed_blocks": "all", "stream_non_blocks": True, "debug_poison": True}
    exact = run_sampling(_request(tiny_sd3_dir, tmp_path / "stream", negative_prompt=NEGATIVE, lora=lora,
                                  memory=stream))
    assert exact.stream_report["bytes_h2d"] > 0 and len(exact.plan.streamed_blocks) == 2
    assert np.array_equal(_images(exact), plain)
    # fp8-stored block Linears (block-scaled e4m3) on top: the weight rounding moves pixels by a few
    # levels (stated bound: at most 8/255, at most 1/255 on average), no more.
    fp8 = run_sampling(_request(tiny_sd3_dir, tmp_path / "fp8", negative_prompt=NEGATIVE, lora=lora,
                                memory={**stream, "fp8": True}))
    assert fp8.plan.fp8
    diff = np.abs(_images(fp8).astype(int) - plain.astype(int))
    assert 0 < diff.max() <= 8 and diff.mean() <= 1.0


@pytest.mark.slow
def test_planner_counts_the_cfg_batch_and_falls_back_to_halves(tiny_sd3_dir, tmp_path):
    """Under a VRAM budget the planner is asked for twice the images per forward (CFG's negatives and
    prompts together); at a budget between what that needs and what the single batch needs, the
    halves run one after the other, with the same images up to a smaller batch's float rounding."""
    from leantune.infer.run import inference_workload, run_sampling
    from leantune.models.sd3 import SD3_SPEC
    from leantune.planner.from_config import plan_memory
    from leantune.planner.workload import Budget, InfeasibleBudget

    request = _request(tiny_sd3_dir, tmp_path / "plain", negative_prompt=NEGATIVE, vae_tiling="off")
    transformer = tiny.sd3_transformer("large")
    text_len = 77 + MAX_LEN

    def least_budget(batch: int) -> int:
        """The smallest VRAM budget (to 64 KiB) the planner finds a plan for."""
        lo, hi = 0, 2**30
        while hi - lo > 2**16:
            mid = (lo + hi) // 2
            try:
                plan_memory(SD3_SPEC, transformer, inference_workload(request, batch, text_len),
                            Budget(vram=mid, ram=8 * 2**30))
                hi = mid
            except InfeasibleBudget:
                lo = mid
        return hi

    single, double = least_budget(2), least_budget(4)
    assert double > single             # the doubled batch's activations are priced
    plain = run_sampling(request)
    between = f"{(single + double) // 2}B"
    tight = run_sampling(_request(tiny_sd3_dir, tmp_path / "tight", negative_prompt=NEGATIVE, vae_tiling="off",
                                  memory={"vram_budget": between}))
    assert plain.cfg_batched is True and tight.cfg_batched is False
    assert tight.stream_t5                 # the three text encoders exceed such a budget too
    # Same images up to the smaller batch's float rounding (and e4m3 weight rounding, should the
    # planner store weights in fp8 at this budget).
    assert np.abs(_images(tight).astype(int) - _images(plain).astype(int)).max() <= (8 if tight.plan.fp8 else 1)
    # Just above what the doubled batch needs, it runs batched again; with room to spare, the plain plan.
    assert run_sampling(_request(tiny_sd3_dir, tmp_path / "edge", negative_prompt=NEGATIVE, vae_tiling="off",
                                 memory={"vram_budget": f"{double + 2**16}B"})).cfg_batched is True
    roomy = run_sampling(_request(tiny_sd3_dir, tmp_path / "roomy", negative_prompt=NEGATIVE, vae_tiling="off",
                                  memory={"vram_budget": "4GiB"}))
    assert roomy.cfg_batched is True and not roomy.plan.fp8 and np.array_equal(_images(roomy), _images(plain))


def test_sample_command_detects_sd3_and_takes_negative_prompt(tiny_sd3_dir, tmp_path, monkeypatch, capsys):
    """`leantune sample --model <SD3.5 folder>` needs no family flag; --negative-prompt and
    --guidance reach the images; a negative prompt for Flux (distilled guidance) is refused."""
    import argparse

    from leantune.commands import sample
    from leantune.infer.images import read_png_metadata

    def cli(argv):
        parser = argparse.ArgumentParser()
        sample.configure(parser)
        return sample.run(parser.parse_args(argv))

    monkeypatch.chdir(tmp_path)
    args = ["--model", str(tiny_sd3_dir), "--prompt", "a yellow star", "--steps", "2", "--width", "64", "--height",
            "64", "--seed", "11", "--set", f"max_text_length={MAX_LEN}"]
    assert cli(args + ["--negative-prompt", "a blue square", "--guidance", "4.5", "--out", "a"]) == 0
    assert cli(args + ["--guidance", "4.5", "--out", "b"]) == 0
    (a,), (b,) = sorted((tmp_path / "a").glob("*.png")), sorted((tmp_path / "b").glob("*.png"))
    meta = read_png_metadata(a)
    assert meta["negative_prompt"] == "a blue square" and meta["guidance"] == "4.5" and meta["variant"] == "large"
    assert read_png_metadata(b)["negative_prompt"] == ""
    from PIL import Image

    assert np.abs(np.asarray(Image.open(a)).astype(int) - np.asarray(Image.open(b)).astype(int)).max() > 0

    capsys.readouterr()
    assert cli(["--model", str(tmp_path / "nothing"), "--family", "flux", "--prompt", "x", "--negative-prompt", "y",
                "--out", "never"]) == 2
    assert "negative_prompt: flux samples with distilled guidance" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


# -- samples during training ------------------------------------------------------------------------------

SD3_RUN = """
[model]
path = "{model}"
family = "sd3"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "cache"
max_text_length = {max_len}

[[data.datasets]]
path = "{images}"
trigger_word = "lnt"

[lora]
rank = 4
alpha = 8

[train]
steps = 2
learning_rate = 1e-2
mixed_precision = "no"
seed = 3

[sample]
every = 2
prompts = ["lnt a red circle", "lnt a blue square"]
negative_prompt = "{negative}"
guidance = 4.5
steps = 3
seed = 9
width = 64
height = 48

[output]
dir = "out"
name = "t"
formats = ["diffusers"]
"""


def test_training_samples_use_cfg_with_the_configs_negative_prompt(tiny_sd3_dir, tmp_path):
    """The trainer's sample grid for SD3 is the CFG sampler's output for the trained LoRA, the
    cached prompts and the cached [sample] negative_prompt (not the empty prompt)."""
    from PIL import Image

    from leantune.config import load_config
    from leantune.demo import draw_shapes
    from leantune.infer.images import make_grid, read_png_metadata
    from leantune.infer.loras import apply_loras
    from leantune.infer.sampler import sample_images
    from leantune.models.family import PromptEmbeds
    from leantune.trainer import train

    draw_shapes(tmp_path / "images", count=2, size=64, seed=5)
    (tmp_path / "run.toml").write_text(SD3_RUN.format(model=tiny_sd3_dir, images=tmp_path / "images",
                                                      max_len=MAX_LEN, negative=NEGATIVE))
    cfg = load_config(tmp_path / "run.toml")
    result = train(cfg, progress=False)
    (grid_file,) = result.sample_files
    meta = read_png_metadata(grid_file)
    assert meta["negative_prompt"] == NEGATIVE and meta["guidance"] == "4.5"

    # The same images from the standalone sampler: base model + the exported LoRA, with the text
    # embeddings the cache holds (the trainer never reloads the text encoders).
    from leantune.data.cache import prepare_caches, sample_prompts

    data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32, extra_prompts=sample_prompts(cfg.sample))
    embeds = data.prompt_embeds(cfg.sample.prompts)
    neg = data.prompt_embeds([NEGATIVE])
    model = tiny.sd3_components("large")["transformer"]
    (lora,) = (tmp_path / "out").glob("t*.safetensors")
    apply_loras(model, [(lora, 1.0)])
    vae = tiny.sd3_components("large")["vae"]

    def grid(negative: PromptEmbeds):
        images = sample_images(model, vae, embeds, [9, 10], width=64, height=48, steps=3, guidance=4.5,
                               negative=negative, device="cpu", dtype=torch.float32)
        return np.asarray(make_grid(images))

    trained = np.asarray(Image.open(grid_file).convert("RGB"))
    assert np.array_equal(grid(neg), trained)
    empty = data.prompt_embeds([""])
    assert np.abs(grid(empty).astype(int) - trained.astype(int)).max() > 10


def test_sample_negative_prompt_is_refused_for_flux():
    from leantune.config import ConfigError, validate

    data = {"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]},
            "sample": {"prompts": ["x"], "negative_prompt": "blurry"}}
    with pytest.raises(ConfigError, match=r"\[sample\] negative_prompt: Flux samples with distilled guidance"):
        validate(data, "run.toml")
    sd3 = validate({**data, "model": {"path": "m", "family": "sd3"}}, "run.toml")
    assert sd3.sample.negative_prompt == "blurry"


@pytest.mark.gpu
def test_cuda_sd3_sampling_streams_exactly_and_runs_cfg_halves_in_sequence(tiny_sd3_dir, tmp_path):
    """On a GPU: CFG batched, streamed (real copy streams, pinned buffers) and with the halves one
    after the other give the resident images (the last up to a smaller batch's float rounding)."""
    from leantune.infer.run import run_sampling

    resident = run_sampling(_request(tiny_sd3_dir, tmp_path / "a", device="cuda", negative_prompt=NEGATIVE))
    assert set(resident.stage_peaks) == {"encode", "denoise", "decode"} and resident.cfg_batched
    streamed = run_sampling(_request(tiny_sd3_dir, tmp_path / "b", device="cuda", negative_prompt=NEGATIVE,
                                     memory={"streamed_blocks": "all", "stream_non_blocks": True}))
    assert streamed.stream_report["bytes_h2d"] > 0
    assert np.array_equal(_images(streamed), _images(resident))

    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import denoise
    from leantune.models.schedule import FlowSchedule
    from leantune.models.family import get_family

    c = tiny.sd3_components("large")
    t = c["transformer"].to("cuda")
    embeds, neg = encode_prompts_stage(_encoders(c), PROMPTS, max_length=MAX_LEN, device="cuda",
                                       family=get_family("sd3"), negative_prompts=[NEGATIVE] * 2)
    kw = dict(width=W, height=H, steps=3, guidance=7.0, schedule=FlowSchedule.sd3(), device="cuda", negative=neg)
    batched, halves = denoise(t, embeds, SEEDS, **kw), denoise(t, embeds, SEEDS, cfg_batched=False, **kw)
    assert (batched - halves).abs().max() < 1e-3 * batched.abs().max()


def test_family_guessed_from_folder_or_file(tiny_sd3_dir, tiny_flux_dir, tmp_path):
    from leantune.models.family import guess_family
    from leantune.models.sd3.loading import save_stability_transformer

    assert guess_family(tiny_sd3_dir) == "sd3" and guess_family(tiny_flux_dir) == "flux"
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert guess_family(tiny_sd3_dir / weights) == "sd3" and guess_family(tiny_flux_dir / weights) == "flux"
    stability = save_stability_transformer(tiny.sd3_transformer(), tmp_path / "sd3.5_tiny.safetensors")
    assert guess_family(stability) == "sd3"
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
    assert guess_family(tmp_path / "junk.safetensors") is None and guess_family(tmp_path / "none") is None
