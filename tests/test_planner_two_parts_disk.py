"""The disk tier under a host-RAM budget for a model of parts that compute one at a time (Wan 2.2
A14B's two experts, [model] expert = "both"; issue 36): the other part waits on the host as stored
through the steps, so the disk split leaves it room (memory_model._with_other_parts adds it to the
steps' holdings) and the plan comes in under the budget with the part in use's blocks partly on
disk; before, the split saw room that the other part takes and found no plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from leantune import tiny
from leantune.memory.disk_tier import disk_split
from leantune.models.flux import FLUX_SPEC
from leantune.planner.host_model import HOST_BASELINE
from leantune.planner.machine import assumed_machine, with_disk
from leantune.planner.search import Planner
from leantune.planner.workload import Budget, InfeasibleBudget, Workload

UNLIMITED = 2**62


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


def test_the_disk_split_leaves_room_for_the_other_part():
    model = tiny.wide_flux_transformer(n_single=8)
    w = Workload(rank=4, buckets=((64, 64),), text_length=8, allow_fp8=False, other_parts=1)
    machine = with_disk(assumed_machine(), 3e9, "test disk")
    p = Planner(FLUX_SPEC, model, w, machine)
    need = min(p._cheap_estimate(c)[0] for c in p.candidates())
    vram = Budget(vram=UNLIMITED).needed_for(need)
    everything = p.plan(Budget(vram=vram, ram=UNLIMITED))
    host = p.host(everything)
    other = host["other experts on the host (as stored)"]
    streamed = host["streamed blocks (pinned)"]
    assert other > 0 and everything.disk_blocks == ()
    limit = host["peak"] - streamed // 2           # half the part in use's blocks must leave RAM
    with pytest.raises(InfeasibleBudget):           # without the disk tier nothing fits
        Planner(FLUX_SPEC, p.measured, w, assumed_machine()).plan(Budget(vram=vram, ram=limit))
    plan = p.plan(Budget(vram=vram, ram=limit))
    assert plan.disk_blocks and plan.notes["predicted_peak_host"] <= limit
    got = p.host(plan)
    assert got["other experts on the host (as stored)"] == other and got["peak"] <= limit
    # the room the steps leave the blocks counts the other part: a split over the room without it
    # (what the split saw before) keeps too many blocks in RAM
    names = [p.weights.blocks[i].name for i in p.ordered(plan)]
    units = p.units(plan)[int(plan.stream_non_blocks):]
    rest = p.host(replace(plan, disk_blocks=tuple(names)))
    room = limit - HOST_BASELINE - (rest["streamed blocks (pinned)"] + rest["staging buffers"] + rest["caches"]
                                    + rest["offloaded activations"] + other)
    assert len(plan.disk_blocks) >= len(disk_split(list(zip(names, units)), room))
    blind = replace(plan, disk_blocks=disk_split(list(zip(names, units)), room + other))
    assert len(blind.disk_blocks) < len(plan.disk_blocks) and p.host(blind)["peak"] > limit
