"""Full fine-tuning on the simulated GPU (leantune/simulated_run.py, [train] mode = "full"):
the trainer's FullMode prepares the faked model, the planner's plan is applied with the trainable
streaming engine, and `train_step` runs the optimizer inside backward, against the planner.

Full width (3072, 24 heads, T5 4096) with one double and one single block (two of each for the
planned case): every tensor of a full-size block, in seconds. bf16 weights with stochastic
rounding (the [full] default), so the rounding's random draw runs on the simulated device too.
Run in a fresh process (see simulated.enable): the one of tests/simulated_cases.py, shared with the
other simulated test modules.
"""

from __future__ import annotations

import pytest
from simulated_cases import GROUP, register, results
from test_simulated import _library_or_skip

from leantune.memory.plan import Plan

GiB = 2**30
DOUBLE, SINGLE = "transformer_blocks.0", "single_transformer_blocks.0"
CASES = {
    "resident_adamw_bf16": dict(state_dtype="bf16", plan=Plan(checkpointing="none")),
    "streamed_checkpointed_adamw_bf16": dict(state_dtype="bf16", plan=Plan(streamed_blocks=(DOUBLE, SINGLE),
                                                                           checkpointing="blocks", ring_slots=2)),
    "streamed_offloaded_adafactor": dict(optimizer="adafactor", plan=Plan(streamed_blocks=(DOUBLE, SINGLE),
                                                                          checkpointing="offload", ring_slots=2)),
    "single_streamed_adamw_fp32": dict(state_dtype="fp32", plan=Plan(streamed_blocks=(SINGLE,),
                                                                     checkpointing="blocks", ring_slots=2)),
    # the optimizer step of the streamed blocks on the host: weight-only slots, gradients back
    "streamed_host_adamw_fp32": dict(state_dtype="fp32", plan=Plan(streamed_blocks=(DOUBLE, SINGLE),
                                                                   checkpointing="blocks", ring_slots=2,
                                                                   optimizer_on_host=True)),
    "streamed_host_offloaded_adafactor": dict(optimizer="adafactor", plan=Plan(streamed_blocks=(DOUBLE, SINGLE),
                                                                               checkpointing="offload", ring_slots=2,
                                                                               optimizer_on_host=True)),
    # two blocks of each kind at 7 GiB: the planner streams all four (their units cycle through 2 slots);
    # the streamed blocks step on the device: under "auto" the choice follows this machine's measured
    # CPU rate (an idle CPU makes the host step the faster plan), which the test must not depend on
    "planned_7GiB": dict(state_dtype="bf16", budget=7 * GiB, blocks=(2, 2), streamed_step="device"),
}


register("full_cases", {n: {"what": "full", "size": 512, "budget": 8 * GiB, "blocks": (1, 1), **CASES[n]}
                        for n in CASES})


@pytest.fixture(scope="module")
def full_cases(request):
    _library_or_skip()
    return results(request, "full_cases")


def _static(r: dict) -> int:
    b = r["breakdown"]
    return b["weights resident"] + b["stream slots"] + b["optimizer states"]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_full_engine_places_and_moves_what_the_planner_counts(full_cases, name):
    """Exact byte counts: after apply_memory the simulated GPU holds the resident weights with
    their optimizer state and the ring slots; the host holds the tensors the planner's host-RAM
    peak counts (its process baseline aside); the steady-state step copies the bytes the planner's
    step simulation moves, host to device (units and offloaded inputs) and back (the write-back)."""
    r = full_cases[name]
    assert "infeasible" not in r, r
    assert r["after_setup"] == _static(r)
    host = r["host_breakdown"]
    # A host-step plan's peak includes the pinned gradient staging of a CUDA run, where a worker
    # thread steps while backward goes on; on the simulated device the host step is synchronous
    # and has none. It is a term of the steady phase, which must then be the peak.
    staging = host.get("gradient staging (pinned)", 0)
    if staging:
        steady = sum(host[k] for k in host if k.startswith(("streamed blocks", "optimizer state of", "optimizer step on",
                                                              "gradient staging", "offloaded", "staging", "caches",
                                                              "fp32 ")))
        assert r["host_predicted"] - host["process baseline"] == steady
        # The host step's temporaries are priced per element from two measured sizes (exact for
        # AdamW; Adafactor's row/column statistics are not linear in the size): at most 1 % over.
        expected = r["host_predicted"] - host["process baseline"] - staging
        # Without the staging the steady phase may fall below set-up's packing peak (the host
        # kernels step with no temporaries the size of a tensor): then that phase is the peak.
        packing = host.get("stored transformer + one unit while packing", 0)
        if packing > expected:
            assert r["host_simulated"] == packing
        else:
            assert 0 <= expected - r["host_simulated"] <= 0.01 * expected, (expected, r["host_simulated"])
    else:
        assert r["host_simulated"] == r["host_predicted"] - host["process baseline"]
    assert r["d2h_simulated"] == r["d2h_predicted"]
    assert r["h2d_simulated"] == r["h2d_predicted"]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_full_step_peak_is_within_the_prediction(full_cases, name):
    """The planner's peak (without its workspace term) is an upper bound of the simulated one, and
    over by less than its step terms and by at most 10%: each weight steps inside backward when
    its gradient completes, and the planner prices each update there, with the activations the
    probe saw live at that moment (the largest, a double block's modulation Linear, comes last in
    its block's backward, after most of the block's activations are gone). Pricing the largest
    update on top of the whole activation peak instead was up to 13.6% over here. The host step
    still prices it so (memory_model.py: per moment it under-predicted at full size), and its
    weight-only slots make the device peak small, so the same term is a larger share: up to 25%."""
    r = full_cases[name]
    predicted = r["predicted"] - r["workspace"]
    step = r["breakdown"]["gradients"] + r["breakdown"]["optimizer step"]
    assert 0 <= predicted - r["simulated"] <= step, (name, predicted, r["simulated"], step)
    assert 1.0 <= r["ratio"] <= (1.25 if "host" in name else 1.10), (name, r["ratio"])


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
def test_planned_full_fine_tune_fits_its_budget(full_cases):
    """The planner's plan for 7 GiB streams the blocks with their optimizer state, writes every
    streamed unit back once per step, and stays inside the usable budget (the budget less the
    allocator margin) on the simulated device, workspace included."""
    r = full_cases["planned_7GiB"]
    assert "infeasible" not in r, r
    assert r["streamed"] == 4 and r["report"]["streamed_units"] == 4
    assert r["d2h_simulated"] > 0
    assert r["simulated"] + r["workspace"] <= r["budget"] - r["margin"]


def test_a_prepared_model_is_refused():
    """simulate_training prepares the faked model itself; a model still carrying the optimizer
    state of an earlier FullMode.prepare (on meta, for planning) would be counted twice in host RAM."""
    from leantune.simulated_run import meta_model, simulate_training, training_config
    from leantune.models.flux import FLUX_SPEC
    from leantune.train.modes import make_mode

    cfg = training_config(512, 8 * GiB, mode="full")
    model = meta_model("flux-dev", (1, 1))
    make_mode(cfg).prepare(model, FLUX_SPEC)
    with pytest.raises(ValueError, match="unprepare_full"):
        simulate_training(model, FLUX_SPEC, cfg, Plan(), (512, 512))
