"""[lora] targets = "all_linear": the "all" preset plus every Linear outside the blocks (embedders,
final layer), for bases whose own input and output layers are no help (the demo's random one).

The adapter must wrap exactly those Linears, count the same in the planner, be named in the ComfyUI
file, and get gradients. (That both file formats read back to the trained model's output, that
diffusers' own loader gives the same deltas, and that it trains streamed as unstreamed: on the tiny
Flux.1-dev in tests/families/test_conformance.py.)"""

# Checks moved to the conformance suite (issue 33), all on the same tiny Flux.1-dev with an all_linear
# LoRA of rank 4, alpha 8:
# - test_all_linear_file_loads_in_diffusers_with_the_same_deltas (removed): moved to
#   tests/families/test_conformance.py::test_diffusers_load_lora_weights_gives_the_trained_output[flux-dev]
#   (every module's delta bit for bit, the top-level ones among them; here within 1e-6)
# - test_all_linear_lora_round_trips_through_both_formats[diffusers] and [comfyui] (removed; the ComfyUI
#   file's top-level names kept as test_all_linear_comfyui_file_names_the_layers_outside_the_blocks): moved
#   to tests/families/test_conformance.py::test_lora_files_read_back_exactly[flux-dev] (both layouts: the
#   same modules, deltas and output bit for bit; here within 1e-5)
# - test_all_linear_trains_the_same_with_every_block_and_the_non_block_group_streamed, trimmed to the
#   non-vacuity it needs (every layer outside the blocks gets a gradient) and renamed
#   test_all_linear_gives_the_layers_outside_the_blocks_gradients: "streamed with the non-block group,
#   poisoned slots and checkpointing it trains as the plain model" moved to
#   tests/families/test_conformance.py::test_streamed_trains_as_the_plain_model_in_poison_mode[flux-dev]
#   (losses, gradients and updated values bit for bit; here within 1e-5 after the first loss)

from __future__ import annotations

import re

import torch

from leantune.config import LoraConfig
from leantune import tiny
from leantune.models.flux import FLUX_SPEC
from leantune.train.lora import add_lora, lora_layers, lora_weights_from_model, save_lora

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


def test_all_linear_comfyui_file_names_the_layers_outside_the_blocks(tmp_path):
    from safetensors.torch import load_file

    path = save_lora(lora_weights_from_model(_trained()), tmp_path / "l_comfyui.safetensors", "comfyui")
    names = {k.split(".")[0] for k in load_file(path)}
    assert {"lora_unet_img_in", "lora_unet_txt_in", "lora_unet_final_layer_linear",
            "lora_unet_final_layer_adaLN_modulation_1", "lora_unet_time_in_in_layer"} <= names


def test_all_linear_gives_the_layers_outside_the_blocks_gradients():
    """The embedders and final layer carry adapters, and a training step reaches them: every LoRA
    layer outside the blocks gets a nonzero gradient (what makes the streamed-equals-plain check of
    tests/families non-vacuous for them)."""
    from test_memory_helpers import run_plan

    from leantune.memory.plan import Plan

    want, handle, _ = run_plan(_trained(), Plan())
    handle.remove()
    top = [n for n in want[0]["grads"] if n.startswith(("x_embedder.", "context_embedder.", "proj_out.", "norm_out.",
                                                        "time_text_embed."))]
    assert {n.split(".lora_")[0] for n in top} == TOP
    assert all(want[0]["grads"][n] is not None and want[0]["grads"][n].abs().max() > 0 for n in top), \
        [n for n in top if want[0]["grads"][n] is None or not want[0]["grads"][n].abs().max() > 0]
