"""Base adapters (issue 34): frozen LoRAs under the trained one, and previews on another adapter
stack or another base, on the tiny Flux and the tiny SD3.5 (train/base_adapters.py,
infer/preview_base.py, models/other_base.py).

What is proved: training through a base adapter equals training on a base with that LoRA merged in
by hand (losses and trained weights), and its files hold the trained adapter only; a preview with
`[sample] base_adapters = []` equals sampling the plain base plus the trained LoRA, and one with
`[sample] base` equals sampling that other base plus the trained LoRA; a run with base adapters
resumes exactly; streamed in poison mode (their weights packed into their blocks' units, the
trained adapter's resident) it trains as the plain model, a whole streamed training run with a
preview on another stack equals the resident run bit for bit, and the device holds no resident
byte for a streamed block's base adapters; the planner's units, slots, streamed host RAM and
resident "base adapters" term are the bytes the engine holds; bad files are refused naming key
and file.
The recipes of the two turbo families run on their tiny presets (z-image, krea2).

Why some take seconds: each comparison is between whole training runs of a few steps (2-4 s per
run on the shared 2-core machine, the tiny folders written once); the runs share one cache.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_toml

from leantune.config import LoraConfig, load_config
from leantune.demo import draw_shapes
from leantune.models.family import get_family
from leantune.train.lora import add_lora, lora_layers, lora_weights_from_model, read_lora, save_lora
from leantune.trainer import train

REST = """
[lora]
rank = 2
alpha = 2
targets = "attention_mlp"

[train]
steps = {steps}
learning_rate = 1e-3
mixed_precision = "no"
save_every = {save_every}
seed = 3

[sample]
prompts = ["a red square"]
steps = 2
width = 32
height = 32
every = {every}

[output]
dir = "out"
name = "t"
formats = ["comfyui", "diffusers"]
"""

FAMILIES = {"flux": "tiny_flux_dir", "sd3": "tiny_sd3_dir"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=2, size=64, seed=5)
    return folder


def _load(family: str, folder: Path) -> torch.nn.Module:
    fam = get_family(family)
    return fam.load_transformer(fam.resolve_sources(_model_cfg(family, folder), folder), dtype=torch.float32)


def _model_cfg(family: str, folder: Path):
    from leantune.config import ModelConfig

    return ModelConfig(family=family, path=str(folder), dtype="fp32")


def _adapter_file(family: str, folder: Path, path: Path, fmt: str, seed: int = 11) -> dict[str, torch.Tensor]:
    """A random rank-2 LoRA of the model's attention (a stand-in for a training adapter), written in
    `fmt`; returns its weight deltas by module name."""
    return _lora_of(_load(family, folder), family, path, fmt, seed)


def _lora_of(model, family: str, path: Path, fmt: str, seed: int = 11) -> dict[str, torch.Tensor]:
    spec = get_family(family).spec
    add_lora(model, spec, LoraConfig(rank=2, alpha=3, targets="attention"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model, "default").values():
            for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    weights = lora_weights_from_model(model)
    save_lora(weights, path, fmt, keys=spec.lora_keys)
    return {name: m.scale * m.up @ m.down for name, m in weights.modules.items()}


def _merged_folder(family: str, folder: Path, out: Path, deltas: dict, strength: float) -> Path:
    """A copy of the tiny folder whose transformer has `strength` x the deltas merged in by hand."""
    shutil.copytree(folder, out)
    model = _load(family, folder)
    with torch.no_grad():
        for name, delta in deltas.items():
            model.get_submodule(name).weight += strength * delta
    shutil.rmtree(out / "transformer")
    model.save_pretrained(out / "transformer", safe_serialization=True)
    return out


def _config(tmp: Path, family: str, folder: Path, images: Path, steps=3, every=0, save_every=0, extra=()):
    """A run of the tiny model; every run of the module shares one cache (entries are keyed by what
    encodes them, so runs on the same encoders hit and load no encoder)."""
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / "run.toml"
    p.write_text(tiny_run_toml(folder, images, REST.format(steps=steps, every=every, save_every=save_every)))
    return load_config(p, [f'model.family="{family}"', "data.max_text_length=16",
                           f'data.cache_dir="{images.parent / "cache"}"', *extra])


def _adapters(path: Path, strength: float) -> str:
    return f'[{{path = "{path}", strength = {strength}}}]'


def _trained(result, fmt="diffusers"):
    return read_lora(next(f for f in result.lora_files if f.name.endswith(f"_{fmt}.safetensors"))).modules


@pytest.mark.parametrize("family", FAMILIES)
def test_training_through_a_base_adapter_equals_training_on_the_merged_base(family, request, tmp_path, images):
    folder = request.getfixturevalue(FAMILIES[family])
    adapter = tmp_path / "adapter.safetensors"
    deltas = _adapter_file(family, folder, adapter, "comfyui")
    merged = _merged_folder(family, folder, tmp_path / "merged", deltas, 0.7)

    through = train(_config(tmp_path / "a", family, folder, images,
                            extra=[f"model.base_adapters={_adapters(adapter, 0.7)}"]), progress=False)
    on_merged = train(_config(tmp_path / "b", family, merged, images), progress=False)
    plain = train(_config(tmp_path / "c", family, folder, images), progress=False)

    assert through.losses == pytest.approx(on_merged.losses, rel=1e-5, abs=1e-7)
    assert through.losses != pytest.approx(plain.losses, rel=1e-3)       # the adapter matters
    for fmt in ("comfyui", "diffusers"):
        got, want = _trained(through, fmt), _trained(on_merged, fmt)
        assert got.keys() == want.keys() == _trained(plain, fmt).keys()   # the trained adapter only
        for name, m in want.items():
            torch.testing.assert_close(got[name].down, m.down, rtol=1e-4, atol=1e-6, msg=f"{fmt} {name}")
            torch.testing.assert_close(got[name].up, m.up, rtol=1e-4, atol=1e-6, msg=f"{fmt} {name}")
    # the resumable state holds the trained adapter and its optimizer state only
    from leantune.train.state import load_latest

    _, _, state = load_latest(through.paths.checkpoints)
    assert state["trainable"] and not [n for n in state["trainable"] if "base_adapter" in n]


class _Recorder:
    """Wraps the sampler's denoise: records every call's arguments and latents."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, transformer, *args, **kwargs):
        out = self.real(transformer, *args, **kwargs)
        self.calls.append((args, kwargs, out))
        return out


def _resample(model, call) -> torch.Tensor:
    from leantune.infer.sampler import denoise

    args, kwargs, _ = call
    return denoise(model.eval(), *args, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_previews_without_the_base_adapter_and_on_another_base(family, request, tmp_path, images, monkeypatch):
    """Train through a base adapter; preview with [sample] base_adapters = [] (the plain base + the
    trained LoRA), with the default (the adapter too), and on another base ([sample] base)."""
    import leantune.infer.sampler as sampler
    from leantune import tiny
    from leantune.infer.loras import apply_loras

    folder = request.getfixturevalue(FAMILIES[family])
    adapter = tmp_path / "adapter.safetensors"
    deltas = _adapter_file(family, folder, adapter, "diffusers")
    if family == "flux":
        other = tiny.save_flux_folder(tmp_path / "other", seed=1)
    else:
        other = tiny.save_sd3_folder(tmp_path / "other", style="large", seed=1)
    base = [f"model.base_adapters={_adapters(adapter, 0.7)}"]
    runs = {"none": ["sample.base_adapters=[]"], "default": [], "other": ["sample.base_adapters=[]", f'sample.base="{other}"']}
    recorded = {}
    for name, extra in runs.items():
        rec = _Recorder(sampler.denoise)
        monkeypatch.setattr(sampler, "denoise", rec)
        result = train(_config(tmp_path / name, family, folder, images, steps=2, every=2, extra=[*base, *extra]),
                       progress=False)
        monkeypatch.setattr(sampler, "denoise", rec.real)
        assert len(rec.calls) == 1 and result.sample_files
        recorded[name] = (rec.calls[0], next(f for f in result.lora_files if "diffusers" in f.name))

    def reference(model_folder, call, lora, with_adapter=False):
        model = _load(family, model_folder)
        apply_loras(model, [(adapter, 0.7)] * with_adapter + [(lora, 1.0)])
        return _resample(model, call)

    for name, folder_of, with_adapter in (("none", folder, False), ("default", folder, True), ("other", other, False)):
        call, lora = recorded[name]
        want = reference(folder_of / "transformer", call, lora, with_adapter)
        torch.testing.assert_close(call[2], want, rtol=1e-4, atol=1e-5, msg=name)
    # the adapter and the other base both change the preview (the comparisons above have teeth)
    call, lora = recorded["none"]
    assert (reference(folder / "transformer", call, lora, True) - call[2]).abs().max() > 1e-3
    call, lora = recorded["other"]
    assert (reference(folder / "transformer", call, lora) - call[2]).abs().max() > 1e-3
    assert deltas


def test_a_run_with_base_adapters_resumes_exactly(tiny_flux_dir, tmp_path, images):
    """Stopped after step 2 of 4 and resumed: the losses and the LoRA file are the uninterrupted
    run's, bit for bit (the adapters are re-read from their files, not saved in the state)."""
    from safetensors.torch import load_file

    adapter = tmp_path / "adapter.safetensors"
    _adapter_file("flux", tiny_flux_dir, adapter, "comfyui")
    extra = [f"model.base_adapters={_adapters(adapter, 0.7)}", f'data.cache_dir="{tmp_path / "cache"}"']
    full = train(_config(tmp_path / "full", "flux", tiny_flux_dir, images, steps=4, save_every=2, extra=extra),
                 progress=False)
    cfg = _config(tmp_path / "parts", "flux", tiny_flux_dir, images, steps=4, save_every=2, extra=extra)
    assert train(cfg, stop_after=2, progress=False).final_step == 2
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.final_step == 4 and resumed.losses == full.losses
    a, r = load_file(str(full.paths.lora_file("comfyui"))), load_file(str(resumed.paths.lora_file("comfyui")))
    assert a.keys() == r.keys() and a and all(torch.equal(a[k], r[k]) for k in a)
    # another adapter stack under the same checkpoint is refused, naming the key
    from leantune.errors import CheckpointError

    other = _config(tmp_path / "parts", "flux", tiny_flux_dir, images, steps=6, save_every=2,
                    extra=[f"model.base_adapters={_adapters(adapter, 0.5)}", extra[1]])
    with pytest.raises(CheckpointError, match="model.base_adapters"):
        train(other, resume=True, progress=False)


def test_a_streamed_run_with_base_adapters_equals_the_resident_run(tiny_flux_dir, tmp_path, images, monkeypatch,
                                                                    caplog):
    """The trainer with every block and the non-block group streamed, checkpointed, in poison mode,
    through a base adapter and previewing without it ([sample] base_adapters = []): its losses,
    its LoRA files and its preview's latents are the resident run's bit for bit, and the files
    hold the trained adapter alone (the [lora] targets' modules, no base-adapter key)."""
    import leantune.infer.sampler as sampler
    from safetensors.torch import load_file

    adapter = _flux_adapter(tiny_flux_dir, tmp_path)
    base = [f"model.base_adapters={_adapters(adapter, 0.7)}", "sample.base_adapters=[]"]
    streamed = ['memory.streamed_blocks="all"', "memory.stream_non_blocks=true", "memory.debug_poison=true",
                'memory.checkpointing="blocks"']
    runs = {}
    caplog.set_level("INFO", logger="leantune.memory")
    for name, extra in (("resident", base), ("streamed", [*base, *streamed])):
        rec = _Recorder(sampler.denoise)
        monkeypatch.setattr(sampler, "denoise", rec)
        result = train(_config(tmp_path / name, "flux", tiny_flux_dir, images, steps=2, every=2, extra=extra),
                       progress=False)
        monkeypatch.setattr(sampler, "denoise", rec.real)
        assert len(rec.calls) == 1
        runs[name] = (result, rec.calls[0][2])
    assert any("streaming: 4/4 blocks + non-block modules" in r.getMessage() and "base adapters" in r.getMessage()
               and "poison" in r.getMessage() for r in caplog.records)           # the trainer's units carry them
    (resident, r_latents), (stream, s_latents) = runs["resident"], runs["streamed"]
    assert stream.losses == resident.losses and torch.equal(s_latents, r_latents)
    for fmt in ("comfyui", "diffusers"):
        a, b = load_file(str(resident.paths.lora_file(fmt))), load_file(str(stream.paths.lora_file(fmt)))
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), fmt
    trained = _trained(stream)
    fresh = _load("flux", tiny_flux_dir)
    add_lora(fresh, get_family("flux").spec, LoraConfig(rank=2, targets="attention_mlp"))
    assert set(trained) == set(lora_layers(fresh, "default"))


def _inputs(model, family, hw, seed):
    from leantune.models.family import PromptEmbeds

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    x = family.pack_latents(torch.randn(2, family.latent_channels, *hw, generator=g))
    text = torch.randn(2, 7, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=g)
    return x, torch.rand(2, generator=g), PromptEmbeds(text, pooled)


def _two_steps(model, family):
    """Two SGD steps on two latent shapes: per step the output, loss, trained gradients and values."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(list(params.values()), lr=0.1)
    records = []
    for step, hw in enumerate(((4, 6), (6, 4))):
        x, sigma, embeds = _inputs(model, family, hw, step)
        target = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + step))
        opt.zero_grad(set_to_none=True)
        out = family.predict(model, x, sigma, embeds, hw, 3.5)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        records.append({"out": out.detach().clone(), "loss": loss.detach().clone(),
                        "grads": {n: p.grad.clone() for n, p in params.items()}})
        opt.step()
        records[-1]["values"] = {n: p.detach().clone() for n, p in params.items()}
    return records


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_with_base_adapters_trains_as_the_plain_model_in_poison_mode(family, request, tmp_path):
    """Every block and the non-block group streamed through two slots, checkpointed, in poison mode
    (a released slot is NaN): with a base adapter under the trained one, outputs, losses, gradients
    and updated LoRA values equal the plain model's bit for bit; the base adapter gets no gradient
    and stays as read. Its weights travel in their blocks' units (packed, in fp32, the trained
    adapter's not), so the device holds for them nothing but the slots' growth: its resident bytes
    are the ones of the same model and plan without the base adapter."""
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.train.base_adapters import BaseAdapterStack, read_adapters
    from leantune.config import AdapterRef

    folder = request.getfixturevalue(FAMILIES[family])
    fam = get_family(family)
    adapter = tmp_path / "adapter.safetensors"
    _adapter_file(family, folder, adapter, "comfyui")
    model = _load(family, folder)
    add_lora(model, fam.spec, LoraConfig(rank=2, targets="attention_mlp"))
    with torch.no_grad():                      # B != 0, so the trained adapter's gradients reach A
        for layer in lora_layers(model, "default").values():
            layer.lora_B["default"].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    adapters = read_adapters([AdapterRef(path=str(adapter), strength=0.7)], Path, fam.spec.lora_keys, "test")
    stack = BaseAdapterStack(model, adapters)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if "base_adapter_" in n}
    assert frozen and not any(p.requires_grad for n, p in model.named_parameters() if "base_adapter_" in n)
    plain = _two_steps(copy.deepcopy(model), fam)
    blocks = tuple(n for n, _ in fam.spec.blocks(model))
    plan = Plan(streamed_blocks=blocks, stream_non_blocks=True, debug_poison=True, checkpointing="blocks", ring_slots=2)
    bare = _load(family, folder)                # the same model and plan without the base adapter
    add_lora(bare, fam.spec, LoraConfig(rank=2, targets="attention_mlp"))
    bare_handle = apply_memory(bare, fam.spec, plan, "cpu", offload_min_bytes=0)
    handle = apply_memory(model, fam.spec, plan, "cpu", offload_min_bytes=0)
    packed = {id(m._parameters[a]) for u in handle.streaming.units for e in u.entries for m, kind, a in e.owners
              if kind == "param"}
    resident_adapters = {id(p) for u in handle.streaming.units for p in u.adapter_params}
    for n, p in model.named_parameters():
        if "base_adapter_" in n:
            assert id(p) in packed and id(p) not in resident_adapters and p.dtype == torch.float32, n
        elif ".lora_" in n:
            assert id(p) in resident_adapters and id(p) not in packed, n     # the trained adapter stays
    held, bare_held = handle.device_bytes(), bare_handle.device_bytes()
    grown = sum(u.nbytes for u in handle.streaming.units) - sum(u.nbytes for u in bare_handle.streaming.units)
    bare_handle.release()
    assert held["resident"] == bare_held["resident"]
    assert grown >= stack.device_bytes() > 0                        # in the units instead (512-byte aligned)
    streamed = _two_steps(model, fam)
    report = handle.step_report()
    handle.remove()
    assert report["bytes_h2d"] > 0
    for step, (got, want) in enumerate(zip(streamed, plain, strict=True)):
        assert torch.equal(got["out"], want["out"]) and torch.equal(got["loss"], want["loss"]), step
        for name, g in want["grads"].items():
            assert torch.equal(got["grads"][name], g), (step, name)
            assert torch.equal(got["values"][name], want["values"][name]), (step, name)
    assert not any("base_adapter_" in n for n in plain[0]["grads"])
    after = {n: p.detach() for n, p in model.named_parameters() if "base_adapter_" in n}
    assert after.keys() == frozen.keys() and all(torch.equal(after[n], frozen[n]) for n in frozen)
    assert stack.device_bytes() == sum(v.numel() * 4 for v in frozen.values())


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_base_adapters_stream_with_their_blocks(kind, tiny_flux_dir):
    """A LoKr / LoHa base adapter (peft keeps its factors in ParameterDicts, keyed by adapter name)
    under a trained LoRA, every unit streamed in poison mode: its factors are packed into the
    units, the trained adapter's are not, and two steps equal the plain model's bit for bit."""
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.train.base_adapters import BaseAdapter, BaseAdapterStack

    fam = get_family("flux")
    source = _load("flux", tiny_flux_dir)
    add_lora(source, fam.spec, LoraConfig(type=kind, rank=2, targets="attention"))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for n, p in source.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    weights = lora_weights_from_model(source)
    assert weights.kind == kind
    model = _load("flux", tiny_flux_dir)
    add_lora(model, fam.spec, LoraConfig(rank=2, targets="attention_mlp"))
    with torch.no_grad():
        for layer in lora_layers(model, "default").values():
            layer.lora_B["default"].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    BaseAdapterStack(model, [BaseAdapter(Path(f"{kind}.safetensors"), 0.8, weights)])
    frozen = {n for n, p in model.named_parameters() if "base_adapter_" in n}
    assert frozen and all(f".{'lokr' if kind == 'lokr' else 'hada'}_" in n for n in frozen)
    plain = _two_steps(copy.deepcopy(model), fam)
    plan = Plan(streamed_blocks=tuple(n for n, _ in fam.spec.blocks(model)), stream_non_blocks=True,
                debug_poison=True, checkpointing="blocks", ring_slots=2)
    handle = apply_memory(model, fam.spec, plan, "cpu", offload_min_bytes=0)
    packed = {id(m._parameters[a]) for u in handle.streaming.units for e in u.entries for m, k, a in e.owners
              if k == "param"}
    assert all(id(p) in packed for n, p in model.named_parameters() if n in frozen)
    assert not any(id(p) in packed for n, p in model.named_parameters() if ".default" in n)
    streamed = _two_steps(model, fam)
    handle.remove()
    for got, want in zip(streamed, plain, strict=True):
        assert torch.equal(got["loss"], want["loss"]) and torch.equal(got["out"], want["out"])
        assert all(torch.equal(got["values"][n], v) for n, v in want["values"].items())


def test_the_planner_prices_what_the_engine_holds(tiny_flux_dir, tmp_path, images):
    """With two of the four blocks streamed, the planner's streamed units are the engine's, byte
    for byte, base adapters packed in (so its stream slots and streamed host RAM too), and its
    "base adapters (resident)" term is what the engine's device holds more than the same model and
    plan without them: the resident blocks' share only, less than the stack. A [sample] base adds
    its transformer's bytes to host RAM while previewing and its ring, the preview's adapters
    packed in, to VRAM, each what the engine and the loader really hold."""
    from dataclasses import replace

    from leantune import tiny
    from leantune.config import AdapterRef
    from leantune.infer.preview_base import preview_plan
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.models.other_base import load_other_base
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.host_model import HOST_BASELINE
    from leantune.planner.memory_model import MemoryModel
    from leantune.train.base_adapters import BaseAdapterStack, priced_bytes, read_adapters

    fam = get_family("flux")
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    _adapter_file("flux", tiny_flux_dir, one, "comfyui", seed=1)
    _adapter_file("flux", tiny_flux_dir, two, "diffusers", seed=2)
    other = tiny.save_flux_folder(tmp_path / "other", seed=1)
    cfg = _config(tmp_path / "run", "flux", tiny_flux_dir, images, every=1, extra=[
        f"model.base_adapters={_adapters(one, 0.7)}",
        f'sample.base_adapters=[{{path = "{one}", strength = 0.2}}, {{path = "{two}"}}]', f'sample.base="{other}"'])
    w = workload_from_config(cfg)

    def engine(with_stack: bool):
        model = _load("flux", tiny_flux_dir)
        add_lora(model, fam.spec, LoraConfig(rank=2, targets="attention_mlp"))
        stack = BaseAdapterStack(model, training, sampling) if with_stack else None
        handle = apply_memory(model, fam.spec, plan, "cpu")
        out = (handle.device_bytes(), [u.nbytes for u in handle.streaming.units], handle.streaming.host_bytes,
               stack.device_bytes() if stack else 0)
        handle.release()
        return out

    read = lambda refs: read_adapters(refs, Path, fam.spec.lora_keys, "test")   # noqa: E731
    training = read([AdapterRef(path=str(one), strength=0.7)])
    sampling = read([AdapterRef(path=str(one), strength=0.2), AdapterRef(path=str(two))])
    names = tuple(n for n, _ in fam.spec.blocks(_load("flux", tiny_flux_dir)))
    plan = Plan(streamed_blocks=names[:2], ring_slots=2)       # both double blocks stream, the single ones not
    (held, units, host, stack_bytes), (bare_held, bare_units, bare_host, _) = engine(True), engine(False)
    assert w.frozen_adapter_bytes == priced_bytes(training, sampling) == stack_bytes > 0      # `one` once, `two` once
    on_device = held["resident"] - bare_held["resident"]
    assert 0 < on_device < stack_bytes and units != bare_units       # the streamed blocks' travel, the rest stays

    meta = fam.load_transformer(fam.resolve_sources(_model_cfg("flux", tiny_flux_dir), tiny_flux_dir),
                                dtype=torch.float32, device="meta")
    bare = replace(w, frozen_adapter_bytes=0, frozen_adapter_tensors=(), preview_base_bytes=0,
                   preview_adapter_tensors=())
    m0 = MemoryModel(fam.spec, meta, bare)
    e0 = m0.estimate(plan)
    with_adapters = replace(bare, frozen_adapter_bytes=w.frozen_adapter_bytes,
                            frozen_adapter_tensors=w.frozen_adapter_tensors)
    m1 = MemoryModel(fam.spec, m0.measured, with_adapters)
    e1 = m1.estimate(plan)
    assert m0.units(plan) == bare_units and m1.units(plan) == units
    assert e1.vram["base adapters (resident)"] == on_device
    assert (e0.vram["stream slots"], e1.vram["stream slots"]) == (bare_held["stream slots"], held["stream slots"])
    assert (e0.host["streamed blocks (pinned)"], e1.host["streamed blocks (pinned)"]) == (bare_host, host)
    assert e1.peak_vram - e0.peak_vram == on_device + held["stream slots"] - bare_held["stream slots"]
    everything = replace(plan, streamed_blocks=names)
    assert m1.estimate(everything).vram["base adapters (resident)"] == 0       # all travel
    assert MemoryModel(fam.spec, m0.measured, replace(with_adapters, frozen_adapter_tensors=())).estimate(
        plan).vram["base adapters (resident)"] == stack_bytes       # unlisted (`leantune sample`'s LoRAs): resident

    loaded = load_other_base(cfg.model, other, tmp_path, torch.float32)
    loaded_bytes = sum(t.numel() * t.element_size() for t in [*loaded.parameters(), *loaded.buffers()])
    assert w.preview_base_bytes == loaded_bytes
    e2 = MemoryModel(fam.spec, m0.measured, replace(bare, preview_base_bytes=loaded_bytes)).estimate(plan)
    assert e2.host["another base for previews"] == loaded_bytes
    steady = e0.host["streamed blocks (pinned)"] + e0.host["staging buffers"] + e0.host["offloaded activations"]
    assert e2.host["steps + another base while previewing"] == steady + loaded_bytes
    assert e2.peak_host == HOST_BASELINE + max(e0.peak_host - HOST_BASELINE, steady + loaded_bytes)
    assert e2.peak_vram - e0.peak_vram == e2.vram["another base for previews"] > 0
    # the preview's ring, [sample]'s adapters packed in as infer/preview_base.sample_on_other_base attaches them
    from leantune.train.lora import apply_lora

    for i, a in enumerate(sampling):
        apply_lora(loaded, a.weights, strength=a.strength, adapter_name=f"base_adapter_{i}")
    preview = apply_memory(loaded.requires_grad_(False), fam.spec, preview_plan(fam.spec, loaded), "cpu")
    ring = sum(s.buf.numel() for s in preview.streaming.engine.slots)
    preview.release()
    assert MemoryModel(fam.spec, m0.measured, w).preview_ring(plan) == ring > m0.preview_ring(plan)


def _sample_cli(argv: list[str]):
    """`leantune sample` as the CLI runs it: its flags -> the request -> run_sampling."""
    import argparse

    from leantune.commands import sample as sample_cmd
    from leantune.infer.request import validate_request
    from leantune.infer.run import run_sampling

    parser = argparse.ArgumentParser()
    sample_cmd.configure(parser)
    data, source = sample_cmd.request_data(parser.parse_args(argv))
    return run_sampling(validate_request(data, source, Path.cwd()))


def test_leantune_sample_takes_base_adapters_and_another_base(tiny_flux_dir, tmp_path, monkeypatch):
    """`--base-adapter` and `--base` equal diffusers' FluxPipeline with that LoRA loaded under the
    other (load_lora_weights, set_adapters) and with the other base's transformer."""
    import numpy as np
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from PIL import Image

    from leantune import tiny
    from leantune.infer.images import read_png_metadata

    adapter, lora = tmp_path / "turbo.safetensors", tmp_path / "trained.safetensors"
    _adapter_file("flux", tiny_flux_dir, adapter, "diffusers", seed=4)
    _adapter_file("flux", tiny_flux_dir, lora, "diffusers", seed=5)
    other = tiny.save_flux_folder(tmp_path / "other", seed=1)
    common = ["--model", str(tiny_flux_dir), "--prompt", "a cat", "--seed", "3", "--steps", "3", "--width", "32",
              "--height", "32", "--lora", f"{lora}:1", "--set", 'model.dtype="fp32"',
              "--set", f"max_text_length={tiny.T5_TINY_MAX_LENGTH}"]
    stacked = _sample_cli([*common, "--base-adapter", f"{adapter}:0.7", "--out", str(tmp_path / "a")])
    on_other = _sample_cli([*common, "--base", str(other), "--out", str(tmp_path / "b")])
    assert read_png_metadata(stacked.files[0])["base_adapters"] == f"{adapter}:0.7"
    assert read_png_metadata(on_other.files[0])["base"] == str(other)
    # under a budget the planner prices the attached adapters (the base adapter and the LoRA): resident,
    # the tiny model streaming no block under 1 GiB
    from leantune.config import AdapterRef
    from leantune.train.base_adapters import adapter_bytes, read_adapters

    import leantune.infer.run as run

    workloads = []
    real = run.inference_workload
    monkeypatch.setattr(run, "inference_workload", lambda *a, **k: workloads.append(real(*a, **k)) or workloads[-1])
    budgeted = _sample_cli([*common, "--base-adapter", f"{adapter}:0.7", "--vram", "1GiB", "--out", str(tmp_path / "c")])
    monkeypatch.setattr(run, "inference_workload", real)
    files = read_adapters([AdapterRef(path=str(adapter)), AdapterRef(path=str(lora))], Path,
                          get_family("flux").spec.lora_keys, "test")
    assert budgeted.plan.notes["vram_breakdown"]["base adapters (resident)"] == adapter_bytes(files) > 0
    # the base adapter's weights are the ones a streamed block would carry (the --lora stays resident)
    assert workloads and all(sum(n for _, n in w.frozen_adapter_tensors) == adapter_bytes(files[:1]) for w in workloads)
    assert all(".base_adapter_" in name and name.split(".")[0] in ("transformer_blocks", "single_transformer_blocks")
               for w in workloads for name, _ in w.frozen_adapter_tensors)

    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, torch_dtype=torch.float32)
    other_tf = FluxTransformer2DModel.from_pretrained(other / "transformer", torch_dtype=torch.float32)
    on_other_pipe = FluxPipeline(**{**pipe.components, "transformer": other_tf})
    pipe.load_lora_weights(str(adapter), adapter_name="turbo")
    for p in (pipe, on_other_pipe):
        p.load_lora_weights(str(lora), adapter_name="trained")
        p.set_progress_bar_config(disable=True)

    def sample(p, names, strengths):
        p.set_adapters(names, strengths)
        images = p("a cat", height=32, width=32, num_inference_steps=3, guidance_scale=3.5,
                   max_sequence_length=tiny.T5_TINY_MAX_LENGTH, generator=[torch.Generator().manual_seed(3)],
                   output_type="np").images
        return (images[0] * 255).round().astype(np.int16)

    want_stacked = sample(pipe, ["turbo", "trained"], [0.7, 1.0])
    plain = sample(pipe, ["trained"], [1.0])
    want_other = sample(on_other_pipe, ["trained"], [1.0])
    for result, want in ((stacked, want_stacked), (on_other, want_other)):
        got = np.asarray(Image.open(result.files[0])).astype(np.int16)
        assert np.abs(got - want).max() <= 1                      # u8 rounding of equal floats
        assert np.abs(got - plain).max() > 8                      # the adapter / the other base shows


def test_bad_base_adapters_and_bases_are_refused_naming_the_key_and_the_file(tiny_flux_dir, tiny_sd3_dir, tmp_path,
                                                                              images):
    """Refused before the caches fill or a weight loads: nothing of the run is written but its log."""
    from leantune.config import ConfigError
    from leantune.models.weights import LoadError
    from leantune.train.lora import LoraFormatError

    def run(name, *extra):
        cfg = _config(tmp_path / name, "flux", tiny_flux_dir, images,
                      extra=[*extra, f'data.cache_dir="{tmp_path / name / "cache"}"'])
        try:
            train(cfg, progress=False)
        finally:
            assert not (tmp_path / name / "cache").exists() and not (tmp_path / name / "out" / "checkpoints").exists()

    missing = tmp_path / "missing.safetensors"
    with pytest.raises(FileNotFoundError, match=rf"\[model\] base_adapters #1: {missing}: no such LoRA file"):
        run("missing", f"model.base_adapters={_adapters(missing, 1.0)}")
    with pytest.raises(ConfigError, match=r"model.base_adapters.*#1.*strength.*outside -10..10"):
        _config(tmp_path / "strong", "flux", tiny_flux_dir, images, extra=[f"model.base_adapters={_adapters(missing, 50)}"])
    with pytest.raises(ConfigError, match=r"sample.base_adapters.*#1.*strength"):
        _config(tmp_path / "nan", "flux", tiny_flux_dir, images, extra=[f"sample.base_adapters={_adapters(missing, 'nan')}"])

    from leantune import tiny

    wide = tmp_path / "wide.safetensors"                     # a LoRA of a wider Flux: its names, other shapes
    _lora_of(tiny.flux_transformer(0, num_attention_heads=3), "flux", wide, "diffusers")
    fits = _flux_adapter(tiny_flux_dir, tmp_path)
    with pytest.raises(LoraFormatError, match=rf"\[sample\] base_adapters #2: {wide}: LoRA key '[^']+' has down"):
        run("other_model", f'sample.base_adapters=[{{path = "{fits}"}}, {{path = "{wide}"}}]')
    with pytest.raises(LoraFormatError, match=r"\[model\] base_adapters #2: .* is listed already \(\[model\] "
                                              r"base_adapters #1\)"):
        run("twice", f'model.base_adapters=[{{path = "{fits}"}}, {{path = "{fits}", strength = 0.5}}]')
    not_lora = tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    with pytest.raises(LoraFormatError, match=rf"\[model\] base_adapters #1: {not_lora}"):
        run("not_lora", f"model.base_adapters={_adapters(not_lora, 1.0)}")

    with pytest.raises(LoadError, match=rf"\[sample\] base: {tiny_sd3_dir} is a sd3 model, but the run's \[model\] "
                                        rf"family is \"flux\""):
        run("sd3_base", f'sample.base="{tiny_sd3_dir}"')
    with pytest.raises(LoadError, match=r"\[sample\] base: .*nowhere: no such file or folder"):
        run("no_base", f'sample.base="{tmp_path / "nowhere"}"')


def _flux_adapter(folder: Path, tmp_path: Path) -> Path:
    path = tmp_path / "flux_adapter.safetensors"
    if not path.exists():
        _adapter_file("flux", folder, path, "comfyui")
    return path


def test_krea2_recipe_train_on_raw_preview_on_turbo(tmp_path, images, monkeypatch):
    """Krea 2's recipe on its tiny preset: a LoRA trained on Raw previews on a Turbo checkpoint
    ([sample] base, Turbo's few steps, no guidance) with Turbo's schedule (told by its folder) and
    equals sampling that Turbo + the trained LoRA; Raw's own schedule would give other latents."""
    from diffusers import Krea2Pipeline

    import leantune.infer.sampler as sampler
    from leantune.infer.loras import apply_loras
    from leantune.tiny import krea2 as tk

    raw = tk.save_krea2_folder(tmp_path / "raw", seed=0)
    turbo = tmp_path / "turbo"               # Raw's encoder and VAE, its own transformer, Turbo's model_index
    shutil.copytree(raw, turbo)
    shutil.rmtree(turbo / "transformer")
    tk.krea2_transformer(1).save_pretrained(turbo / "transformer", safe_serialization=True)
    index = json.loads((turbo / "model_index.json").read_text())
    (turbo / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    assert Krea2Pipeline.load_config(turbo)["is_distilled"]          # as the pipeline reads it
    rec = _Recorder(sampler.denoise)
    monkeypatch.setattr(sampler, "denoise", rec)
    cfg = _config(tmp_path / "run", "krea2", raw, images, steps=2, every=2,
                  extra=[f'sample.base="{turbo}"', "sample.steps=3", "sample.guidance=0.0", "data.max_text_length=32"])
    result = train(cfg, progress=False)
    monkeypatch.setattr(sampler, "denoise", rec.real)
    assert len(rec.calls) == 1 and result.sample_files
    args, kwargs, latents = rec.calls[0]
    fam = get_family("krea2")
    assert kwargs["schedule"] == fam.sampling.schedule("krea2", turbo) != fam.sampling.schedule("krea2", raw)

    lora = next(f for f in result.lora_files if "diffusers" in f.name)
    model = _load("krea2", turbo / "transformer")
    apply_loras(model, [(lora, 1.0)])
    torch.testing.assert_close(latents, _resample(model, rec.calls[0]), rtol=1e-4, atol=1e-5)
    wrong = dict(kwargs, schedule=fam.sampling.schedule("krea2", raw))
    assert (_resample(model, (args, wrong, None)) - latents).abs().max() > 1e-3


def test_z_image_recipe_train_through_the_adapter_preview_without_it(tmp_path, images, monkeypatch):
    """Z-Image Turbo's recipe on its tiny preset: trained through a training adapter, the preview
    with `[sample] base_adapters = []` (Turbo's few steps, no guidance) equals sampling the plain
    base + the trained LoRA, and the exported LoRA holds the trained adapter alone."""
    import leantune.infer.sampler as sampler
    from leantune.infer.loras import apply_loras
    from leantune.tiny import z_image as tz

    folder = tz.save_z_image_folder(tmp_path / "z-image")
    adapter = tmp_path / "training_adapter.safetensors"
    _adapter_file("z-image", folder, adapter, "comfyui")
    rec = _Recorder(sampler.denoise)
    monkeypatch.setattr(sampler, "denoise", rec)
    cfg = _config(tmp_path / "run", "z-image", folder, images, steps=2, every=2,
                  extra=[f"model.base_adapters={_adapters(adapter, 1.0)}", "sample.base_adapters=[]",
                         "sample.steps=3", "sample.guidance=0.0", "data.max_text_length=32"])
    result = train(cfg, progress=False)
    monkeypatch.setattr(sampler, "denoise", rec.real)
    assert len(rec.calls) == 1
    lora = next(f for f in result.lora_files if "diffusers" in f.name)
    trained = read_lora(lora).modules
    fresh = _load("z-image", folder)
    add_lora(fresh, get_family("z-image").spec, LoraConfig(rank=2, targets="attention_mlp"))
    assert set(trained) == set(lora_layers(fresh, "default"))          # the [lora] targets, one adapter each
    plain = _load("z-image", folder / "transformer")
    apply_loras(plain, [(lora, 1.0)])
    torch.testing.assert_close(rec.calls[0][2], _resample(plain, rec.calls[0]), rtol=1e-4, atol=1e-5)
    with_adapter = _load("z-image", folder / "transformer")
    apply_loras(with_adapter, [(adapter, 1.0), (lora, 1.0)])
    assert (_resample(with_adapter, rec.calls[0]) - rec.calls[0][2]).abs().max() > 1e-3


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_switching_to_the_preview_stack_and_back_is_exact(tiny_flux_dir, tmp_path, streamed):
    """for_sampling() with [sample] base_adapters = [b at 0.5] (a is [model]'s): inside, the output is
    the one of a model holding only b at 0.5 beside the trained adapter; after, the training output
    and every requires_grad come back exactly. Streamed: every block and the non-block group
    through two slots in poison mode, both adapters' weights travelling in the units (bit for bit
    the resident model's outputs)."""
    from leantune.config import AdapterRef
    from leantune.train.base_adapters import BaseAdapterStack, read_adapters

    fam = get_family("flux")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _adapter_file("flux", tiny_flux_dir, a, "comfyui", seed=1)
    _adapter_file("flux", tiny_flux_dir, b, "diffusers", seed=2)
    read = lambda *refs: read_adapters(list(refs), Path, fam.spec.lora_keys, "test")    # noqa: E731

    def model_with(training, sampling=None):
        model = _load("flux", tiny_flux_dir)
        torch.manual_seed(7)                      # the trained adapter's A init draws from it
        add_lora(model, fam.spec, LoraConfig(rank=2, targets="attention_mlp"))
        with torch.no_grad():
            for layer in lora_layers(model, "default").values():
                layer.lora_B["default"].weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        return model, BaseAdapterStack(model, training, sampling)

    def out(model):
        with torch.no_grad():
            return fam.predict(model, *_inputs(model, fam, (4, 6), 0), (4, 6), 3.5)

    model, stack = model_with(read(AdapterRef(path=str(a))), read(AdapterRef(path=str(b), strength=0.5)))
    handle = None
    if streamed:
        from leantune.memory.engine import apply_memory
        from leantune.memory.plan import Plan

        plan = Plan(streamed_blocks=tuple(n for n, _ in fam.spec.blocks(model)), stream_non_blocks=True,
                    debug_poison=True, ring_slots=2)
        handle = apply_memory(model, fam.spec, plan, "cpu")
        packed = {f"{u.name}.{p}" for u in handle.streaming.units for p in _packed_names(u)}
        assert {n for n, _ in model.named_parameters() if "base_adapter_" in n} <= packed
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    training = out(model)
    with stack.for_sampling():
        previewed = out(model)
        assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert torch.equal(out(model), training)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    if handle is not None:
        assert handle.step_report()["bytes_h2d"] > 0
        handle.remove()
    only_b, _ = model_with(read(AdapterRef(path=str(b), strength=0.5)))
    assert torch.equal(previewed, out(only_b))
    assert not torch.allclose(previewed, training, atol=1e-4)
    if streamed:                        # and the training stack's output is the resident model's
        resident, _ = model_with(read(AdapterRef(path=str(a))), read(AdapterRef(path=str(b), strength=0.5)))
        assert torch.equal(training, out(resident))


def _packed_names(unit) -> list[str]:
    """Qualified names (under the unit's module) of the parameters a streamed unit packs."""
    names = []
    for top in unit.modules:
        where = {id(m): n for n, m in top.named_modules()}
        for e in unit.entries:
            for m, kind, attr in e.owners:
                if kind == "param" and id(m) in where:
                    names.append(f"{where[id(m)]}.{attr}".lstrip("."))
    return names
