"""Loading straight into what is kept: a bf16 or fp32 file whose block Linears the run stores in fp8
is quantized tensor by tensor as it is read (`load_transformer(quantize_fp8=True)`), so host RAM
never holds the model in full precision. The result is bitwise what loading in bf16 and then
quantizing (the engine's apply_fp8_storage) gave, for Flux, SD3.5 and Qwen-Image files; the peak
is the bytes kept plus one block; full mode keeps its trained weights in their dtype.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leantune.config import FullConfig, MemoryConfig
from leantune.memory.fp8 import FP8_DTYPE, FP8_MAX, SCALE_ATTR, apply_fp8_storage, block_linears
from leantune.models.flux import loading as flux_loading
from leantune.models.qwen_image import loading as qwen_image_loading
from leantune.models.sd3 import loading as sd3_loading
from leantune import tiny
from leantune.models.family import fp8_load_options
from leantune.models.flux.spec import FLUX_SPEC
from leantune.models.qwen_image.spec import QWEN_IMAGE_SPEC
from leantune.models.sd3.spec import SD3_SPEC
from leantune.tiny.qwen_image import qwen_image_transformer
from leantune.train.trainable import trains_name

WIDE_FLUX = dict(attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))   # width 128: block scales


def _old_quantize(w: torch.Tensor, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """memory/fp8.quantize as it was before loads quantized (the reference the new path must equal bitwise)."""
    out_f, in_f = w.shape
    nb = in_f // block if (block and in_f % block == 0) else 1
    x = w.detach().float().reshape(out_f, nb, in_f // nb)
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(out_f, in_f), scale


def _flux_sources(path):
    return flux_loading.FluxSources(Path(path), None, None, None, None, None)


def _sd3_sources(path):
    return sd3_loading.SD3Sources(Path(path), None, None, None, None, None, None, None)


def _qwen_sources(path):
    return qwen_image_loading.QwenImageSources(Path(path), None, None, None)


def _assert_fp8_load_equals_bf16_then_quantize(loader, sources, spec, modulation=False, trains=None):
    """The quantizing load against the old path: load in bf16, then quantize with the old formula
    (and with the engine's apply_fp8_storage): every tensor, fp8 values and scales, bitwise."""
    ref = loader(sources, dtype=torch.bfloat16)
    got = loader(sources, dtype=torch.bfloat16, quantize_fp8=True, quantize_modulation=modulation,
                 trained=trains)
    engine = loader(sources, dtype=torch.bfloat16)
    for n, p in engine.named_parameters():
        p.requires_grad_(trains is not None and trains(n))
    apply_fp8_storage(engine, spec, modulation=modulation, keep_trainable=trains is not None)
    quantized = 0
    ref_linears = {q: lin for q, _, lin in block_linears(spec, ref)}
    eng_linears = {q: lin for q, _, lin in block_linears(spec, engine)}
    for qname, rel, lin in block_linears(spec, got):
        w_ref = ref_linears[qname].weight
        if spec.keeps_compute_dtype(rel, fp8_modulation=modulation) or (trains and trains(qname + ".weight")):
            assert lin.weight.dtype == torch.bfloat16 and torch.equal(lin.weight, w_ref), qname
            continue
        q, s = _old_quantize(w_ref)
        assert lin.weight.dtype == FP8_DTYPE, qname
        assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8)), qname
        assert torch.equal(getattr(lin, SCALE_ATTR), s), qname
        assert torch.equal(lin.weight.view(torch.uint8), eng_linears[qname].weight.view(torch.uint8)), qname
        assert torch.equal(getattr(lin, SCALE_ATTR), getattr(eng_linears[qname], SCALE_ATTR)), qname
        assert not lin.weight.requires_grad
        quantized += 1
    assert quantized > 0
    # everything outside the quantized Linears is the bf16 load, tensor for tensor
    g, r = got.state_dict(), ref.state_dict()
    for k, v in g.items():
        if v.dtype != FP8_DTYPE and not k.endswith(SCALE_ATTR):
            assert v.dtype == r[k].dtype and torch.equal(v, r[k]), k
    return got, engine


@pytest.mark.parametrize("file_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("modulation", [False, True])
def test_flux_quantizing_load_equals_bf16_load_then_quantize(tmp_path, file_dtype, modulation):
    path = flux_loading.save_bfl_transformer(tiny.flux_transformer(seed=4, **WIDE_FLUX), tmp_path / "f.safetensors",
                                             dtype=file_dtype)
    _assert_fp8_load_equals_bf16_then_quantize(flux_loading.load_transformer, _flux_sources(path), FLUX_SPEC,
                                               modulation=modulation)


def test_flux_diffusers_folder_and_full_mode_keep_trained_weights(tmp_path):
    """Full mode with a frozen part: the trained weights load in bf16, only the frozen block Linears in fp8."""
    folder = tiny.save_flux_folder(tmp_path / "flux", seed=5, **WIDE_FLUX)
    full = FullConfig(train=["*"], exclude=["single_transformer_blocks.*"])

    def trains(name):
        return trains_name(name, full.train, full.exclude)

    got, _ = _assert_fp8_load_equals_bf16_then_quantize(flux_loading.load_transformer,
                                                         _flux_sources(folder / "transformer"), FLUX_SPEC,
                                                         trains=trains)
    dtypes = {n: p.dtype for n, p in got.named_parameters()}
    assert dtypes["transformer_blocks.0.attn.to_q.weight"] == torch.bfloat16            # trained
    assert dtypes["single_transformer_blocks.0.attn.to_q.weight"] == FP8_DTYPE          # frozen


def test_sd3_quantizing_load_equals_bf16_load_then_quantize(tmp_path):
    path = sd3_loading.save_stability_transformer(tiny.sd3_transformer(seed=6), tmp_path / "sd3.safetensors",
                                                  dtype=torch.bfloat16)
    _assert_fp8_load_equals_bf16_then_quantize(sd3_loading.load_transformer, _sd3_sources(path), SD3_SPEC)


def test_qwen_image_quantizing_load_equals_bf16_load_then_quantize(tmp_path):
    model = qwen_image_transformer(seed=7, attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))
    path = qwen_image_loading.save_comfy_transformer(model, tmp_path / "qwen.safetensors", dtype=torch.float32)
    _assert_fp8_load_equals_bf16_then_quantize(qwen_image_loading.load_transformer, _qwen_sources(path),
                                               QWEN_IMAGE_SPEC)


def test_meta_load_prices_what_the_quantizing_load_keeps(tmp_path):
    path = flux_loading.save_bfl_transformer(tiny.flux_transformer(seed=4, **WIDE_FLUX), tmp_path / "f.safetensors",
                                             dtype=torch.bfloat16)
    meta = flux_loading.load_transformer(_flux_sources(path), quantize_fp8=True, device="meta")
    real = flux_loading.load_transformer(_flux_sources(path), quantize_fp8=True)
    shapes = {k: (v.dtype, tuple(v.shape)) for k, v in real.state_dict().items()}
    assert {k: (v.dtype, tuple(v.shape)) for k, v in meta.state_dict().items()} == shapes
    assert any(d == FP8_DTYPE for d, _ in shapes.values())


def test_load_options_follow_the_memory_section():
    """Quantize while loading exactly when the run's plan is the explicit [memory] one and stores fp8."""
    assert fp8_load_options(MemoryConfig(fp8=False)) == {}
    assert fp8_load_options(MemoryConfig(fp8=True)) == {"quantize_fp8": True}
    assert fp8_load_options(MemoryConfig(fp8=True, fp8_modulation=True)) == {"quantize_fp8": True,
                                                                           "quantize_modulation": True}
    assert fp8_load_options(MemoryConfig(fp8=True, vram_budget="8GiB")) == {}     # the planner decides later
    trains = trains_name.__call__
    assert fp8_load_options(MemoryConfig(fp8=True), trained=trains) == {"quantize_fp8": True, "trained": trains}


# -- the peak ----------------------------------------------------------------------------------------

def _status(key: str) -> int:
    return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0]) * 1024


def _random_bf16_flux_file(path: Path, n_double: int, n_single: int) -> Path:
    """A width-512 Flux BFL file in bf16 with random values (built on meta, filled tensor by tensor)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=n_double, num_single_layers=n_single,
                                       attention_head_dim=128, num_attention_heads=4, joint_attention_dim=64,
                                       pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    g = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(v.shape, generator=g) * 0.02).to(torch.bfloat16) for k, v in model.state_dict().items()}
    return flux_loading.save_bfl_transformer(state, path, metadata={
        "leantune.config": '{"axes_dims_rope": [16, 56, 56]}'})


_MEASURE = """
import ctypes, json, sys
from pathlib import Path
import torch
from leantune.config import MemoryConfig
from leantune.memory.fp8 import apply_fp8_storage
from leantune.models import weights
from leantune.models.flux import loading as flux_loading
from leantune.models.family import fp8_load_options
from leantune.models.flux.spec import FLUX_SPEC

weights.STAGING_BYTES = 2**20                      # small chunks: a tight, meaningful slack
path = Path(sys.argv[1])
sources = flux_loading.FluxSources(path, None, None, None, None, None)
options = fp8_load_options(MemoryConfig(fp8=True))

def status(key):
    return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0]) * 1024

def load_for_fp8_run():
    model = flux_loading.load_transformer(sources, dtype=torch.bfloat16, **options)
    apply_fp8_storage(model.requires_grad_(False), FLUX_SPEC)      # what apply_memory does with plan.fp8
    return model

load_for_fp8_run()                                   # warm-up: lazy imports, caches
ctypes.CDLL("libc.so.6").malloc_trim(0)
Path("/proc/self/clear_refs").write_text("5")        # the peak (VmHWM) starts now
before = status("VmRSS")
model = load_for_fp8_run()
peak = status("VmHWM") - before
kept = sum(t.numel() * t.element_size() for t in model.state_dict().values())
block = max(sum(p.numel() * 2 for p in b.parameters()) for _, b in FLUX_SPEC.blocks(model))   # in bf16
print(json.dumps({"peak": peak, "kept": kept, "block": block, "staging": weights.STAGING_BYTES}))
"""


def test_peak_is_the_bytes_kept_plus_one_block(tmp_path):
    """A bf16 file loaded for an fp8 run (memory.fp8 = true), in a fresh process: the host peak over
    load + the engine's fp8 storage stays within the bytes kept, one block and the staging buffers.
    The old path (the whole model in bf16, then quantized) peaks above the bf16 file's size."""
    path = _random_bf16_flux_file(tmp_path / "flux-bf16.safetensors", n_double=2, n_single=16)
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    slack = 4 * m["staging"] + 8 * 2**20                    # staging, quantize temporaries, allocator
    limit = m["kept"] + m["block"] + slack
    assert path.stat().st_size > limit                      # the whole model in bf16 would fail
    assert m["peak"] <= limit, {k: round(v / 2**20, 1) for k, v in m.items()}


# -- through the trainer ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from leantune.demo import draw_shapes

    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=6, size=64, seed=5)
    return folder


def test_an_fp8_lora_run_loads_quantized_and_trains_as_before(tmp_path, tiny_flux_dir, images, monkeypatch):
    """[memory] fp8 = true: the trainer loads the block Linears quantized, and the run trains as on
    the old path (load in the run's dtype, the engine quantizes). The first loss is bitwise the
    same (LoRA B starts at zero, so it is the base model's alone); later ones differ only through
    the LoRA's initial A, which add_lora redraws in fp32 when peft made it in the base's fp8 dtype."""
    from test_train import make_config

    from leantune import trainer as trainer_mod

    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    cfg = make_config(tmp_path / "new", tiny_flux_dir, images, extra=["memory.fp8=true"])
    assert trainer_mod._fp8_load_options(cfg) == {"quantize_fp8": True}
    seen = []
    real = flux_loading.load_transformer

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        if kwargs.get("device") != "meta":
            seen.append(sum(lin.weight.dtype == FP8_DTYPE for _, _, lin in block_linears(FLUX_SPEC, model)))
        return model

    monkeypatch.setattr(flux_loading, "load_transformer", spy)
    new = trainer_mod.train(cfg, progress=False, stop_after=3)
    assert seen and seen[0] > 0                                            # quantized while loading

    monkeypatch.setattr(trainer_mod, "_fp8_load_options", lambda cfg, plan=None: {})
    old_cfg = make_config(tmp_path / "old", tiny_flux_dir, images, extra=["memory.fp8=true"])
    old = trainer_mod.train(old_cfg, progress=False, stop_after=3)
    assert seen[-1] == 0                                                    # the old path loaded it unquantized
    assert new.losses[0] == old.losses[0]
    assert new.losses == pytest.approx(old.losses, rel=1e-3)


def test_full_mode_load_options_leave_trained_weights_alone():
    from types import SimpleNamespace

    from leantune import trainer as trainer_mod

    cfg = SimpleNamespace(train=SimpleNamespace(mode="full"), memory=MemoryConfig(fp8=True),
                          full=FullConfig(exclude=["single_transformer_blocks.*"]))
    options = trainer_mod._fp8_load_options(cfg)
    assert options["quantize_fp8"] is True
    assert options["trained"]("transformer_blocks.0.attn.to_q.weight")
    assert not options["trained"]("single_transformer_blocks.0.attn.to_q.weight")


def test_flux2_quantizing_load_equals_bf16_load_then_quantize(tmp_path):
    from leantune.models.flux2 import loading as flux2_loading, single_file as flux2_single_file
    from leantune.models.flux2.spec import FLUX2_DEV_SPEC
    from leantune.tiny.flux2 import flux2_transformer

    path = flux2_single_file.save_single_file(flux2_transformer(seed=8), tmp_path / "flux2.safetensors",
                                              dtype=torch.bfloat16)
    sources = flux2_loading.Flux2Sources(**{f: None for f in flux2_loading.Flux2Sources.__dataclass_fields__})
    sources = type(sources)(**{**sources.__dict__, "transformer": Path(path)})
    _assert_fp8_load_equals_bf16_then_quantize(flux2_loading.load_transformer, sources, FLUX2_DEV_SPEC)
