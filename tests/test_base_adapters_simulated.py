"""Base adapters on the simulated GPU (leantune/memory/simulated.py): a full-width Z-Image Turbo
LoRA step through a rank-64 training adapter, the main blocks streamed, against the planner.

What is proved: after apply_memory the simulated device holds exactly the planner's resident
weights + ring slots + trained adapter + "base adapters (resident)", the last being the resident
refiner blocks' share of the training adapter only (the streamed blocks' travel in their units:
less than the whole stack, and the slots and the streamed host units grow by their packed
bytes); the step's peak is the prediction's within 3 % (without the workspace term, which the
simulation cannot see). Full width (30 heads of 128, dim 3840) with one block of each refiner and
two main blocks, in the shared fresh process of tests/simulated_cases.py (see simulated.enable).
"""

from __future__ import annotations

import pytest
from simulated_cases import GROUP, Call, register, results
from test_simulated import _library_or_skip

GiB = 2**30
RANK = 64          # the training adapter's (ostris' Z-Image Turbo adapter is a LoRA of about this size)


def _turbo_adapter_step(with_adapter: bool) -> dict:
    """In the fresh process: the trainer's LoRA step of the full-width Z-Image Turbo at 512 px, its
    two main blocks streamed and checkpointed, with (or without) a frozen rank-RANK base adapter
    on the trained LoRA's Linears (built on meta: only its shapes are placed and priced)."""
    from dataclasses import replace
    from pathlib import Path

    import torch

    from leantune.memory.plan import Plan
    from leantune.models.family import get_family
    from leantune.planner.corrections import Calibration
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.machine import assumed_machine
    from leantune.planner.search import Planner
    from leantune.simulated_run import meta_model, simulate_training, training_config
    from leantune.train.base_adapters import BaseAdapter, BaseAdapterStack, priced_bytes, priced_tensors
    from leantune.train.lora import lora_layers
    from leantune.train.lora_formats import LoraModule, LoraWeights
    from leantune.train.modes import make_mode

    fam = get_family("z-image")
    cfg = training_config(512, 8 * GiB, rank=16, family="z-image")

    def model_with_lora():
        model = meta_model("z-image-turbo", (1, 1, 2))
        make_mode(cfg).prepare(model, fam.spec)          # the trained LoRA, as the trainer adds it
        return model

    model = model_with_lora()
    workload = workload_from_config(cfg, model)
    if with_adapter:
        zero = torch.zeros(1)              # expanded: each matrix its full shape, no bytes (copied onto meta)
        weights = LoraWeights({name: LoraModule(zero.expand(RANK, layer.in_features),
                                                zero.expand(layer.out_features, RANK), float(RANK))
                               for name, layer in lora_layers(model, "default").items()})
        stack = BaseAdapterStack(model, [BaseAdapter(Path("zimage_turbo_training_adapter.safetensors"), 1.0, weights)])
        workload = replace(workload, frozen_adapter_bytes=priced_bytes(stack.training, None),
                           frozen_adapter_tensors=priced_tensors(stack.training, None))
    main = tuple(n for n, _ in fam.spec.blocks(model) if n.startswith("layers."))
    plan = Plan(streamed_blocks=main, checkpointing="blocks", ring_slots=2)
    # priced on a model without the base adapter, as `leantune plan` prices (from the workload)
    est = Planner(fam.spec, model_with_lora(), workload, assumed_machine(8 * GiB), Calibration()).estimate(plan)
    sim = simulate_training(model, fam.spec, cfg, plan, (512, 512))
    return {"after_setup": sim.after_setup, "breakdown": dict(est.vram), "host": dict(est.host),
            "host_after_setup": sim.host_after_setup, "stack": workload.frozen_adapter_bytes, "streamed": len(main),
            "ratio": (est.peak_vram - est.vram["workspace"]) / sim.peak}


register("base_adapter_cases", {f"adapter_{w}": Call("test_base_adapters_simulated", "_turbo_adapter_step",
                                                     {"with_adapter": w}) for w in (False, True)})


@pytest.fixture(scope="module")
def base_adapter_cases(request):
    _library_or_skip()
    return results(request, "base_adapter_cases")


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
def test_a_streamed_blocks_base_adapter_travels_with_it_on_the_simulated_device(base_adapter_cases):
    r, bare = base_adapter_cases["adapter_True"], base_adapter_cases["adapter_False"]
    b, b0 = r["breakdown"], bare["breakdown"]
    assert r["streamed"] == 2
    placed = b["weights resident"] + b["stream slots"] + b["adapters"] + b["base adapters (resident)"]
    assert r["after_setup"] == placed, (r["after_setup"], b)
    assert 0 < b["base adapters (resident)"] < r["stack"]                # the refiners' share only
    assert b["weights resident"] == b0["weights resident"] and b["adapters"] == b0["adapters"]
    assert b["stream slots"] > b0["stream slots"]                          # the main blocks' share rides there
    streamed = "streamed blocks (pinned)"
    grown = r["host"][streamed] - bare["host"][streamed]
    assert grown >= r["stack"] - b["base adapters (resident)"]            # packed (aligned) in the units
    assert r["host_after_setup"] - bare["host_after_setup"] == grown       # as the engine packs them
    for case in (r, bare):
        assert 0.97 <= case["ratio"] <= 1.03, case
