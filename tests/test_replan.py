"""A re-plan (after an out-of-memory error, or a calibration) swaps the memory setup of a model
whose frozen base must come out of it unchanged, without a second copy of it in host RAM.

- fp8 storage is kept through the re-plan: the e4m3 weights and their scales stay as they are
  (no bf16 copy of the whole model on the host, and no dequantize/requantize round trip, which with
  a bf16-rounded scale moved the frozen base a little on every re-plan).
- A shared host copy (several processes of one machine) is re-pointed, not copied: each process's
  weights become views of the shared pages until the new plan's buffers are filled, instead of N
  private copies of the streamed blocks.
"""

import copy
from types import SimpleNamespace

import torch
from test_memory_helpers import block_names, lora_flux, make_batch

from leantune.distributed import DistContext
from leantune.memory.engine import apply_memory
from leantune.memory.fp8 import FP8_DTYPE, SCALE_ATTR, block_linears
from leantune.memory.plan import Plan
from leantune.memory.shared_host import SharedHostBuffers
from leantune.models.flux import FLUX_SPEC, predict
from leantune import trainer


def _linears(model):
    return [(name, lin) for name, _, lin in block_linears(FLUX_SPEC, model)]


def test_a_forced_replan_keeps_the_fp8_base_as_it_is(monkeypatch):
    model = lora_flux(seed=0, dtype=torch.bfloat16)
    blocks = block_names(model)
    first = Plan(streamed_blocks=tuple(blocks[:2]), fp8=True, ring_slots=2)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=7, dtype=torch.bfloat16)
    handle = apply_memory(model, FLUX_SPEC, first, "cpu")
    with torch.no_grad():
        before = predict(model, x, sigma, embeds, hw, guidance=3.5)
    scales = {n: getattr(lin, SCALE_ATTR).clone() for n, lin in _linears(model) if hasattr(lin, SCALE_ATTR)}
    resident = [n for n in scales if not n.startswith((blocks[0] + ".", blocks[1] + "."))]
    assert scales
    seen = []
    real_apply = trainer._apply_engine

    def apply(share, spec, transformer, plan, device, mode, dist):
        seen.append({n: lin.weight.dtype for n, lin in _linears(transformer) if n in resident})
        return real_apply(share, spec, transformer, plan, device, mode, dist)

    monkeypatch.setattr(trainer, "_apply_engine", apply)
    mode = SimpleNamespace(spec=FLUX_SPEC, name="lora", drop_partial_step=lambda t: None, memory_options=lambda: {})
    t = SimpleNamespace(mode=mode, memory=handle, transformer=model, device=torch.device("cpu"),
                        dist=DistContext(), plan=first, share_host_weights=False)
    trainer._replan(t, Plan(streamed_blocks=tuple(blocks[1:4]), fp8=True, ring_slots=2, checkpointing="blocks"))
    # Between the two plans the resident blocks' weights stayed e4m3 (no bf16 copy on the host).
    assert seen and all(d == FP8_DTYPE for d in seen[0].values()), seen
    resident_now = [n for n in scales if not n.startswith(tuple(b + "." for b in blocks[1:4]))]
    assert resident_now
    for n, lin in _linears(model):                                  # streamed ones live in a slot now
        if n in resident_now:
            assert lin.weight.dtype == FP8_DTYPE and torch.equal(getattr(lin, SCALE_ATTR), scales[n]), n
    with torch.no_grad():
        after = predict(model, x, sigma, embeds, hw, guidance=3.5)
    assert torch.equal(after, before)                                        # the base did not move
    t.memory.remove()


def test_a_replan_with_a_shared_host_copy_repoints_instead_of_copying(tmp_path):
    base = lora_flux(seed=0)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=7)
    with torch.no_grad():
        want = predict(copy.deepcopy(base), x, sigma, embeds, hw, guidance=3.5)
    blocks = block_names(base)
    plan = Plan(streamed_blocks=(blocks[0], blocks[-1]), ring_slots=2)
    leader, follower = SharedHostBuffers("r1", leader=True, folder=tmp_path), SharedHostBuffers("r1", leader=False,
                                                                                                 folder=tmp_path)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ha = apply_memory(a, FLUX_SPEC, plan, "cpu", host_buffers=leader)
    hb = apply_memory(b, FLUX_SPEC, plan, "cpu", host_buffers=follower)
    mapped = [(u.host.data_ptr(), u.host.data_ptr() + u.host.numel()) for u in hb.streaming.units]
    leader.unlink()
    streamed = [p for n, p in b.named_parameters() if n.startswith(blocks[0] + ".") and "lora_" not in n]
    hb.remove(device="cpu", keep_host=True)
    ha.remove(device="cpu", keep_host=True)
    inside = [any(lo <= p.data_ptr() < hi for lo, hi in mapped) for p in streamed]
    assert streamed and all(inside), "the follower copied the shared weights into private memory"
    # The next plan's shared buffers are filled from those views; outputs are unchanged.
    leader2, follower2 = (SharedHostBuffers("r2", leader=True, folder=tmp_path),
                          SharedHostBuffers("r2", leader=False, folder=tmp_path))
    new = Plan(streamed_blocks=tuple(blocks[1:3]), ring_slots=2)
    ha = apply_memory(a, FLUX_SPEC, new, "cpu", host_buffers=leader2)
    hb = apply_memory(b, FLUX_SPEC, new, "cpu", host_buffers=follower2)
    leader2.unlink()
    with torch.no_grad():
        for model in (a, b):
            assert torch.equal(predict(model, x, sigma, embeds, hw, guidance=3.5), want)
    ha.remove(), hb.remove()
