"""FLUX.2 on the simulated GPU (leantune/simulated_run.py through the flux2 families): the trainer's
LoRA step at full width, planned for a budget, against the planner.

Full width (dev: 48 heads of 128, Mistral context 15360; klein-4B: 24 heads, Qwen3-4B context 7680)
with a few blocks of each list, double and single: every tensor of a full-size block, in under a
minute each. Run in a fresh process (see simulated.enable). The full-size tables are in
docs/benchmarks.md (bench/simulate.py --model flux2-...).
"""

from __future__ import annotations

import pytest
from test_simulated import _library_or_skip

GiB = 2**30
CASES = {
    "klein4b_planned_3GiB": dict(model_name="flux2-klein-4b", what="train", size=1024, budget=3 * GiB, blocks=(2, 2)),
    "klein9b_planned_4GiB": dict(model_name="flux2-klein-9b", what="train", size=1024, budget=4 * GiB, blocks=(2, 2)),
    "dev_planned_8GiB": dict(model_name="flux2-dev", what="train", size=1024, budget=8 * GiB, blocks=(1, 2)),
}


@pytest.fixture(scope="module")
def flux2_cases():
    _library_or_skip()
    from leantune.simulated_run import run_in_fresh_process

    names = list(CASES)
    return dict(zip(names, run_in_fresh_process([dict(CASES[n]) for n in names]), strict=True))


def _static(r: dict) -> int:
    b = r["breakdown"]
    return b["weights resident"] + b["stream slots"] + b["adapters"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_flux2_engine_places_what_the_planner_counts_and_the_peak_matches(flux2_cases, name):
    """After apply_memory the simulated GPU holds exactly the resident weights, ring slots and
    adapters the planner prices; the step's peak is within 10% of the prediction (without its
    workspace term, which the simulation cannot see); the plan stays inside its budget."""
    r = flux2_cases[name]
    assert "infeasible" not in r, r
    assert r["model"] == CASES[name]["model_name"]
    assert r["after_setup"] == _static(r)
    assert 0.90 <= r["ratio"] <= 1.10, (name, r["ratio"])
    assert r["simulated"] + r["workspace"] <= r["budget"], r
