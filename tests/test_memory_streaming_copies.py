"""The streaming engine's copy paths that a CPU run can check: page-aligned pinning and what a
refused pin leaves behind (with a recording stand-in for the CUDA runtime), per-slot ordering of
staged and direct copies, and stall accounting of a staged copy compute waits for."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from test_memory_helpers import block_names, lora_flux

from leantune.memory import host_buffers
from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC


class _FakeCudart:
    """Records cudaHostRegister/Unregister/GetLastError; refuses registration with `rc`."""

    def __init__(self, rc: int = 0, unregister_rc: int = 0):
        self.rc, self.unregister_rc, self.calls = rc, unregister_rc, []

    def cudaHostRegister(self, ptr, n, flags):
        self.calls.append(("register", ptr, n))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return self.unregister_rc

    def cudaGetLastError(self):
        self.calls.append(("clear",))
        return 0


@pytest.mark.parametrize("nbytes", [1, 100, 4096, 5000, 3 * 4096 + 7])
def test_pinned_range_is_page_aligned_and_owned(nbytes):
    buf, start, length = host_buffers.page_aligned(nbytes)
    assert buf.numel() == nbytes and buf.data_ptr() == start
    assert start % host_buffers.PAGE == 0 and length % host_buffers.PAGE == 0 and length >= nbytes
    storage = buf.untyped_storage()
    assert storage.data_ptr() <= start and start + length <= storage.data_ptr() + storage.nbytes()


def test_pinning_registers_whole_own_pages_and_unregisters_when_freed(monkeypatch):
    rt = _FakeCudart(rc=0)
    monkeypatch.setattr(host_buffers, "_cudart", lambda: rt)
    a, undo_a = host_buffers.alloc_host(1000, pin=True)
    b, undo_b = host_buffers.alloc_host(1000, pin=True)
    (_, pa, na), (_, pb, nb) = rt.calls
    assert (pa, pb) == (a.data_ptr(), b.data_ptr()) and na == nb == host_buffers.PAGE
    assert pa + na <= pb or pb + nb <= pa          # two small buffers never share a page
    undo_a()
    assert rt.calls[-1] == ("unregister", pa)
    del b
    gc.collect()
    assert rt.calls[-1] == ("unregister", pb)      # dropped without undo: unregistered by the finalizer
    assert undo_b.alive is False


def test_refused_pin_clears_the_sticky_error_and_stays_pageable(monkeypatch, caplog):
    rt = _FakeCudart(rc=712)                       # cudaErrorHostMemoryAlreadyRegistered
    monkeypatch.setattr(host_buffers, "_cudart", lambda: rt)
    buf, undo = host_buffers.alloc_host(1000, pin=True)
    assert undo is None and buf.numel() == 1000
    assert [c[0] for c in rt.calls] == ["register", "clear"]
    assert "could not pin" in caplog.text


def test_refused_unpin_clears_the_sticky_error_too(monkeypatch):
    rt = _FakeCudart(rc=0, unregister_rc=1)       # cudaErrorInvalidValue
    monkeypatch.setattr(host_buffers, "_cudart", lambda: rt)
    _, undo = host_buffers.alloc_host(1000, pin=True)
    undo()
    assert [c[0] for c in rt.calls] == ["register", "unregister", "clear"]


def _slow_stager(monkeypatch, delay: float):
    real = host_buffers.Stager._run

    def slow(self, fill, n, dst, free_event):
        time.sleep(delay)
        return real(self, fill, n, dst, free_event)
    monkeypatch.setattr(host_buffers.Stager, "_run", slow)


@pytest.fixture
def pageable_engine():
    model = lora_flux(seed=0)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), ring_slots=2,
                                                    pin_memory=False), "cpu")
    yield handle.streaming.engine
    handle.remove()


def test_copies_into_one_slot_land_in_order(pageable_engine, monkeypatch):
    """A pageable unit's staged copy is still queued when a pinned unit of the same slot is fetched:
    the slot must end up holding the pinned unit's bytes, as its owner says."""
    eng = pageable_engine
    a, b = eng.units[0], eng.units[2]
    assert a.slot == b.slot and not a.pinned and not torch.equal(a.host[:64], b.host[:64])
    b.pinned = True                                # mixed: b takes the direct path
    _slow_stager(monkeypatch, 0.3)
    slot = eng.slots[a.slot]
    eng._fetch(a, demand=True)
    eng._fetch(b, demand=True)
    eng.copies.wait_ready(slot)
    eng.copies.stager.pool.submit(lambda: None).result()  # every queued copy has run
    assert slot.owner is b
    assert torch.equal(slot.buf[:b.nbytes], b.host[:b.nbytes])


def test_waiting_for_a_staged_copy_counts_as_stall(pageable_engine, monkeypatch):
    eng = pageable_engine
    eng.report()
    _slow_stager(monkeypatch, 0.3)
    unit = eng.units[0]
    eng._fetch(unit, demand=True)
    eng.copies.wait_ready(eng.slots[unit.slot])
    rep = eng.report()
    assert rep["stall_s"] >= 0.25, rep


@pytest.mark.gpu
def test_small_blocks_pin_and_first_copies_wait_for_the_slots():
    """On CUDA: the tiny model's blocks (far smaller than a page group of their neighbours) are all
    pinned, no CUDA error is left behind, and every slot's first copy waits on an event recorded
    after its allocation and poison fill."""
    model = lora_flux(seed=0)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), ring_slots=2,
                                                 debug_poison=True), "cuda")
    eng = handle.streaming.engine
    assert all(u.pinned for u in eng.units)
    assert all(s.free_event is not None for s in eng.slots)
    torch.cuda.synchronize()
    handle.remove(device="cpu")


class _CurrentDevice:
    """torch.cuda.device / set_device stand-in: records the device made current, and by which thread."""

    def __init__(self):
        self.current, self.log = None, []

    def device(self, dev):
        rec = self

        class Guard:
            def __enter__(self):
                rec.current = dev
                rec.log.append(("enter", str(dev), threading.current_thread().name))

            def __exit__(self, *exc):
                rec.current = None
        return Guard()

    def set_device(self, dev):
        self.current = dev
        self.log.append(("set", str(dev), threading.current_thread().name))


def test_a_pinned_buffer_is_unregistered_with_its_gpu_current_on_whatever_thread_it_dies(monkeypatch):
    """GPU-only in effect (one GPU on the CPU-free part of bench/gpu_checks.sh; its two-GPU check
    needs two): a finalizer runs on the thread where the buffer dies (the autograd thread, a
    worker), whose current device is GPU 0; cudaHostUnregister there would open a context on GPU 0
    and unregister in the wrong one. Here: the recorded current device at the unregistration."""
    rec = _CurrentDevice()
    monkeypatch.setattr(torch.cuda, "device", rec.device)

    class Rt(_FakeCudart):
        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr, str(rec.current)))
            return 0

    rt = Rt(rc=0)
    monkeypatch.setattr(host_buffers, "_cudart", lambda: rt)
    buf, _ = host_buffers.alloc_host(1000, pin=True, cuda_device=torch.device("cuda", 1))
    ptr = buf.data_ptr()
    box = [buf]
    del buf
    worker = threading.Thread(target=lambda: (box.clear(), gc.collect()), name="dies-here")
    worker.start()
    worker.join()
    assert rt.calls[-1] == ("unregister", ptr, "cuda:1")


def test_the_host_step_worker_runs_with_the_engines_gpu_current(monkeypatch):
    """GPU-only in effect (see above): the host-step thread's CUDA calls (an event's synchronize,
    freeing a pinned gradient) must run on the engine's GPU, not on GPU 0 (a new thread's default)."""
    from leantune.memory.trainable_streaming import host_step_worker

    rec = _CurrentDevice()
    monkeypatch.setattr(torch.cuda, "set_device", rec.set_device)
    pool = host_step_worker(torch.device("cuda", 1))
    seen = pool.submit(lambda: (str(rec.current), threading.current_thread().name)).result()
    pool.shutdown(wait=True)
    assert seen[0] == "cuda:1" and seen[1].startswith("leantune-host-step")


def test_the_host_step_workers_kernels_leave_a_core_to_the_backward(monkeypatch):
    """Issue 40 finding 10: a host step beside a GPU backward splits its kernels' work over one
    thread fewer than torch's count (the autograd thread launches the device's kernels meanwhile);
    any other thread (a CPU run's own step) keeps every one. The result does not depend on the
    split (host_kernels' fixed blocks), so only the ranges change."""
    from leantune.memory.trainable_streaming import host_step_worker
    from leantune.train import host_kernels

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    n = 64 * host_kernels.MIN_PER_THREAD
    pool = host_step_worker(torch.device("cuda", 0))
    inside = pool.submit(lambda: len(host_kernels._ranges(n))).result()
    pool.shutdown(wait=True)
    assert (inside, len(host_kernels._ranges(n))) == (7, 8)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    pool = host_step_worker(torch.device("cuda", 0))
    assert pool.submit(lambda: len(host_kernels._ranges(n))).result() == 1      # never below one
    pool.shutdown(wait=True)
