"""Z-Image on the simulated GPU (leantune/simulated_run.py through the z-image family): the trainer's
LoRA step and a sampling step at full width, planned for a budget, against the planner.

Full width (30 heads of 128, dim 3840, Qwen3-4B captions of 2560) with one block of each refiner and
two main blocks: every tensor of a full-size block; the joined image + caption sequence (4096 + 512
tokens at 1024 px) is what the planner's probe prices. Run in the shared fresh process of
tests/simulated_cases.py (see simulated.enable).
"""

from __future__ import annotations

import pytest
from simulated_cases import GROUP, Call, register, results
from test_simulated import _library_or_skip

GiB = 2**30
CASES = {
    "turbo_lora_planned_3GiB": dict(model_name="z-image-turbo", what="train", size=1024, budget=3 * GiB, blocks=(1, 1, 2)),
    # ZImagePipeline batches CFG's halves: sampling plans for the doubled batch
    "turbo_sample_planned_3GiB": dict(model_name="z-image-turbo", what="sample", size=1024, budget=3 * GiB,
                                      blocks=(1, 1, 2)),
}

register("z_image_cases", {n: dict(CASES[n]) for n in CASES})


def _tiny_placement(stream_non_blocks: bool) -> dict:
    """In the fresh process: the tiny Z-Image's LoRA step with every block streamed, the non-block
    modules streamed or not: what the simulated device holds after set-up against the planner's
    resident weights + ring slots + adapters (the pad tokens the model holds itself are in no unit)."""
    import tempfile
    from pathlib import Path

    import torch

    from leantune.config import ModelConfig, validate
    from leantune.memory.plan import Plan
    from leantune.models.family import get_family
    from leantune.planner.corrections import Calibration
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.machine import assumed_machine
    from leantune.planner.meta import meta_from_config
    from leantune.planner.search import Planner
    from leantune.simulated_run import simulate_training
    from leantune.tiny.z_image import save_z_image_folder
    from leantune.train.lora import add_lora

    root = Path(tempfile.mkdtemp())
    folder = save_z_image_folder(root / "z_image")
    fam = get_family("z-image")
    cfg = validate({"model": {"path": str(folder), "family": "z-image", "dtype": "bf16"},
                    "data": {"datasets": [{"path": "unused"}], "resolutions": [64], "batch_size": 1,
                             "max_text_length": 32},
                    "lora": {"rank": 4, "targets": "all"}, "train": {"mixed_precision": "bf16"}})
    meta = fam.load_transformer(fam.resolve_sources(ModelConfig(path=str(folder), family="z-image"), root),
                                dtype=torch.bfloat16, device="meta")
    add_lora(meta, fam.spec, cfg.lora)
    plan = Plan(streamed_blocks=tuple(n for n, _ in fam.spec.blocks(meta)), stream_non_blocks=stream_non_blocks,
                checkpointing="blocks", ring_slots=2)
    est = Planner(fam.spec, meta, workload_from_config(cfg, meta), assumed_machine(8 * 2**30), Calibration()).estimate(plan)
    model = meta_from_config(type(meta), meta.config)
    add_lora(model, fam.spec, cfg.lora)
    sim = simulate_training(model, fam.spec, cfg, plan, (64, 64))
    v = est.vram
    return {"simulated": sim.after_setup, "predicted": v["weights resident"] + v["stream slots"] + v["adapters"],
            "ratio": (est.peak_vram - v["workspace"]) / sim.peak}


register("z_image_tiny", {f"non_blocks_streamed_{nb}": Call("test_simulated_z_image", "_tiny_placement",
                                                            {"stream_non_blocks": nb}) for nb in (False, True)})


@pytest.fixture(scope="module")
def z_image_cases(request):
    _library_or_skip()
    return results(request, "z_image_cases")


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_z_image_engine_places_what_the_planner_counts_and_the_peak_matches(z_image_cases, name):
    """After apply_memory the simulated GPU holds exactly the resident weights, ring slots and
    adapters the planner prices; the step's peak is within 10% of the prediction (without its
    workspace term, which the simulation cannot see); the plan stays inside its budget."""
    r = z_image_cases[name]
    assert "infeasible" not in r, r
    assert r["model"] == CASES[name]["model_name"]
    b = r["breakdown"]
    assert r["after_setup"] == b["weights resident"] + b["stream slots"] + b.get("adapters", 0), (r["after_setup"], b)
    assert 0.90 <= r["ratio"] <= 1.10, (name, r["ratio"], r["predicted"], r["simulated"])
    assert r["simulated"] + r["workspace"] <= r["budget"], r


@pytest.fixture(scope="module")
def z_image_tiny(request):
    _library_or_skip()
    return results(request, "z_image_tiny")


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("streamed", [False, True])
def test_tiny_z_image_places_its_own_tensors_where_the_planner_counts_them(z_image_tiny, streamed):
    """The pad tokens ZImageTransformer2DModel holds itself stay resident whether or not the
    non-block modules stream: what the engine places after set-up is the planner's resident weights,
    ring slots and adapters exactly, both ways (priced with the non-block group they were 1920 bytes
    over with it streamed)."""
    r = z_image_tiny[f"non_blocks_streamed_{streamed}"]
    assert r["simulated"] == r["predicted"], r
    assert 0.90 <= r["ratio"] <= 1.10, r
