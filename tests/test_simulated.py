"""The memory engine on the simulated GPU (leantune/memory/simulated.py): the seams that let its
real code run on fake tensors, the byte tracker, and full-width Flux steps against the planner.

Fake tensors (torch's FakeTensorMode) carry shapes, dtypes and devices but no data, and every fake
storage reports data_ptr() 0. The engine must tell its ring slots apart by storage identity, and
checkpoint offload must treat the host as a device of its own.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from simulated_cases import GROUP, Call, register, results
from test_memory_helpers import lora_flux, lora_params, make_batch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from leantune.memory import simulated
from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, predict


def _faked(model: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """Replace every parameter and buffer by a fake tensor of the same shape, dtype and device."""
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(mode.from_tensor(p.data), requires_grad=p.requires_grad)
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = mode.from_tensor(b)
    return model


def _step(model):
    x, sigma, embeds, hw, target = make_batch(8, 8, seed=0)
    loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0), target)
    return loss


def test_streaming_without_checkpointing_runs_on_fake_storages():
    """Saved slot views are recognised by storage identity: with data_ptr() (0 for every fake
    storage) every saved activation looked like a slot view and backward failed."""
    mode = FakeTensorMode()
    model = _faked(lora_flux(seed=0), mode)
    names = tuple(n for n, _ in FLUX_SPEC.blocks(model))
    with mode:
        handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=names, ring_slots=2), "cpu")
        _step(model).backward()
        grads = {n: p.grad for n, p in lora_params(model).items()}
        rep = handle.step_report()
    assert grads and all(isinstance(g, FakeTensor) and g.shape == p.shape
                         for g, p in zip(grads.values(), lora_params(model).values(), strict=True))
    assert rep["streamed_units"] == len(names)
    assert rep["copies"] >= len(names)


def test_offloaded_inputs_go_to_the_host_device_and_come_back():
    """Checkpoint offload keeps block inputs on the host device and restores them to the compute
    device, also when neither is CUDA (here: host "meta", compute "cpu")."""
    mode = FakeTensorMode()
    model = _faked(lora_flux(seed=0), mode)
    with mode:
        handle = apply_memory(model, FLUX_SPEC, Plan(checkpointing="offload"), "cpu", offload_min_bytes=0,
                              host_device="meta")
        loss = _step(model)
        group = handle.checkpointing.offloader._last()        # the last block's group, alive until backward
        assert group.handles and {h.host.device.type for h in group.handles} == {"meta"}
        loss.backward()
        rep = handle.step_report()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in lora_params(model).values())
    assert rep["offload_tensors"] > 0 and rep["offload_bytes_h2d"] == rep["offload_bytes_d2h"]


# -- the simulated device ----------------------------------------------------------------------------

def test_tracker_counts_new_storages_not_views():
    """Live bytes follow storages: a view or an in-place result adds nothing, a dead storage is
    subtracted, the peak stays until reset."""
    tracker = simulated.DeviceMemoryTracker()
    with FakeTensorMode(), tracker:
        x = torch.empty(1000, dtype=torch.float32)
        v = x[10:20].view(2, 5)
        x.add_(1)
        assert tracker.live["cpu"] == 4000
        y = x * 2                                      # a new storage
        assert tracker.live["cpu"] == 8000
        del x, v, y
        assert tracker.live["cpu"] == 0 and tracker.peak["cpu"] == 8000
        tracker.reset_peak()
        assert tracker.peak["cpu"] == 0


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(tmp_path))
    with pytest.raises(simulated.SimulatedDeviceUnavailable, match="no-such-compiler-here.*not on PATH"):
        simulated.build_library()


def _library_or_skip():
    try:
        return simulated.build_library()
    except simulated.SimulatedDeviceUnavailable as e:
        pytest.skip(f"simulated device unavailable: {e}")


def test_library_is_built_once(monkeypatch, tmp_path):
    """The real guard library (one build, 3-6 s): kept with its digest beside it (native.py's rules;
    tests/test_native_security.py has the planted, damaged and private-copy cases)."""
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(tmp_path))
    first = _library_or_skip()
    stamp = first.stat().st_mtime_ns
    assert simulated.build_library() == first and first.stat().st_mtime_ns == stamp
    digest = first.with_name(first.name + ".sha256")
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, digest.name]   # no temporary left behind
    assert digest.read_text().split()[0] == hashlib.sha256(first.read_bytes()).hexdigest()


# Full width (3072, 24 heads, T5 4096) with one double and one single block: every tensor of a
# full-size block, in seconds. Run in a fresh process (see simulated.enable), the one of
# tests/simulated_cases.py, which every simulated test module's jobs share.
BLOCKS = (1, 1)
DOUBLE, SINGLE = "transformer_blocks.0", "single_transformer_blocks.0"
GiB = 2**30
CASES = {
    "resident": dict(what="train", size=512, plan=Plan(checkpointing="none")),
    "streamed_checkpointed": dict(what="train", size=512,
                                  plan=Plan(streamed_blocks=(DOUBLE, SINGLE), checkpointing="blocks", ring_slots=2)),
    "streamed_offloaded": dict(what="train", size=512,
                               plan=Plan(streamed_blocks=(DOUBLE, SINGLE), checkpointing="offload", ring_slots=2)),
    "fp8_checkpointed": dict(what="train", size=512, plan=Plan(streamed_blocks=(SINGLE,), fp8=True,
                                                                checkpointing="blocks", ring_slots=2)),
    "planned_1.75GiB": dict(what="train", size=512, budget=int(1.75 * GiB)),
    "sample_fp8_streamed": dict(what="sample", size=1024, plan=Plan(streamed_blocks=(DOUBLE, SINGLE), fp8=True,
                                                                    ring_slots=2)),
}


register("simulated_cases", {n: {"budget": 8 * GiB, **CASES[n], "blocks": BLOCKS} for n in CASES})


@pytest.fixture(scope="module")
def simulated_cases(request):
    _library_or_skip()
    return results(request, "simulated_cases")


def _static(r: dict) -> int:
    b = r["breakdown"]
    return b["weights resident"] + b["stream slots"] + b["adapters"]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["resident", "streamed_checkpointed", "streamed_offloaded", "sample_fp8_streamed"])
def test_engine_places_what_the_planner_counts(simulated_cases, name):
    """After apply_memory, the simulated GPU holds exactly the resident weights, the ring slots and
    the adapters the planner prices; the step's peak is within 3% of the planner's prediction
    (without its workspace term, which the simulation cannot see)."""
    r = simulated_cases[name]
    assert r["after_setup"] == _static(r)
    assert 0.97 <= r["ratio"] <= 1.03, r


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
def test_streaming_and_checkpointing_lower_the_simulated_peak(simulated_cases):
    resident, ckpt = simulated_cases["resident"], simulated_cases["streamed_checkpointed"]
    assert ckpt["breakdown"]["weights resident"] < resident["breakdown"]["weights resident"]
    slots = ckpt["breakdown"]["stream slots"]
    assert slots > 0 and ckpt["report"]["slots"] == 2
    # both units fit the ring: each is copied once (the first step), and neither again for backward
    assert ckpt["report"]["copies"] == 2 and ckpt["report"]["demand_fetches"] == 0
    assert ckpt["simulated"] - ckpt["after_setup"] < resident["simulated"] - resident["after_setup"]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
def test_planned_budget_holds_on_the_simulated_device(simulated_cases):
    """The plan the planner chooses for a 1.75 GiB budget stays under that budget on the simulated
    device, workspace included. (Its prediction is checked by the fp8 test below: at 512 px the
    planner chooses fp8 here.)"""
    r = simulated_cases["planned_1.75GiB"]
    assert "infeasible" not in r, r
    assert r["simulated"] + r["workspace"] <= r["budget"]


@pytest.mark.xdist_group(GROUP)
@pytest.mark.slow
def test_fp8_training_step_matches_the_prediction(simulated_cases):
    """Prediction within 10% of the simulation for fp8 training plans, given and planned; and the
    planned one inside the usable budget (the budget less the allocator margin)."""
    for name in ("fp8_checkpointed", "planned_1.75GiB"):
        r = simulated_cases[name]
        assert r["fp8"] and r["after_setup"] == _static(r)
        assert 0.90 <= r["ratio"] <= 1.10, (name, r["ratio"])
    planned = simulated_cases["planned_1.75GiB"]
    assert planned["simulated"] + planned["workspace"] <= planned["budget"] - planned["margin"]


def _autocast_peak(cached: bool) -> dict:
    """In the fresh process (tests/simulated_cases.py): tests/simulated_autocast_worker.py's
    measurement, run as its command line runs it (`cached` its argument), its JSON line parsed."""
    import contextlib
    import io
    import json
    import sys

    import simulated_autocast_worker

    argv, printed = sys.argv, io.StringIO()
    sys.argv = ["simulated_autocast_worker.py", *(["cached"] if cached else [])]
    try:
        with contextlib.redirect_stdout(printed):
            simulated_autocast_worker.main()
    finally:
        sys.argv = argv
    return json.loads(printed.getvalue().strip().splitlines()[-1])


register("autocast_peaks", {mode: Call("test_simulated", "_autocast_peak", {"cached": mode == "cached"})
                            for mode in ("trainer", "cached")})


@pytest.fixture(scope="module")
def autocast_peaks(request):
    _library_or_skip()
    return results(request, "autocast_peaks")


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("autocast", ["trainer", "cached"])
def test_autocast_keeps_no_bf16_copy_of_checkpointed_fp32_trained_weights(autocast_peaks, autocast):
    """Six fp32 trained Linears of Flux's width, checkpointed as streamed blocks are, forward under
    bf16 autocast on the simulated GPU (tests/simulated_autocast_worker.py, run in the fresh process
    of tests/simulated_cases.py). The simulated device keeps torch's autocast cast cache as CUDA's
    autocast does: with the cache on, the bf16 cast of every fp32 leaf that requires grad lives
    until autocast exits, so the forward holds all six copies (for Flux-dev streamed in fp32: about
    24 GB). The trainer's autocast turns the cache off: one copy at a time."""
    r = autocast_peaks[autocast]
    if autocast == "cached":
        assert r["peak"] >= r["layers"] * r["bf16_weight"], r            # the simulation shows the cache
    else:
        assert r["peak"] <= 2 * r["bf16_weight"] + r["layers"] * r["activation"], r


def _silu_backward() -> dict:
    """In the fresh process (tests/simulated_cases.py): the bytes silu's backward allocates above
    what was live, and the size of its input."""
    from leantune.memory.simulated import DeviceMemoryTracker, enable, simulation

    device = enable()
    tracker = DeviceMemoryTracker()
    with simulation(tracker):
        x = torch.empty(4096, 9216, dtype=torch.bfloat16, device=device, requires_grad=True)
        y = torch.nn.functional.silu(x)
        g = torch.empty_like(y)
        tracker.reset_peak()
        before = tracker.live[str(device)]
        y.backward(g)
        return {"above": tracker.peak[str(device)] - before, "tensor": x.numel() * x.element_size()}


register("silu_backward", {"silu": Call("test_simulated", "_silu_backward")})


@pytest.fixture(scope="module")
def silu_backward(request):
    _library_or_skip()
    return results(request, "silu_backward")


@pytest.mark.xdist_group(GROUP)
def test_simulated_device_keeps_silu_backward_fused_as_cuda_does(silu_backward):
    """SwiGLU's backward (FLUX.2's single blocks) is one fused `silu_backward` kernel on CUDA: it
    allocates its output and nothing else. The simulated device once fell back to the op's
    CompositeImplicitAutograd decomposition (sigmoid, 1 - sigmoid, products: five more full-size
    temporaries), so a simulated FLUX.2 klein step peaked about one fused projection above a GPU's
    and above the planner's prediction."""
    r = silu_backward["silu"]
    assert r["above"] == r["tensor"], r          # x.grad only: no decomposed temporaries
