"""Split blocks as a plan choice (memory/split_parts.py, Plan.split_blocks): the planner probes a
family's blocks split and not, considers a split plan only with block checkpointing, prices its
extra forward, and takes it where no unsplit plan fits or where it is faster; the engine switches
the blocks from the plan; a stored measurement without split profiles still loads."""

from __future__ import annotations

import json

import pytest
import torch

from leantune.memory.plan import Plan
from leantune.models import qwen_image21 as fam
from leantune.models.qwen_image21.spec import QWEN_IMAGE21_SPEC as SPEC
from leantune.tiny import qwen_image21 as tq

GiB = 2**30


@pytest.fixture(scope="module")
def tiny_planner():
    """The tiny Qwen-Image-2.1 on meta with one reference (a LoRA step at 64 x 64), planned."""
    from leantune.models.qwen_image21.meta_model import QwenImage21Transformer2DModel as Meta
    from leantune.planner.machine import assumed_machine
    from leantune.planner.search import Planner
    from leantune.planner.workload import Workload

    with torch.device("meta"):
        meta = Meta.from_config(dict(tq.QWEN_IMAGE21_TINY))
    w = Workload(mode="lora", rank=4, targets="all", buckets=((64, 64),), text_length=7, references=1,
                 autocast=False, dtype=torch.float32)
    return Planner(SPEC, meta, w, assumed_machine())


def test_the_planner_splits_qwen_image21_only_where_the_unsplit_plan_does_not_fit(capsys, tmp_path, monkeypatch):
    """`leantune plan --model qwen-image-2.1` LoRA r16 at 1024²: with one reference 8 GiB holds an
    unsplit plan, faster than any split one, so the blocks do not split; with three references no
    unsplit plan fits 6 GiB (predicted: its activations alone are 7.9 GiB) and the split plan (4.2 GiB)
    does. The plan line and the JSON say so."""
    from test_planner import _run_plan

    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))
    common = ["--model", "qwen-image-2.1", "--resolution", "1024", "--ram", "24GiB"]
    rc, out, err = _run_plan(capsys, *common, "--references", "1", "--vram", "8GiB", "--json")
    assert rc == 0, err
    one = json.loads(out)["plans"][0]["plan"]
    assert "split_blocks" not in one and one["checkpointing"] != "none"      # to_dict omits it when off
    assert "split_blocks" not in one["notes"]

    rc, out, err = _run_plan(capsys, *common, "--references", "3", "--vram", "6GiB", "--json")
    assert rc == 0, err
    entry = json.loads(out)["plans"][0]
    three, notes = entry["plan"], entry["plan"]["notes"]
    assert three["split_blocks"] is True and three["checkpointing"] in ("blocks", "offload")
    assert notes["predicted_peak_vram"] <= entry["budget_bytes"] - notes["margin_vram"]
    assert notes["split_blocks"]["unsplit_needs_vram"] > 6 * GiB
    assert notes["vram_breakdown"]["activations"] < 5 * GiB
    rc, out, _ = _run_plan(capsys, *common, "--references", "3", "--vram", "6GiB")     # the kept measurement
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("plan:"))
    assert line.endswith(", split blocks")
    assert "no unsplit plan fits: the smallest needs" in out


def test_a_split_plan_is_priced_with_one_more_forward_per_block_and_only_with_checkpointing(tiny_planner):
    """The split probe's backward holds the parts' recompute: one more forward of each block (the
    tiny model: within 1 % of the block's forward FLOPs), so a split plan's compute is the unsplit
    one's plus the blocks' forwards; it keeps less. Split candidates come only with checkpointing
    "blocks" / "offload"."""
    pl = tiny_planner
    bucket = (64, 64)
    plain, split = pl.profile_of((False, False), bucket), pl.profile_of((False, False), bucket, split=True)
    for kind, k in plain.kinds.items():
        s = split.kinds[kind]
        assert s.fwd_flops == k.fwd_flops and s.out == k.out
        assert s.bwd_flops - k.bwd_flops == pytest.approx(k.fwd_flops, rel=0.01)
        assert s.saved < k.saved
    for ckpt in ("blocks", "offload"):
        a, b = Plan(checkpointing=ckpt), Plan(checkpointing=ckpt, split_blocks=True)
        ta, tb = pl.estimate(a), pl.estimate(b)
        rate = pl.machine.flops * pl.calibration.flops_scale
        extra = sum(plain.kinds[k].fwd_flops for k in pl.kinds) / rate
        assert tb.compute_s - ta.compute_s == pytest.approx(extra, rel=0.01)
        assert tb.vram["activations"] < ta.vram["activations"]
    plans = list(pl.candidates())
    assert any(p.split_blocks for p in plans)
    assert all(p.checkpointing != "none" for p in plans if p.split_blocks)


def test_the_engine_switches_the_blocks_from_the_plan():
    """apply_memory turns the split blocks' switch on for a plan with split_blocks and off for one
    without (whatever it was), and remove() leaves the plain block's forward."""
    from leantune.memory.engine import apply_memory

    model = tq.qwen_image21_transformer(0)
    fam.QWEN_IMAGE21.split_blocks(model)
    blocks = model.transformer_blocks

    def switches():
        return {b.split_parts for b in blocks}

    assert switches() == {False}
    handle = apply_memory(model, SPEC, Plan(checkpointing="blocks", split_blocks=True), "cpu")
    assert switches() == {True} and all("split_parts" in b.__dict__ for b in blocks)
    handle.remove()
    assert switches() == {False}
    for b in blocks:
        b.split_parts = True
    handle = apply_memory(model, SPEC, Plan(checkpointing="blocks"), "cpu")
    assert switches() == {False}
    handle.remove()


def test_a_stored_measurement_without_split_profiles_loads_with_split_plans_absent(tiny_planner):
    """A measurement kept before split blocks (no "split_profiles") reads back, and its planner
    offers no split plan; one with them reads back whole. A plan without split_blocks is written
    as before them."""
    from leantune.planner.machine import assumed_machine
    from leantune.planner.search import Planner
    from leantune.planner.spec_cache import MeasuredModel

    measured = tiny_planner.measured
    assert measured.split_profiles and measured.split_profiles.keys() == measured.profiles.keys()
    d = json.loads(json.dumps(measured.to_dict()))
    again = MeasuredModel.from_dict(d)
    assert again.split_profiles == measured.split_profiles and again.profiles == measured.profiles
    del d["split_profiles"]
    old = MeasuredModel.from_dict(d)
    assert old.split_profiles == {} and "split_profiles" not in old.to_dict()
    pl = Planner(SPEC, old, tiny_planner.workload, assumed_machine())
    assert not pl.splits and not any(p.split_blocks for p in pl.candidates())
    with pytest.raises(ValueError, match="no split variant"):
        pl.estimate(Plan(checkpointing="blocks", split_blocks=True))
    assert "split_blocks" not in Plan().to_dict() and Plan(split_blocks=True).to_dict()["split_blocks"] is True
    assert Plan(split_blocks=True).describe().endswith(", split blocks")


def test_a_family_without_split_blocks_is_probed_once_per_storage():
    """The split variant is probed only for a family that has split blocks: Qwen-Image's (none)
    measurement holds no split profile, and an inference workload of Qwen-Image-2.1 none either."""
    from leantune.models.qwen_image.spec import QWEN_IMAGE_SPEC
    from leantune.planner.spec_cache import measure_model
    from leantune.planner.workload import Workload
    from leantune.tiny.qwen_image import qwen_image_transformer

    w = Workload(mode="lora", rank=4, targets="all", buckets=((64, 64),), text_length=7, autocast=False,
                 dtype=torch.float32)
    measured = measure_model(QWEN_IMAGE_SPEC, qwen_image_transformer(0), w)
    assert measured.profiles and not measured.split_profiles
    model = tq.qwen_image21_transformer(0)
    inference = Workload(mode="inference", buckets=((64, 64),), text_length=7, autocast=False, dtype=torch.float32)
    assert not measure_model(SPEC, model, inference).split_profiles


def test_memory_split_blocks_pins_the_choice_in_config_planner_and_engine(tiny_planner, tmp_path):
    """[memory] split_blocks: true plans only split plans (each checkpointed), false none, "auto"
    both; true without checkpointing and without a budget is refused naming the key; the explicit
    key reaches the engine's plan; a model without split blocks refuses a split plan, naming the key."""
    from dataclasses import replace

    from leantune.config import MemoryConfig
    from leantune.memory.engine import apply_memory, resolve_plan
    from leantune.planner.search import Planner
    from leantune.planner.workload import Budget

    pl = tiny_planner
    pinned = {s: Planner(SPEC, pl.measured, replace(pl.workload, split_blocks=s), pl.machine)
              for s in (True, False)}
    assert {p.split_blocks for p in pl.candidates()} == {False, True}
    assert all(p.split_blocks and p.checkpointing != "none" for p in pinned[True].candidates())
    assert not any(p.split_blocks for p in pinned[False].candidates())
    assert pinned[True].plan(Budget(vram=8 * 2**30, ram=2**40)).split_blocks

    with pytest.raises(ValueError, match=r'split_blocks = true .* needs checkpointing = "blocks" or "offload"'):
        MemoryConfig(split_blocks=True)
    assert MemoryConfig(split_blocks=True, vram_budget="8GiB").split_blocks is True
    cfg = MemoryConfig(split_blocks=True, checkpointing="offload")
    model = tq.qwen_image21_transformer(0)
    fam.QWEN_IMAGE21.split_blocks(model)
    plan = resolve_plan(cfg, SPEC, model)
    assert plan.split_blocks and plan.checkpointing == "offload"
    assert not resolve_plan(MemoryConfig(checkpointing="offload"), SPEC, model).split_blocks     # "auto": off
    plain = tq.qwen_image21_transformer(0)                     # the family's blocks not swapped in
    with pytest.raises(ValueError, match=r"\[memory\] split_blocks = true: this model's blocks have no split"):
        apply_memory(plain, SPEC, plan, "cpu")
