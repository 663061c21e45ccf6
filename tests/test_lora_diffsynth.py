"""DiffSynth-Studio's LoRA files (train/lora_diffsynth.py) read by `leantune convert` and read_lora.

Each file is written here as DiffSynth-Studio's trainer writes one (peft's keys with the adapter
name, `<module>.lora_A.default.weight` (r, in) / `.lora_B.default.weight` (out, r), under its DiT's
module names, no alpha key: it trains at alpha / r = 1), from a trained tiny LoRA of the family:

* Qwen-Image-2.1, Qwen-Image and FLUX.2: DiffSynth's QwenImage21DiT, QwenImageDiT and FLUX.2 DiT
  have diffusers' names, the trained LoRA's modules as they are;
* Wan: its WanModel has Wan-AI's names (`WAN_NAMES` below, by hand);
* FLUX.1: its FluxDiT fuses q / k / v (and a single block's MLP input) into one Linear, as BFL does,
  under names of its own: the LoRA is one dense adapter of that fused Linear, and the deltas it
  must give each diffusers Linear (its rows; `final_norm_out` emits (shift, scale) where diffusers'
  `norm_out` emits (scale, shift)) are worked out here from `FLUX_PARTS`, by hand.

Read, converted to both layouts and read back, every module's delta is the source's; applied to the
tiny model it gives the trained model's output.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from safetensors.torch import save_file

from families.cases import CASES
from families.conftest import Built, frozen
from leantune.models.family import PromptEmbeds, family_for_model, text_width
from leantune.train.lora import LoraFormatError, apply_lora, read_lora

LATENT_HW = (4, 6)

# Wan: diffusers' in-block / top-level names -> Wan-AI's (DiffSynth's WanModel)
WAN_NAMES = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1", "proj_out": "head.head",
}

# FLUX.1: FluxDiT's Linear -> the diffusers Linears whose rows it stacks, top to bottom ("N": the block)
FLUX_PARTS = {
    "blocks.N.attn.a_to_qkv": ["transformer_blocks.N.attn.to_q", "transformer_blocks.N.attn.to_k",
                               "transformer_blocks.N.attn.to_v"],
    "blocks.N.attn.b_to_qkv": ["transformer_blocks.N.attn.add_q_proj", "transformer_blocks.N.attn.add_k_proj",
                               "transformer_blocks.N.attn.add_v_proj"],
    "blocks.N.attn.a_to_out": ["transformer_blocks.N.attn.to_out.0"],
    "blocks.N.attn.b_to_out": ["transformer_blocks.N.attn.to_add_out"],
    "blocks.N.ff_a.0": ["transformer_blocks.N.ff.net.0.proj"], "blocks.N.ff_a.2": ["transformer_blocks.N.ff.net.2"],
    "blocks.N.ff_b.0": ["transformer_blocks.N.ff_context.net.0.proj"],
    "blocks.N.ff_b.2": ["transformer_blocks.N.ff_context.net.2"],
    "blocks.N.norm1_a.linear": ["transformer_blocks.N.norm1.linear"],
    "blocks.N.norm1_b.linear": ["transformer_blocks.N.norm1_context.linear"],
    "single_blocks.N.to_qkv_mlp": ["single_transformer_blocks.N.attn.to_q", "single_transformer_blocks.N.attn.to_k",
                                   "single_transformer_blocks.N.attn.to_v", "single_transformer_blocks.N.proj_mlp"],
    "single_blocks.N.proj_out": ["single_transformer_blocks.N.proj_out"],
    "single_blocks.N.norm.linear": ["single_transformer_blocks.N.norm.linear"],
    "x_embedder": ["x_embedder"], "context_embedder": ["context_embedder"],
    "time_embedder.timestep_embedder.0": ["time_text_embed.timestep_embedder.linear_1"],
    "time_embedder.timestep_embedder.2": ["time_text_embed.timestep_embedder.linear_2"],
    "guidance_embedder.timestep_embedder.0": ["time_text_embed.guidance_embedder.linear_1"],
    "guidance_embedder.timestep_embedder.2": ["time_text_embed.guidance_embedder.linear_2"],
    "pooled_text_embedder.0": ["time_text_embed.text_embedder.linear_1"],
    "pooled_text_embedder.2": ["time_text_embed.text_embedder.linear_2"],
    "final_proj_out": ["proj_out"],
    "final_norm_out.linear": ["norm_out.linear"],        # rows (shift, scale) there, (scale, shift) in diffusers
}
RANK = 4


def _built(family, tmp_path) -> Built:
    return Built(next(c for c in CASES if c.family == family), tmp_path)


@torch.no_grad()
def run(b, model, seed=3):
    """The family's forward on fixed random inputs (the conformance suite's, tests/families)."""
    family = family_for_model(model)
    g = torch.Generator().manual_seed(seed)
    x = family.pack_latents(torch.randn(2, family.latent_channels, *LATENT_HW, generator=g))
    text = torch.randn(2, 7, text_width(family, model.config), generator=g)
    text[0, 5:] = 0
    embeds = PromptEmbeds(text, torch.randn(2, getattr(model.config, "pooled_projection_dim", None) or 0, generator=g))
    return b.family.predict(model, x, torch.rand(2, generator=g), embeds, LATENT_HW, 3.5).float()


def _wan_name(name: str) -> str:
    if name in WAN_NAMES:
        return WAN_NAMES[name]
    _, index, inner = name.split(".", 2)            # blocks.N.<in-block name>
    return f"blocks.{index}.{WAN_NAMES[inner]}"


def _diffsynth_file_of_trained(b, name_of) -> dict[str, torch.Tensor]:
    """The trained LoRA (alpha / rank 2) as DiffSynth writes one: its scale 1, so alpha / rank is
    folded into lora_B; one peft adapter named "default"."""
    out = {}
    for name, m in b.lora.weights.modules.items():
        stem = name_of(name)
        out[f"{stem}.lora_A.default.weight"] = m.down.clone()
        out[f"{stem}.lora_B.default.weight"] = (m.up * m.scale).clone()
    return out


def _flux_diffsynth_file(b) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A dense LoRA on each of FluxDiT's Linears of the tiny Flux, and the deltas it gives the
    diffusers Linears: {file key: tensor}, {diffusers Linear: delta}."""
    g = torch.Generator().manual_seed(7)
    model = b.tiny
    blocks = {"blocks": len(model.transformer_blocks), "single_blocks": len(model.single_transformer_blocks)}
    tensors, deltas = {}, {}
    for ours, parts in FLUX_PARTS.items():
        listed = ours.split(".", 1)[0]
        for n in range(blocks.get(listed, 1)):
            stem, names = ours.replace(".N.", f".{n}."), [p.replace(".N.", f".{n}.") for p in parts]
            linears = [model.get_submodule(p) for p in names]
            rows = [lin.out_features for lin in linears]
            down = torch.randn(RANK, linears[0].in_features, generator=g) * 0.1
            up = torch.randn(sum(rows), RANK, generator=g) * 0.1
            tensors[f"{stem}.lora_A.default.weight"], tensors[f"{stem}.lora_B.default.weight"] = down, up
            delta = up @ down                          # DiffSynth's scale: 1
            if ours == "final_norm_out.linear":
                half = delta.shape[0] // 2
                delta = torch.cat([delta[half:], delta[:half]])
            for p, part in zip(names, delta.split(rows)):
                deltas[p] = part
    return tensors, deltas


def _merged(base, deltas):
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, delta in deltas.items():
            model.get_submodule(name).weight += delta
    return frozen(model)


def _convert(*args):
    from leantune.commands import convert

    parser = argparse.ArgumentParser()
    convert.configure(parser)
    return convert.run(parser.parse_args([str(a) for a in args]))


def _source(family, tmp_path):
    """(Built, DiffSynth file, the deltas it must give, the output it must give)."""
    b = _built(family, tmp_path)
    if family == "flux":
        tensors, deltas = _flux_diffsynth_file(b)
        want = run(b, _merged(b.tiny, deltas))
    else:
        tensors = _diffsynth_file_of_trained(b, _wan_name if family == "wan2.2" else (lambda n: n))
        deltas, want = b.lora.deltas, run(b, b.lora.model)
    path = tmp_path / "diffsynth.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})      # accelerate's safetensors header
    return b, path, deltas, want


@pytest.mark.parametrize("family", ["qwen-image-2.1", "qwen-image", "flux2-dev", "wan2.2", "flux"])
def test_a_diffsynth_lora_converts_and_loads_as_trained(family, tmp_path):
    b, path, deltas, want = _source(family, tmp_path)
    got = read_lora(path)
    assert got.format == "diffsynth" and got.keys is b.spec.lora_keys        # the family from the file alone
    assert set(got.modules) == set(deltas)
    for name, delta in deltas.items():
        torch.testing.assert_close(got.modules[name].delta(), delta, rtol=1e-5, atol=1e-7, msg=name)
    model = copy.deepcopy(b.tiny)
    apply_lora(model, got)
    out = run(b, frozen(model))
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(want, run(b, b.tiny), atol=1e-3)               # the LoRA changes the output
    for fmt in ("comfyui", "diffusers"):
        out_path = tmp_path / f"out_{fmt}.safetensors"
        assert _convert(path, out_path, "--to", fmt) == 0
        back = read_lora(out_path)
        assert back.keys is b.spec.lora_keys and set(back.modules) == set(deltas), fmt
        for name, delta in deltas.items():
            torch.testing.assert_close(back.modules[name].delta(), delta, rtol=1e-5, atol=1e-7, msg=(fmt, name))


def test_an_alpha_key_scales_as_diffsynths_loader_does(tmp_path):
    """DiffSynth's loader scales a file by alpha / rank only where it has `<module>.alpha` keys
    (another tool's file): the trained LoRA unfolded, with its alpha (8 at rank 4), reads as trained."""
    b = _built("qwen-image", tmp_path)
    tensors = {}
    for name, m in b.lora.weights.modules.items():
        tensors[f"{name}.lora_A.default.weight"], tensors[f"{name}.lora_B.default.weight"] = m.down, m.up
        tensors[f"{name}.alpha"] = torch.tensor(float(m.alpha))
    save_file(tensors, str(tmp_path / "a.safetensors"))
    got = read_lora(tmp_path / "a.safetensors")
    for name, delta in b.lora.deltas.items():
        assert got.modules[name].scale == 2.0
        torch.testing.assert_close(got.modules[name].delta(), delta, rtol=1e-5, atol=1e-7, msg=name)


def test_a_diffsynth_key_that_maps_to_no_module_is_named(tmp_path, capsys):
    b = _built("flux", tmp_path)
    tensors, _ = _flux_diffsynth_file(b)
    bad = dict(tensors)
    bad["blocks.0.attn.c_to_qkv.lora_A.default.weight"] = bad.pop("blocks.0.attn.a_to_qkv.lora_A.default.weight")
    save_file(bad, str(tmp_path / "bad.safetensors"))
    named = r"bad\.safetensors.*'blocks\.0\.attn\.c_to_qkv\.lora_A\.default\.weight'"
    with pytest.raises(LoraFormatError, match=named):
        read_lora(tmp_path / "bad.safetensors")
    assert _convert(tmp_path / "bad.safetensors", tmp_path / "out.safetensors", "--to", "comfyui") == 2
    assert "blocks.0.attn.c_to_qkv.lora_A.default.weight" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()
    # a weight DiffSynth trained whole beside the LoRA is not read as one
    whole = dict(tensors, **{"blocks.0.norm1_a.linear.weight": torch.zeros(2, 2)})
    save_file(whole, str(tmp_path / "whole.safetensors"))
    with pytest.raises(LoraFormatError, match=r"'blocks\.0\.norm1_a\.linear\.weight'.*not a LoRA matrix"):
        read_lora(tmp_path / "whole.safetensors")


def test_init_from_and_base_adapters_take_a_diffsynth_file(tmp_path):
    """[lora] init_from continues a DiffSynth file (its scale 1 into a rank-4, alpha-8 LoRA: the
    same deltas) and [model] base_adapters reads it as the family's LoRA."""
    from families.conftest import lora_config

    from leantune.config import AdapterRef
    from leantune.train.base_adapters import read_adapters
    from leantune.train.lora import lora_layers
    from leantune.train.lora_mode import LoraMode

    b, path, deltas, _ = _source("wan2.2", tmp_path)
    model = copy.deepcopy(b.tiny)
    LoraMode(lora_config(), None, [], init_from=path).prepare(model, b.spec)
    layers = lora_layers(model, "default")
    assert set(layers) == set(deltas)
    for name, delta in deltas.items():
        torch.testing.assert_close(layers[name].get_delta_weight("default").detach(), delta, rtol=1e-5, atol=1e-7,
                                   msg=name)
    (adapter,) = read_adapters([AdapterRef(path=str(path), strength=0.5)], lambda p: tmp_path / p, b.spec.lora_keys,
                               "[model] base_adapters")
    assert adapter.weights.format == "diffsynth" and set(adapter.weights.modules) == set(deltas)
