"""The memory engine on CUDA (`pytest -m gpu`; skipped without a GPU).

Parity with the plain model on the device, peak memory falling as techniques are added, no
memory growth over 50 steps, and no device- or stream-wide synchronize during a training step.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from test_memory_helpers import (
    block_names,
    lora_flux,
    lora_params,
    make_batch,
    run_plan,
    synchronizes_beyond_the_profiler,
)

from leantune.memory import host_buffers
from leantune.memory.engine import apply_memory, even_spread
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, predict

pytestmark = pytest.mark.gpu

# A mid-size Flux (width 512, 4 double + 8 single blocks) in bf16: weights and activations are
# both large enough that every technique shows in the allocator's peak.
MID = dict(num_layers=4, num_single_layers=8, attention_head_dim=64, num_attention_heads=8,
           joint_attention_dim=256, pooled_projection_dim=64, axes_dims_rope=(8, 28, 28))
MID_LATENT = (64, 64)     # 1024 image tokens
MID_TEXT = 64


def _close(got, want):
    """Losses and LoRA gradients within fp32 kernel non-determinism (atomics in attention backward)."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-5, atol=1e-6)
        for name in w["grads"]:
            torch.testing.assert_close(g["grads"][name], w["grads"][name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("plan_kw", [
    dict(streamed_blocks="some", debug_poison=True),
    dict(streamed_blocks="all", stream_non_blocks=True, debug_poison=True, checkpointing="blocks"),
    dict(streamed_blocks="all", stream_non_blocks=True, debug_poison=True, checkpointing="offload", fp8=True),
    dict(streamed_blocks="all", debug_poison=True, pin_memory=False),
    dict(streamed_blocks="all", ring_slots=3, checkpointing="blocks", fp8=True),
])
def test_parity_on_cuda(plan_kw):
    base = lora_flux(seed=0)
    names = block_names(base)
    kw = dict(plan_kw)
    kw["streamed_blocks"] = tuple(even_spread(names, 2) if kw["streamed_blocks"] == "some" else names)
    want, ref_handle, _ = run_plan(base, Plan(fp8=kw.get("fp8", False)), device="cuda")
    ref_handle.remove()
    got, handle, _ = run_plan(base, Plan(**kw), device="cuda", offload_min_bytes=0)
    _close(got, want)
    if kw.get("pin_memory", True):
        # cudaHostRegister accepted every unit (torch 2.11's is_pinned() does not see registered memory)
        assert all(u.pinned and u.unpin is not None for u in handle.streaming.units)
    rep = handle.step_report(wait=True)
    assert rep["bytes_h2d"] > 0 and rep["copy_s"] > 0
    handle.remove()


def _mid_model():
    return lora_flux(seed=0, dtype=torch.bfloat16, **MID)


def _step(model, params, opt, batch):
    """One training step with nothing that synchronizes the host (no .item(), no .cpu())."""
    x, sigma, embeds, hw, target = batch
    opt.zero_grad(set_to_none=True)
    pred = predict(model, x, sigma, embeds, hw, guidance=1.0)
    loss = torch.nn.functional.mse_loss(pred.float(), target)
    loss.backward()
    opt.step()
    return loss.detach()


def _setup(plan: Plan, base):
    model = copy.deepcopy(base)
    handle = apply_memory(model, FLUX_SPEC, plan, "cuda")
    params = list(lora_params(model).values())
    opt = torch.optim.SGD(params, lr=1e-3)
    batch = make_batch(*MID_LATENT, seed=0, device="cuda", dtype=torch.bfloat16, text_dim=256, pooled_dim=64,
                       batch=1, text_len=MID_TEXT)
    return model, handle, params, opt, batch


def test_peak_memory_falls_as_techniques_are_added():
    base = _mid_model()
    names = block_names(base)
    ladder = [
        ("resident", Plan()),
        ("+ checkpointing", Plan(checkpointing="blocks")),
        ("+ fp8", Plan(checkpointing="blocks", fp8=True)),
        ("+ stream half", Plan(checkpointing="blocks", fp8=True, streamed_blocks=tuple(even_spread(names, 6)))),
        ("+ stream all", Plan(checkpointing="blocks", fp8=True, streamed_blocks=tuple(names), stream_non_blocks=True)),
        ("+ offload", Plan(checkpointing="offload", fp8=True, streamed_blocks=tuple(names), stream_non_blocks=True)),
    ]
    peaks = []
    for label, plan in ladder:
        torch.cuda.empty_cache()
        model, handle, params, opt, batch = _setup(plan, base)
        _step(model, params, opt, batch)                 # optimizer state and caches exist from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(model, params, opt, batch)
        torch.cuda.synchronize()
        peaks.append((label, torch.cuda.max_memory_allocated()))
        handle.remove(device="cpu")
        del model, handle, params, opt, batch
    print("\npeak allocated per step:", ", ".join(f"{l} {p / 2**20:.0f} MiB" for l, p in peaks))
    for (l0, p0), (l1, p1) in itertools.pairwise(peaks):
        assert p1 < p0, f"{l1} ({p1} B) does not lower the peak of {l0} ({p0} B)"


def test_no_memory_growth_over_50_steps():
    base = _mid_model()
    plan = Plan(checkpointing="offload", fp8=True, streamed_blocks=tuple(block_names(base)), stream_non_blocks=True)
    model, handle, params, opt, batch = _setup(plan, base)
    for _ in range(3):
        _step(model, params, opt, batch)
    reserved, allocated = _settled_memory()
    for _ in range(50):
        loss = _step(model, params, opt, batch)
        handle.step_report()
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
    assert _settled_memory() == (reserved, allocated)
    handle.remove()


def _settled_memory() -> tuple[int, int]:
    """Reserved and allocated bytes once freed blocks are settled: a block freed while a side
    stream still used it (record_stream: offloaded inputs, their copies) is returned to the pool at
    the allocator's next allocation after its event completed, and counts as allocated until then
    (seen on an H100: 256 KiB more after 50 steps, one such block)."""
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")                  # the allocator processes completed events here
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


@pytest.mark.parametrize("checkpointing", ["none", "offload"])
def test_no_synchronize_in_the_block_loop(checkpointing):
    base = _mid_model()
    names = block_names(base)
    plan = Plan(checkpointing=checkpointing, fp8=True, streamed_blocks=tuple(even_spread(names, 8)))
    model, handle, params, opt, batch = _setup(plan, base)
    for _ in range(3):
        _step(model, params, opt, batch)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        _step(model, params, opt, batch)
    torch.cuda.synchronize()
    names_seen = {e.name for e in prof.events()}
    assert any("Memcpy HtoD" in n or "cudaMemcpyAsync" in n for n in names_seen)   # streaming did copy
    assert not synchronizes_beyond_the_profiler(prof.events()), "a training step synchronized"
    rep = handle.step_report(wait=True)
    assert rep["demand_fetches"] == 0 and rep["copies"] > 0
    handle.remove()



@pytest.mark.parametrize("pin_memory", [True, False])
def test_release_frees_slots_and_pins_without_copies(pin_memory):
    """release() right after sampling (copies of the next step still in flight): device memory
    drops by the slots, nothing is allocated on the device, pinned host buffers are unregistered."""
    model = _mid_model()
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), pin_memory=pin_memory),
                          "cuda")
    assert all(u.pinned for u in handle.streaming.units) == pin_memory
    handle.forward_only(True)
    x, sigma, embeds, hw, _ = make_batch(16, 16, seed=0, device="cuda", dtype=torch.bfloat16, text_dim=256,
                                         pooled_dim=64, batch=1, text_len=MID_TEXT)
    with torch.no_grad():
        predict(model, x, sigma, embeds, hw, guidance=3.5)          # the ring prefetches the next step
    slot_bytes = sum(s.buf.numel() for s in handle.streaming.engine.slots)
    hosts = [u.host for u in handle.streaming.units]                 # kept alive to probe their pinning
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    handle.release()
    assert torch.cuda.max_memory_allocated() == before              # nothing copied onto the device
    assert torch.cuda.memory_allocated() <= before - slot_bytes
    rt = torch.cuda.cudart()
    for h in hosts:                                                  # 0 would mean it was still registered
        assert int(rt.cudaHostUnregister(h.data_ptr())) != 0
        host_buffers.clear_cuda_error(rt)    # the refusal is deliberate: leave no error for later launches
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_an_unused_offload_prefetch_keeps_its_memory_until_its_copy_is_done():
    """A block input restored ahead of its recompute but never used (backward interrupted) is freed
    while its host->device copy may still run on the side stream: the allocator must not hand that
    memory to the compute stream before the copy is done (record_stream)."""
    from leantune.memory.checkpointing import ActivationOffloader, _HostTensor

    off = ActivationOffloader(min_bytes=0)
    t = torch.randn(1 << 20, device="cuda")
    h = _HostTensor(off, t)
    torch.cuda.synchronize()
    side = off.side_stream(t.device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)         # keeps the side stream busy: the copy stays pending
    h.prefetch()
    pending = h.dev.data_ptr()
    h.dev = None                                  # dropped without get(): nothing waited for the copy
    fresh = torch.empty_like(t)                   # same size, compute stream
    assert fresh.data_ptr() != pending
    torch.cuda.synchronize()


def _base_adapter_case(device: str):
    """A frozen base adapter (train/base_adapters.py) under the trained LoRA of the tiny Flux, every
    unit streamed in poison mode, checkpointed: (records, resident-plan records, device bytes with
    and without the base adapter under the streamed plan, bytes moved with and without it)."""
    from pathlib import Path

    from test_memory_helpers import train

    from leantune.train.base_adapters import BaseAdapter, BaseAdapterStack
    from leantune.train.lora import lora_weights_from_model

    weights = lora_weights_from_model(lora_flux(seed=1), "default")     # a stand-in for a training adapter

    def build(with_adapter: bool):
        model = lora_flux(seed=0)
        if with_adapter:
            BaseAdapterStack(model, [BaseAdapter(Path("adapter.safetensors"), 0.7, weights)])
        return model

    plan = Plan(streamed_blocks=tuple(block_names(build(False))), stream_non_blocks=True, debug_poison=True,
                checkpointing="blocks", ring_slots=2)
    out = {}
    for name, with_adapter, p in (("resident", True, Plan()), ("streamed", True, plan), ("bare", False, plan)):
        model = build(with_adapter)
        handle = apply_memory(model, FLUX_SPEC, p, device, offload_min_bytes=0)
        held = handle.device_bytes()
        records = train(model, device=device)
        out[name] = (records, held, handle.step_report(wait=True)["bytes_h2d"])
        handle.remove()
    return out


def test_base_adapters_stream_with_their_blocks_on_cuda():
    """GPU-only: a base adapter's weights travel in their blocks' pinned units. Losses and LoRA
    gradients are the resident run's (within kernel non-determinism); the device's resident bytes
    under the streamed plan are those of the same model without the base adapter; a step moves
    more bytes (the adapter's weights cross the bus with their blocks)."""
    out = _base_adapter_case("cuda")
    (want, _, _), (got, held, moved), (_, bare_held, bare_moved) = out["resident"], out["streamed"], out["bare"]
    _close(got, want)
    assert held["resident"] == bare_held["resident"] and moved > bare_moved > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_dequantize_on_cuda_allocates_only_its_output(dtype):
    """Issue 40, finding 5: on CUDA the product is formed in the output, so the peak above the
    inputs is the output's bytes (the fp32 product's path added 2x them), with the fp32 product's
    bits."""
    from leantune.memory.fp8 import dequantize, quantize

    w = torch.randn(2048, 4096, device="cuda") * 0.02
    q, s = quantize(w)
    del w
    want = (q.float().view(2048, s.shape[1], -1) * s.float()[..., None]).view(2048, 4096).to(dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = dequantize(q, s, dtype)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= got.numel() * got.element_size() + 2 * 2**20, extra
    assert torch.equal(got, want)
