"""What every model family promises, stated once and checked for each case of cases.py.

One test function per promise, each parameterized over the cases (a family and its variants), and
the adapter promises (5, 7, 9, 10, 11) over the adapter types of `[lora] type` too (LoRA, LoKr,
LoHa, DoRA: the trained adapter on every Linear of the tiny model, conftest.Built.adapter):

1. it builds from its tiny preset: the family's loader on the tiny diffusers folder gives the tiny
   model (weights, config, outputs), the family is told from the model and the folder, and the
   meta build the planner uses holds no data and has the real load's shapes and dtypes;
2. its diffusers folder loads as diffusers' own DiffusionPipeline.from_pretrained reads it
   (transformer, VAE, text encoders, tokenizers);
3. each single-file layout it claims (its spec's, as a full fine-tune exports it, under both
   prefixes ComfyUI's files use) loads to the tiny model with the architecture read from the file;
4. another family's file is refused, and the error names the family to set;
5. a trained adapter's files of each type in both layouts (comfyui/kohya/LyCORIS, diffusers/peft)
   read back exactly, and applied give the trained model's output;
6. diffusers' `load_lora_weights` on a LoRA's diffusers file gives the trained model's output;
7. it does so for a LoKr, LoHa or DoRA file wherever the export says diffusers loads the type, and
   refuses the file wherever the export warns that it does not;
8. every LoRA file of every layout loads whole through ComfyUI's key map (tests/comfyui_keymap.py, an
   independent model of comfy/lora.py) at the trained strength;
9. every LoKr, LoHa and DoRA file loads through ComfyUI's key map (its LoKr, LoHa and DoRA
   adapters) to the trained weights at strength 1: the comfyui layout whole, DoRA under the
   output-axis norm LyCORIS and peft use (ComfyUI with Comfy-Org/ComfyUI#15458; stock ComfyUI's
   differs, and the export says so), the diffusers layout but for the keys its export warns about;
10. streamed through the memory engine (poison mode) it trains as the plain model, bit for bit,
    with each adapter type;
11. a run stopped and resumed equals the uninterrupted run, bit for bit (LoRA on every case; LoKr,
    LoHa and DoRA on one case each: resume is the trainer's, family-independent);
12. the planner prices it without weights, and its prediction is what the simulated device measures;
13. its samples equal its diffusers pipeline's.

Where a promise fails for a case today it is listed in FINDINGS (strict xfail: the check stays as
strict as for the others, and the entry must go when the promise holds). Family-specific behaviour
(Edit references, FLUX.2's stacked text layers, SD3's T5 padding) stays in the family test files.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from leantune.memory.plan import Plan
from leantune.models.family import (PromptEmbeds, family_for_model, guess_family, known_families, probe_output,
                                    text_width)
from leantune.family_registry import FAMILIES

from .cases import CASES
from .conftest import ADAPTER_TYPES, frozen

PROMPT, SEED = "a photo of a cat", 3
W, H = 64, 48                 # non-square: catches height / width mix-ups
LATENT_HW = (4, 6)            # the transformer-level checks' latent size (even: every family packs 2 x 2)
COMFY_PREFIX = "model.diffusion_model."
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")      # the pipelines' component names

_FLUX2_COMFYUI = ("ComfyUI's key map has no diffusers names for FLUX.2's time/guidance embedders and shared "
                  "modulation: a diffusers-layout file of an all_linear LoRA loses those keys in ComfyUI "
                  "(the export warns, LoraCompatibilityWarning; the kohya file loads whole)")
_QWEN_IMAGE21_COMFYUI = ("ComfyUI's code for Qwen-Image-2.1 cannot be read here (not in the code index, the repository "
                         "too large to fetch): tests/comfyui_keymap.py models its generic key map only (lora_unet_ / "
                         "diffusion_model. names), under which a diffusers-layout file's transformer.* keys do not "
                         "load, nor a LoKr / LoHa / DoRA kohya file's LyCORIS names for the fused gate_up's parts; a LoRA's "
                         "kohya file loads whole (tests/test_qwen_image21.py checks each type's kohya file)")
_QWEN_IMAGE21_SAMPLES = ("the promise samples at 64x48 px, but Qwen-Image-2.1 takes sides that are multiples of 32 "
                         "(one vision slot per 2x2 tokens of 16 px: QwenImage21Pipeline floors 48 to 32 itself, "
                         "leantune refuses it); its pipeline also takes no max_sequence_length and returns RGBA. "
                         "tests/test_qwen_image21.py checks samples against the pipeline at 64x64")
_WAN_COMFYUI = ("ComfyUI's Wan model (WAN21) holds Wan-AI's names and no Wan branch of its LoRA key map was found "
                "in the code index's copies of comfy/lora.py: tests/comfyui_keymap.py models the generic map only "
                "(lora_unet_ / diffusion_model. names), under which a diffusers-layout file's transformer.blocks.N.attn1.* "
                "keys do not load; the comfyui-layout (kohya) file of every type loads whole (tests/test_wan.py)")
_WAN_TI2V_SAMPLES = ("the promise samples at 64x48 px, but TI2V-5B takes sides that are multiples of 32 (the Wan 2.2 "
                     "VAE's 16x and the 2 x 2 patches: WanPipeline floors 48 to 32 itself, leantune refuses it). "
                     "tests/test_wan_ti2v.py checks its videos against WanPipeline(expand_timesteps=True) at 96x64")
# (promise, case id) -> (the exception the check fails with today, why): strict xfails.
FINDINGS = {
    **{("comfyui", c): (AssertionError, _FLUX2_COMFYUI) for c in ("flux2-dev", "flux2-klein-4b", "flux2-klein-9b")},
    ("comfyui", "qwen-image-2.1"): (AssertionError, _QWEN_IMAGE21_COMFYUI),
    ("samples", "qwen-image-2.1"): (ValueError, _QWEN_IMAGE21_SAMPLES),
    **{("comfyui_types", f"qwen-image-2.1-{k}"): (AssertionError, _QWEN_IMAGE21_COMFYUI) for k in ("lokr", "loha", "dora")},
    **{("comfyui", c): (AssertionError, _WAN_COMFYUI) for c in ("wan2.2", "wan2.2-ti2v")},
    **{("comfyui_types", f"{c}-{k}"): (AssertionError, _WAN_COMFYUI) for c in ("wan2.2", "wan2.2-ti2v")
       for k in ("lokr", "loha", "dora")},
    ("samples", "wan2.2-ti2v"): (ValueError, _WAN_TI2V_SAMPLES),
}


def cases(promise: str, kinds: tuple[str, ...] | None = None):
    """The cases as parameters of `promise`'s test, a FINDINGS entry as a strict xfail. With
    `kinds` (adapter types, [lora] type), (case, kind) pairs: every case once per type, its id the
    case's for LoRA ("flux-dev") and suffixed for the others ("flux-dev-lokr"); a FINDINGS entry
    names the pair's id."""
    out = []
    for c in CASES:
        for kind in kinds or (None,):
            pid = c.id if kind in (None, "lora") else f"{c.id}-{kind}"
            finding = FINDINGS.get((promise, pid))
            marks = [] if finding is None else [pytest.mark.xfail(strict=True, raises=finding[0],
                                                                  reason=f"finding: {finding[1]}")]
            out.append(pytest.param(c, id=pid, marks=marks) if kind is None else
                       pytest.param(c, kind, id=pid, marks=marks))
    return out


OTHER_TYPES = tuple(k for k in ADAPTER_TYPES if k != "lora")      # lokr, loha, dora


# -- helpers --------------------------------------------------------------------------------------------

def transformer_inputs(model, batch: int = 2, hw=LATENT_HW, seed: int = 3):
    """Fixed random inputs of the family's forward call: packed latents, sigmas, text embeddings
    (the first prompt's last rows zero, as a batch pads a shorter prompt)."""
    family = family_for_model(model)
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    x = family.pack_latents(torch.randn(batch, family.latent_channels, *hw, generator=g))
    text = torch.randn(batch, 7, text_width(family, cfg), generator=g)
    if batch > 1:
        text[0, 5:] = 0
    embeds = PromptEmbeds(text, torch.randn(batch, getattr(cfg, "pooled_projection_dim", None) or 0, generator=g))
    return x, torch.rand(batch, generator=g), embeds, hw


@torch.no_grad()
def run(b, model, **kw):
    x, sigma, embeds, hw = transformer_inputs(model, **kw)
    return b.family.predict(model, x, sigma, embeds, hw, 3.5).float()


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module):
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:6]
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def assert_same_output(case, got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Two models of equal weights (asserted before) compute the same output: bitwise, but for Krea 2,
    whose text fusion collapses its layer axis with a 3-input Linear on a permuted tensor: the CPU's
    matrix-vector kernel sums it in an order that depends on the operands' addresses, so two instances
    differ by an ulp (2.4e-7 seen) as the allocator places them (the same instance repeats its bits)."""
    if case.family == "krea2":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), what


def _plain(v):
    return list(v) if isinstance(v, (list, tuple)) else v


def assert_same_config(got, want):
    differ = {k: (got.config.get(k), v) for k, v in want.config.items()
              if not k.startswith("_") and _plain(got.config.get(k)) != _plain(v)}
    assert not differ, differ


def merged_model(base, deltas):
    """`base` with the LoRA's weight deltas added to its Linears by hand: the reference a LoRA loader
    must reproduce, independent of peft."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, delta in deltas.items():
            model.get_submodule(name).weight += delta
    return model


# -- the registry ---------------------------------------------------------------------------------------

def test_every_registered_family_has_a_case():
    """A family that registers without a case here would go unchecked: it fails this test."""
    covered = {c.family for c in CASES}
    missing = [name for name in known_families() if name not in covered]
    assert not missing, f"no conformance case for {missing}: add one to tests/families/cases.py"
    assert not covered - set(known_families())
    assert len({c.id for c in CASES}) == len(CASES)
    assert {key[1] for key in FINDINGS} <= {c.id for c in CASES} | {f"{c.id}-{k}" for c in CASES for k in OTHER_TYPES}


# -- building and loading -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", cases("builds"))
def test_builds_from_its_tiny_preset(case, built):
    b = built(case)
    model = b.family.load_transformer(b.sources(), dtype=torch.float32)
    assert_same_weights(model, b.tiny)
    assert_same_config(model, b.tiny)
    out = run(b, model)
    assert torch.isfinite(out).all() and out.abs().max() > 0
    assert_same_output(case, out, run(b, b.tiny), "the tiny preset's")
    assert family_for_model(b.tiny).name == (case.file_family or case.family)
    assert guess_family(b.folder) == case.family
    assert isinstance(b.family.describe(model), str) and b.family.describe(model)
    # Its family_registry.py entry (read before the family module is imported) agrees with the spec:
    # the block lists in order, the kinds [lora] blocks may name, the config keys of their lengths.
    entry = FAMILIES[case.family]
    assert [bl.attr for bl in b.family.spec.block_lists] == list(entry.block_counts)
    assert [bl.kind for bl in b.family.spec.block_lists] == list(entry.lora_blocks)
    assert {attr: len(getattr(model, attr)) for attr in entry.block_counts} == \
        {attr: model.config[key] for attr, key in entry.block_counts.items()}
    assert entry.video == (b.family.video is not None)            # a stock plan prices frames by it
    # The planner's build: no data, the real load's shapes and dtypes, and its forward runs.
    meta = b.family.load_transformer(b.sources(), dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    real = b.family.load_transformer(b.sources(), dtype=torch.bfloat16).state_dict()
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == {k: (v.shape, v.dtype) for k, v in real.items()}
    with torch.no_grad():
        probe = probe_output(b.family, meta(**b.family.probe_inputs(meta.config, 2, LATENT_HW, 7, torch.bfloat16)))
    if b.family.references is None:
        assert probe.shape == out.shape
    else:        # the probe may price reference tokens too; predict returns the target's
        assert probe.shape[0] == out.shape[0] and probe.shape[2:] == out.shape[2:] and probe.shape[1] >= out.shape[1]


@pytest.mark.parametrize("case", cases("folder"))
def test_loads_its_diffusers_folder_as_diffusers_does(case, built):
    """Every component the family's loaders read from the folder is what diffusers'
    DiffusionPipeline.from_pretrained reads from it."""
    b = built(case)
    pipe = b.pipeline
    assert type(pipe).__name__ == case.pipeline
    sources = b.sources()
    assert_same_weights(b.family.load_transformer(sources, dtype=torch.float32), pipe.transformer)
    vae = b.family.load_vae(sources, torch.float32, "cpu")
    assert_same_weights(getattr(vae, "vae", vae), pipe.vae)
    encoders = b.family.load_text_encoders(sources, torch.float32, "cpu")
    compared = 0
    for name, part in pipe.components.items():
        if name.startswith("text_encoder") and part is not None:
            assert_same_weights(getattr(encoders, name), part)
            compared += 1
        elif name.startswith("tokenizer") and part is not None:
            assert getattr(encoders, name).get_vocab() == part.get_vocab(), name
    assert compared >= 1


@pytest.mark.parametrize("case", cases("single_file"))
def test_loads_each_single_file_layout_it_claims(case, built):
    """The spec's single-file layout (what a full fine-tune's "comfyui" export writes), with its own
    prefix and the other one: the architecture is read from the file (shapes and its metadata), the
    weights and outputs are the tiny model's, and the file alone tells the family."""
    b = built(case)
    layout = b.spec.single_file
    assert layout is not None, f"{case.family} declares no single-file layout"
    assert set(b.single_files) == {"", COMFY_PREFIX}
    want = run(b, b.tiny)
    for prefix, path in b.single_files.items():
        keys = list(load_file(path))
        assert keys and all(k.startswith(prefix) for k in keys), (prefix, keys[:3])
        if prefix == "":
            assert not any(k.startswith(COMFY_PREFIX) for k in keys)
        model = b.family.load_transformer(b.sources(path), dtype=torch.float32)
        assert_same_weights(model, b.tiny)
        assert_same_config(model, b.tiny)
        assert_same_output(case, run(b, model), want, (layout.name, prefix))
        assert guess_family(path) == (case.file_family or case.family), (layout.name, prefix)


@pytest.mark.parametrize("case", cases("refused"))
def test_refuses_another_familys_file_naming_the_family_to_set(case, built):
    """A single file of every other family (but those its loader takes by design: a shared
    transformer) is refused before any tensor is read, the error naming the file and the family
    that reads it."""
    from leantune.models.weights import LoadError

    b = built(case)
    wrong = []
    for other in CASES:
        if other.family == case.family or other.family in case.accepts:
            continue
        path = built(other).single_files[COMFY_PREFIX]
        with pytest.raises(LoadError) as e:
            b.family.load_transformer(b.sources(path), dtype=torch.float32)
        message = str(e.value)
        name = other.file_family or other.family
        if path.name not in message or "[model] family" not in message or f'"{name}"' not in message:
            wrong.append(f"{other.id}: {message}")
    assert not wrong, "\n".join(wrong)


# -- adapter files --------------------------------------------------------------------------------------

# peft's state-dict name of each role of an adapter module: a diffusers-layout file's keys are
# transformer.<module>.<name> (LoKr: lokr_w1 ..., LoHa: hada_w1_a ...)
_PEFT_NAMES = {"down": "lora_A.weight", "up": "lora_B.weight", "magnitude": "lora_magnitude_vector"}


def _peft_name(kind: str, role: str) -> str:
    return {"lokr": f"lokr_{role}", "loha": f"hada_{role}"}.get(kind) or _PEFT_NAMES[role]


@pytest.mark.parametrize("case, kind", cases("lora_files", ADAPTER_TYPES))
def test_lora_files_read_back_exactly(case, kind, built):
    """An all_linear adapter of each [lora] type (every Linear, blocks and top level) exported in
    both layouts reads back, its family told from the file alone, to the same modules of the same
    type with bit-equal tensors (LoRA: down, up; DoRA: and its magnitude; LoKr / LoHa: their
    factors), scales and weight deltas; applied to the base model it gives the trained model's
    output."""
    from leantune.train.lora import apply_lora, read_lora

    b = built(case)
    lora = b.adapter(kind)
    assert lora.weights.keys is b.spec.lora_keys and lora.weights.kind == kind
    linears = {n for n, m in b.tiny.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(lora.weights.modules) == linears
    want = run(b, lora.model)
    for fmt, path in lora.files.items():
        tensors = load_file(path)
        if fmt == "diffusers":
            assert set(tensors) == {f"transformer.{n}.{_peft_name(kind, role)}"
                                    for n, m in lora.weights.modules.items() for role in m.tensors()}
        back = read_lora(path)
        assert back.keys is b.spec.lora_keys, (fmt, back.keys)
        assert back.kind == kind and set(back.modules) == set(lora.weights.modules), fmt
        for name, m in lora.weights.modules.items():
            got = back.modules[name]
            assert got.tensors().keys() == m.tensors().keys(), (fmt, name)
            assert all(torch.equal(got.tensors()[r], t) for r, t in m.tensors().items()), (fmt, name)
            assert got.scale == m.scale and torch.equal(got.delta(), m.delta()), (fmt, name)
        model = copy.deepcopy(b.tiny)
        apply_lora(model, back)
        assert torch.equal(run(b, model), want), fmt


@pytest.mark.parametrize("case", cases("diffusers_lora"))
def test_diffusers_load_lora_weights_gives_the_trained_output(case, built):
    """The pipeline's own `load_lora_weights` on our diffusers-layout file: peft's deltas are the
    trained ones, and the pipeline's transformer gives the trained model's output (bit for bit:
    both are peft layers, and alpha / rank = 2 folds exactly), within float rounding of the base
    model with the deltas merged by hand, and not the base model's."""
    from leantune.train.lora import lora_layers

    b = built(case)
    lora = b.lora
    pipe = b.pipeline_with(transformer=copy.deepcopy(b.tiny))
    pipe.load_lora_weights(str(lora.files["diffusers"]), adapter_name="x")
    frozen(pipe.transformer)
    layers = lora_layers(pipe.transformer, "x")
    assert set(layers) == set(lora.deltas)
    for name, layer in layers.items():
        assert torch.equal(layer.get_delta_weight("x").detach(), lora.deltas[name]), name
    got, want = run(b, pipe.transformer), run(b, lora.model)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, run(b, merged_model(b.tiny, lora.deltas)), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(want, run(b, b.tiny), atol=1e-3)          # the LoRA changes the output


@pytest.mark.parametrize("case, kind", cases("diffusers_types", OTHER_TYPES))
def test_diffusers_loads_each_adapter_type_where_its_export_says_it_does(case, kind, built):
    """The pipeline's own `load_lora_weights` on the diffusers-layout file of a LoKr, LoHa or DoRA
    adapter (peft's key names, its config in the header): where the export warns that diffusers
    does not load the type (LoKr but for FLUX.2 and Z-Image, LoHa everywhere: diffusers 0.42's
    loaders) the pipeline refuses the file; elsewhere it loads it, and the pipeline's transformer
    gives the trained model's output bit for bit (both are peft layers of the same values)."""
    b = built(case)
    lora = b.adapter(kind)
    pipe = b.pipeline_with(transformer=copy.deepcopy(b.tiny))
    refused = [w for w in lora.warned["diffusers"] if "diffusers loads" in w]
    if refused:
        with pytest.raises(ValueError, match="Invalid (LoRA|adapter) checkpoint"):
            pipe.load_lora_weights(str(lora.files["diffusers"]), adapter_name="x")
        return
    from leantune.train.lora import layer_kind, lora_layers

    assert kind == "dora" or (kind == "lokr" and case.family.startswith(("flux2", "z-image")))
    pipe.load_lora_weights(str(lora.files["diffusers"]), adapter_name="x")
    frozen(pipe.transformer)
    layers = lora_layers(pipe.transformer, "x")
    assert set(layers) == set(lora.weights.modules) and {layer_kind(m, "x") for m in layers.values()} == {kind}
    got, want = run(b, pipe.transformer), run(b, lora.model)
    assert torch.equal(got, want)
    assert not torch.allclose(want, run(b, b.tiny), atol=1e-3)          # the adapter changes the output


@pytest.mark.parametrize("case", cases("comfyui"))
def test_every_lora_file_loads_whole_in_comfyui_at_the_trained_strength(case, built):
    """ComfyUI's key map (tests/comfyui_keymap.py) on the model as ComfyUI holds it: every key of
    each file patches a weight, none is skipped, and the merged weights are the base plus the
    trained deltas."""
    from comfyui_keymap import comfyui_load, comfyui_native_state

    b = built(case)
    lora = b.lora
    native = comfyui_native_state(case.family, b.tiny)
    merged = {k: v.clone() for k, v in b.tiny.state_dict().items()}
    for name, delta in lora.deltas.items():
        merged[f"{name}.weight"] += delta
    want = comfyui_native_state(case.family, b.tiny, merged)
    changed = {k for k in native if not torch.equal(want[k], native[k])}
    assert changed
    problems = []
    for fmt, path in lora.files.items():
        tensors = load_file(path)
        load = comfyui_load(case.family, native, tensors)
        if load.skipped or load.loaded != set(tensors):
            problems.append(f"{fmt}: {len(load.skipped)} keys skipped, e.g. {sorted(load.skipped)[:4]}")
            continue
        assert set(load.deltas) == changed, (fmt, sorted(set(load.deltas) ^ changed)[:4])
        for k in native:
            torch.testing.assert_close(native[k] + load.deltas.get(k, 0), want[k], rtol=1e-5, atol=1e-6, msg=f"{fmt} {k}")
    assert not problems, problems


def _comfyui_unloaded(b, lora, fmt: str, tensors) -> tuple[set[str], set[str]]:
    """(file keys, native weights) ComfyUI leaves out of `lora`'s `fmt` file, by what the export
    warns about: in the diffusers layout the modules ComfyUI's key map has no diffusers name for
    (LoraKeyMap.comfyui_unnamed: FLUX.2's time/guidance embedders and shared modulation; their
    weights stay unpatched), and DoRA's lora_magnitude_vector (ComfyUI reads kohya's dora_scale only,
    comfy/lora.py load_lora: the update then loads as a plain LoRA's)."""
    if fmt != "diffusers":
        return set(), set()
    keys = b.spec.lora_keys
    unnamed = {n for n in lora.weights.modules if n in keys.comfyui_unnamed}
    module = lambda k: k.removeprefix("transformer.").rsplit(".", 2 if k.endswith(".weight") else 1)[0]  # noqa: E731
    skipped = {k for k in tensors if module(k) in unnamed}
    if lora.kind == "dora":
        skipped |= {k for k in tensors if k.endswith(".lora_magnitude_vector")}
    return skipped, {f"{keys.target_for_diffusers(n)[0].native}.weight" for n in unnamed}


@pytest.mark.parametrize("case, kind", cases("comfyui_types", OTHER_TYPES))
def test_every_adapter_type_file_loads_in_comfyui_as_trained(case, kind, built):
    """LoKr, LoHa and DoRA files through ComfyUI's key map (tests/comfyui_keymap.py: its LoKr,
    LoHa and DoRA adapters and their scales) on the model as ComfyUI holds it. The comfyui layout
    loads whole (LyCORIS names for the parts of fused Linears) and gives the trained weights
    (peft's own merge) at strength 1; for DoRA under the output-axis norm of LyCORIS and peft,
    which ComfyUI gets with Comfy-Org/ComfyUI#15458 (`dora_fixed`): stock ComfyUI's is not the
    trained weights, and the export says so. The diffusers layout loads whole too but for what
    its export warns about (`_comfyui_unloaded`), the rest at the trained weights."""
    from comfyui_keymap import comfyui_load, comfyui_native_state

    from leantune.train.lora_formats import COMFYUI_DIFFUSERS_DORA_NOTE, COMFYUI_DORA_NOTE

    b = built(case)
    lora = b.adapter(kind)
    native = comfyui_native_state(case.family, b.tiny)
    merged = dict(b.tiny.state_dict())
    merged.update({f"{name}.weight": w for name, w in lora.merged.items()})
    want = comfyui_native_state(case.family, b.tiny, merged)
    changed = {k for k in native if not torch.equal(want[k], native[k])}
    assert changed
    for fmt, path in lora.files.items():
        tensors = load_file(path)
        if fmt == "comfyui":            # kohya names, and LyCORIS ones for the parts of fused Linears
            assert not any(k.startswith("transformer.") for k in tensors)
        skipped, unpatched = _comfyui_unloaded(b, lora, fmt, tensors)
        load = comfyui_load(case.family, native, tensors, dora_fixed=True)
        assert set(load.skipped) == skipped, (fmt, sorted(set(load.skipped) ^ skipped)[:4])
        assert load.loaded == set(tensors) - skipped, fmt
        if unpatched:
            assert any("ComfyUI's LoRA loader has no diffusers name" in w for w in lora.warned[fmt]), fmt
        if kind == "dora" and fmt == "diffusers":
            assert any(COMFYUI_DIFFUSERS_DORA_NOTE in w for w in lora.warned[fmt]), lora.warned[fmt]
            assert any(not torch.allclose(native[k] + load.deltas[k], want[k], rtol=1e-5, atol=1e-6)
                       for k in load.deltas)        # the update without its magnitude: not as trained
            continue
        assert set(load.deltas) == changed - unpatched, (fmt, sorted(set(load.deltas) ^ (changed - unpatched))[:4])
        for k in load.deltas:
            torch.testing.assert_close(native[k] + load.deltas[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{fmt} {k}")
        if kind == "dora":            # stock ComfyUI: the base weight's row norms; said at export
            stock = comfyui_load(case.family, native, tensors).deltas
            assert any(not torch.allclose(native[k] + stock[k], want[k], rtol=1e-5, atol=1e-6) for k in stock)
            assert any(COMFYUI_DORA_NOTE in w for w in lora.warned[fmt])


# -- the memory engine ----------------------------------------------------------------------------------

def _train_two_steps(b, model):
    """Two SGD steps on two latent shapes; per step the output, loss, LoRA gradients and values."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(list(params.values()), lr=0.1)
    records = []
    for step, hw in enumerate((LATENT_HW, LATENT_HW[::-1])):
        x, sigma, embeds, _ = transformer_inputs(model, hw=hw, seed=step)
        target = torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + step))
        opt.zero_grad(set_to_none=True)
        out = b.family.predict(model, x, sigma, embeds, hw, 3.5)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        records.append({"out": out.detach().clone(), "loss": loss.detach().clone(),
                        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}})
        opt.step()
        records[-1]["values"] = {n: p.detach().clone() for n, p in params.items()}
    return records


@pytest.mark.parametrize("case, kind", cases("streamed", ADAPTER_TYPES))
def test_streamed_trains_as_the_plain_model_in_poison_mode(case, kind, built):
    """Every block and the non-block group streamed through a ring of two slots, with blocks
    checkpointed; poison mode destroys a slot's weights at each release, so a weight used outside
    its window would show (DoRA reads its base weight's row norms in the forward). For each
    [lora] type, outputs, losses, gradients and updated adapter values equal the plain model's bit
    for bit, and the frozen weights come back unchanged."""
    from leantune.memory.engine import apply_memory

    b = built(case)
    base = copy.deepcopy(b.adapter(kind).model)
    for name, p in base.named_parameters():
        p.requires_grad_("default" in name.split("."))          # the adapter's parameters (peft's "default")
    plain = _train_two_steps(b, copy.deepcopy(base))
    model = copy.deepcopy(base)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    blocks = tuple(n for n, _ in b.spec.blocks(model))
    plan = Plan(streamed_blocks=blocks, stream_non_blocks=True, debug_poison=True, checkpointing="blocks", ring_slots=2)
    handle = apply_memory(model, b.spec, plan, "cpu", offload_min_bytes=0)
    streamed = _train_two_steps(b, model)
    report = handle.step_report()
    handle.remove()
    assert report["bytes_h2d"] > 0 and report["slots"] == 2
    assert any(g is not None for g in plain[0]["grads"].values())
    for step, (got, want) in enumerate(zip(streamed, plain, strict=True)):
        assert torch.equal(got["out"], want["out"]), step
        assert torch.equal(got["loss"], want["loss"]), step
        for name, g in want["grads"].items():
            assert (g is None) == (got["grads"][name] is None), (step, name)
            assert g is None or torch.equal(got["grads"][name], g), (step, name)
        for name, v in want["values"].items():
            assert torch.equal(got["values"][name], v), (step, name)
    after = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    assert after.keys() == frozen.keys() and all(torch.equal(after[n], frozen[n]) for n in frozen)


# -- training -------------------------------------------------------------------------------------------

RUN = """
[model]
family = "{family}"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 1
cache_dir = "{cache}"
max_text_length = {text_length}

[[data.datasets]]
path = "{images}"
caption_dropout = 0.5

[lora]
rank = 4
alpha = 8
targets = "all"

[train]
steps = 2
learning_rate = 1e-3
lr_scheduler = "cosine"
warmup_steps = 1
gradient_accumulation = 2
mixed_precision = "no"
seed = 3
save_every = 1

[output]
dir = "out"
name = "t"
formats = ["diffusers"]
"""


# The other adapter types resume on one case each: what resume restores (the adapter's parameters
# by name, the optimizer's state of them, the data order and the RNG) is the trainer's, the same
# code for every family, which the LoRA cases check. Each type on another family, where it is routine.
RESUMED_TYPES = {"lokr": "flux2-klein-4b", "loha": "qwen-image", "dora": "sd3.5-medium"}


def resume_cases():
    """LoRA on every case, each other type on its RESUMED_TYPES case."""
    typed = [p for p in cases("resume", ADAPTER_TYPES) if RESUMED_TYPES.get(p.values[1]) in (None, p.values[0].id)]
    assert len(typed) == len(CASES) + len(RESUMED_TYPES)
    return typed


@pytest.mark.parametrize("case, kind", resume_cases())
def test_resume_equals_the_uninterrupted_run(case, kind, built, shape_images, tmp_path):
    """A run of 2 steps (2 micro-batches each over 2 images: every step an epoch, so the second
    reshuffles; caption dropout, a cosine schedule after warmup) stopped after step 1 and resumed
    gives the uninterrupted run's losses and adapter file, bit for bit: LoRA on every case, LoKr,
    LoHa and DoRA ([lora] type) on one case each (RESUMED_TYPES: resume is family-independent)."""
    import warnings

    from leantune.config import load_config
    from leantune.train.lora import LoraCompatibilityWarning
    from leantune.trainer import train

    b = built(case)

    def config(name):
        folder = tmp_path / name
        folder.mkdir()
        text = RUN.format(family=case.family, model=b.folder, cache=tmp_path / "cache",
                          text_length=case.text_length, images=shape_images)
        (folder / "run.toml").write_text(text.replace("[lora]\n", f'[lora]\ntype = "{kind}"\n'))
        return load_config(folder / "run.toml", [])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LoraCompatibilityWarning)    # a LoHa / DoRA diffusers file's notes
        full = train(config("full"), progress=False)
        cfg = config("parts")
        assert train(cfg, stop_after=1, progress=False).final_step == 1
        resumed = train(cfg, resume=True, progress=False)
    assert resumed.final_step == 2 and len(full.losses) == 2
    assert resumed.losses == full.losses
    a, r = load_file(str(full.paths.lora_file("diffusers"))), load_file(str(resumed.paths.lora_file("diffusers")))
    assert a.keys() == r.keys() and a and all(torch.equal(a[k], r[k]) for k in a)
    assert (kind == "lora") == all(".lora_A." in k or ".lora_B." in k for k in a)      # the type was trained


# -- the planner ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", cases("planner"))
def test_planner_prices_it_without_weights_as_the_simulated_device_measures(case, built):
    """The planner prices a LoRA step (bf16 autocast, every block streamed and checkpointed) on the
    model the family's loader builds on the meta device from the tiny folder (no weights read);
    the simulated device (memory/simulated.py) runs that step through the trainer's own code. The
    weights, ring slots and adapters it places are the planner's bytes exactly, and the step's peak
    is within 10% of the prediction (without its workspace term, which the simulation cannot see),
    as for the full-width models (tests/test_simulated_*.py)."""
    from leantune.config import validate
    from leantune.memory import simulated
    from leantune.planner.corrections import Calibration
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.machine import assumed_machine
    from leantune.planner.meta import meta_from_config
    from leantune.planner.search import Planner
    from leantune.simulated_run import simulate_training, training_references
    from leantune.train.lora import add_lora

    try:
        simulated.enable()
    except simulated.SimulatedDeviceUnavailable as e:
        pytest.skip(f"simulated device unavailable: {e}")
    b = built(case)
    cfg = validate({"model": {"path": str(b.folder), "family": case.family, "dtype": "bf16"},
                    "data": {"datasets": [{"path": "unused"}], "resolutions": [64], "batch_size": 1,
                             "max_text_length": case.text_length},
                    "lora": {"rank": 4, "targets": "all"}, "train": {"mixed_precision": "bf16"}})
    meta = b.family.load_transformer(b.sources(), dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    add_lora(meta, b.spec, cfg.lora)
    # Like with like: the planner prices the image tokens the step simulate_training runs feeds (the
    # target's, and an edit family's reference latents: training_references).
    h = w = 64 // b.family.vae_scale_factor
    # (a family whose transformer takes its latents per image, Z-Image, has no hidden_states tensor)
    hidden = b.family.probe_inputs(meta.config, 1, (h, w), 7, torch.bfloat16).get("hidden_states")
    fed = b.family.image_tokens(h, w) + sum(b.family.image_tokens(*r.shape[-2:]) for r in
                                            training_references(b.family, meta.config, (64, 64), 1, torch.bfloat16) or ())
    assert hidden is None or hidden.dim() != 3 or hidden.shape[1] == fed, (hidden.shape, fed)
    plan = Plan(streamed_blocks=tuple(n for n, _ in b.spec.blocks(meta)), checkpointing="blocks", ring_slots=2)
    est = Planner(b.spec, meta, workload_from_config(cfg, meta), assumed_machine(8 * 2**30), Calibration()).estimate(plan)
    # The simulation's copy: the same architecture with every tensor on meta (fake_parameters fakes
    # meta tensors only, and a loader's meta build may keep plain tensor attributes on the CPU).
    model = meta_from_config(type(meta), meta.config)
    add_lora(model, b.spec, cfg.lora)
    sim = simulate_training(model, b.spec, cfg, plan, (64, 64))
    v = est.vram
    assert sim.after_setup == v["weights resident"] + v["stream slots"] + v["adapters"], (sim.after_setup, dict(v))
    ratio = (est.peak_vram - v["workspace"]) / sim.peak
    assert 0.90 <= ratio <= 1.10, (ratio, sim.peak, dict(v))


# -- sampling -------------------------------------------------------------------------------------------

def _reference_images(n: int):
    from PIL import Image

    rng = np.random.default_rng(4)
    return [Image.fromarray(rng.integers(0, 255, (48, 80, 3), dtype=np.uint8)) for _ in range(n)]


def _loaded(b):
    """The folder's models as the family's loaders give them, and the folder's pipeline with our
    transformer and VAE: diffusers' own from_pretrained ones hold the same weights (checked above),
    but their tensors sit elsewhere in memory and CPU kernels then round 1e-6 apart. The pipeline
    keeps its own text encoders, so our encoding is checked against diffusers' too."""
    family, sources = b.family, b.sources()
    encoders = family.load_text_encoders(sources, torch.float32, "cpu")
    vae = family.load_vae(sources, torch.float32, "cpu")
    transformer = frozen(family.load_transformer(sources, torch.float32))
    pipe = b.pipeline_with(transformer=transformer, vae=frozen(getattr(vae, "vae", vae)))
    pipe.set_progress_bar_config(disable=True)
    return SimpleNamespace(encoders=encoders, vae=vae, transformer=transformer, pipeline=pipe)


def _our_sample(b, m, guidance: float, steps: int = 2):
    """Our staged sampler (encode, denoise, decode) on the loaded models: (float images, latents)."""
    from leantune.infer.decode import decode_latents
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.references import reference_latents, text_images
    from leantune.infer.sampler import denoise

    case, family = b.case, b.family
    cfg = family.sampling.guidance == "cfg"
    images = _reference_images(case.sample.references)
    encoded = encode_prompts_stage(m.encoders, [PROMPT], max_length=case.text_length, device="cpu", family=family,
                                   negative_prompts=[case.sample.negative] if cfg else None,
                                   images=text_images(images, family))
    embeds, negative = encoded if cfg else (encoded, None)
    schedule = family.sampling.schedule(family.sampling.variant(m.transformer), b.folder)
    if "references" not in m.__dict__:          # the VAE encodes them at the pipeline's size: once per test
        m.references = reference_latents(m.vae, images, family) or None
    latents = denoise(m.transformer, embeds, [SEED], width=W, height=H, steps=steps, guidance=guidance,
                      schedule=schedule, device="cpu", family=family, negative=negative,
                      cfg_batched=case.sample.cfg_batched, references=m.references)
    return decode_latents(m.vae, latents, "cpu").permute(0, 2, 3, 1).numpy(), latents


def _pipeline_sample(b, m, guidance: float, steps: int = 2):
    s = b.case.sample
    kw = {s.scale_arg: guidance}
    if s.negative_arg:
        kw[s.negative_arg] = s.negative
    if s.references:
        kw["image"] = _reference_images(s.references)
    if s.video:                 # one frame: the image our sampler draws
        kw["num_frames"] = 1
    out = m.pipeline(prompt=PROMPT, height=H, width=W, num_inference_steps=steps, max_sequence_length=b.case.text_length,
                     generator=torch.Generator().manual_seed(SEED), output_type="np", **kw)
    return out.frames[:, 0] if s.video else out.images


@pytest.mark.parametrize("case", cases("samples"))
def test_samples_equal_the_diffusers_pipelines(case, built):
    """fp32, the folder's scheduler, the family's guidance (the distilled input, or classifier-free
    with the negative prompt; under CFG a scale of 1 is no guidance, as in the pipeline): our float
    images equal the pipeline's bit for bit, and the scale matters where the model takes one."""
    b = built(case)
    m = _loaded(b)
    g = case.sample.guidance
    ours, latents = _our_sample(b, m, g)
    assert ours.shape == (1, H, W, 3)
    assert np.abs(ours - _pipeline_sample(b, m, g)).max() == 0.0
    cfg = b.family.sampling.guidance == "cfg"
    if cfg and not case.sample.references:       # (an edit pipeline's reference encode costs seconds)
        assert np.abs(_our_sample(b, m, 1.0)[0] - _pipeline_sample(b, m, 1.0)).max() == 0.0
    if cfg or b.tiny.config.get("guidance_embeds", False):
        images, other = _our_sample(b, m, g / 2)
        assert (other - latents).abs().max() > 1e-4 * latents.abs().max()       # rounding: 1e-6
        if not case.sample.references:      # (an edit model's tiny image follows its reference: 6e-5 apart)
            assert np.abs(images - ours).max() > 1e-4


@pytest.mark.parametrize("case", cases("builds"))
def test_a_model_cut_to_a_few_blocks_is_the_model_its_config_builds(case, built):
    """`leantune check` on a model too large to compare whole cuts it to a few of its blocks
    (models/block_subset.py): the cut model's config builds the same model (its block counts and
    variant lists follow the cut), whose forward equals the cut one's, and the family's forward
    runs it."""
    from leantune.models.block_subset import choose, keep_blocks, renamed

    b = built(case)
    spec = b.family.spec
    model = copy.deepcopy(b.tiny)
    names = [n for n, _ in spec.blocks(model)]
    streamed = tuple(names[::2])                               # every other block, as a plan might stream
    keep = choose(spec, model, streamed, ring_slots=1)
    keep_blocks(model, spec, keep)
    assert sum(len(v) for v in keep.values()) == len(spec.blocks(model)) <= len(names)
    assert set(renamed(keep, streamed)) <= {n for n, _ in spec.blocks(model)}
    again = type(model).from_config(model.config).to(torch.float32)
    again.load_state_dict(model.state_dict())
    out = run(b, model)
    assert torch.isfinite(out).all() and out.shape == run(b, b.tiny).shape
    # (to fp32 rounding: two instances of Krea 2's class with equal weights differ by ~2e-7; a config
    # that did not follow the cut would build another model, or none)
    torch.testing.assert_close(run(b, again), out, rtol=1e-5, atol=1e-6)


CHECKED_PLAN = '[memory]\nstreamed_blocks = 2\ncheckpointing = "offload"\nfp8 = true\npin_memory = false\n'


@pytest.mark.parametrize("case", cases("builds"))
def test_leantune_check_holds_on_its_plan(case, built, shape_images, tmp_path):
    """`leantune check` on the family's tiny model with a plan of every technique (two blocks
    streamed in poison mode, checkpointing with offloaded inputs, fp8 block Linears): each holds,
    the exact ones bitwise, fp8 within its tolerance (issue 39: the check passes on every family)."""
    from leantune.check.run import run_check
    from leantune.config import load_config

    b = built(case)
    text = RUN.format(family=case.family, model=b.folder, cache=tmp_path / "cache", text_length=case.text_length,
                      images=shape_images).replace("gradient_accumulation = 2\n", "") + CHECKED_PLAN
    (tmp_path / "run.toml").write_text(text)
    result = run_check(load_config(tmp_path / "run.toml", []), steps=1, emit=lambda line: None)
    assert result.rc == 0, result.lines
    assert set(result.verdicts) == {"streaming", "fp8", "checkpointing", "plan"}, result.lines
    assert all(v.held for v in result.verdicts.values()), result.lines
