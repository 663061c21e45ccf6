"""The optimizer step of streamed blocks on the host (Plan.optimizer_on_host, [full] streamed_step).

Their optimizer state stays in host RAM (never packed, never on the device), each trained weight's
gradient goes to the host and the update runs on the weight's host copy; the slot's copy is then
out of date and is fetched again. On the CPU the math is the device step's, so the runs must equal
the plain `backward(); opt.step()` loop bitwise, like tests/test_full_finetune.py's matrix, with
poisoned slots proving that nothing stale is reused.
"""

from __future__ import annotations

import pytest
import torch
from test_memory_helpers import synchronizes_beyond_the_profiler
from test_full_finetune import EXCLUDE, LR, _model, _plan, assert_same, reference, run_steps, trained_values

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.memory.trainable_streaming import TrainableStreamingEngine
from leantune.models.flux import FLUX_SPEC
from leantune.train.trainable import select_trainable
from leantune.train.fused_optim import STATE_SUFFIX, FusedOptimizer, _owner
from leantune.train.in_backward import InBackwardStep


def run(kind: str, plan: Plan, steps: int = 3, accumulation: int = 1, exclude=tuple(EXCLUDE), dtype=None,
        state_dtype: str = "fp32", master_weights: bool = False, clip: float = 0.0, device: str = "cpu",
        profile: list | None = None):
    """`steps` steps of the in-backward update under `plan`; with `profile`, the last step runs under
    torch's profiler and its events are appended there (the steady state: slots and state exist)."""
    model = _model(exclude)
    if dtype is not None:
        model.to(dtype)
    named = select_trainable(model, ["*"], list(exclude))
    # Adafactor: the torch-op path, bitwise torch's (the host kernels are within a tolerance of it,
    # tests/test_host_kernels.py; this file checks the host-step machinery bit for bit).
    opt = FusedOptimizer(model, named, kind, lr=LR[kind], state_dtype=state_dtype, master_weights=master_weights,
                         host_kernels=kind != "adafactor")
    handle = apply_memory(model, FLUX_SPEC, plan, device, offload_min_bytes=0, streaming_engine=TrainableStreamingEngine)
    engine = handle.streaming.engine
    stepper = InBackwardStep(opt, list(named.values()), accumulation=accumulation, max_grad_norm=clip,
                             on_step=engine.mark_stepped,
                             host=lambda p: engine if engine.steps_on_host(p) else None)
    autocast = torch.bfloat16 if dtype == torch.bfloat16 else None
    if profile is None:
        losses = run_steps(model, stepper, steps, accumulation, device, autocast=autocast)
    else:
        losses = run_steps(model, stepper, steps - 1, accumulation, device, autocast=autocast)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            losses += run_steps(model, stepper, 1, accumulation, device, autocast=autocast, start=steps - 1)
        profile.extend(prof.events())
    return losses, trained_values(handle, model, named), handle, model, opt


def _host(plan: Plan | None) -> Plan:
    from dataclasses import replace

    return replace(plan, optimizer_on_host=True)


def _names():
    return [n for n, _ in FLUX_SPEC.blocks(_model())]


MATRIX = [(k, s, c) for k in ("sgd", "adamw") for s in ("some", "all") for c in ("none", "blocks", "offload")]
MATRIX += [("adafactor", s, c) for s in ("some", "all") for c in ("none", "blocks")]


@pytest.mark.parametrize("kind,streaming,checkpointing", MATRIX)
def test_host_step_equals_the_plain_loop_bitwise(kind, streaming, checkpointing):
    want_losses, want = reference(kind)
    losses, got, handle, model, _ = run(kind, _host(_plan(streaming, checkpointing, _names())))
    assert losses == want_losses
    assert_same(got, want)


def test_state_stays_on_the_host_and_only_gradients_go_back():
    """Slots hold weights only; the streamed weights' state is ordinary host memory beside the
    packed buffer; per step the device sends back exactly the streamed trained gradients."""
    names = _names()
    plan = Plan(streamed_blocks=tuple(names), stream_non_blocks=True, checkpointing="blocks", debug_poison=True)
    _, _, dev_handle, _, _ = run("adamw", plan, steps=1)
    _, _, handle, model, opt = run("adamw", _host(plan), steps=1)
    engine = handle.streaming.engine
    packed = {id(t) for u in handle.streaming.units for e in u.entries for m, kind, attr in e.owners
              for t in [(m._parameters if kind == "param" else m._buffers)[attr]]}
    assert packed
    streamed_trained = [p for p in model.parameters() if p.requires_grad and engine.steps_on_host(p)]
    assert len(streamed_trained) == sum(1 for p in model.parameters() if p.requires_grad)   # all streamed
    state_bytes = 0
    for name, holder in opt.holders.items():
        for t in holder.tensors().values():
            assert t.device.type == "cpu" and id(t) not in packed
            state_bytes += t.numel() * t.element_size()
    # The device-step plan's units carry that state; these do not: every unit is smaller by its state.
    dev_units = dev_handle.streaming.unit_bytes()
    host_units = handle.streaming.unit_bytes()
    assert sum(host_units.values()) < sum(dev_units.values()) and state_bytes > 0
    for name in host_units:
        assert host_units[name] < dev_units[name]
    rep = handle.step_report()
    grads = sum(p.numel() * p.element_size() for p in streamed_trained)
    assert rep["bytes_d2h"] == grads                  # one step: each gradient once, no write-back
    assert dev_handle.step_report()["bytes_d2h"] >= sum(dev_units.values())   # weights + state, each unit


def test_host_step_with_some_resident_blocks_and_accumulation_equals_the_plain_loop():
    """Resident blocks step on the device, streamed ones on the host; two micro-batches (the host
    adds its accumulator to the last gradient there)."""
    want_losses, want = reference("adamw", accumulation=2)
    losses, got, _, _, _ = run("adamw", _host(_plan("some", "blocks", _names())), accumulation=2)
    assert losses == want_losses
    assert_same(got, want)


@pytest.mark.parametrize("state_dtype,master", [("bf16", False), ("fp32", True)])
def test_bf16_weights_with_stochastic_rounding_step_the_same_on_host_and_device(state_dtype, master):
    """bf16 weights (stochastic rounding, bf16 moments or fp32 masters, clipping): the host step
    draws the same random numbers in the same order as the device step, so the runs are equal."""
    plan = Plan(streamed_blocks=tuple(_names()), stream_non_blocks=True, checkpointing="blocks", debug_poison=True)
    kw = dict(dtype=torch.bfloat16, state_dtype=state_dtype, master_weights=master, clip=0.5, exclude=())
    dev_losses, dev, _, _, _ = run("adamw", plan, **kw)
    host_losses, host, _, _, opt = run("adamw", _host(plan), **kw)
    assert host_losses == dev_losses
    assert_same(host, dev)
    start = dict(_model(()).to(torch.bfloat16).named_parameters())
    moved = sum(not torch.equal(v, start[n].detach()) for n, v in host.items())
    assert moved > len(host) // 2                     # the weights did train


def test_remove_restores_a_plain_model_with_its_state_on_the_device_side():
    """Tearing the engine down puts the host-kept state where the rest of the model goes, so a
    re-plan to a device-step plan finds every tensor in one place."""
    plan = _host(Plan(streamed_blocks=tuple(_names()[:2]), checkpointing="blocks"))
    _, _, handle, model, opt = run("adamw", plan, steps=1)
    handle.remove(device="cpu")
    for name, holder in opt.holders.items():
        owner, attr = _owner(model, name)
        assert getattr(owner, attr + STATE_SUFFIX) is holder
        assert all(t.device.type == "cpu" for t in holder.tensors().values())
    assert not handle.streaming


@pytest.mark.gpu
@pytest.mark.parametrize("kind,clip", [("adamw", 0.0), ("adafactor", 0.0), ("adamw", 0.05)])
@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_host_step_on_cuda_matches_the_device_step_and_never_synchronizes_the_device(kind, clip, checkpointing):
    """On CUDA the gradients go to pinned buffers on the write-back stream and one worker thread
    steps the host copies while backward goes on; poisoned slots, every block streamed. The result
    equals the device-step run to float rounding (the device runs the same kernels in another
    order of launches, the CPU its own), and no device- or stream-wide synchronize is issued.
    With clipping (`clip`), the device takes each gradient's norm and its pinned copy travels with
    the gradient (trainable_streaming.step_on_host): read on the worker after the copy's event."""
    plan = Plan(checkpointing=checkpointing, streamed_blocks=tuple(_names()), stream_non_blocks=True,
                debug_poison=True)
    want_losses, want, *_ = run(kind, plan, device="cuda", clip=clip)
    events: list = []
    losses, got, handle, _, _ = run(kind, _host(plan), device="cuda", profile=events, clip=clip)
    # Only the last (steady) step is profiled: set-up and reading the weights back synchronize by
    # design. The worker thread waits on its copies' events (cudaEventSynchronize): only device-
    # and stream-wide waits are refused.
    extra = [n for n in synchronizes_beyond_the_profiler(events) if n != "cudaEventSynchronize"]
    assert not extra, f"{extra} called during a host-step fine-tune"
    assert handle.streaming.engine.host_worker is not None
    assert losses == pytest.approx(want_losses, rel=1e-5)
    for n in want:
        torch.testing.assert_close(got[n].cpu(), want[n].cpu(), rtol=1e-5, atol=1e-3 * LR[kind])


# -- through the trainer -----------------------------------------------------------------------------

from test_full_train import FULL_RUN, _same_files, full_run, images, make_config  # noqa: E402,F401  (fixtures)

from leantune.config import ConfigError  # noqa: E402
from leantune.trainer import train  # noqa: E402


@pytest.mark.xdist_group(FULL_RUN)
def test_a_run_stepping_streamed_blocks_on_the_host_equals_the_device_step_and_resumes_exactly(
        tmp_path, tiny_flux_dir, images, full_run):  # noqa: F811
    """[full] streamed_step = "host" with the full-mode run of tests/test_full_train.py (two
    streamed blocks + the non-block group, poison, checkpointing, two micro-batches): stopped after
    3 steps and resumed, it gives the uninterrupted device-step run's losses and exported model."""
    _, device_run = full_run
    cfg = make_config(tmp_path, tiny_flux_dir, images, extra=["full.streamed_step=host"])
    first = train(cfg, stop_after=3, progress=False)
    assert first.final_step == 3
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == device_run.losses
    _same_files(device_run.paths.root / "t_comfyui.safetensors", resumed.paths.root / "t_comfyui.safetensors")
    log = (cfg.resolve("out") / "train.log").read_text()
    assert "optimizer step of streamed blocks on the host" in log


def test_host_step_with_8bit_adamw_is_refused_by_key(tmp_path, tiny_flux_dir, images):  # noqa: F811
    with pytest.raises(ConfigError, match=r"streamed_step = \"host\".*adamw8bit"):
        make_config(tmp_path, tiny_flux_dir, images, extra=["full.streamed_step=host", "train.optimizer=adamw8bit"])


# -- the planner's copy counts against the engine ------------------------------------------------------

@pytest.mark.parametrize("host", [False, True], ids=["device_step", "host_step"])
@pytest.mark.parametrize("stream_non_blocks", [False, True], ids=["blocks", "blocks+non_blocks"])
@pytest.mark.parametrize("ring,streamed", [(2, 2), (2, 4), (3, 4)])
def test_the_planner_counts_the_bytes_the_engine_copies_per_step(host, stream_non_blocks, ring, streamed):
    """A steady-state full fine-tuning step on the tiny Flux: the bytes the engine copies host to
    device and back equal the planner's step simulation, for the device step (a stepped unit is
    written back when another unit claims its slot, once however often it was released: the
    non-block group is released per module) and the host step (gradients out; a stepped unit's
    slot is fetched afresh after backward, not within it)."""
    from leantune.planner.search import Planner
    from leantune.planner.workload import Workload

    model = _model(())
    named = select_trainable(model, ["*"], [])
    opt = FusedOptimizer(model, named, "adamw", lr=LR["adamw"])
    names = _names()
    blocks = tuple(names[:streamed]) if streamed == 4 else (names[1], names[-1])
    plan = Plan(streamed_blocks=blocks, stream_non_blocks=stream_non_blocks, checkpointing="blocks",
                ring_slots=ring, optimizer_on_host=host)
    workload = Workload(mode="full", optimizer="adamw", buckets=((64, 64),), text_length=8, allow_fp8=False,
                        dtype=torch.float32)
    est = Planner(FLUX_SPEC, model, workload).estimate(plan)
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu", streaming_engine=TrainableStreamingEngine)
    engine = handle.streaming.engine
    stepper = InBackwardStep(opt, list(named.values()), on_step=engine.mark_stepped, hold=engine.holding,
                             host=lambda p: engine if engine.steps_on_host(p) else None)
    run_steps(model, stepper, 1, 1)
    handle.step_report()
    run_steps(model, stepper, 1, 1)                   # the steady state: what the last step left in the slots
    rep = handle.step_report()
    assert rep["bytes_h2d"] == est.h2d_bytes
    assert rep["bytes_d2h"] == est.d2h_bytes
    assert rep["bytes_d2h"] > 0 or (not host and streamed + stream_non_blocks <= ring)


def test_host_steps_in_flight_stay_within_their_byte_limit():
    """The worker queue (CUDA's path, driven here with a thread on the CPU): the thread waits for
    the oldest steps once the next gradient would pass the limit, so the pinned gradient bytes in
    flight never exceed it; every step runs, in order, and `_drain` waits for them all."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    plan = _host(Plan(streamed_blocks=tuple(_names()), checkpointing="blocks"))
    _, _, handle, _, _ = run("sgd", plan, steps=1)
    engine = handle.streaming.engine
    engine.host_worker = ThreadPoolExecutor(1)
    limit = engine.host_inflight_limit
    unit = engine.units[0]
    lock, live, peak, order = threading.Lock(), [0], [0], []

    def job(i, n):
        def fn():
            time.sleep(0.01)
            with lock:
                order.append(i)
                live[0] -= n
        return fn

    for i in range(12):
        n = limit // 3
        engine._make_room(n)                          # as step_on_host does before pinning a gradient
        with lock:
            live[0] += n
            peak[0] = max(peak[0], live[0])
        engine._submit(unit, n, job(i, n))
    engine._drain()
    assert peak[0] <= limit and order == list(range(12)) and not engine.pending
    engine.close()


def test_a_write_back_keeps_its_own_completion_event_when_the_slot_is_released_again(monkeypatch):
    """CUDA's write-back path, driven on the CPU with recording stand-ins for streams and events:
    the write-back's completion event (what `_drain` and the next fetch wait for before the host
    copy is read) must stay recorded on the write-back stream. Handing the slot that same object
    as its free event let the slot's next release re-record it on the compute stream, so a drain
    would then wait for the compute stream, not for the copy into the host buffer."""
    import contextlib

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            pass

    class Event:
        def __init__(self):
            self.recorded_on = []

        def record(self, stream):
            self.recorded_on.append(stream.name)

    class Backend:
        cuda = True
        compute = Stream("compute")

        def event(self, timing=False):
            return Event()

        def compute_stream(self):
            return self.compute

    plan = _host(Plan(streamed_blocks=tuple(_names()), checkpointing="blocks"))
    _, _, handle, _, _ = run("sgd", plan, steps=1)
    engine = handle.streaming.engine
    real_backend = engine.backend
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    engine.backend, engine.writeback_stream = Backend(), Stream("writeback")
    unit = engine.units[0]
    slot = engine.slots[unit.slot]
    engine.dirty.add(id(unit))
    engine._write_back(unit, slot, poison=False)
    done = engine.written[id(unit)]
    assert done.recorded_on == ["writeback"]
    engine.dirty.add(id(unit))                       # stepped again, its hold ends: the slot's release
    engine._retire(unit, slot)
    assert done.recorded_on == ["writeback"], "the write-back's event was re-recorded by the slot's release"
    engine.written.clear()
    engine.backend, engine.writeback_stream = real_backend, None
    handle.remove()


def test_removing_a_trainable_streaming_engine_frees_each_host_buffer_as_its_unit_goes_home():
    """remove() copies a unit's weights out, then frees its host buffer, so a re-plan (after an OOM
    or a calibration) holds one unit of extra host RAM, not a second copy of the streamed blocks
    (about 240 GB for Flux-dev with fp32 moments). The engine's views of the host buffers (its host
    step's weights) kept every buffer's memory alive until the engine itself died: once remove()
    returns, nothing but this test may hold a buffer's storage."""
    import gc

    plan = _host(Plan(streamed_blocks=tuple(_names()), checkpointing="blocks"))
    _, _, handle, model, _ = run("sgd", plan, steps=1)
    engine = handle.streaming.engine
    storages = [u.host.untyped_storage() for u in handle.streaming.units]   # this test's own handles
    assert storages and all(torch._C._storage_Use_Count(s._cdata) > 1 for s in storages)
    handle.remove(device="cpu")
    gc.collect()
    held = sum(torch._C._storage_Use_Count(s._cdata) > 1 for s in storages)
    assert held == 0, f"{held} of {len(storages)} host buffers still referenced after remove() (engine alive: {engine is not None})"
