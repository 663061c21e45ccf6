"""The planner's host-step variant of a full fine-tune (Plan.optimizer_on_host): streamed blocks'
units without their optimizer state, the gradients' device->host bytes, the host RAM the state and
the CPU step hold, and the search's streamed_step rule (auto / device / host) at full Flux-dev size."""

from __future__ import annotations

import argparse

import pytest
import torch

from leantune.memory.plan import Plan
from leantune.memory.simulated import DeviceMemoryTracker
from leantune import tiny
from leantune.models.flux import FLUX_SPEC
from leantune.planner.meta import build_meta_flux
from leantune.planner.search import Planner
from leantune.planner.weight_bytes import align
from leantune.planner.workload import Budget, InfeasibleBudget, Workload
from leantune.train.trainable import select_trainable
from leantune.train.fused_optim import STATE_SUFFIX, FusedOptimizer
from leantune.train.in_backward import InBackwardStep

GiB = 2**30


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


def _is_state(name: str) -> bool:
    return f"{STATE_SUFFIX}." in name


CASES = [("adamw", "fp32", False), ("adamw", "bf16", True), ("adafactor", "fp32", False)]


@pytest.mark.parametrize("optimizer,state_dtype,master", CASES)
def test_host_step_plan_prices_weight_only_units_and_gradient_traffic(optimizer, state_dtype, master):
    """A bf16 tiny Flux set up as the trainer's full mode sets it up (trainable selection, the fused
    optimizer's per-weight state), two blocks and the non-block group streamed with the optimizer
    step on the host: the units, slots and host buffers are the weights alone (512-byte aligned),
    the streamed state is host RAM of its own, the GPU->host bytes per step are the streamed
    trained tensors' gradients and the host->GPU bytes each unit once (its slot is stale after the
    host step); the host step's transient is what one real CPU update of the largest streamed
    tensor allocates, plus its gradient's copy."""
    torch.manual_seed(0)
    model = tiny.flux_transformer(seed=0, dtype=torch.bfloat16)
    model.requires_grad_(False)
    named = select_trainable(model, ["*"], [])
    for p in named.values():
        p.requires_grad_(True)
    opt = FusedOptimizer(model, named, optimizer, lr=1e-3, state_dtype=state_dtype, master_weights=master)
    workload = Workload(mode="full", optimizer=optimizer, buckets=((64, 64),), text_length=8, state_dtype=state_dtype,
                        master_weights=master, allow_fp8=False)
    planner = Planner(FLUX_SPEC, model, workload)
    blocks = dict(FLUX_SPEC.blocks(model))
    names = list(blocks)
    streamed = (names[1], names[-1])
    device = Plan(streamed_blocks=streamed, stream_non_blocks=True, checkpointing="blocks", ring_slots=3)
    host = Plan(streamed_blocks=streamed, stream_non_blocks=True, checkpointing="blocks", ring_slots=3,
                optimizer_on_host=True)
    in_blocks = {id(t) for b in blocks.values() for t in (*b.parameters(), *b.buffers())}

    def unit_tensors(name):         # (name, tensor) of a streamed unit, the non-block group first
        if name is None:
            return [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if id(t) not in in_blocks]
        return list((*blocks[name].named_parameters(), *blocks[name].named_buffers()))

    units = [unit_tensors(n) for n in (None, *streamed)]
    weights_only = [sum(align(t.numel() * t.element_size()) for n, t in u if not _is_state(n)) for u in units]
    state_packed = [sum(align(t.numel() * t.element_size()) for n, t in u if _is_state(n)) for u in units]
    state = [sum(t.numel() * t.element_size() for n, t in u if _is_state(n)) for u in units]
    grads = [sum(t.numel() * t.element_size() for n, t in u if isinstance(t, torch.nn.Parameter) and t.requires_grad)
             for u in units]
    assert all(state) and all(grads)

    assert planner.units(host) == weights_only
    assert [d - h for d, h in zip(planner.units(device), planner.units(host))] == state_packed
    vram, hram, _ = planner.memory(host)
    dvram, dhram, _ = planner.memory(device)
    assert vram["stream slots"] == 3 * align(max(weights_only)) < dvram["stream slots"]
    resident = [b for n, b in blocks.items() if n not in streamed]
    assert vram["optimizer states"] == dvram["optimizer states"] == sum(
        t.numel() * t.element_size() for b in resident for n, t in b.named_buffers() if _is_state(n))
    # The host step keeps the largest gradient and the largest resident update on top of the
    # activation peak (memory_model.py); the device step prices each update where it runs.
    assert vram["gradients"] == max(p.numel() for p in named.values()) * 2 and dvram["gradients"] == 0
    largest_resident = max(p.numel() for b in resident for p in b.parameters() if p.requires_grad)
    assert vram["optimizer step"] == planner.full.step_of(largest_resident)

    # Host RAM: weight-only buffers, the streamed state on its own, the CPU step, the CUDA staging.
    assert hram["streamed blocks (pinned)"] == sum(weights_only)
    assert hram["optimizer state of streamed blocks (host)"] == sum(state)
    # Each pinned gradient is its own allocation, which the caching host allocator rounds up to a
    # power of two and keeps: the staging line prices the rounded sizes (2x the raw ones at worst).
    from leantune.planner.host_model import caching_host_size

    reserved = [sum(caching_host_size(t.numel() * t.element_size()) for n, t in u
                    if isinstance(t, torch.nn.Parameter) and t.requires_grad) for u in units]
    assert max(reserved) > max(grads)
    assert hram["gradient staging (pinned)"] == 2 * max(reserved)
    assert "optimizer state of streamed blocks (host)" not in dhram
    loaded = sum(t.numel() * t.element_size() for n, t in (*model.named_parameters(), *model.named_buffers())
                 if not _is_state(n))
    # Packing copies no state into the buffers: the stored model and its state stay; each buffer
    # adds its weights' alignment slack once its originals are freed.
    assert hram["stored transformer + one unit while packing"] >= loaded + opt_state_bytes(model)
    assert (hram["stored transformer + one unit while packing"]
            <= loaded + opt_state_bytes(model) + sum(weights_only) + (opt_masters(opt)))

    # One real host step of the largest streamed trained tensor, on the CPU where it runs.
    streamed_params = [t for u in units for n, t in u if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    big = max(streamed_params, key=lambda p: p.numel())
    stepper = InBackwardStep(opt, list(named.values()), max_grad_norm=1.0)
    peak = 0
    for _ in range(2):
        g = torch.ones_like(big)
        tracker = DeviceMemoryTracker()
        with tracker:
            stepper._update(big, g)
        peak = max(peak, max(tracker.peak.values(), default=0))
    line = hram["optimizer step on the host (one tensor)"]
    if optimizer == "adafactor":
        # The kernel's scratch is a float per row, per column and per column and block of ROW_BLOCK
        # rows (host_kernels.adafactor_matrix): O(rows + cols), priced from step_bytes' 128-column
        # measurement, so a wider tensor's column scratch is off the line by at most its own size
        # (this tiny model's 256 columns: 0.9 KB; under 2 % of the update at Flux's shapes).
        from leantune.train.host_kernels import ROW_BLOCK

        rows, cols = big.shape
        scratch = 4 * (rows + -(-rows // ROW_BLOCK) * cols + cols + 1)
        assert line == pytest.approx(big.numel() * 2 + peak, rel=0.02, abs=scratch)
    else:
        assert line == big.numel() * 2 + peak

    # Traffic per step: each unit's gradients go to the host once; each unit comes in once.
    est = planner.estimate(host)
    assert est.d2h_bytes == sum(grads)
    assert est.h2d_bytes == sum(weights_only)
    assert planner.estimate(device).h2d_bytes == 0         # 3 units in 3 slots, updated in place, stay
    rate = planner.full.host_rate()
    assert est.step_s >= sum(p.numel() for p in streamed_params) / rate

    # The engine bounds the pinned gradients in flight by the same rounded bytes the plan prices.
    from leantune.memory.engine import apply_memory
    from leantune.memory.trainable_streaming import TrainableStreamingEngine

    handle = apply_memory(model, FLUX_SPEC, host, "cpu", streaming_engine=TrainableStreamingEngine)
    assert handle.streaming.engine.host_inflight_limit == hram["gradient staging (pinned)"]
    handle.remove()


def opt_state_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for n, t in model.named_buffers() if _is_state(n))


def opt_masters(opt) -> int:
    return sum(t.numel() * t.element_size() for t in opt.masters.values())


def test_host_steps_serialise_and_delay_the_next_fetch():
    """timing.py: a host step as long as the whole step's compute makes the step last at least the
    host steps' sum, and no slot is reused across steps (its weights changed on the host)."""
    from leantune.planner.activations import ActivationProfile
    from leantune.planner.corrections import Calibration
    from leantune.planner.machine import assumed_machine
    from leantune.planner.timing import simulate_step

    torch.manual_seed(0)
    model = tiny.flux_transformer(seed=0, dtype=torch.bfloat16)
    workload = Workload(mode="full", buckets=((64, 64),), text_length=8, allow_fp8=False)
    planner = Planner(FLUX_SPEC, model, workload)
    names = [b.name for b in planner.weights.blocks]
    plan = Plan(streamed_blocks=tuple(names[:2]), checkpointing="blocks", ring_slots=2, optimizer_on_host=True)
    prof = planner.profiles[(False, False)][(64, 64)]
    assert isinstance(prof, ActivationProfile)
    units = planner.units(plan)
    m, cal = assumed_machine(), Calibration()
    fast = simulate_step(m, cal, plan, prof, prof, planner.kinds, [0, 1], units, "full", 0, host_steps=[(100, 0.0)] * 2)
    slow = simulate_step(m, cal, plan, prof, prof, planner.kinds, [0, 1], units, "full", 0, host_steps=[(100, 5.0)] * 2)
    assert fast.h2d_bytes == slow.h2d_bytes == sum(units) and fast.d2h_bytes == 200
    assert slow.step_s >= 10.0 > fast.step_s


@pytest.fixture(scope="module")
def flux_dev():
    return build_meta_flux("dev")


def _planner(model, **kw):
    return Planner(FLUX_SPEC, model, Workload(mode="full", buckets=((1024, 1024),), **kw))


def test_fp32_adamw_fits_8gib_only_with_the_host_step(flux_dev):
    """AdamW with fp32 moments: no device-step plan fits 8 GiB at 1024 px (the slots carry the
    state), so "device" refuses it, naming streamed_step = "host" with a budget under 8 GiB;
    "auto" falls back to a host-step plan that fits, as "host" does."""
    device = _planner(flux_dev, streamed_step="device")
    with pytest.raises(InfeasibleBudget) as e:
        device.plan(Budget(vram=8 * GiB, ram=2**62))
    assert e.value.needed_vram > 8 * GiB and e.value.best.optimizer_on_host is False
    assert "[full] streamed_step = \"host\"" in str(e.value)
    for step in ("auto", "host"):
        plan = _planner(flux_dev, streamed_step=step).plan(Budget(vram=8 * GiB, ram=2**62))
        n = plan.notes
        assert plan.optimizer_on_host and plan.streamed_blocks
        assert n["predicted_peak_vram"] <= 8 * GiB - n["margin_vram"]
        assert n["host_breakdown"]["optimizer state of streamed blocks (host)"] > 50 * GiB
        assert n["d2h_bytes_per_step"] > 0 and n["host_step_params"] > 0
        assert "on the host" in plan.describe()


def test_auto_keeps_the_device_step_where_it_is_faster(flux_dev, monkeypatch):
    """bf16 moments fit 8 GiB on the device. With the CPU rate pinned to a slow CPU's (40 M
    parameters/s) the device step is faster, so "auto" gives the "device" plan; "host" makes the
    streaming plan step on the host, slower; a plan that streams nothing never does."""
    monkeypatch.setattr("leantune.planner.full_model.host_step_rate", lambda *key: 40e6)
    auto = _planner(flux_dev, state_dtype="bf16").plan(Budget(vram=8 * GiB, ram=2**62))
    assert auto.streamed_blocks and not auto.optimizer_on_host
    assert auto == _planner(flux_dev, state_dtype="bf16", streamed_step="device").plan(Budget(vram=8 * GiB, ram=2**62))
    forced = _planner(flux_dev, state_dtype="bf16", streamed_step="host")
    plan = forced.plan(Budget(vram=8 * GiB, ram=2**62))
    assert plan.optimizer_on_host and plan.notes["predicted_step_s"] > auto.notes["predicted_step_s"]
    assert all(p.optimizer_on_host == bool(p.streamed_blocks) for p in forced.candidates())
    assert _planner(flux_dev, optimizer="adamw8bit").step_places() == (False,)


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
def test_auto_takes_the_host_step_where_it_is_faster(flux_dev, monkeypatch, state_dtype):
    """With a CPU rate pinned high (20 G parameters/s: the CPU step hides behind the GPU's
    backward) the host-step plan of 12 GiB is faster than the device-step plan (whose state crosses
    PCIe twice per step): "auto" takes it, and its plan is exactly the faster of the best plan of
    each place ("device", and "host" less its plans that stream nothing). Before, "auto" used the
    host step only where no device-step plan fitted."""
    monkeypatch.setattr("leantune.planner.full_model.host_step_rate", lambda *key: 20e9)
    budget = Budget(vram=12 * GiB, ram=2**62)
    auto = _planner(flux_dev, state_dtype=state_dtype).plan(budget)
    device = _planner(flux_dev, state_dtype=state_dtype, streamed_step="device").plan(budget)
    host = _planner(flux_dev, state_dtype=state_dtype, streamed_step="host")
    host_plan = host.plan(budget)
    assert host_plan.optimizer_on_host
    assert host_plan.notes["predicted_step_s"] < device.notes["predicted_step_s"]
    assert auto.optimizer_on_host
    assert auto.notes["predicted_step_s"] == host_plan.notes["predicted_step_s"]
    assert auto.notes["predicted_step_s"] < device.notes["predicted_step_s"]


def test_auto_keeps_the_device_step_on_a_tie(flux_dev, monkeypatch):
    """Equal predicted step times (every plan priced at 1 s): "auto" keeps the device step, as
    before, rather than the simpler-shaped host-step plan."""
    from leantune.planner import search

    monkeypatch.setattr(search.Planner, "_timed", lambda self, plan: search._Timed(1.0, 0))
    plan = _planner(flux_dev, state_dtype="bf16").plan(Budget(vram=12 * GiB, ram=2**62))
    assert plan.streamed_blocks and not plan.optimizer_on_host


def test_search_stays_monotone_with_host_step_plans(flux_dev, monkeypatch):
    """More budget never streams more nor slows the step while the step's place stays; with a slow
    CPU (rate pinned at 40 M parameters/s) "auto" turns the host step off along growing budgets
    once, where a device-step plan fits."""
    monkeypatch.setattr("leantune.planner.full_model.host_step_rate", lambda *key: 40e6)
    budgets = (6, 8, 10, 12, 16, 24, 40)
    for step in ("host", "auto"):
        planner = _planner(flux_dev, streamed_step=step)
        plans = [planner.plan(Budget(vram=gb * GiB, ram=2**62)) for gb in budgets]
        times = [p.notes["predicted_step_s"] for p in plans]
        streamed = [len(p.streamed_blocks) for p in plans]
        on_host = [p.optimizer_on_host for p in plans]
        assert streamed == sorted(streamed, reverse=True)
        # Time falls with the budget while the step stays where it is; it may rise once, where
        # the step's place changes.
        for place in (True, False):
            seg = [t for t, p in zip(times, plans) if p.optimizer_on_host == place]
            assert seg == sorted(seg, reverse=True)
        for gb, p in zip(budgets, plans):
            assert p.notes["predicted_peak_vram"] <= gb * GiB - p.notes["margin_vram"]
        if step == "host":
            assert on_host == [bool(s) for s in streamed]
        else:
            assert on_host == sorted(on_host, reverse=True) and on_host[0] and not on_host[-1]


def test_plan_command_streamed_step_flag(capsys):
    """`leantune plan --mode full --streamed-step`: auto prints the host-step plan where only it
    fits, with its host RAM lines and GPU->host bytes; device refuses and names the key; the kept
    answers (answer_cache.py) are keyed by the flag; it is a --mode full flag."""
    from leantune.cli import main
    from leantune.commands.plan import _question, configure
    from leantune.planner.answer_cache import answer_path

    args = ["plan", "--model", "flux-dev", "--mode", "full", "--optimizer", "adamw", "--state-dtype", "fp32",
            "--resolution", "1024", "--vram", "8GiB"]
    rc = main(args)
    text = capsys.readouterr().out
    assert rc == 0
    assert "optimizer step of streamed blocks on the host" in text
    for line in ("optimizer state of streamed blocks (host)", "optimizer step on the host (one tensor)",
                 "gradient staging (pinned)", "GB GPU->host per step", "stepped on the CPU"):
        assert line in text
    rc = main(args + ["--streamed-step", "device"])
    captured = capsys.readouterr()
    assert rc == 1 and "streamed_step = \"host\"" in captured.err
    rc = main(args + ["--streamed-step", "host"])
    assert rc == 0 and "on the host" in capsys.readouterr().out

    parser = argparse.ArgumentParser()
    configure(parser)
    keys = {answer_path(_question(parser.parse_args(args[1:] + extra)))
            for extra in ([], ["--streamed-step", "device"], ["--streamed-step", "host"], ["--streamed-step", "auto"])}
    assert len(keys) == 4
    rc = main(["plan", "--model", "flux-dev", "--mode", "lora", "--streamed-step", "host", "--vram", "8GiB"])
    assert rc == 2 and "--streamed-step" in capsys.readouterr().err


def test_timing_the_full_host_step_rate_leaves_the_run_s_random_numbers_alone():
    """The planner times the full fine-tune's CPU step (full_model.host_step_rate) possibly inside a
    run, under a vram_budget, before its data order and noise are drawn: its tensors come from a
    generator of their own, so the global generator's state is what it was."""
    from leantune.planner import full_model

    full_model._HOST_RATE.clear()
    full_model._HOST_RATE_TENSORS.clear()
    before = torch.random.get_rng_state()
    full_model.host_step_rate("adamw", torch.bfloat16, "fp32", True, False, True)
    assert torch.equal(torch.random.get_rng_state(), before)
