"""The staged sampler against diffusers' FluxPipeline, on tiny real components.

Parity is exact (max |diff| 0) wherever the computation is the same: in fp32 and in bf16 (with
diffusers decoding one image at a time as we do; batched bf16 convolutions round differently).
"""

from __future__ import annotations

import copy
import re
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from leantune import tiny
from leantune.models.flux import PromptEmbeds

PROMPTS = ["a photo of a cat", "a green triangle"]
SEEDS = [3, 7]
W, H = 96, 64          # latent 12 x 8: a non-square size catches packing / id mix-ups
MAX_LEN = tiny.T5_TINY_MAX_LENGTH


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


def _eval(components: dict) -> dict:
    # Freshly built transformers models are in train mode (T5 dropout 0.1); pipelines loaded from
    # disk are in eval mode. Compare like with like.
    for v in components.values():
        if isinstance(v, torch.nn.Module):
            v.eval()
    return components


@pytest.fixture(scope="module")
def comps32():
    return _eval(tiny.flux_components(seed=0))


def _pipe(components, one_image_decodes: bool = True):
    """A FluxPipeline over the same modules; by default its VAE decodes image by image like stage 3
    (batched convolutions reassociate sums: ~1e-6 apart, enough to flip a rare 8-bit rounding)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.use_slicing = one_image_decodes
    return pipe


def _reference(pipe, prompts=PROMPTS, seeds=SEEDS, steps=4, guidance=3.5, output_type="np", **kw):
    return pipe(prompts, height=H, width=W, num_inference_steps=steps, guidance_scale=guidance,
                max_sequence_length=MAX_LEN, generator=[torch.Generator().manual_seed(s) for s in seeds],
                output_type=output_type, **kw).images


def _encoders(c):
    return SimpleNamespace(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"],
                           tokenizer_2=c["tokenizer_2"], text_encoder_2=c["text_encoder_2"])


def _ours(c, prompts=PROMPTS, seeds=SEEDS, steps=4, guidance=3.5, transformer=None, **kw):
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import sample_images
    from leantune.models.schedule import FlowSchedule

    embeds = encode_prompts_stage(_encoders(c), prompts, max_length=MAX_LEN, device="cpu")
    schedule = FlowSchedule.from_scheduler_config(dict(c["scheduler"].config),
                                                  "dev" if c["transformer"].config.guidance_embeds else "schnell")
    images = sample_images(transformer or c["transformer"], c["vae"], embeds, seeds, width=W, height=H, steps=steps,
                           guidance=guidance, schedule=schedule, device="cpu", **kw)
    return np.stack([np.asarray(im) for im in images])


def _u8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


# -- schedule ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dev", "schnell"])
@pytest.mark.parametrize("steps,seq_len", [(1, 256), (4, 24), (28, 4096), (20, 1024), (50, 6000)])
def test_sigmas_equal_diffusers_scheduler(variant, steps, seq_len):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from leantune.models.schedule import FlowSchedule

    if variant == "dev":
        sched = tiny.flux_scheduler()
    else:   # FLUX.1-schnell's published scheduler config
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    mu = calculate_shift(seq_len)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = FlowSchedule.from_scheduler_config(dict(sched.config), variant)
    assert ours.mu(seq_len) == mu
    assert torch.equal(ours.sigmas(steps, seq_len), sched.sigmas)
    assert FlowSchedule.for_variant(variant).sigmas(steps, seq_len).equal(sched.sigmas)


def test_schedule_rejects_unsupported_scheduler_settings(tmp_path):
    from leantune.models.schedule import FlowSchedule

    folder = tmp_path / "m"
    (folder / "scheduler").mkdir(parents=True)
    cfg = folder / "scheduler" / "scheduler_config.json"
    cfg.write_text('{"use_karras_sigmas": true}')
    with pytest.raises(ValueError, match=re.escape(str(cfg)) + ".*use_karras_sigmas"):
        FlowSchedule.from_model_folder(folder, "dev")
    cfg.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(cfg)) + ": not a readable scheduler config"):
        FlowSchedule.from_model_folder(folder, "dev")


# -- parity with FluxPipeline -----------------------------------------------------------------------

def test_staged_sampler_equals_flux_pipeline_fp32(comps32):
    ref = _reference(_pipe(comps32))                       # (2, H, W, 3) float in [0, 1]
    ours = _ours(comps32)
    assert ours.shape == (2, H, W, 3)
    assert np.array_equal(ours, _u8(ref))
    batched = _u8(_reference(_pipe(comps32, one_image_decodes=False)))
    assert np.abs(ours.astype(int) - batched.astype(int)).max() <= 1
    # The float images too, before rounding to 8 bits.
    from leantune.infer.decode import decode_latents
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import denoise
    from leantune.models.schedule import FlowSchedule

    embeds = encode_prompts_stage(_encoders(comps32), PROMPTS, max_length=MAX_LEN)
    lat = denoise(comps32["transformer"], embeds, SEEDS, width=W, height=H, steps=4, guidance=3.5,
                  schedule=FlowSchedule.for_variant("dev"), device="cpu")
    floats = decode_latents(comps32["vae"], lat, "cpu").permute(0, 2, 3, 1).numpy()
    assert np.abs(floats - ref).max() == 0.0
    # Guidance is an input of dev models: a different scale gives a different image.
    assert not np.array_equal(_ours(comps32, guidance=1.0), ours)


def test_staged_sampler_equals_flux_pipeline_bf16():
    c = _eval(tiny.flux_components(seed=1, dtype=torch.bfloat16))
    ref = _reference(_pipe(c), steps=3)
    assert np.array_equal(_ours(c, steps=3), _u8(ref))


def test_schnell_equals_flux_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler

    c = _eval(tiny.flux_components(seed=2, guidance_embeds=False))
    c["scheduler"] = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    ref = _reference(_pipe(c), steps=4, guidance=0.0)
    ours = _ours(c, steps=None, guidance=None)            # schnell defaults: 4 steps, no guidance input
    assert np.array_equal(ours, _u8(ref))


def test_batch_size_and_per_image_seeds_do_not_change_images(comps32):
    whole = _ours(comps32)
    one_by_one = _ours(comps32, batch_size=1)
    assert np.abs(whole.astype(int) - one_by_one.astype(int)).max() <= 1   # float reassociation only
    # Image i depends only on its own seed: swapping seeds swaps the noise, not the prompt.
    swapped = _ours(comps32, prompts=PROMPTS, seeds=[7, 3])
    assert not np.array_equal(swapped[0], whole[0])
    single = _ours(comps32, prompts=PROMPTS[:1], seeds=SEEDS[:1])
    assert np.abs(single[0].astype(int) - whole[0].astype(int)).max() <= 1


def test_size_must_be_multiple_of_16(comps32):
    from leantune.infer.sampler import denoise
    from leantune.models.schedule import FlowSchedule

    e = PromptEmbeds(torch.zeros(1, 4, 32), torch.zeros(1, 32))
    with pytest.raises(ValueError, match="width = 72 must be a positive multiple of 16"):
        denoise(comps32["transformer"], [e], [0], width=72, height=64, steps=1, guidance=1.0,
                schedule=FlowSchedule(), device="cpu")
    with pytest.raises(ValueError, match="2 prompt embeddings but 1 seeds"):
        denoise(comps32["transformer"], [e, e], [0], width=64, height=64, steps=1, guidance=1.0,
                schedule=FlowSchedule(), device="cpu")


# -- LoRAs ------------------------------------------------------------------------------------------

def _random_lora(transformer, names: list[str], rank: int, alpha: float, seed: int):
    from leantune.train.lora import LoraModule, LoraWeights

    g = torch.Generator().manual_seed(seed)
    mods = {}
    for n in names:
        lin = transformer.get_submodule(n)
        mods[n] = LoraModule(torch.randn(rank, lin.in_features, generator=g) * 0.3,
                             torch.randn(lin.out_features, rank, generator=g) * 0.3, alpha)
    return LoraWeights(modules=mods)


_DOUBLE_ATTN = [f"transformer_blocks.{i}.attn.{m}" for i in range(2)
                for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj")]
_SINGLE = [f"single_transformer_blocks.{i}.{m}" for i in range(2) for m in ("attn.to_q", "proj_out")]


def test_loras_equal_diffusers_load_lora_weights(comps32, tmp_path):
    """A diffusers-format and a kohya-format LoRA at two strengths, against diffusers' own loader."""
    from leantune.infer.loras import apply_loras
    from leantune.train.lora import save_lora

    base = comps32["transformer"]
    a = save_lora(_random_lora(base, _DOUBLE_ATTN + _SINGLE, rank=4, alpha=8.0, seed=1), tmp_path / "a.safetensors",
                  "diffusers")
    # kohya layout: q/k/v fused into qkv. (diffusers splits a single block's fused linear1 only at
    # Flux's real width, so this one stays in the double blocks.)
    b = save_lora(_random_lora(base, _DOUBLE_ATTN, rank=2, alpha=1.0, seed=2), tmp_path / "b.safetensors", "comfyui")

    ref_c = dict(comps32, transformer=copy.deepcopy(base))
    pipe = _pipe(ref_c)
    pipe.load_lora_weights(str(a), adapter_name="a")
    pipe.load_lora_weights(str(b), adapter_name="b")
    pipe.set_adapters(["a", "b"], [0.8, 0.5])
    ref = _reference(pipe)

    ours_t = copy.deepcopy(base)
    names = apply_loras(ours_t, [(a, 0.8), (b, 0.5)])
    assert len(names) == 2
    ours = _ours(comps32, transformer=ours_t)
    assert np.array_equal(ours, _u8(ref))
    # The LoRAs matter: without them the image is visibly different.
    plain = _ours(comps32)
    assert np.abs(plain.astype(int) - ours.astype(int)).max() > 10


def test_bad_lora_files_give_clear_errors(comps32, tmp_path):
    from leantune.infer.loras import apply_loras
    from leantune.train.lora import save_lora

    t = copy.deepcopy(comps32["transformer"])
    good = save_lora(_random_lora(t, _DOUBLE_ATTN, 2, 2.0, 0), tmp_path / "good.safetensors", "diffusers")

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(good.read_bytes()[:200])            # truncated download
    with pytest.raises(ValueError, match=re.escape(str(corrupt))):
        apply_loras(t, [(good, 1.0), (corrupt, 1.0)])

    # A LoRA for a wider Flux (inner width 64): right names, wrong shapes.
    wide = tiny.flux_transformer(num_attention_heads=4)
    wrong = save_lora(_random_lora(wide, _DOUBLE_ATTN, 2, 2.0, 0), tmp_path / "wide.safetensors", "comfyui")
    with pytest.raises(ValueError, match=re.escape(str(wrong)) + r".*lora_unet_double_blocks_0_img_attn_"):
        apply_loras(t, [(good, 1.0), (wrong, 1.0)])

    # A LoRA for more blocks than the model has.
    deep = tiny.flux_transformer(num_layers=4)
    names = ["transformer_blocks.3.attn.to_q"]
    too_deep = save_lora(_random_lora(deep, names, 2, 2.0, 0), tmp_path / "deep.safetensors", "diffusers")
    with pytest.raises(ValueError, match=re.escape(str(too_deep)) + r".*transformer_blocks\.3\.attn\.to_q"):
        apply_loras(t, [(too_deep, 1.0)])

    # Keys of another architecture altogether (an SDXL UNet LoRA).
    from leantune.io import save_safetensors

    sdxl = save_safetensors({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(2, 8),
                             "lora_unet_down_blocks_0_attentions_0_proj_in.lora_up.weight": torch.zeros(8, 2)},
                            tmp_path / "sdxl.safetensors")
    with pytest.raises(ValueError, match=re.escape(str(sdxl)) + r".*lora_unet_down_blocks_0_attentions_0_proj_in"):
        apply_loras(t, [(sdxl, 1.0)])

    # Nothing was applied by the failed calls: the good file was checked but never added.
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert not any(isinstance(m, BaseTunerLayer) for m in t.modules())


# -- stage 1: T5 block by block ---------------------------------------------------------------------

def test_t5_blockwise_offload_equals_resident_and_keeps_blocks_empty(comps32):
    from leantune.infer.encode import blockwise_offload, encode_prompts_stage, t5_blocks

    enc = _encoders(comps32)
    t5 = enc.text_encoder_2
    before = {n: p.data_ptr() for n, p in t5.named_parameters()}
    resident = encode_prompts_stage(enc, PROMPTS, max_length=MAX_LEN, stream_t5=False)
    streamed = encode_prompts_stage(enc, PROMPTS, max_length=MAX_LEN, stream_t5=True)
    for r, s in zip(resident, streamed):
        assert torch.equal(r.t5, s.t5) and torch.equal(r.pooled, s.pooled)

    # While block i runs, every other block holds no weights: only one block is ever resident.
    blocks = t5_blocks(t5)
    seen = []

    def probe(i):
        def hook(module, *_):
            sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
            seen.append((i, sizes))
        return hook

    hs = [b.register_forward_hook(probe(i)) for i, b in enumerate(blocks)]
    ids = enc.tokenizer_2(PROMPTS, padding="max_length", max_length=MAX_LEN, return_tensors="pt").input_ids
    try:
        with blockwise_offload(t5, blocks, "cpu"), torch.no_grad():
            assert all(p.numel() == 0 for p in blocks.parameters())
            t5(ids)
    finally:
        for h in hs:
            h.remove()
    assert [i for i, _ in seen] == list(range(len(blocks)))
    for i, sizes in seen:
        assert sizes[i] > 0 and all(s == 0 for j, s in enumerate(sizes) if j != i)
    # Afterwards every weight is back, the very same storage.
    assert {n: p.data_ptr() for n, p in t5.named_parameters()} == before


# -- stage 3: decode ----------------------------------------------------------------------------------

class _PeakTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of tensor storages alive at once, created inside the mode (CPU max_memory_allocated)."""

    def __init__(self):
        super().__init__()
        self.cur = self.peak = 0
        self.live: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n == 0 or key in self.live:
                    continue
                self.live.add(key)
                self.cur += n
                self.peak = max(self.peak, self.cur)
                weakref.finalize(st, self._free, key, n)
        return out

    def _free(self, key, n):
        self.cur -= n
        self.live.discard(key)


def test_tiled_decode_fits_budget_and_stays_close():
    from leantune.infer.decode import decode_latents, estimate_decode_bytes, plan_decode

    vae = tiny.vae().eval()
    z = torch.randn(1, 16, 32, 32, generator=torch.Generator().manual_seed(0))    # a 256 x 256 image
    whole_est = estimate_decode_bytes(vae, 256, 256)
    whole_plan = plan_decode(vae, 256, 256, "auto", available_bytes=whole_est)
    assert whole_plan.tile_latent is None
    budget = whole_est // 2
    tiled_plan = plan_decode(vae, 256, 256, "auto", available_bytes=budget)
    assert tiled_plan.tile_latent is not None and tiled_plan.estimated_peak_bytes <= budget

    peaks, images = {}, {}
    for name, plan in (("whole", whole_plan), ("tiled", tiled_plan)):
        tracker = _PeakTracker()
        with torch.no_grad(), tracker:
            images[name] = decode_latents(vae, z, "cpu", plan)
        peaks[name] = tracker.peak
    # The estimates bound what was measured, and tiling measurably lowers the peak.
    assert peaks["whole"] <= whole_est
    assert peaks["tiled"] <= tiled_plan.estimated_peak_bytes
    assert peaks["tiled"] < 0.5 * peaks["whole"]
    assert images["tiled"].shape == images["whole"].shape == (1, 3, 256, 256)
    # Tiles see less context (the mid-block attention is global), so pixels differ near seams; on a
    # random tiny VAE the mean stays within 0.05 of [0, 1].
    assert (images["tiled"] - images["whole"]).abs().mean() < 0.05
    assert plan_decode(vae, 256, 256, "off", available_bytes=1).tile_latent is None
    with pytest.raises(ValueError, match="vae tiling"):
        plan_decode(vae, 256, 256, "sometimes")


def test_decode_estimate_for_flux_vae_at_1024():
    """The full-size Flux VAE at 1024^2 needs a tiled decode under a 6 GB budget minus the model."""
    from diffusers import AutoencoderKL

    from leantune.infer.decode import estimate_decode_bytes, plan_decode

    with torch.device("meta"):
        vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            norm_num_groups=32, sample_size=1024).to(torch.bfloat16)
    whole = estimate_decode_bytes(vae, 1024, 1024)
    assert 2 * 2**30 < whole < 3 * 2**30                     # 256 ch x 1024^2 x 2 B x 4 + attention
    plan = plan_decode(vae, 1024, 1024, "auto", available_bytes=1 * 2**30)
    assert plan.tile_latent is not None and plan.estimated_peak_bytes <= 2**30


# -- images -------------------------------------------------------------------------------------------

def test_png_metadata_round_trip_and_grid(tmp_path):
    from PIL import Image

    from leantune.infer.images import (
        format_loras,
        make_grid,
        read_png_metadata,
        save_png,
    )

    img = Image.new("RGB", (32, 16), (10, 20, 30))
    meta = {"prompt": "a cat, \"quoted\" — ünïcode", "seed": "42", "steps": "28", "guidance": "3.5",
            "loras": format_loras([("a.safetensors", 0.8), ("b.safetensors", 1.0)]), "model": "/m/flux"}
    path = save_png(img, tmp_path / "x.png", meta)
    back = read_png_metadata(path)
    for k, v in meta.items():
        assert back[k] == v
    assert back["loras"] == "a.safetensors:0.8, b.safetensors:1"
    assert not list(tmp_path.glob(".*.tmp"))
    grid = make_grid([img, Image.new("RGB", (32, 16), (200, 0, 0)), img], cols=2)
    assert grid.size == (64, 32)
    assert grid.getpixel((40, 5)) == (200, 0, 0) and grid.getpixel((5, 20)) == (10, 20, 30)
    assert grid.getpixel((40, 20)) == (255, 255, 255)
    with pytest.raises(ValueError, match="image 1 is 8x8, expected 32x16"):
        make_grid([img, Image.new("RGB", (8, 8))])


# -- during training ---------------------------------------------------------------------------------

class _ForwardOnlyProbe:
    """A memory handle stand-in that records the mode the transformer actually ran in."""

    def __init__(self, transformer):
        self.mode = False
        self.modes_seen: list[bool] = []
        self.transitions: list[bool] = []
        transformer.register_forward_pre_hook(lambda *_: self.modes_seen.append(self.mode))

    def forward_only(self, enabled: bool) -> None:
        self.mode = enabled
        self.transitions.append(enabled)


def test_sample_during_training_matches_sampler_and_restores_state(comps32):
    from leantune.config import SampleConfig
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.images import make_grid
    from leantune.infer.sampler import sample_during_training

    t = copy.deepcopy(comps32["transformer"])
    embeds = encode_prompts_stage(_encoders(comps32), PROMPTS, max_length=MAX_LEN)
    batched = PromptEmbeds(torch.cat([e.t5 for e in embeds]), torch.cat([e.pooled for e in embeds]))
    cfg = SampleConfig(prompts=PROMPTS, seed=3, steps=4, guidance=3.5, width=W, height=H)
    handle = _ForwardOnlyProbe(t)
    t.train()
    rng = torch.get_rng_state()
    loads = []

    def vae_loader():
        loads.append(1)
        return copy.deepcopy(comps32["vae"])

    grid = sample_during_training(t, vae_loader, batched, cfg, memory_handle=handle, device="cpu", cols=2)
    assert handle.transitions == [True, False]
    assert handle.modes_seen and all(handle.modes_seen)        # every denoising forward ran forward-only
    assert len(handle.modes_seen) == 4                        # 4 steps, both images in one batch
    assert t.training and loads == [1]
    assert torch.equal(torch.get_rng_state(), rng)            # the training run's random stream is untouched
    # Seeds are cfg.seed + i: the same images as the standalone sampler with seeds [3, 4].
    from PIL import Image

    expected = make_grid([Image.fromarray(a) for a in _ours(comps32, seeds=[3, 4])], cols=2)
    assert np.array_equal(np.asarray(grid), np.asarray(expected))


# -- the memory engine under sampling -------------------------------------------------------------------

@pytest.fixture(scope="module")
def comps16():
    return _eval(tiny.flux_components(seed=4, dtype=torch.bfloat16))


def _engine_sample(c, plan, steps=3):
    from leantune.memory.engine import apply_memory
    from leantune.models.flux import FLUX_SPEC

    t = copy.deepcopy(c["transformer"]).requires_grad_(False)
    handle = apply_memory(t, FLUX_SPEC, plan, "cpu")
    handle.forward_only(True)
    try:
        images = _ours(c, transformer=t, steps=steps)
        units = handle.streaming.unit_bytes() if handle.streaming is not None else {}
        return images, {**handle.step_report(), "unit_bytes": units}
    finally:
        handle.remove()


def test_streaming_is_exact_and_fp8_is_near(comps16):
    """Streamed weights are the same bytes: identical images. fp8 storage rounds the block Linear
    weights (block-scaled e4m3): at most 8/255 per pixel and 1/255 on average on the tiny model."""
    from leantune.memory.plan import Plan
    from leantune.models.flux import FLUX_SPEC

    names = [n for n, _ in FLUX_SPEC.blocks(comps16["transformer"])]
    resident = _ours(comps16, steps=3)
    # Every other block streamed, with poison: a released slot is NaN, so a stale weight would show.
    half, rep = _engine_sample(comps16, Plan(streamed_blocks=tuple(names[1::2]), debug_poison=True))
    assert np.array_equal(half, resident)
    # Forward-only keeps the resident blocks in place: only the 2 streamed blocks travel, once per
    # denoising step (3), plus the ring's prefetch of the next step's first blocks.
    per_step = sum(rep["unit_bytes"].values())
    assert len(rep["unit_bytes"]) == 2
    assert 3 * per_step <= rep["bytes_h2d"] <= 3 * per_step + rep["slots"] * rep["slot_bytes"]
    everything, _ = _engine_sample(comps16, Plan(streamed_blocks=tuple(names), stream_non_blocks=True,
                                                 debug_poison=True))
    assert np.array_equal(everything, resident)

    fp8, _ = _engine_sample(comps16, Plan(fp8=True))
    diff = np.abs(fp8.astype(int) - resident.astype(int))
    assert 0 < diff.max() <= 8 and diff.mean() <= 1.0
    fp8_streamed, _ = _engine_sample(comps16, Plan(fp8=True, streamed_blocks=tuple(names), debug_poison=True))
    assert np.array_equal(fp8_streamed, fp8)


def test_sample_during_training_with_streaming_engine(comps16):
    """The trainer's model as it trains: a LoRA adapter, streamed blocks, checkpointing, train mode.
    Sampling reuses it as is and training continues afterwards."""
    from leantune.config import LoraConfig, SampleConfig
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import sample_during_training
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.models.flux import FLUX_SPEC, predict
    from leantune.train.lora import add_lora

    embeds = encode_prompts_stage(_encoders(comps16), PROMPTS, max_length=MAX_LEN)
    cfg = SampleConfig(prompts=PROMPTS, seed=5, steps=2, guidance=3.5, width=W, height=H)

    def model_with_adapter():
        t = copy.deepcopy(comps16["transformer"])
        params = add_lora(t, FLUX_SPEC, LoraConfig(rank=2, dropout=0.5))   # dropout must be off in samples
        with torch.no_grad():
            for p in params:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
        return t, params

    plain, _ = model_with_adapter()
    expected = sample_during_training(plain.eval(), comps16["vae"], embeds, cfg)

    t, params = model_with_adapter()
    names = [n for n, _ in FLUX_SPEC.blocks(t)]
    handle = apply_memory(t, FLUX_SPEC, Plan(streamed_blocks=tuple(names[::2]), checkpointing="blocks",
                                             debug_poison=True), "cpu")
    t.train()
    handle.step_report()
    grid = sample_during_training(t, comps16["vae"], embeds, cfg, memory_handle=handle)
    assert np.array_equal(np.asarray(grid), np.asarray(expected))
    assert grid.size == (2 * W, H)
    assert t.training and not handle.mode.forward_only
    # A training step still runs after sampling: gradients reach the adapter through streamed blocks.
    x = torch.randn(1, (H // 16) * (W // 16), 64, dtype=torch.bfloat16)
    out = predict(t, x, torch.tensor([0.5]), embeds[0], (H // 8, W // 8), 3.5)
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params)
    handle.remove()


# -- `leantune sample`: request -> PNG files ------------------------------------------------------------

def _request(folder, out, **kw):
    from leantune.infer.request import validate_request

    data = {"model": {"path": str(folder), "dtype": "fp32"}, "prompts": PROMPTS, "seed": 3, "steps": 3,
            "width": W, "height": H, "max_text_length": MAX_LEN, "out": str(out), **kw}
    return validate_request(data, "test request")


def test_run_sampling_equals_pipeline_from_folder(tiny_flux_dir, tmp_path):
    """Loading, a LoRA at 0.7, three stages, PNGs with metadata; equal to FluxPipeline.from_pretrained."""
    from diffusers import FluxPipeline

    from leantune.infer.images import read_png_metadata
    from leantune.infer.run import run_sampling
    from leantune.train.lora import save_lora

    lora = save_lora(_random_lora(tiny.flux_transformer(), _DOUBLE_ATTN + _SINGLE, 2, 4.0, 9),
                     tmp_path / "style.safetensors", "diffusers")
    result = run_sampling(_request(tiny_flux_dir, tmp_path / "out", lora=[{"path": str(lora), "strength": 0.7}]))
    assert [f.name for f in result.files] == ["00000-3.png", "00001-4.png"]
    assert not result.stream_t5 and result.decode_tile is None and result.plan.streamed_blocks == ()
    meta = read_png_metadata(result.files[1])
    assert meta["prompt"] == PROMPTS[1] and meta["seed"] == "4" and meta["steps"] == "3"
    assert meta["guidance"] == "3.5" and meta["width"] == str(W) and meta["height"] == str(H)
    assert meta["loras"] == f"{lora}:0.7" and meta["model"] == str(tiny_flux_dir) and meta["variant"] == "dev"

    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.use_slicing = True
    pipe.load_lora_weights(str(lora), adapter_name="style")
    pipe.set_adapters(["style"], [0.7])
    ref = _u8(_reference(pipe, seeds=[3, 4], steps=3))
    from PIL import Image

    ours = np.stack([np.asarray(Image.open(f)) for f in result.files])
    assert np.array_equal(ours, ref)

    # Under a budget smaller than CLIP + T5 + margin, T5 runs block by block: same images, and the
    # next run's files are numbered after the first run's (nothing is overwritten).
    tight = run_sampling(_request(tiny_flux_dir, tmp_path / "out", lora=[{"path": str(lora), "strength": 0.7}],
                                  memory={"vram_budget": "400MiB"}))
    assert tight.stream_t5
    assert [f.name for f in tight.files] == ["00002-3.png", "00003-4.png"]
    assert np.array_equal(np.stack([np.asarray(Image.open(f)) for f in tight.files]), ours)

    # Every block and the non-block group streamed, in fp8: one model alive at a time (each stage's
    # model is gone when the next one is asked for), and images near the unquantized ones.
    from leantune.infer.run import FolderComponents

    class Watched(FolderComponents):
        def text_encoders(self, dtype):
            enc = super().text_encoders(dtype)
            self.t5 = weakref.ref(enc.text_encoder_2)
            return enc

        def transformer(self, dtype):
            self.t5_alive_at_denoise = self.t5() is not None
            t = super().transformer(dtype)
            self.tr = weakref.ref(t)
            self.block = t.transformer_blocks[0]        # a streamed block, kept to see how it was left
            return t

        def vae(self, dtype, device):
            self.transformer_alive_at_decode = self.tr() is not None
            return super().vae(dtype, device)

    request = _request(tiny_flux_dir, tmp_path / "fp8", lora=[{"path": str(lora), "strength": 0.7}],
                       memory={"streamed_blocks": "all", "stream_non_blocks": True, "fp8": True})
    watched = Watched(request)
    streamed = run_sampling(request, components=watched)
    assert not watched.t5_alive_at_denoise and not watched.transformer_alive_at_decode
    assert streamed.plan.fp8 and len(streamed.plan.streamed_blocks) == 4
    # The engine was released, not removed: no streamed weight was copied back, no wrapper is left.
    base = [p for n, p in watched.block.named_parameters() if "lora_" not in n]
    assert base and all(p.numel() == 0 for p in base)
    assert "forward" not in watched.block.__dict__                 # streaming's and checkpointing's wrappers
    assert streamed.stream_report["bytes_h2d"] > 0
    diff = np.abs(np.stack([np.asarray(Image.open(f)) for f in streamed.files]).astype(int) - ours.astype(int))
    assert 0 < diff.max() <= 8 and diff.mean() <= 1.0


def _sample_cli(argv):
    import argparse

    from leantune.commands import sample

    parser = argparse.ArgumentParser()
    sample.configure(parser)
    return sample.run(parser.parse_args(argv))


def test_sample_command_flags_and_toml(tiny_flux_dir, tmp_path, monkeypatch, capsys):
    from leantune.config import ConfigError
    from leantune.infer.images import read_png_metadata

    monkeypatch.chdir(tmp_path)
    rc = _sample_cli(["--model", str(tiny_flux_dir), "--prompt", "a yellow star", "--steps", "2", "--width", "64",
                      "--height", "64", "--seed", "11", "--out", "flags", "--set", "max_text_length=32"])
    assert rc == 0
    files = sorted((tmp_path / "flags").glob("*.png"))
    assert [f.name for f in files] == ["00000-11.png"]
    meta = read_png_metadata(files[0])
    assert meta["prompt"] == "a yellow star" and meta["steps"] == "2" and meta["loras"] == ""

    # The TOML form; flags override its values.
    (tmp_path / "req").mkdir()
    toml = tmp_path / "req" / "request.toml"
    toml.write_text(f'prompts = ["a cyan cross", "a magenta diamond on grey"]\nseed = 1\nsteps = 2\nwidth = 64\n'
                    f'height = 48\nmax_text_length = 32\nout = "imgs"\n[model]\npath = "{tiny_flux_dir}"\n')
    assert _sample_cli([str(toml), "--seed", "20"]) == 0
    files = sorted((tmp_path / "req" / "imgs").glob("*.png"))          # `out` is relative to the TOML file
    assert [f.name for f in files] == ["00000-20.png", "00001-21.png"]
    assert read_png_metadata(files[1])["prompt"] == "a magenta diamond on grey"
    from PIL import Image

    assert Image.open(files[0]).size == (64, 48)

    # Unknown keys and bad values are errors naming the file and the key.
    toml.write_text(toml.read_text().replace("seed = 1", "sed = 1"))
    with pytest.raises(ConfigError, match=re.escape(str(toml)) + r": top level: unknown key 'sed'; did you mean 'seed'\?"):
        _sample_cli([str(toml)])
    with pytest.raises(ConfigError, match=r"command line: top level: key 'width': .*width = 50 must be a positive multiple"):
        _sample_cli(["--model", str(tiny_flux_dir), "--prompt", "x", "--width", "50"])
    with pytest.raises(ConfigError, match=r"\[\[lora\]\] #1: unknown key 'strenght'; did you mean 'strength'"):
        _sample_cli(["--model", str(tiny_flux_dir), "--prompt", "x", "--set", "lora=[{path='a', strenght=1}]"])
    # A corrupt LoRA file: exit status 2 and a message naming the file.
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 64)
    capsys.readouterr()
    rc = _sample_cli(["--model", str(tiny_flux_dir), "--prompt", "x", "--steps", "1", "--width", "64", "--height",
                      "64", "--lora", f"{bad}:0.5", "--set", "max_text_length=32", "--out", "never"])
    assert rc == 2
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_lora_argument_parsing():
    from leantune.infer.request import parse_lora_arg

    assert parse_lora_arg("a.safetensors:0.8") == {"path": "a.safetensors", "strength": 0.8}
    assert parse_lora_arg("a.safetensors") == {"path": "a.safetensors", "strength": 1.0}
    assert parse_lora_arg(r"C:\loras\a.safetensors") == {"path": r"C:\loras\a.safetensors", "strength": 1.0}
    assert parse_lora_arg(r"C:\loras\a.safetensors:-0.5") == {"path": r"C:\loras\a.safetensors", "strength": -0.5}


@pytest.mark.gpu
def test_cuda_staged_sampling_streams_exactly_and_reports_stage_peaks(tiny_flux_dir, tmp_path):
    """On a GPU: real copy streams and pinned buffers give the resident images, T5 streaming too,
    and every stage's peak reserved memory is measured."""
    from PIL import Image

    from leantune.infer.run import run_sampling

    def images(result):
        return np.stack([np.asarray(Image.open(f)) for f in result.files])

    resident = run_sampling(_request(tiny_flux_dir, tmp_path / "a", device="cuda"))
    assert set(resident.stage_peaks) == {"encode", "denoise", "decode"}
    assert all(v > 0 for v in resident.stage_peaks.values())
    streamed = run_sampling(_request(tiny_flux_dir, tmp_path / "b", device="cuda",
                                     memory={"streamed_blocks": "all", "stream_non_blocks": True}))
    assert streamed.stream_report["bytes_h2d"] > 0
    assert np.array_equal(images(streamed), images(resident))
    tight = run_sampling(_request(tiny_flux_dir, tmp_path / "c", device="cuda", memory={"vram_budget": "400MiB"}))
    assert tight.stream_t5 and np.array_equal(images(tight), images(resident))
    assert max(tight.stage_peaks.values()) <= 400 * 2**20


def test_run_sampling_on_a_base_quantized_as_read(tiny_flux_dir, tmp_path):
    """[memory] base_format = "int8" in a sample request: the transformer's block Linears are int8
    ConvRot rows quantized as its file is read, with a LoRA unmerged over them; the images equal
    those of the plain load quantized in place (the same bytes) and stay near the bf16-free ones."""
    from PIL import Image

    from leantune.infer.run import FolderComponents, run_sampling
    from leantune.memory import int8_storage
    from leantune.models.flux import FLUX_SPEC
    from leantune.train.lora import save_lora

    lora = save_lora(_random_lora(tiny.flux_transformer(), _DOUBLE_ATTN + _SINGLE, 2, 4.0, 9),
                     tmp_path / "style.safetensors", "diffusers")
    lora_arg = [{"path": str(lora), "strength": 0.7}]

    class Kept(FolderComponents):
        def transformer(self, dtype):
            t = super().transformer(dtype)
            self.int8 = sum(int8_storage.is_int8(m) for m in t.modules())
            return t

    class InPlace(FolderComponents):
        def transformer(self, dtype):
            t = super().transformer(dtype).requires_grad_(False)
            int8_storage.apply_int8_storage(t, FLUX_SPEC)
            return t

    request = _request(tiny_flux_dir, tmp_path / "int8", lora=lora_arg, memory={"base_format": "int8"})
    kept = Kept(request)
    quantized = run_sampling(request, components=kept)
    plain_request = _request(tiny_flux_dir, tmp_path / "ref", lora=lora_arg)
    in_place = run_sampling(plain_request, components=InPlace(plain_request))
    plain = run_sampling(_request(tiny_flux_dir, tmp_path / "plain", lora=lora_arg))
    images = lambda r: np.stack([np.asarray(Image.open(f)) for f in r.files]).astype(int)   # noqa: E731
    assert kept.int8 > 0
    assert np.array_equal(images(quantized), images(in_place))
    diff = np.abs(images(quantized) - images(plain))
    assert 0 < diff.max() <= 24 and diff.mean() <= 2.0
