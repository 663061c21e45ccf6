"""Host RAM of the memory engine, measured as the process's resident set (Linux /proc).

A Flux of real class, one double and eight single blocks at width 1024 (324 MiB in bf16), so that
the streamed blocks (240 MiB) dwarf one block (30 MiB) and allocator noise. apply_memory must
pack block by block (peak extra ≈ one block, not the streamed total), release() must return the
engine's memory without allocating, and remove() must restore unit by unit.
"""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import pytest
import torch

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, predict
from leantune.tiny import wide_flux_transformer

MiB = 2**20
SLACK = 12 * MiB          # interpreter, allocator and bookkeeping noise allowed on top of a bound


def _status() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE)}


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")      # VmHWM := current VmRSS


try:
    _reset_peak()
    HAS_PROC = "VmHWM" in _status()
except OSError:
    HAS_PROC = False

pytestmark = pytest.mark.skipif(not HAS_PROC, reason="needs Linux /proc/self/status and a writable clear_refs")


class _Peak:
    """Extra resident memory while the block runs: peak and end, relative to its start."""

    def __enter__(self):
        gc.collect()
        self.start = _status()["VmRSS"]
        _reset_peak()
        return self

    def __exit__(self, *exc):
        st = _status()
        self.peak = st["VmHWM"] - self.start
        self.end = st["VmRSS"] - self.start
        return False


def _singles(model) -> tuple[str, ...]:
    return tuple(n for n, _ in FLUX_SPEC.blocks(model) if n.startswith("single"))


def _sample(model) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 64, generator=g).to(torch.bfloat16)                       # (B, 2x2 tokens, 64)
    embeds = PromptEmbeds(torch.randn(1, 4, 64, generator=g), torch.randn(1, 64, generator=g)).to("cpu", torch.bfloat16)
    with torch.no_grad():
        return predict(model, x, torch.tensor([0.5]), embeds, (4, 4), guidance=3.5)


@pytest.fixture
def wide():
    model = wide_flux_transformer()
    yield model
    del model
    gc.collect()


def test_apply_packs_block_by_block(wide):
    """Each streamed block is packed, re-pointed at its host buffer and its original storage freed
    before the next one: peak extra host RAM ≈ one block, and afterwards the streamed weights exist
    once (in their buffers). Packing everything first would peak at the streamed total (240 MiB)."""
    with _Peak() as m:
        handle = apply_memory(wide, FLUX_SPEC, Plan(streamed_blocks=_singles(wide)), "cpu")
    units = handle.streaming.unit_bytes()
    total, largest = sum(units.values()), max(units.values())
    assert len(units) == 8 and total >= 7 * largest                 # the two behaviours are far apart
    assert m.peak <= largest + SLACK, f"peak {m.peak / MiB:.0f} MiB, one block is {largest / MiB:.0f} MiB"
    assert m.end <= SLACK, f"{m.end / MiB:.0f} MiB left over after apply"
    # the slots are (CPU) buffers no page of which was touched yet; a forward touches them
    assert torch.isfinite(_sample(wide)).all()
    handle.remove()


def test_release_returns_memory_without_copying(wide):
    """release() frees host buffers and slots and allocates nothing: no weight is copied back."""
    streamed = _singles(wide)
    handle = apply_memory(wide, FLUX_SPEC, Plan(streamed_blocks=streamed, ring_slots=2), "cpu")
    _sample(wide)                                                   # slots now hold real pages
    eng = handle.streaming.engine
    total = sum(handle.streaming.unit_bytes().values())
    slot_bytes = sum(s.buf.numel() for s in eng.slots)
    buffers = [weakref.ref(u.host) for u in handle.streaming.units] + [weakref.ref(s.buf) for s in eng.slots]
    blocks = dict(FLUX_SPEC.blocks(wide))
    with _Peak() as m:
        handle.release()
    assert m.peak <= SLACK, f"release allocated {m.peak / MiB:.0f} MiB"
    assert -m.end >= total + slot_bytes - SLACK, (
        f"released {-m.end / MiB:.0f} MiB of {(total + slot_bytes) / MiB:.0f} MiB (buffers + slots)")
    assert all(r() is None for r in buffers)
    # every wrapper and hook is gone; streamed modules hold no weights; resident ones are untouched
    assert not wide._forward_pre_hooks and not wide._forward_hooks
    assert not any("forward" in mod.__dict__ for mod in wide.modules())
    for name, block in blocks.items():
        sizes = {p.numel() for p in block.parameters()}
        assert (sizes == {0}) == (name in streamed), name
    assert handle.streaming is None and handle.step_report()["bytes_h2d"] == 0
    with pytest.raises(ValueError, match=r"memory engine was released .* load the model again"):
        apply_memory(wide, FLUX_SPEC, Plan(), "cpu")
    with pytest.raises(RuntimeError, match=r"engine was released; the streamed weights are gone"):
        handle.remove()


def test_remove_restores_unit_by_unit(wide):
    """remove(device="cpu") copies each unit out and frees its buffer before the next: one block of
    extra host RAM, not a second copy of the streamed blocks; the restored model computes as before."""
    want = _sample(wide)
    handle = apply_memory(wide, FLUX_SPEC, Plan(streamed_blocks=_singles(wide)), "cpu")
    largest = max(handle.streaming.unit_bytes().values())
    slot_bytes = sum(s.buf.numel() for s in handle.streaming.engine.slots)
    _sample(wide)
    with _Peak() as m:
        handle.remove(device="cpu")
    assert m.peak <= largest + SLACK, f"peak {m.peak / MiB:.0f} MiB, one block is {largest / MiB:.0f} MiB"
    assert m.end <= -slot_bytes + SLACK                            # the touched slots are gone too
    assert torch.equal(_sample(wide), want)
