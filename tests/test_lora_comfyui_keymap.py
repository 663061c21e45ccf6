"""FLUX.2 LoRA files through ComfyUI's own key map (tests/comfyui_keymap.py, an independent model of
comfy/lora.py) and diffusers' own loader, with the non-block layers trained (targets = "all_linear").

ComfyUI's map gives a FLUX.2 model diffusers names only from comfy.utils.flux_to_diffusers, which
has none for FLUX.2's time/guidance embedders and shared modulation: a diffusers-layout file's keys
for them are skipped ("lora key not loaded"), and diffusers reads a file in one layout only, so no
name in a diffusers file loads them in both. The kohya/ComfyUI file loads whole in ComfyUI at the
trained strength; the diffusers file loads whole in diffusers, and its export says which modules
ComfyUI skips (LoraCompatibilityWarning), exactly those the map lacks. Each file's header states
the alpha its tensors apply (kohya: scale = ss_network_alpha / ss_network_dim).
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from comfyui_keymap import comfyui_load, comfyui_native_state
from safetensors import safe_open
from safetensors.torch import load_file

from leantune.config import LoraConfig, TrainConfig
from leantune.models.flux2.spec import SPECS
from leantune.tiny.flux2 import flux2_scheduler, flux2_transformer
from leantune.train.lora import LoraCompatibilityWarning, add_lora, lora_layers
from leantune.train.lora_mode import LoraMode

FAMILY = {"dev": "flux2-dev", "klein": "flux2-klein-4b"}
RANK, ALPHA = 4, 8.0


def _trained(variant: str, targets: str):
    """(base model, trained model, {module: trained delta}, LoraMode) with random LoRA weights."""
    base = flux2_transformer(variant, seed=0)
    model = copy.deepcopy(base)
    cfg = LoraConfig(rank=RANK, alpha=ALPHA, targets=targets)
    params = add_lora(model, SPECS[FAMILY[variant]], cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    # peft's own delta of each adapted Linear: the truth, independent of leantune's file code
    deltas = {n: layer.get_delta_weight("default").detach() for n, layer in lora_layers(model, "default").items()}
    mode = LoraMode(cfg, TrainConfig(), ["comfyui", "diffusers"])
    mode.spec = SPECS[FAMILY[variant]]
    return base, model, deltas, mode


class _Paths:
    def __init__(self, root):
        self.root, self.name = root, "run"

    def lora_file(self, fmt, step=None):
        return self.root / f"{self.name}_{fmt}.safetensors"


def _export(mode, model, tmp_path):
    """The files a training run writes (LoraMode.export: the trainer's path, header notes and all),
    and the warnings the export gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comfy, diffusers = mode.export(SimpleNamespace(transformer=model), _Paths(tmp_path), step=10,
                                       intermediate=False)
    return comfy, diffusers, [w for w in caught if issubclass(w.category, LoraCompatibilityWarning)]


@pytest.fixture(scope="module", params=["dev", "klein"])
def all_linear(request, tmp_path_factory):
    variant = request.param
    base, model, deltas, mode = _trained(variant, "all_linear")
    comfy, diffusers, warned = _export(mode, model, tmp_path_factory.mktemp(variant))
    return SimpleNamespace(variant=variant, family=FAMILY[variant], base=base, deltas=deltas, comfy=comfy,
                           diffusers=diffusers, warned=warned)


def _merged_native(family, base, deltas):
    """The base model with `deltas` added, as ComfyUI holds it (native names)."""
    state = base.state_dict()
    merged = {k: v.clone() for k, v in state.items()}
    for name, d in deltas.items():
        merged[f"{name}.weight"] += d
    return comfyui_native_state(family, base, merged)


def _assert_comfyui_applies(family, base, tensors, deltas):
    """ComfyUI's merge of `tensors` on `base` gives exactly the weights of base + `deltas`."""
    native = comfyui_native_state(family, base)
    got = comfyui_load(family, native, tensors).deltas
    want = _merged_native(family, base, deltas)
    changed = {k for k in native if not torch.equal(want[k], native[k])}
    assert changed and set(got) == changed, sorted(set(got) ^ changed)
    for k in native:
        torch.testing.assert_close(native[k] + got.get(k, 0), want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_all_linear_trains_the_layers_comfyui_has_no_diffusers_name_for(all_linear):
    """The premise: the LoRA has FLUX.2's shared modulation and time (and, in dev, guidance) embedders."""
    top = {n for n in all_linear.deltas if "blocks." not in n}
    assert {"double_stream_modulation_img.linear", "single_stream_modulation.linear",
            "time_guidance_embed.timestep_embedder.linear_1"} <= top
    assert ("time_guidance_embed.guidance_embedder.linear_1" in top) == (all_linear.variant == "dev")


def test_comfyui_file_loads_whole_in_comfyui_at_the_trained_strength(all_linear):
    tensors = load_file(all_linear.comfy)
    load = comfyui_load(all_linear.family, comfyui_native_state(all_linear.family, all_linear.base), tensors)
    assert load.loaded == set(tensors) and not load.skipped
    _assert_comfyui_applies(all_linear.family, all_linear.base, tensors, all_linear.deltas)


def test_diffusers_file_in_comfyui_warns_naming_exactly_what_comfyui_skips(all_linear):
    """ComfyUI skips the keys of the modules its map has no diffusers name for, and applies the rest
    at the trained strength; the export's one warning names exactly those modules."""
    tensors = load_file(all_linear.diffusers)
    load = comfyui_load(all_linear.family, comfyui_native_state(all_linear.family, all_linear.base), tensors)
    skipped = {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in load.skipped}
    guidance = {"time_guidance_embed.guidance_embedder.linear_1", "time_guidance_embed.guidance_embedder.linear_2"}
    expected = {"time_guidance_embed.timestep_embedder.linear_1", "time_guidance_embed.timestep_embedder.linear_2",
                "double_stream_modulation_img.linear", "double_stream_modulation_txt.linear",
                "single_stream_modulation.linear"} | (guidance if all_linear.variant == "dev" else set())
    assert skipped == expected and len(load.skipped) == 2 * len(expected)     # the 14 / 10 keys
    assert all(why.startswith("lora key not loaded") for why in load.skipped.values())
    assert load.loaded == set(tensors) - set(load.skipped)
    kept = {n: d for n, d in all_linear.deltas.items() if n not in skipped}
    _assert_comfyui_applies(all_linear.family, all_linear.base, tensors, kept)

    assert len(all_linear.warned) == 1
    message = str(all_linear.warned[0].message)
    named = {n for n in all_linear.deltas if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w.])", message)}
    assert named == skipped, sorted(named ^ skipped)
    assert "comfyui-layout file" in message


def test_diffusers_file_loads_whole_in_diffusers_at_the_trained_strength(all_linear):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline(transformer=copy.deepcopy(all_linear.base), vae=None, text_encoder=None, tokenizer=None,
                         scheduler=flux2_scheduler())
    pipe.load_lora_weights(str(all_linear.diffusers), adapter_name="x")
    layers = lora_layers(pipe.transformer, "x")
    assert set(layers) == set(all_linear.deltas)
    for name, layer in layers.items():
        torch.testing.assert_close(layer.get_delta_weight("x").detach(), all_linear.deltas[name], rtol=1e-5,
                                   atol=1e-6, msg=name)


def _header(path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_each_files_header_states_the_alpha_its_tensors_apply(all_linear):
    """kohya's convention (scale = ss_network_alpha / ss_network_dim) applied to each file's own
    up @ down gives the trained delta: the diffusers file folds alpha / rank into lora_B, so its
    header says alpha = rank; the [lora] settings stay noted apart."""
    for path, up, down in ((all_linear.diffusers, ".lora_B.weight", ".lora_A.weight"),
                           (all_linear.comfy, ".lora_up.weight", ".lora_down.weight")):
        header, tensors = _header(path), load_file(path)
        scale = float(header["ss_network_alpha"]) / int(header["ss_network_dim"])
        ups = [k for k in tensors if k.endswith(up)]
        assert ups
        for key in ups:
            module = key[:-len(up)]
            alpha_key = module + ".alpha"
            applied = tensors[alpha_key].item() / tensors[module + down].shape[0] if alpha_key in tensors else 1.0
            assert applied == scale, (path.name, module, applied, scale)
    tensors = load_file(all_linear.diffusers)          # the kohya file's deltas: the ComfyUI test above
    header = _header(all_linear.diffusers)
    scale = float(header["ss_network_alpha"]) / int(header["ss_network_dim"])
    for name, delta in all_linear.deltas.items():
        got = scale * tensors[f"transformer.{name}.lora_B.weight"] @ tensors[f"transformer.{name}.lora_A.weight"]
        torch.testing.assert_close(got, delta, rtol=1e-5, atol=1e-6, msg=name)
    for path in (all_linear.diffusers, all_linear.comfy):
        header = _header(path)
        assert (header["leantune_lora_rank"], header["leantune_lora_alpha"]) == (str(RANK), str(ALPHA))
    config = json.loads(_header(all_linear.diffusers)["lora_adapter_metadata"])
    assert float(_header(all_linear.diffusers)["ss_network_alpha"]) == config["transformer.lora_alpha"] == RANK


def test_without_the_non_block_layers_the_diffusers_file_loads_whole_and_nothing_warns(tmp_path):
    base, model, deltas, mode = _trained("klein", "all")
    assert not any("modulation" in n or "embed" in n for n in deltas)
    comfy, diffusers, warned = _export(mode, model, tmp_path)
    assert warned == []
    for path in (comfy, diffusers):
        tensors = load_file(path)
        load = comfyui_load("flux2-klein-4b", comfyui_native_state("flux2-klein-4b", base), tensors)
        assert load.loaded == set(tensors) and not load.skipped
        _assert_comfyui_applies("flux2-klein-4b", base, tensors, deltas)


def test_the_declared_names_are_what_comfyuis_map_lacks():
    """FLUX2_LORA_KEYS.comfyui_unnamed (what the export warns about) is checked against the model of
    ComfyUI's map: every FLUX.2 top-level diffusers Linear it lacks, and only those."""
    from comfyui_keymap import comfyui_key_map

    from leantune.models.flux2.lora_keys import FLUX2_LORA_KEYS

    base = flux2_transformer("dev", seed=0)
    key_map = comfyui_key_map("flux2-dev", comfyui_native_state("flux2-dev", base))
    linears = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    lacking = {n for n in linears if f"transformer.{n}" not in key_map}
    assert lacking == set(FLUX2_LORA_KEYS.comfyui_unnamed)


# -- the other families, through the same model of ComfyUI's map ---------------------------------------

def _build(case: str):
    from leantune import tiny
    from leantune.tiny.qwen_image import qwen_image_transformer

    return {"flux": tiny.flux_transformer, "sd3-large": lambda seed: tiny.sd3_transformer("large", seed=seed),
            "sd3-medium": lambda seed: tiny.sd3_transformer("medium", seed=seed),
            "qwen-image": qwen_image_transformer}[case](seed=0)


@pytest.mark.parametrize("case", ["flux", "sd3-large", "sd3-medium", "qwen-image"])
def test_other_families_files_of_both_layouts_load_whole_in_comfyui_at_the_trained_strength(tmp_path, case):
    """Flux.1, SD3.5 (MMDiT and MMDiT-X) and Qwen-Image: ComfyUI's map names every module of an
    all_linear LoRA in both layouts, at the trained alpha (3: not a power of two), and nothing warns."""
    from leantune.models.family import get_family
    from leantune.train.lora import lora_weights_from_model, save_lora

    family = case.split("-")[0] if case.startswith("sd3") else case
    base = _build(case)
    model = copy.deepcopy(base)
    params = add_lora(model, get_family(family).spec, LoraConfig(rank=4, alpha=3.0, targets="all_linear"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    deltas = {n: layer.get_delta_weight("default").detach() for n, layer in lora_layers(model, "default").items()}
    assert any("blocks." not in n for n in deltas)                     # non-block layers trained too
    weights = lora_weights_from_model(model)
    native = comfyui_native_state(family, base)
    for fmt in ("comfyui", "diffusers"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", LoraCompatibilityWarning)
            tensors = load_file(save_lora(weights, tmp_path / f"{fmt}.safetensors", fmt))
        load = comfyui_load(family, native, tensors)
        assert load.loaded == set(tensors) and not load.skipped, (fmt, sorted(load.skipped)[:4])
        _assert_comfyui_applies(family, base, tensors, deltas)


def test_the_model_of_comfyui_can_tell_a_wrong_file(tmp_path):
    """Negative controls: a name ComfyUI's map lacks is skipped, and without its `.alpha` tensors a
    kohya file applies alpha = rank (ComfyUI reads no alpha from the header)."""
    base, model, deltas, mode = _trained("klein", "all")
    comfy, _, _ = _export(mode, model, tmp_path)
    tensors = load_file(comfy)
    native = comfyui_native_state("flux2-klein-4b", base)
    renamed = {k.replace("lora_unet_double_blocks_0_img_attn_proj", "lora_unet_double_blocks_0_img_attn_out"): v
               for k, v in tensors.items()}
    skipped = comfyui_load("flux2-klein-4b", native, renamed).skipped
    assert set(skipped) == {k for k in renamed if "img_attn_out" in k}
    no_alpha = {k: v for k, v in tensors.items() if not k.endswith(".alpha")}
    with pytest.raises(AssertionError):
        _assert_comfyui_applies("flux2-klein-4b", base, no_alpha, deltas)
    _assert_comfyui_applies("flux2-klein-4b", base, tensors, deltas)
