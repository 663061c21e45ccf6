"""The planner's full fine-tuning mode: its byte counts against what the trainer really allocates on
the tiny Flux (weights, optimizer state resident and packed with streamed blocks, slots, host
buffers, masters, the gradient and update temporaries of one in-backward step), and the search and
`leantune plan --mode full` at full Flux-dev size."""

from __future__ import annotations

import json

import pytest
import torch
from test_memory_helpers import make_batch

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.memory.simulated import DeviceMemoryTracker
from leantune.memory.trainable_streaming import TrainableStreamingEngine
from leantune import tiny
from leantune.models.flux import FLUX_SPEC, predict
from leantune.planner.meta import build_meta_flux
from leantune.planner.search import Planner
from leantune.planner.workload import Budget, InfeasibleBudget, Workload
from leantune.train.trainable import select_trainable
from leantune.train.fused_optim import STATE_SUFFIX, FusedOptimizer
from leantune.train.in_backward import InBackwardStep

GiB = 2**30


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


def _state_bytes(module) -> int:
    return sum(b.numel() * b.element_size() for n, b in module.named_buffers() if f"{STATE_SUFFIX}." in n)


def _weight_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


CASES = [("adamw", "fp32", False, ()), ("adamw", "bf16", True, ()),
         ("adafactor", "fp32", False, ("single_transformer_blocks.*",)), ("sgd", "fp32", True, ("x_embedder.*",))]


@pytest.mark.parametrize("optimizer,state_dtype,master,exclude", CASES)
def test_full_mode_byte_counts_equal_the_real_allocations(optimizer, state_dtype, master, exclude):
    """A bf16 tiny Flux set up as the trainer's full mode sets it up (trainable selection, the fused
    optimizer's per-weight state, the trainable streaming engine with two blocks and the non-block
    group streamed), then one real in-backward step: every byte count the planner gives for that
    plan is what the model, the engine and the step really hold."""
    torch.manual_seed(0)
    model = tiny.flux_transformer(seed=0, dtype=torch.bfloat16)
    model.requires_grad_(False)
    named = select_trainable(model, ["*"], list(exclude))
    for p in named.values():
        p.requires_grad_(True)
    # The update a GPU runs (torch ops): on this CPU the host kernels would step instead and
    # allocate nothing the size of a tensor (tests/test_host_kernels.py), which is not what a device
    # step's "optimizer step" line prices.
    opt = FusedOptimizer(model, named, optimizer, lr=1e-3, state_dtype=state_dtype, master_weights=master,
                         host_kernels=False)
    workload = Workload(mode="full", optimizer=optimizer, buckets=((64, 64),), text_length=8, state_dtype=state_dtype,
                        master_weights=master, full_exclude=exclude, allow_fp8=False)
    planner = Planner(FLUX_SPEC, model, workload)
    names = [n for n, _ in FLUX_SPEC.blocks(model)]
    streamed = (names[1], names[-1])
    plan = Plan(streamed_blocks=streamed, stream_non_blocks=True, checkpointing="blocks", ring_slots=2)
    vram, host, _ = planner.memory(plan)
    full = planner.full

    # Before the plan is applied: weights, the state of every trained weight, the masters.
    weights = _weight_bytes(model)
    states = _state_bytes(model)
    masters = sum(t.numel() * t.element_size() for t in opt.masters.values())
    assert states > 0 or optimizer == "sgd"
    assert full.state_total == states and full.trained == sum(p.numel() for p in named.values())
    assert host["transformer + optimizer state + masters at set-up"] == weights + states + masters
    assert host["fp32 master weights"] == masters and (masters > 0) == master

    blocks = dict(FLUX_SPEC.blocks(model))
    resident = [b for n, b in blocks.items() if n not in streamed]
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu", streaming_engine=TrainableStreamingEngine)
    try:
        engine = handle.streaming.engine
        # Streamed units: weights and state packed together, in host buffers and in the slots.
        assert host["streamed blocks (pinned)"] == handle.streaming.host_bytes
        assert planner.units(plan) == [u.nbytes for u in handle.streaming.units]
        assert vram["stream slots"] == sum(s.buf.numel() for s in engine.slots)
        # Resident: the blocks that do not stream, their weights and their optimizer state.
        assert vram["weights resident"] == sum(_weight_bytes(b) for b in resident)
        assert vram["optimizer states"] == sum(_state_bytes(b) for b in resident)

        # One in-backward step: the live gradients and each update's temporaries, measured.
        seen = {"grad": 0, "step": 0}
        stepper = InBackwardStep(opt, list(named.values()), max_grad_norm=1.0, on_step=engine.mark_stepped)
        update = stepper._update

        def measured_update(p, g):
            seen["grad"] = max(seen["grad"], sum(q.grad.numel() * q.grad.element_size()
                                                 for q in named.values() if q.grad is not None) + g.numel() * 2)
            tracker = DeviceMemoryTracker()
            with tracker:
                update(p, g)
            seen["step"] = max(seen["step"], max(tracker.peak.values(), default=0))

        stepper._update = measured_update
        stepper.begin_step()
        x, sigma, embeds, hw, target = make_batch(8, 8, seed=1)
        with torch.autocast("cpu", torch.bfloat16):
            pred = predict(model, x.to(torch.bfloat16), sigma, embeds.to("cpu", torch.bfloat16), hw, guidance=1.0)
        torch.nn.functional.mse_loss(pred.float(), target).backward()
        stepper.finish_step()
        stepper.remove()
        assert engine.bytes_d2h > 0
        assert set(opt.steps.values()) == {1}
        largest = max(p.numel() for p in named.values())
        assert full.gradient == seen["grad"] == largest * 2
        # On a GPU the fp32 master is copied to the device for its update; on the CPU it is used in
        # place, so the planner's price is this run's plus that copy (4 bytes per element).
        copy = 4 * largest if master else 0
        if optimizer == "adafactor":       # row/column statistics: not proportional to the tensor
            assert full.step_of(largest) == pytest.approx(seen["step"] + copy, rel=0.02)
        else:
            assert full.step_of(largest) == full.step == seen["step"] + copy > 0
        # The peak prices each update where its gradient completes (memory_model.py): no gradient
        # term of its own, and the updates add at most the largest one's gradient and temporaries.
        assert vram["gradients"] == 0
        assert 0 <= vram["optimizer step"] <= full.gradient + full.step
    finally:
        handle.remove(device="cpu")


@pytest.fixture(scope="module")
def flux_dev():
    return build_meta_flux("dev")


def _planner(model, **kw):
    return Planner(FLUX_SPEC, model, Workload(mode="full", buckets=((1024, 1024),), **kw))


def test_full_flux_dev_adamw_fits_8gib_with_bf16_moments_and_is_monotone(flux_dev):
    """AdamW (bf16 moments) full fine-tune of Flux-dev: the planner finds a plan for 8 GiB; more
    budget never slows the step; fp32 moments are refused at 8 GiB with the smallest budget that
    works, and that budget does plan."""
    bf16 = _planner(flux_dev, state_dtype="bf16")
    times, streamed = [], []
    for gb in (8, 12, 16, 24, 40):
        plan = bf16.plan(Budget(vram=gb * GiB, ram=2**62))
        n = plan.notes
        assert n["predicted_peak_vram"] <= gb * GiB - n["margin_vram"]
        assert plan.fp8 is False                          # everything trains: nothing for fp8 to hold
        times.append(n["predicted_step_s"])
        streamed.append(len(plan.streamed_blocks))
        if plan.streamed_blocks:
            assert n["d2h_bytes_per_step"] > 0        # trained units are written back
    assert times == sorted(times, reverse=True) and streamed == sorted(streamed, reverse=True)
    fp32 = _planner(flux_dev, streamed_step="device")     # the host step would fit: test_planner_host_step.py
    with pytest.raises(InfeasibleBudget) as e:
        fp32.plan(Budget(vram=8 * GiB, ram=2**62))
    assert "state_dtype = \"bf16\"" in str(e.value) and e.value.needed_vram > 8 * GiB
    ok = fp32.plan(Budget(vram=e.value.needed_vram, ram=2**62))
    assert ok.notes["predicted_peak_vram"] <= e.value.needed_vram - ok.notes["margin_vram"]


def test_full_host_ram_matches_the_trainers_check_and_a_frozen_part_uses_fp8(flux_dev):
    """The planner's set-up host RAM is train/full_host_ram.py's total for AdamW (the same parts);
    freezing the single blocks makes fp8 storage a candidate for them, and it shrinks their bytes."""
    from leantune.config import validate
    from leantune.train.full_host_ram import host_bytes

    cfg = validate({"model": {"path": "unused"}, "data": {"datasets": [{"path": "unused"}]},
                    "train": {"mode": "full"}})
    parts = host_bytes(cfg.train, cfg.full, flux_dev)
    parts.pop("_trained")
    planner = _planner(flux_dev)
    plan = planner.plan(Budget(vram=24 * GiB, ram=2**62))
    assert plan.notes["host_breakdown"]["transformer + optimizer state + masters at set-up"] == sum(parts.values())

    frozen = _planner(flux_dev, full_exclude=("single_transformer_blocks.*",))
    assert frozen.storages == [(False, False), (True, False)] and planner.storages == [(False, False)]
    single = next(i for i, b in enumerate(frozen.weights.blocks) if b.kind == "single")
    double = next(i for i, b in enumerate(frozen.weights.blocks) if b.kind == "double")
    assert frozen._bytes[(True, False)][single] < 0.65 * frozen._bytes[(False, False)][single]     # its modulation stays bf16
    assert frozen._bytes[(True, False)][double] == frozen._bytes[(False, False)][double]      # trained: stays bf16
    assert frozen.full.state[single] == 0 and frozen.full.state[double] > 0


def test_plan_command_plans_full_fine_tunes(capsys):
    from leantune.cli import main

    rc = main(["plan", "--model", "flux-dev", "--mode", "full", "--optimizer", "adamw", "--state-dtype", "bf16",
               "--vram", "8GiB", "--vram", "24GiB", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    data = json.loads(out)
    assert "full fine-tune (bf16 moments), adamw" in data["workload"]
    for entry in data["plans"]:
        n = entry["plan"]["notes"]
        assert n["predicted_peak_vram"] <= entry["budget_bytes"] - n["margin_vram"]
        assert n["vram_breakdown"]["adapters"] == 0 and n["vram_breakdown"]["optimizer step"] > 0
    rc = main(["plan", "--model", "flux-dev", "--mode", "full", "--optimizer", "adafactor", "--vram", "8GiB"])
    text = capsys.readouterr().out
    assert rc == 0 and "GB GPU->host per step" in text and "fp32 master weights" in text
    rc = main(["plan", "--model", "flux-dev", "--mode", "full", "--optimizer", "prodigy", "--vram", "8GiB"])
    assert rc == 2 and "for LoRA training" in capsys.readouterr().err
