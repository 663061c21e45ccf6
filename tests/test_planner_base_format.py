"""The plan search's choice of base format ([memory] base_format = "auto", planner/base_formats.py):
fp8, int8 ConvRot and NF4 stored block Linears priced exactly, chosen within the error bound, a
pinned format kept, the choice printed with its runner-up, and the trainer loading the format the
plan chose.

The model is the tiny Flux 128 wide (block Linear inputs 128, 512, 640: whole 64-value NF4 blocks
and ConvRot groups). The machine's host->GPU copies are made slow (1 MB/s) so that a streamed
block costs more than any dequantization: the search then prefers whichever base fits resident.
The budget has no margin (the tiny model's weights are a few MB; the default margin is 256 MiB).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from leantune import tiny
from leantune.memory import int8_storage as i8
from leantune.memory import nf4_storage as nf4
from leantune.memory.engine import apply_memory
from leantune.memory.fp8 import block_linears
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC
from leantune.planner.machine import assumed_machine
from leantune.planner.report import format_plan
from leantune.planner.search import Planner
from leantune.planner.weight_bytes import measure_weights
from leantune.planner.workload import UNLIMITED_RAM, Budget, Workload

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDE = dict(attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))   # inner width 128
ALL = ("fp8", "int8", "nf4")


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model():
    return tiny.flux_transformer(seed=3, dtype=torch.bfloat16, **WIDE).requires_grad_(False)


def _slow_machine():
    return replace(assumed_machine(), h2d_pinned=1e6, h2d_pageable=1e6, workspace=0)


def _workload(**kw) -> Workload:
    return Workload(rank=4, targets="all", buckets=((64, 64),), text_length=16, base_formats=ALL, **kw)


def _budget(vram: int) -> Budget:
    return Budget(vram=vram, ram=UNLIMITED_RAM, margin=0.0, min_margin=0)


def _resident_peak(planner: Planner, fmt: str, fp8: bool = True) -> int:
    """The smallest predicted peak of a plan streaming nothing, with the block Linears in `fmt`."""
    return min(planner.estimate(Plan(fp8=fp8, base_format=fmt, checkpointing=c)).peak_vram
               for c in ("none", "blocks", "offload"))


def _tight(planner: Planner) -> int:
    """A budget the NF4 base fits resident in and no other storage does."""
    v = _resident_peak(planner, "nf4")
    others = [_resident_peak(planner, f) for f in planner.formats if f != "nf4"] + [_resident_peak(planner, "fp8", False)]
    assert v < min(others)
    return v


def test_the_formats_bytes_are_the_stored_bytes(model):
    """Per block, the planner's int8 / NF4 bytes equal what apply_int8_storage / apply_nf4_storage
    store, and its unit bytes the streaming engine's packed units."""
    import copy

    weights = measure_weights(FLUX_SPEC, model)
    for fmt, apply in (("int8", i8.apply_int8_storage), ("nf4", nf4.apply_nf4_storage)):
        stored = copy.deepcopy(model)
        assert apply(stored, FLUX_SPEC)
        for (name, block), w in zip(FLUX_SPEC.blocks(stored), weights.blocks):
            actual = sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))
            assert w.bytes(2, fp8=True, fmt=fmt) == actual, (fmt, name)
        handle = apply_memory(stored, FLUX_SPEC, Plan(streamed_blocks=tuple(w.name for w in weights.blocks),
                                                      fp8=True, base_format=fmt), "cpu")
        try:
            packed = {u.name: u.nbytes for u in handle.streaming.units}
            for w in weights.blocks:
                assert packed[w.name] == w.unit_bytes(2, fp8=True, fmt=fmt), (fmt, w.name)
        finally:
            handle.remove()


def test_auto_picks_the_resident_4bit_base_where_fp8_must_stream(model):
    planner = Planner(FLUX_SPEC, model, _workload(max_base_error=10.0), _slow_machine())
    plan = planner.plan(_budget(_tight(planner)))
    assert plan.fp8 and plan.base_format == "nf4" and not plan.streamed_blocks
    rows = {r["format"]: r for r in plan.notes["base_format"]["formats"]}
    assert rows["nf4"]["chosen"] and rows["fp8"]["streamed"] > 0
    assert rows["fp8"]["step_s"] > rows["nf4"]["step_s"]
    line = format_plan(plan)
    assert "base:     nf4 resident" in line and "error 9.23 % vs bf16" in line
    assert "runner-up " in line and ("fp8 streamed" in line or "int8 streamed" in line)


def test_the_error_bound_keeps_fp8(model):
    """NF4 (9.23 %) is over the default bound (fp8 e4m3's 2.52 %): the same budget keeps fp8,
    streaming, and the line says what NF4 would have given."""
    planner = Planner(FLUX_SPEC, model, replace(_workload(), base_formats=("fp8", "nf4")), _slow_machine())
    plan = planner.plan(_budget(_tight(planner)))
    assert plan.fp8 and plan.base_format == "fp8" and plan.streamed_blocks
    rows = {r["format"]: r for r in plan.notes["base_format"]["formats"]}
    assert not rows["nf4"]["allowed"] and not rows["nf4"]["streamed"]
    line = format_plan(plan)
    assert "base:     fp8 streamed" in line and "over the bound: nf4 resident" in line


def test_a_pinned_format_is_never_overridden(model):
    """base_format = "int8" pinned: every budget's plan stores int8, even where bf16 fits resident
    and a bound below int8's error would exclude it."""
    pinned = replace(_workload(max_base_error=0.1), base_formats=("int8",), base_pinned=True)
    planner = Planner(FLUX_SPEC, model, pinned, _slow_machine())
    free = Planner(FLUX_SPEC, model, _workload(), _slow_machine())
    tight = _tight(free)
    for vram in (tight, 2 * tight, 2**34):
        plan = planner.plan(_budget(vram))
        assert plan.fp8 and plan.base_format == "int8", vram
        assert "pinned by [memory] base_format" in format_plan(plan)
    assert not free.plan(_budget(2**34)).fp8          # unpinned, the roomy budget keeps bf16


def test_the_trainer_loads_the_chosen_format_and_a_replan_keeps_it(model, tmp_path, monkeypatch):
    """Under a vram_budget with base_format = "auto", the trainer's plan-before-load chooses NF4,
    the load reads the block Linears as NF4 rows (the plan's loader options), the engine keeps them
    so (nothing becomes e4m3), and a re-plan of the same planner at a roomy budget stays NF4."""
    from leantune.config import RunConfig
    from leantune.models.flux import loading as flux_loading
    from leantune.planner import from_config
    from leantune.trainer import _fp8_load_options, _plan_before_load

    path = flux_loading.save_bfl_transformer(model, tmp_path / "flux.safetensors", dtype=torch.bfloat16)
    sources = flux_loading.FluxSources(path, None, None, None, None, None)
    cfg = RunConfig(model={"path": str(path), "dtype": "bf16"}, lora={"rank": 4, "targets": "all"},
                    data={"datasets": [{"path": str(tmp_path)}], "resolutions": [64], "max_text_length": 16},
                    memory={"vram_budget": "1GiB", "max_base_error": 10.0})
    meta = flux_loading.load_transformer(sources, dtype=torch.bfloat16, device="meta")
    machine = _slow_machine()
    tight = _tight(Planner(FLUX_SPEC, meta, from_config.workload_from_config(cfg), machine))
    monkeypatch.setattr(from_config, "budget_from_config", lambda memory, m: _budget(tight))   # sized for the tiny model
    plan, planner, budget = _plan_before_load(cfg, FLUX_SPEC, lambda: meta, machine)
    assert plan.base_format == "nf4" and plan.fp8 and not plan.streamed_blocks
    options = _fp8_load_options(cfg, plan)
    assert options["quantize_fp8"] == "nf4"
    loaded = flux_loading.load_transformer(sources, dtype=torch.bfloat16, **options)
    taken = [lin for _, _, lin in block_linears(FLUX_SPEC, loaded) if nf4.is_nf4(lin)]
    assert len(taken) == 34                       # every block Linear but the modulation ones
    handle = apply_memory(loaded, FLUX_SPEC, plan, "cpu")
    try:
        assert not (handle.fp8 and handle.fp8.linears)
        assert len([lin for _, _, lin in block_linears(FLUX_SPEC, loaded) if nf4.is_nf4(lin)]) == 34
    finally:
        handle.remove()
    again = planner.plan(_budget(2**34))          # an OOM's or a calibration's re-plan
    assert again.fp8 and again.base_format == "nf4"


def test_a_pinned_formats_load_takes_the_plans_modulation():
    """[memory] base_format = "int8" pinned: the load quantizes the modulation Linears into int8
    rows too where the plan stores them so (as the planner prices that plan), and not otherwise."""
    from leantune.config import RunConfig
    from leantune.trainer import _fp8_load_options

    cfg = RunConfig(model={"path": "x"}, data={"datasets": [{"path": "d"}]},
                    memory={"base_format": "int8", "vram_budget": "8GiB"})
    with_mod = Plan(fp8=True, fp8_modulation=True, base_format="int8")
    assert _fp8_load_options(cfg, with_mod) == {"quantize_fp8": "int8", "quantize_modulation": True}
    assert _fp8_load_options(cfg, replace(with_mod, fp8_modulation=False)) == {"quantize_fp8": "int8"}
    assert _fp8_load_options(cfg) == {"quantize_fp8": "int8"}


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_the_dequantization_is_priced_per_use(model, fmt):
    """An int8 / NF4 base's step is fp8's plus, for every block, its dequantization beyond fp8's
    (base_formats.dequant_extra_s over the weights it stores) once per use: forward and backward,
    and the recompute when checkpointed; nothing streams, so nothing else differs. int8's decode
    costs more than fp8's, NF4's less (one bitsandbytes kernel moves 3.8 bytes a weight, fp8's copy
    and scale product 7)."""
    from leantune.planner.base_formats import dequant_extra_s

    machine = _slow_machine()
    planner = Planner(FLUX_SPEC, model, _workload(), machine)
    weights = measure_weights(FLUX_SPEC, model)
    per_use = sum(dequant_extra_s(fmt, b.quantized(True, False, fmt)[0], machine.hbm, machine.flops)
                  for b in weights.blocks)
    assert (per_use > 0) if fmt == "int8" else (per_use < 0)
    for ckpt, uses in (("none", 2), ("blocks", 3)):
        base = planner.estimate(Plan(fp8=True, checkpointing=ckpt)).step_s
        got = planner.estimate(Plan(fp8=True, base_format=fmt, checkpointing=ckpt)).step_s
        assert got - base == pytest.approx(uses * per_use, rel=1e-6), ckpt
