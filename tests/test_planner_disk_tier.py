"""The planner's disk tier (issue 39): the disk's read rate measured by a short probe and kept per
disk (planner/disk_rate.py), blocks put on disk exactly when the host-RAM budget forces it, the
three tiers it predicts equal to what apply_memory places on the tiny Flux, and the disk's reads
priced in the step (timing.py) and said by `leantune plan`."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from leantune import tiny
from leantune.config import ConfigError
from leantune.memory.disk_tier import disk_split
from leantune.memory.engine import apply_memory
from leantune.memory.host_buffers import STAGING_CHUNK
from leantune.models.flux import FLUX_SPEC
from leantune.planner import disk_rate
from leantune.planner.host_model import HOST_BASELINE
from leantune.planner.machine import assumed_machine, with_disk
from leantune.planner.report import format_plan
from leantune.planner.search import Planner
from leantune.planner.workload import Budget, InfeasibleBudget, Workload

UNLIMITED = 2**62
CACHES = 512 * 2**20         # caches held in host RAM: the steps, not the load, are the host's peak
STAGING = 2 * STAGING_CHUNK  # the pinned staging pool the disk's reads go through


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


def test_the_probe_measures_the_disk_not_the_page_cache_and_is_kept_per_disk(tmp_path, monkeypatch, caplog):
    rate = disk_rate.measure_disk_read(tmp_path, 4 * 2**20)
    assert rate.read > 0 and rate.method in ("O_DIRECT", "pages dropped") and rate.probe_bytes == 4 * 2**20
    assert not rate.cached and os.listdir(tmp_path) == []            # the probe's file is gone
    assert rate.device.startswith(f"dev {os.major(os.stat(tmp_path).st_dev)}:")
    kept = disk_rate.disk_read_rate(tmp_path, 4 * 2**20)
    path = tmp_path / "leantune-cache" / disk_rate.RATES_FILE
    assert json.loads(path.read_text())[kept.device]["read"] == kept.read

    def no_probe(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(disk_rate, "measure_disk_read", no_probe)
    assert disk_rate.disk_read_rate(tmp_path / "leantune-cache") == kept      # the same disk: kept
    path.write_text("{not json")
    monkeypatch.setattr(disk_rate, "measure_disk_read", lambda folder, n: replace(kept, read=123.0))
    assert disk_rate.disk_read_rate(tmp_path).read == 123.0                   # unreadable: measured, replaced
    assert "ignoring unreadable disk rates file" in caplog.text
    assert json.loads(path.read_text())[kept.device]["read"] == 123.0


def _model():
    """The real Flux class at width 1024 (1 double + 8 single blocks, bf16): blocks that dwarf the
    disk tier's 64 MiB staging pool, as a real model's do."""
    return tiny.wide_flux_transformer(n_single=8)


_MEASURED: list = []      # the model as the planner measures it, once for the file (weights, probes)


def _planner(disk_read: float | None, caches: int = CACHES) -> Planner:
    model = _MEASURED[0] if _MEASURED else _model()
    machine = assumed_machine() if disk_read is None else with_disk(assumed_machine(), disk_read, "test disk")
    w = Workload(rank=4, buckets=((64, 64),), text_length=8, allow_fp8=False, host_cache_bytes=caches)
    p = Planner(FLUX_SPEC, model, w, machine)
    _MEASURED[:] = [p.measured]
    return p


def _tight(p: Planner) -> tuple[int, object]:
    """A VRAM budget only plans that stream every block fit (fewest-byte plan's peak), and that plan."""
    vram, plan = min(((p._cheap_estimate(c)[0], c) for c in p.candidates()), key=lambda vp: vp[0])
    return Budget(vram=UNLIMITED).needed_for(vram), plan


def test_blocks_go_to_disk_exactly_when_the_host_budget_forces_it(tmp_path):
    p = _planner(3e9)
    need, frugal = _tight(p)
    everything = p.plan(Budget(vram=need, ram=UNLIMITED))
    assert len(everything.streamed_blocks) >= 4 and everything.disk_blocks == ()    # not forced: all in RAM
    streamed = p.host(everything)["streamed blocks (pinned)"]
    limit = HOST_BASELINE + CACHES + STAGING + streamed // 2
    with pytest.raises(InfeasibleBudget):                      # without the disk tier nothing fits
        _planner(None).plan(Budget(vram=need, ram=limit))
    plan = p.plan(Budget(vram=need, ram=limit))
    units = p.units(plan)[int(plan.stream_non_blocks):]
    names = [p.weights.blocks[i].name for i in p.ordered(plan)]
    rest = p.host(replace(plan, disk_blocks=tuple(names)))
    # the room the steps leave the blocks: the limit less what they hold with every block on disk
    room = limit - HOST_BASELINE - (rest["streamed blocks (pinned)"] + rest["staging buffers"] + rest["caches"]
                                    + rest["offloaded activations"])
    assert plan.disk_blocks == disk_split(list(zip(names, units)), room) != ()
    assert 0 < len(plan.disk_blocks) < len(plan.streamed_blocks)
    assert plan.notes["predicted_peak_host"] <= limit < p.host(replace(plan, disk_blocks=()))["peak"]
    assert set(plan.disk_blocks) <= set(plan.streamed_blocks)
    text = format_plan(plan)
    assert f"({len(plan.disk_blocks)} streamed blocks) at 3.00 GB/s read" in text and "GB read per step" in text
    # the host budget with room for every block: nothing on disk again
    assert p.plan(Budget(vram=need, ram=limit + streamed)).disk_blocks == ()
    # the load shrinks on disk too (its disk-tier blocks load straight there, memory/disk_load.py):
    # a budget under the whole load is planned with the disk tier and refused without it
    whole = p.host(replace(plan, disk_blocks=()))["transformer while loading"]
    assert p.host(plan)["transformer while loading"] < whole
    under = Budget(vram=2 * need, ram=HOST_BASELINE + whole - 1)
    with pytest.raises(InfeasibleBudget, match="loading the transformer alone takes"):
        _planner(None, caches=0).plan(under)
    assert _planner(3e9, caches=0).plan(under).disk_blocks


def test_the_predicted_tiers_are_what_apply_memory_places(tmp_path):
    p = _planner(3e9)
    need, _ = _tight(p)
    everything = p.plan(Budget(vram=need, ram=UNLIMITED))
    limit = HOST_BASELINE + CACHES + STAGING + p.host(everything)["streamed blocks (pinned)"] // 2
    plan = p.plan(Budget(vram=need, ram=limit))
    tiers = plan.notes["tiers"]
    model = _model()
    handle = apply_memory(model, FLUX_SPEC, replace(plan, debug_poison=True), "cpu", disk_dir=tmp_path)
    try:
        held = handle.device_bytes()
        assert handle.streaming.disk_blocks == plan.disk_blocks
        assert tiers["disk"] == handle.streaming.disk_bytes > 0
        assert tiers["host RAM"] == handle.streaming.host_bytes == plan.notes["host_breakdown"]["streamed blocks (pinned)"]
        assert tiers["VRAM"] == held["resident"] + held["stream slots"]
    finally:
        handle.release()


def test_the_disk_is_priced_against_the_steps_compute():
    fast, slow = _planner(1e12), _planner(1e6)          # a disk far faster than the bus, and a crawling one
    need, _ = _tight(fast)
    limit = HOST_BASELINE + CACHES + STAGING + fast.host(fast.plan(Budget(vram=need, ram=UNLIMITED)))["streamed blocks (pinned)"] // 2
    quick, crawl = fast.plan(Budget(vram=need, ram=limit)), slow.plan(Budget(vram=need, ram=limit))
    for plan in (quick, crawl):
        assert plan.disk_blocks and 0 < plan.notes["disk_bytes_per_step"] <= plan.notes["h2d_bytes_per_step"]
    n = crawl.notes
    assert n["disk_read_s"] == pytest.approx(n["disk_bytes_per_step"] / 1e6)
    assert n["predicted_step_s"] >= n["disk_read_s"]                 # reads hold the copy stream
    assert n["disk_exposed_s"] == pytest.approx(n["predicted_step_s"] - n["step_s_in_ram"]) and n["disk_exposed_s"] > 0
    assert quick.notes["disk_exposed_s"] == pytest.approx(0.0, abs=1e-9)   # as fast as the bus: nothing added


def test_the_plan_command_names_a_bad_disk_flag(tmp_path):
    import argparse

    from leantune.commands import plan as plan_cmd

    parser = argparse.ArgumentParser()
    plan_cmd.configure(parser)
    with pytest.raises(ConfigError, match="--disk-read must be a positive"):
        plan_cmd._run(parser.parse_args(["--model", "flux-dev", "--vram", "8GiB", "--disk-read", "0"]))
    with pytest.raises(ConfigError, match=r"--disk-dir .*nowhere: .* does not exist"):
        plan_cmd._run(parser.parse_args(["--model", "flux-dev", "--vram", "8GiB", "--disk-dir", str(tmp_path / "nowhere")]))

