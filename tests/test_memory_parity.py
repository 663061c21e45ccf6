"""Parity of the composed memory engine with the plain model, on CPU.

Streaming {none, some, all + non-block group} x fp8 {off, on} x checkpointing {none, blocks, offload},
with a LoRA, batch 2, two bucket shapes, two SGD steps. Streaming runs in poison mode, so a weight
used outside its hold window would turn the loss NaN. The reference for each fp8 setting is the
plain model with the same storage (fp8 alone), and equality is bitwise: streaming and
checkpointing do not change the arithmetic. fp8 against full precision is bounded in
test_memory_fp8.py.
"""

from __future__ import annotations

import pytest
import torch
from test_memory_helpers import (
    assert_records_equal,
    base_state,
    block_names,
    lora_flux,
    run_plan,
    train,
)

from leantune.memory.engine import even_spread
from leantune.memory.plan import Plan

_CACHE: dict = {}


def _base():
    if "base" not in _CACHE:
        _CACHE["base"] = lora_flux(seed=0)
    return _CACHE["base"]


def _reference(fp8: bool):
    key = ("ref", fp8)
    if key not in _CACHE:
        records, handle, model = run_plan(_base(), Plan(fp8=fp8))
        handle.remove()
        _CACHE[key] = (records, base_state(model))
    return _CACHE[key]


def _streaming(kind: str, names: list[str]) -> dict:
    if kind == "none":
        return {}
    if kind == "some":
        return {"streamed_blocks": tuple(even_spread(names, 2)), "debug_poison": True}
    return {"streamed_blocks": tuple(names), "stream_non_blocks": True, "debug_poison": True}


@pytest.mark.parametrize("checkpointing", ["none", "blocks", "offload"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf", "fp8"])
@pytest.mark.parametrize("streaming", ["none", "some", "all"])
def test_parity_matrix(streaming, fp8, checkpointing):
    base = _base()
    plan = Plan(fp8=fp8, checkpointing=checkpointing, **_streaming(streaming, block_names(base)))
    want, want_base = _reference(fp8)
    got, handle, model = run_plan(base, plan, offload_min_bytes=0)
    assert all(torch.isfinite(r["loss"]) for r in got)
    assert_records_equal(got, want)
    rep = handle.step_report()
    if streaming != "none":
        assert rep["bytes_h2d"] > 0 and rep["slots"] == 2
    if checkpointing == "offload":
        # every offloaded block input came back exactly once for the recompute
        assert rep["offload_bytes_d2h"] > 0 and rep["offload_bytes_h2d"] == rep["offload_bytes_d2h"]
    # The frozen base weights are untouched by training: remove() gives back the same values.
    handle.remove()
    after = base_state(model)
    assert after.keys() == want_base.keys()
    for name, value in want_base.items():
        assert torch.equal(after[name], value), f"base weight {name} changed"


@pytest.mark.parametrize("variant", [
    dict(ring_slots=3),
    dict(ring_slots=2, pin_memory=False),                     # pageable buffers through the staging worker
    dict(ring_slots=4, stream_non_blocks=True),               # ring as large as the streamed set + 1
])
def test_parity_ring_variants(variant):
    base = _base()
    names = block_names(base)
    want, _ = _reference(False)
    for ckpt in ("none", "blocks"):
        plan = Plan(streamed_blocks=tuple(names), debug_poison=True, checkpointing=ckpt, **variant)
        got, handle, _ = run_plan(base, plan)
        assert_records_equal(got, want)
        handle.remove()


def test_parity_without_poison_reuses_resident_slots():
    """Normal mode keeps a slot's bytes until another unit needs the slot: same results, and in
    steady state each unit is copied once per forward and once per backward minus the ring's worth
    that is still resident at the turn, every copy prefetched (none on demand). Poison mode, which
    destroys a slot at each release, copies every unit in forward and again in backward."""
    base = _base()
    names = block_names(base)
    want, _ = _reference(False)
    runs = {}
    for poison in (False, True):
        plan = Plan(streamed_blocks=tuple(names), checkpointing="blocks", debug_poison=poison)
        got, handle, model = run_plan(base, plan)
        assert_records_equal(got, want)
        unit_bytes = handle.streaming.unit_bytes()
        handle.step_report()
        train(model)                                           # two more steps, steady state
        runs[poison] = handle.step_report()
        handle.remove()
    total = sum(unit_bytes.values())                           # 4 blocks, ring of 2
    assert runs[False]["demand_fetches"] == 0
    assert runs[False]["bytes_h2d"] == 2 * total               # 2 steps x (2 units fwd + 2 units bwd)
    assert runs[True]["bytes_h2d"] == 2 * 2 * total            # 2 steps x (4 fwd + 4 bwd)
