"""`[lora] type`: DoRA, LoKr and LoHa beside plain LoRA (train/adapter_types.py, train/lora.py,
train/lora_formats.py), on tiny Flux and SD3.5 models on CPU: what the family conformance suite
(tests/families/) does not check for every family.

- the shapes the planner prices are the ones peft creates, and its probe prices each type;
- fp8 storage under the memory engine computes the same losses, adapter gradients and updates as
  the plain model with the same storage, bitwise (as tests/test_memory_parity.py); DoRA over fp8
  storage is refused naming `[lora] type`. (Streamed blocks in poison mode for every type and
  family: the suite's test_streamed_trains_as_the_plain_model_in_poison_mode.)
- LoKr with both factors products (rank 2, decompose_both): the comfyui-layout export, applied the
  way ComfyUI applies it (tests/comfyui_keymap.py), gives peft's own merged weights at strength 1,
  and leantune's reader gives back exactly the tensors written; the sampler's apply_lora the
  trained outputs. (Every type's files on every family, in ComfyUI, diffusers and leantune's
  reader: the suite's promises.)
- the diffusers layout carries peft's names and config, `leantune convert` round-trips, init_from
  continues a file of the same type;
- the config names the key it refuses. (Resume by type: the suite's
  test_resume_equals_the_uninterrupted_run.)
"""

from __future__ import annotations

import copy
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from comfyui_keymap import comfyui_load, comfyui_native_state
from safetensors.torch import load_file

from leantune import tiny
from leantune.config import ConfigError, LoraConfig, TrainConfig, load_config
from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC
from leantune.models.flux import predict as flux_predict
from leantune.models.sd3 import SD3_SPEC
from leantune.train.adapter_types import adapter_numel, adapter_shapes
from leantune.train.lora import (LoraCompatibilityWarning, adapter_parameters, add_lora, apply_lora, layer_kind,
                                 lora_layers, lora_weights_from_model, read_lora)
from leantune.train.lora_formats import LycorisModule, effective_weight
from leantune.train.lora_mode import LoraMode

KINDS = ("lora", "dora", "lokr", "loha")
FILE_KINDS = (*KINDS, "lokr2")         # LoKr with every factor a product too (_lora_cfg)
FAMILIES = {"flux": FLUX_SPEC, "sd3": SD3_SPEC}


def _lora_cfg(kind: str, rank: int = 4, **extra) -> LoraConfig:
    """Rank 4 on the tiny models' 32..128-wide Linears: LoKr's factors are whole there (its scale is
    then folded into w1 in a LyCORIS file); "lokr2", rank 2 with decompose_both: both are products."""
    options = {}
    if kind == "lokr2":
        kind, rank, options = "lokr", 2, {"decompose_both": True}
    return LoraConfig(type=kind, rank=rank, alpha=2.0 * rank, targets="all", **options, **extra)


def _model(family: str):
    return tiny.flux_transformer(seed=0) if family == "flux" else tiny.sd3_transformer("large", seed=0)


def _trained(family: str, kind: str, rank: int = 4):
    """(base, model with a random adapter of `kind`, its parameters by name)."""
    base = _model(family)
    base.requires_grad_(False)
    model = copy.deepcopy(base)
    params = add_lora(model, FAMILIES[family], _lora_cfg(kind, rank))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            # DoRA's magnitude stays near the base rows' norms; every other factor random
            p.copy_(p * (1 + 0.1 * torch.randn(p.shape, generator=g)) if p.dim() == 1
                    else 0.2 * torch.randn(p.shape, generator=g))
    return base, model


def _batch(family: str, step: int):
    g = torch.Generator().manual_seed(step)
    h, w = (8, 8) if step == 0 else (8, 12)
    if family == "flux":
        from leantune.models.flux import PromptEmbeds, pack_latents

        x = pack_latents(torch.randn(2, 16, h, w, generator=g))
        embeds = PromptEmbeds(torch.randn(2, 8, 32, generator=g), torch.randn(2, 32, generator=g))
        return (x, torch.rand(2, generator=g), embeds, (h, w)), torch.randn(2, (h // 2) * (w // 2), 64, generator=g)
    inputs = dict(hidden_states=torch.randn(2, 16, h, w, generator=g),
                  encoder_hidden_states=torch.randn(2, 8, 64, generator=g),
                  pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.rand(2, generator=g) * 1000)
    return inputs, torch.randn(2, 16, h, w, generator=g)


def _forward(family: str, model, inputs):
    if family == "flux":
        x, sigma, embeds, hw = inputs
        return flux_predict(model, x, sigma, embeds, hw, guidance=1.0)
    return model(**inputs).sample


def _train(family: str, model) -> list[dict]:
    """Two SGD steps; per step the loss, the adapter gradients and the values after the step."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(list(params.values()), lr=0.05)
    records = []
    for step in range(2):
        inputs, target = _batch(family, step)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(_forward(family, model, inputs).float(), target)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        opt.step()
        records.append({"loss": loss.detach(), "grads": grads, "values": {n: p.detach().clone() for n, p in params.items()}})
    return records


def _assert_same(got: list[dict], want: list[dict]) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g["loss"], w["loss"]), f"step {step}: loss {g['loss'].item()} != {w['loss'].item()}"
        assert g["grads"].keys() == w["grads"].keys() and w["grads"]
        for n in w["grads"]:
            assert torch.equal(g["grads"][n], w["grads"][n]), f"step {step}: gradient of {n}"
            assert torch.equal(g["values"][n], w["values"][n]), f"step {step}: {n} after the step"


# -- the shapes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_peft_creates_the_shapes_the_planner_prices(kind):
    from peft import LoHaConfig, LoKrConfig, LoraConfig as PeftLoraConfig, inject_adapter_in_model

    for (inn, out), rank, factor, both in [((64, 96), 4, -1, False), ((3072, 3072), 16, -1, False),
                                           ((3072, 12288), 16, -1, True), ((48, 16), 40, -1, False),
                                           ((128, 128), 2, 4, True), ((96, 192), 1, 8, False)]:
        if kind != "lokr" and (factor != -1 or both):
            continue
        net = torch.nn.Sequential(torch.nn.Linear(inn, out, bias=False, device="meta"))
        config = {"lora": PeftLoraConfig(r=rank, target_modules=["0"]),
                  "dora": PeftLoraConfig(r=rank, target_modules=["0"], use_dora=True),
                  "lokr": LoKrConfig(r=rank, target_modules=["0"], decompose_factor=factor, decompose_both=both),
                  "loha": LoHaConfig(r=rank, target_modules=["0"])}[kind]
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inject_adapter_in_model(config, net)
        got = {role: tuple(p.shape) for role, p in adapter_parameters(net[0], "default").items()}
        assert got == adapter_shapes(kind, inn, out, rank, factor, both), (inn, out, rank, factor, both)


@pytest.mark.parametrize("kind", KINDS)
def test_the_planner_counts_the_parameters_training_creates(kind):
    from leantune.planner.weight_bytes import measure_weights
    from leantune.planner.workload import Workload

    model = _model("flux")
    params = add_lora(copy.deepcopy(model), FLUX_SPEC, _lora_cfg(kind))
    weights = measure_weights(FLUX_SPEC, model, Workload(rank=4, targets="all", adapter=kind))
    assert weights.adapter_params(4, kind) == sum(p.numel() for p in params)
    assert sum(adapter_numel(kind, a.in_features, a.out_features, 4) for a in weights.adapters) == \
        sum(p.numel() for p in params)


@pytest.mark.parametrize("kind", ["dora", "loha", "lokr"])
def test_the_probe_prices_the_type_at_any_rank(kind):
    """DoRA's and LoHa's activations are affine in the rank, as LoRA's: one trace prices every rank
    exactly (tests/test_planner_rank.py's claim). LoKr's factors change shape with the rank, so it
    is traced at the workload's rank, and its measurement is kept per rank."""
    from dataclasses import replace

    from leantune.planner.activation_probe import probe_activations
    from leantune.planner.spec_cache import _workload_shape
    from leantune.planner.workload import Workload

    model = tiny.flux_transformer(num_layers=1, num_single_layers=1)
    model.requires_grad_(False)
    w = Workload(rank=4, targets="attention_mlp", buckets=((128, 128),), text_length=8, dtype=torch.float32,
                 autocast=True, allow_fp8=False, adapter=kind)
    profile = probe_activations(FLUX_SPEC, model, w, (128, 128))
    if kind == "lokr":
        assert profile.per_rank is None and _workload_shape(w)["rank"] == 4
        assert _workload_shape(w) != _workload_shape(replace(w, rank=8))
        return
    assert profile.per_rank is not None and "rank" not in _workload_shape(w)
    for rank in (2, 16):
        direct = probe_activations(FLUX_SPEC, model, replace(w, rank=rank), (128, 128), rank=rank)
        got, want = profile.at_rank(rank), direct
        for name, k in want.kinds.items():
            assert got.kinds[name].saved == k.saved and got.kinds[name].bwd_transient == k.bwd_transient, (name, rank)
        assert (got.pre, got.post) == (want.pre, want.post)
    plain = probe_activations(FLUX_SPEC, model, replace(w, adapter="lora"), (128, 128))
    assert profile.kinds["double"].saved > plain.kinds["double"].saved      # the type's own activations are traced


# -- the memory engine ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_fp8_storage_equals_the_plain_model_with_the_same_storage(kind):
    """fp8 storage of the streamed base weights (the adapter stays resident in fp32): losses,
    adapter gradients and updates bitwise those of the plain model with fp8 storage. Plain LoRA:
    tests/test_memory_parity.py; streamed blocks in poison mode for every type and family: the
    conformance suite."""
    _, model = _trained("flux", kind)
    ref = copy.deepcopy(model)
    handle = apply_memory(ref, FLUX_SPEC, Plan(fp8=True), "cpu")
    want = _train("flux", ref)
    handle.remove()
    names = tuple(n for n, _ in FLUX_SPEC.blocks(model))
    got = copy.deepcopy(model)
    handle = apply_memory(got, FLUX_SPEC, Plan(fp8=True, streamed_blocks=names, stream_non_blocks=True,
                                              debug_poison=True), "cpu")
    records = _train("flux", got)
    assert handle.step_report()["bytes_h2d"] > 0
    assert all("default" in n.split(".") for n in records[0]["grads"])     # only the adapter trains
    _assert_same(records, want)
    handle.remove()


def test_dora_over_fp8_storage_is_refused_naming_the_key():
    _, model = _trained("flux", "dora")
    with pytest.raises(ValueError, match=r'\[lora\] type = "dora"'):
        apply_memory(model, FLUX_SPEC, Plan(fp8=True), "cpu")


def test_dora_on_an_fp8_checkpoint_is_refused_naming_the_key():
    model = _model("flux")
    lin = model.transformer_blocks[0].attn.to_q
    lin.weight.data = lin.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r'\[lora\] type = "dora".*float8_e4m3fn'):
        add_lora(model, FLUX_SPEC, _lora_cfg("dora"))


# -- files ------------------------------------------------------------------------------------------------

class _Paths:
    def __init__(self, root):
        self.root, self.name = root, "run"

    def lora_file(self, fmt, step=None):
        return self.root / f"{self.name}_{fmt}.safetensors"


def _export(family: str, model, tmp_path):
    spec = FAMILIES[family]
    mode = LoraMode(_lora_cfg("lora"), TrainConfig(), ["comfyui", "diffusers"])
    mode.spec = spec
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files = mode.export(SimpleNamespace(transformer=model, optimizer=None), _Paths(tmp_path), step=3,
                            intermediate=False)
    return files, [str(w.message) for w in caught if issubclass(w.category, LoraCompatibilityWarning)]


def _peft_merged(base, model) -> dict[str, torch.Tensor]:
    """The base state dict with each adapted Linear's weight as peft's own merge makes it."""
    merged = {k: v.clone() for k, v in base.state_dict().items()}
    work = copy.deepcopy(model)
    for name, layer in lora_layers(work, "default").items():
        layer.merge(adapter_names=["default"])
        merged[f"{name}.weight"] = layer.get_base_layer().weight.detach().clone()
    return merged


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        for kind in FILE_KINDS:
            base, model = _trained(family, kind)
            files, warned = _export(family, model, tmp_path_factory.mktemp(f"{family}-{kind}"))
            out[family, kind] = SimpleNamespace(base=base, model=model, comfy=files[0], diffusers=files[1],
                                                warned=warned)
    return out


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("kind", ["lokr2"])           # the other types: the conformance suite, every family
def test_comfyui_applies_the_exported_file_as_peft_merges_it(exported, family, kind):
    e = exported[family, kind]
    tensors = load_file(e.comfy)
    native = comfyui_native_state(family, e.base)
    want = comfyui_native_state(family, e.base, _peft_merged(e.base, e.model))
    load = comfyui_load(family, native, tensors, dora_fixed=True)
    assert load.loaded == set(tensors) and not load.skipped
    changed = {k for k in native if not torch.equal(want[k], native[k])}
    assert changed and set(load.deltas) == changed, sorted(set(load.deltas) ^ changed)
    for k in changed:
        torch.testing.assert_close(native[k] + load.deltas[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    if kind != "lora":
        fused = [k for k in tensors if k.startswith("lycoris_")]
        assert fused, "the parts of fused native Linears carry their LyCORIS names"
    if kind == "dora":
        # stock ComfyUI divides by the base weight's row norms: close, not the trained weights; said at export
        stock = comfyui_load(family, native, tensors).deltas
        assert any(not torch.allclose(native[k] + stock[k], want[k], rtol=1e-5, atol=1e-6) for k in changed)
        assert any("Comfy-Org/ComfyUI#15458" in w for w in e.warned)


@pytest.mark.parametrize("family", ["flux", "sd3"])
@pytest.mark.parametrize("kind", ["lokr2"])           # the other types: the conformance suite, every family
def test_leantune_reads_its_files_back_exactly_and_samples_as_trained(exported, family, kind):
    e = exported[family, kind]
    if kind == "lokr2":
        assert any({"w1_a", "w2_a"} <= set(m.factors) for m in lora_weights_from_model(e.model).modules.values())
        kind = "lokr"
    trained = lora_weights_from_model(e.model)
    g = torch.Generator().manual_seed(1)
    for path in (e.comfy, e.diffusers):
        back = read_lora(path, FAMILIES[family].lora_keys)
        assert back.kind == kind and back.modules.keys() == trained.modules.keys()
        for name, m in trained.modules.items():
            got = back.modules[name]
            assert got.tensors().keys() == m.tensors().keys()
            for role, t in m.tensors().items():
                assert torch.equal(got.tensors()[role], t), (path.name, name, role)
            assert math.isclose(got.scale, m.scale, rel_tol=1e-12)
            if isinstance(m, LycorisModule):
                assert got.alpha == m.alpha and got.rank == m.rank
        # the sampler's path: a frozen adapter on a fresh base computes what the trained one does
        fresh = _model(family)
        fresh.requires_grad_(False)
        apply_lora(fresh, back, 1.0, "sampled")
        layers, trained_layers = lora_layers(fresh, "sampled"), lora_layers(e.model, "default")
        for name, layer in trained_layers.items():
            assert layer_kind(layers[name], "sampled") == kind
            x = torch.randn(3, layer.in_features, generator=g)
            torch.testing.assert_close(layers[name](x), layer(x), rtol=1e-5, atol=1e-6)


def test_exports_warn_where_diffusers_does_not_load_the_type(exported):
    assert not exported["flux", "lora"].warned
    assert any("diffusers loads LoKr files only through its FLUX.2 and Z-Image" in w
               for w in exported["flux", "lokr"].warned)
    assert any("diffusers loads no LoHa" in w for w in exported["flux", "loha"].warned)


def test_diffusers_layout_carries_peft_names_and_config(exported):
    import json

    from safetensors import safe_open

    for kind, key in (("dora", "lora_magnitude_vector"), ("lokr", "lokr_w"), ("loha", "hada_w1_a")):
        path = exported["flux", kind].diffusers
        assert any(key in k for k in load_file(path))
        with safe_open(str(path), "pt") as f:
            config = json.loads(f.metadata()["lora_adapter_metadata"])
        assert ("transformer.use_dora" in config) == (kind == "dora")
        if kind == "lokr":      # diffusers' LoKrConfig(**metadata) rebuilds the same factor shapes
            assert config["transformer.decompose_factor"] == -1 and "transformer.alpha" in config


@pytest.mark.parametrize("kind", ["dora", "lokr", "loha"])
def test_convert_round_trips_the_type(exported, tmp_path, kind):
    from leantune.cli import main

    e = exported["flux", kind]
    mid, back = tmp_path / "mid.safetensors", tmp_path / "back.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LoraCompatibilityWarning)
        assert main(["convert", str(e.comfy), str(mid), "--to", "diffusers"]) == 0
        assert main(["convert", str(mid), str(back), "--to", "comfyui"]) == 0
    a, b = load_file(e.comfy), load_file(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_continues_a_file_of_the_same_type_and_refuses_another(exported):
    from leantune.train.lora import load_lora_into_model
    from leantune.train.lora_formats import LoraFormatError

    e = exported["flux", "lokr"]
    model = _model("flux")
    add_lora(model, FLUX_SPEC, _lora_cfg("lokr"))
    load_lora_into_model(model, read_lora(e.comfy, FLUX_SPEC.lora_keys))
    for name, layer in lora_layers(e.model, "default").items():
        torch.testing.assert_close(lora_layers(model, "default")[name].get_delta_weight("default"),
                                   layer.get_delta_weight("default"), rtol=1e-6, atol=1e-7)
    other = _model("flux")
    add_lora(other, FLUX_SPEC, _lora_cfg("loha"))
    with pytest.raises(LoraFormatError, match=r"a lokr file, but \[lora\] type = 'loha'"):
        load_lora_into_model(other, read_lora(e.comfy, FLUX_SPEC.lora_keys))


def test_effective_weight_is_peft_dora():
    base, model = _trained("flux", "dora")
    w = lora_weights_from_model(model)
    merged = _peft_merged(base, model)
    for name, m in w.modules.items():
        torch.testing.assert_close(effective_weight(m, base.get_submodule(name).weight), merged[f"{name}.weight"],
                                   rtol=1e-5, atol=1e-6)


# -- config ------------------------------------------------------------------------------------------

_MINIMAL = '[model]\npath = "model"\n[[data.datasets]]\npath = "images"\n'


@pytest.mark.parametrize("extra, message", [
    ('[lora]\ntype = "lycoris"\n', r"\[lora\]: key 'type': Input should be 'lora', 'lokr', 'loha' or 'dora'"),
    ('[lora]\nfactor = 4\n', r"\[lora\] factor is a LoKr option; it needs \[lora\] type = \"lokr\""),
    ('[lora]\ntype = "loha"\ndropout = 0.1\n', r"\[lora\] dropout = 0.1 with \[lora\] type = 'loha'"),
    ('[lora]\ntype = "dora"\n[memory]\nfp8 = true\n', r"\[lora\] type = \"dora\" with \[memory\] fp8 = true"),
    ('[lora]\ntype = "lokr"\nfactor = 0\n', r"factor"),
])
def test_config_refuses_naming_the_key(tmp_path, extra, message):
    p = tmp_path / "run.toml"
    p.write_text(_MINIMAL + extra)
    with pytest.raises(ConfigError, match=message):
        load_config(p)


def test_planner_prices_the_type_and_never_gives_dora_fp8(tmp_path):
    from leantune.planner.from_config import workload_from_config

    p = tmp_path / "run.toml"
    p.write_text('[model]\npath = "model"\nfamily = "flux"\n[[data.datasets]]\npath = "images"\n'
                 '[lora]\ntype = "dora"\n')
    w = workload_from_config(load_config(p))
    assert w.adapter == "dora" and not w.allow_fp8 and w.fp8_modulation is False
