"""SD3.5 on the simulated GPU (leantune/simulated_run.py through the sd3 family): the
trainer's step and the sampler's classifier-free-guidance step at full width, against the planner.

Full width (Large: 38 heads of 64, T5 width 4096; Medium: 24 heads with the dual-attention blocks)
with two joint blocks, the second the context-pre-only one every SD3 stack ends with: every tensor
of a full-size block, in seconds. Run in a fresh process (see simulated.enable): the one of
tests/simulated_cases.py, shared with the other simulated test modules.
"""

from __future__ import annotations

import pytest
from simulated_cases import GROUP, register, results
from test_simulated import _library_or_skip

from leantune.memory.plan import Plan

GiB = 2**30
BLOCKS = (2,)
JOINT = ("transformer_blocks.0", "transformer_blocks.1")
CASES = {
    "large_streamed_checkpointed": dict(model_name="sd3.5-large", what="train", size=512,
                                        plan=Plan(streamed_blocks=JOINT, checkpointing="blocks", ring_slots=2)),
    "large_fp8_offloaded": dict(model_name="sd3.5-large", what="train", size=512,
                                plan=Plan(streamed_blocks=JOINT[1:], fp8=True, checkpointing="offload", ring_slots=2)),
    "large_planned_1.2GiB": dict(model_name="sd3.5-large", what="train", size=512, budget=int(1.2 * GiB)),
    "large_sample_planned_1.5GiB": dict(model_name="sd3.5-large", what="sample", size=1024, budget=int(1.5 * GiB)),
    "medium_planned_1.2GiB": dict(model_name="sd3.5-medium", what="train", size=512, budget=int(1.2 * GiB)),
    "medium_sample_planned_1.2GiB": dict(model_name="sd3.5-medium", what="sample", size=1024, budget=int(1.2 * GiB)),
}


register("sd3_cases", {n: {"budget": 8 * GiB, **CASES[n], "blocks": BLOCKS} for n in CASES})


@pytest.fixture(scope="module")
def sd3_cases(request):
    _library_or_skip()
    return results(request, "sd3_cases")


def _static(r: dict) -> int:
    b = r["breakdown"]
    return b["weights resident"] + b["stream slots"] + b["adapters"]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_sd3_engine_places_what_the_planner_counts_and_the_peak_matches(sd3_cases, name):
    """After apply_memory the simulated GPU holds exactly the resident weights, ring slots and
    adapters the planner prices; the step's peak is within 10% of the prediction (without its
    workspace term, which the simulation cannot see)."""
    r = sd3_cases[name]
    assert "infeasible" not in r, r
    assert r["model"] == CASES[name]["model_name"]
    assert r["after_setup"] == _static(r)
    assert 0.90 <= r["ratio"] <= 1.10, (name, r["ratio"])


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if "planned" in n])
def test_sd3_planned_budget_holds_on_the_simulated_device(sd3_cases, name):
    """The planner's plan for the budget stays inside the budget on the simulated device, workspace
    included, and takes at most a tenth of the allocator margin (the 1024 px sampling step measures
    about 9 MB more than predicted, which reaches into the margin when the plan sits at the edge of
    the usable budget, as the 1.5 GiB one does)."""
    r = sd3_cases[name]
    used = r["simulated"] + r["workspace"]
    assert used <= r["budget"], r
    assert used <= r["budget"] - 0.9 * r["margin"], (name, used - (r["budget"] - r["margin"]))


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
def test_sd3_sampling_runs_cfg_doubled_or_halved_as_planned(sd3_cases):
    """Classifier-free guidance: at 1.5 GiB the Large's doubled batch (negative and positive halves
    in one forward) fits and runs so; at 1.2 GiB the Medium's does not and the halves run one after
    the other. The prediction agreeing with the simulation (test above) checks that the planner
    priced the batch the sampler ran."""
    batched, halves = sd3_cases["large_sample_planned_1.5GiB"], sd3_cases["medium_sample_planned_1.2GiB"]
    assert batched["cfg_batched"] is True and halves["cfg_batched"] is False
    assert batched["report"]["streamed_units"] == batched["streamed"]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
def test_sd3_streaming_and_checkpointing_lower_the_simulated_peak(sd3_cases):
    streamed, planned = sd3_cases["large_streamed_checkpointed"], sd3_cases["large_planned_1.2GiB"]
    assert streamed["report"]["slots"] == 2 and streamed["report"]["demand_fetches"] == 0
    assert planned["streamed"] == 2 and planned["fp8"]
    assert planned["simulated"] < streamed["simulated"]
