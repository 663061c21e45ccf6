"""Z-Image on the simulated GPU (leantune/simulated_run.py through the z-image family): the trainer's
LoRA step and a sampling step at full width, planned for a budget, against the planner.

Full width (30 heads of 128, dim 3840, Qwen3-4B captions of 2560) with one block of each refiner and
two main blocks: every tensor of a full-size block; the joined image + caption sequence (4096 + 512
tokens at 1024 px) is what the planner's probe prices. Run in the shared fresh process of
tests/simulated_cases.py (see simulated.enable).
"""

from __future__ import annotations

import pytest
from simulated_cases import GROUP, register, results
from test_simulated import _library_or_skip

GiB = 2**30
CASES = {
    "turbo_lora_planned_3GiB": dict(model_name="z-image-turbo", what="train", size=1024, budget=3 * GiB, blocks=(1, 1, 2)),
    # ZImagePipeline batches CFG's halves: sampling plans for the doubled batch
    "turbo_sample_planned_3GiB": dict(model_name="z-image-turbo", what="sample", size=1024, budget=3 * GiB,
                                      blocks=(1, 1, 2)),
}

register("z_image_cases", {n: dict(CASES[n]) for n in CASES})


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
