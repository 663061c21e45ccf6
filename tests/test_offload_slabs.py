"""Offloaded block inputs in host slabs (memory/host_buffers.HostSlabs, issue 36): one stack over
fixed-size slabs instead of one power-of-two caching-allocator block per input. The inputs round-trip
bitwise (also across slab boundaries), the stack takes and gives back in order and reuses its slabs,
and the planner's price (planner/host_model.offloaded_inputs) is the bytes the engine holds; the
blocks whose inputs need no gradient are priced as the engine moves them (none)."""

from __future__ import annotations

import pytest
import torch

from test_memory_helpers import lora_flux, make_batch

from leantune.memory import host_buffers
from leantune.memory.checkpointing import ActivationOffloader, _HostTensor
from leantune.memory.engine import apply_memory
from leantune.memory.host_buffers import PAGE, HostSlabs, offload_extent, offload_host_bytes
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, predict

SLAB = PAGE + 1024            # 1024 usable bytes per slab: tiny tensors span several


def test_the_stack_spans_slabs_pops_in_order_and_reuses_them():
    s = HostSlabs(slab=SLAB)
    a, b, c = s.take(700), s.take(1500), s.take(10)
    assert [len(list(s.pieces(e))) for e in (a, b, c)] == [1, 2, 1]       # b spans slabs 1 and 2
    assert [sum(p.numel() for _, p in s.pieces(e)) for e in (a, b, c)] == [700, 1500, 10]
    assert s.top == offload_extent(700) + offload_extent(1500) + offload_extent(10) == 3072
    assert s.reserved == offload_host_bytes([700, 1500, 10], SLAB) == 3 * SLAB
    s.give_back(b)                          # out of order: waits under c
    assert s.top == 3072
    s.give_back(c)                          # c and b popped together
    assert s.top == offload_extent(700)
    s.give_back(a)
    assert s.top == 0
    for n in (700, 1500, 10):               # the same sizes again: the slabs are reused
        s.take(n)
    assert s.reserved == 3 * SLAB and s.peak == 3072


def test_pieces_tile_the_extent_exactly():
    s = HostSlabs(slab=SLAB)
    s.take(300)
    e = s.take(2500)
    offsets = [(off, p.numel()) for off, p in s.pieces(e)]
    assert offsets[0][0] == 0 and sum(n for _, n in offsets) == 2500
    assert all(o2 == o1 + n1 for (o1, n1), (o2, _) in zip(offsets, offsets[1:]))


def test_offloaded_inputs_come_back_bitwise_across_slabs(monkeypatch):
    monkeypatch.setattr(host_buffers, "OFFLOAD_SLAB", SLAB)
    off = ActivationOffloader(min_bytes=0)
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 333), generator=g, dtype=torch.int32)
    inputs = [bits.view(torch.float32),                              # every bit pattern, NaNs included
              bits.view(torch.bfloat16)[:, 5:400],                   # not contiguous
              torch.randn(7, 1, 61, generator=g).to(torch.float16),
              torch.empty(0, 4)]                                     # no bytes at all
    want = [t.clone() for t in inputs]
    handles = [_HostTensor(off, t) for t in inputs]
    bits.zero_()                           # the originals may be overwritten once offloaded
    inputs[2].zero_()
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    for h, t in zip(handles, want):
        got = h.get()
        assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous()
        if t.numel():
            assert torch.equal(got.view(ints[t.dtype]), t.contiguous().view(ints[t.dtype]))
    slabs = off.slabs_for(torch.device("cpu"))
    assert off.host_bytes() == slabs.reserved == offload_host_bytes([h.nbytes for h in handles], SLAB)
    assert off.stats["bytes_d2h"] == sum(h.nbytes for h in handles)
    del handles, h
    assert slabs.top == 0


def test_the_engine_holds_what_the_planner_prices(monkeypatch):
    """A LoRA step of the tiny Flux in bf16 with offloaded inputs: the slabs hold exactly
    offload_host_bytes of the inputs moved, each block's inputs are the sizes the planner's
    profile prices (image and text streams), every extent is back after backward, and a second step
    takes no new slab. The first block's inputs come from the frozen embedders and need no
    gradient: nothing of it moves, and the planner leaves it out (host_model.frozen_lead), so its
    price is the engine's bytes exactly."""
    from leantune.planner.machine import assumed_machine
    from leantune.planner.search import Planner
    from leantune.planner.workload import Workload

    monkeypatch.setattr(host_buffers, "OFFLOAD_SLAB", 2 * PAGE)
    model = lora_flux(seed=0, dtype=torch.bfloat16)
    w = Workload(rank=4, buckets=((64, 64),), text_length=8, batch_size=2, allow_fp8=False)
    planner = Planner(FLUX_SPEC, model, w, assumed_machine())
    plan = Plan(checkpointing="offload")
    prof = planner.profiles[plan.storage][(64, 64)]
    img = w.image_tokens((64, 64)) / prof.tokens
    priced = [(int(prof.kinds[k].out * img), int(prof.kinds[k].out * (1 - img))) for k in planner.kinds]
    assert planner.host(plan)["offloaded activations"] == offload_host_bytes([n for p in priced[1:] for n in p])

    handle = apply_memory(model, FLUX_SPEC, plan, "cpu", offload_min_bytes=0)
    off = handle.checkpointing.offloader
    for step in range(2):
        x, sigma, embeds, hw, target = make_batch(8, 8, seed=step, dtype=torch.bfloat16)
        loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0).float(), target)
        groups, g = [], off._last()
        while g is not None:
            groups.append([h.nbytes for h in g.handles])
            g = g.prev() if g.prev is not None else None
        groups.reverse()
        moved = [n for grp in groups for n in grp]
        assert groups[0] == [] and [tuple(grp) for grp in groups[1:]] == priced[1:]
        assert off.host_bytes() == offload_host_bytes(moved) > 0
        assert off.host_bytes() == planner.host(plan)["offloaded activations"]
        loss.backward()
        assert off.slabs_for(torch.device("cpu")).top == 0     # given back during backward, loss still alive
        del loss, groups, g
    assert off.host_bytes() == offload_host_bytes(moved)        # the second step reused the slabs


def test_the_blocks_before_the_first_adapter_move_nothing():
    from leantune.planner.host_model import frozen_lead

    blocks = ["blocks.0", "blocks.1", "blocks.2"]
    assert frozen_lead("lora", blocks, ["blocks.0.attn.to_q", "blocks.2.ff.net.0.proj"]) == 1
    assert frozen_lead("lora", blocks, ["blocks.1.attn.to_q"]) == 2          # [lora] blocks from blocks.1 on
    assert frozen_lead("lora", blocks, ["x_embedder", "blocks.1.attn.to_q"]) == 0   # trained upstream: all move
    assert frozen_lead("lora", ["blocks.1"], ["blocks.10.attn.to_q"]) == 0  # "blocks.1" does not own blocks.10
    assert frozen_lead("full", blocks, ["blocks.0.attn.to_q"]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only (bench/gpu_checks.sh window 1): pinned slabs "
                                                          "(cudaHostRegister) and copies on the offloader's side stream")
def test_cuda_inputs_come_back_bitwise_through_pinned_slabs(monkeypatch):
    """On CUDA the slabs are page-locked (cudaHostRegister on each slab's size) and every copy runs
    non-blocking on the offloader's side stream: an input spanning many slabs, overwritten on the
    device once offloaded, comes back bit for bit; a slab reused by a later input after the first was
    given back does not corrupt it (the copies are ordered on the one stream)."""
    monkeypatch.setattr(host_buffers, "OFFLOAD_SLAB", SLAB)
    off = ActivationOffloader(min_bytes=0)
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-2**31, 2**31 - 1, (3 * SLAB // 4,), generator=g, dtype=torch.int32)   # spans 15 slabs
    first = bits.cuda()
    want = first.clone()
    h = _HostTensor(off, first)
    first.zero_()                                   # the device copy may be overwritten once offloaded
    slabs = off.slabs_for(first.device)
    assert slabs.pin and all(s.is_pinned() for s in slabs.slabs)
    got = h.get()
    assert got.is_cuda and torch.equal(got, want)
    del h, got
    second = torch.randint(-2**31, 2**31 - 1, (SLAB // 8,), generator=g, dtype=torch.int32).cuda()
    h2 = _HostTensor(off, second)
    again = second.clone()
    second.zero_()
    assert torch.equal(h2.get(), again)
