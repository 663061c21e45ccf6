"""[lora] targets = "all_linear": the "all" preset plus every Linear outside the blocks (embedders,
final layer), for bases whose own input and output layers are no help (the demo's random one).

The adapter must wrap exactly those Linears, count the same in the planner, and survive both file
formats: read back into a fresh model it reproduces the trained model's output, and diffusers'
own loader gives the same deltas."""

from __future__ import annotations

import re

import pytest
import torch

from leantune.config import LoraConfig
from leantune import tiny
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, predict
from leantune.train.lora import add_lora, apply_lora, lora_layers, lora_weights_from_model, read_lora, save_lora

TOP = {"x_embedder", "context_embedder", "proj_out", "norm_out.linear",
       *(f"time_text_embed.{e}.linear_{i}" for e in ("timestep_embedder", "text_embedder", "guidance_embedder")
         for i in (1, 2))}


def _trained(seed: int = 5):
    tr = tiny.flux_transformer(seed=0)
    params = add_lora(tr, FLUX_SPEC, LoraConfig(rank=4, alpha=8, targets="all_linear"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return tr


@torch.no_grad()
def _out(tr):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 64, generator=g)                                          # (B, N, 64)
    embeds = PromptEmbeds(t5=torch.randn(1, 8, 32, generator=g), pooled=torch.randn(1, 32, generator=g))
    return predict(tr, x, torch.tensor([0.6]), embeds, (8, 8), guidance=3.5)


def test_all_linear_wraps_the_all_preset_and_every_linear_outside_the_blocks():
    tr = _trained()
    wrapped = set(lora_layers(tr, "default"))
    in_blocks = {n for n in wrapped if re.match(r"(single_)?transformer_blocks\.", n)}
    plain = tiny.flux_transformer(seed=0)
    add_lora(plain, FLUX_SPEC, LoraConfig(rank=4, targets="all"))
    assert in_blocks == set(lora_layers(plain, "default"))
    assert wrapped - in_blocks == TOP
    # The planner counts the same adapters (it reads the spec's regex on the base Linears).
    from leantune.planner.weight_bytes import measure_weights
    from leantune.planner.workload import Workload

    counted = {a.name for a in measure_weights(FLUX_SPEC, tiny.flux_transformer(seed=0),
                                             Workload(mode="lora", rank=4, targets="all_linear")).adapters}
    assert counted == wrapped


@pytest.mark.parametrize("fmt", ["comfyui", "diffusers"])
def test_all_linear_lora_round_trips_through_both_formats(tmp_path, fmt):
    tr = _trained()
    path = save_lora(lora_weights_from_model(tr), tmp_path / f"l_{fmt}.safetensors", fmt)
    if fmt == "comfyui":
        from safetensors.torch import load_file

        names = {k.split(".")[0] for k in load_file(path)}
        assert {"lora_unet_img_in", "lora_unet_txt_in", "lora_unet_final_layer_linear",
                "lora_unet_final_layer_adaLN_modulation_1", "lora_unet_time_in_in_layer"} <= names
    fresh = tiny.flux_transformer(seed=0)
    apply_lora(fresh, read_lora(path), adapter_name="back")
    assert set(lora_layers(fresh, "back")) == set(lora_layers(tr, "default"))
    base = _out(tiny.flux_transformer(seed=0))
    trained = _out(tr)
    assert (trained - base).abs().max() > 1e-2                      # the LoRA does change the output
    torch.testing.assert_close(_out(fresh), trained, atol=1e-5, rtol=1e-5)


def test_all_linear_file_loads_in_diffusers_with_the_same_deltas(tmp_path):
    from diffusers import FluxPipeline

    tr = _trained()
    w = lora_weights_from_model(tr)
    path = save_lora(w, tmp_path / "l.safetensors", "diffusers")
    comps = tiny.flux_components(seed=0)
    pipe = FluxPipeline(**comps)
    pipe.load_lora_weights(str(path), adapter_name="d")
    layers = lora_layers(pipe.transformer, "d")
    assert set(layers) == set(w.modules)
    for name in TOP:
        layer = layers[name]
        delta = layer.scaling["d"] * (layer.lora_B["d"].weight @ layer.lora_A["d"].weight)
        torch.testing.assert_close(delta.detach(), w.modules[name].delta(), atol=1e-6, rtol=1e-6)


def test_all_linear_trains_the_same_with_every_block_and_the_non_block_group_streamed():
    """The embedders and final layer carry adapters now: streamed as the non-block group (with
    poisoned slots and checkpointing), the loss, every LoRA gradient and the
    updated LoRA weights match the unstreamed run's.

    Not bitwise: every block's modulation sends a gradient into the timestep embedding, and the
    streamed backward adds them up in another order, which moves the timestep embedder's LoRA
    gradient by float32 rounding (~1e-9 on values ~1e-3). The first step's loss (forward only) is
    bitwise equal."""
    from test_memory_helpers import block_names, run_plan

    from leantune.memory.plan import Plan

    base = _trained()
    want, handle, _ = run_plan(base, Plan())
    handle.remove()
    top = [n for n in want[0]["grads"] if n.startswith(("x_embedder.", "proj_out.", "norm_out."))]
    assert top and all(want[0]["grads"][n].abs().max() > 0 for n in top)
    plan = Plan(streamed_blocks=tuple(block_names(base)), stream_non_blocks=True, debug_poison=True,
                checkpointing="blocks")
    got, handle, _ = run_plan(base, plan)
    assert handle.step_report()["bytes_h2d"] > 0
    handle.remove()
    assert torch.equal(got[0]["loss"], want[0]["loss"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-6, atol=0)
        assert g["grads"].keys() == w["grads"].keys()
        for name in w["grads"]:
            torch.testing.assert_close(g["grads"][name], w["grads"][name], rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(g["values"][name], w["values"][name], rtol=1e-5, atol=1e-8)
