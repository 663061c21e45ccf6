"""Activation checkpointing from outside the blocks, with and without offloaded inputs: what stays
saved on the device, what goes to the host and comes back, and how it composes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_memory_helpers import lora_flux, make_batch

from leantune.memory.checkpointing import apply_checkpointing, remove_checkpointing
from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, predict

BIG = dict(num_layers=2, num_single_layers=2, attention_head_dim=32, num_attention_heads=4,
           joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(8, 12, 12))   # width 128


def _saved_bytes(model, shape=(16, 16)) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward *on the compute device*, counted by an outer saved-tensor
    hook (inner hooks, like checkpoint's and the offloader's, take precedence over it), and the loss."""
    x, sigma, embeds, hw, target = make_batch(*shape, seed=0, text_dim=32)
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0), target)
    loss.backward()
    return sum(seen.values()), loss.detach()


def test_checkpointing_reduces_saved_activations():
    base = lora_flux(seed=0, **BIG)
    results = {}
    for mode in ("none", "blocks", "offload"):
        model = copy.deepcopy(base)
        handle = apply_memory(model, FLUX_SPEC, Plan(checkpointing=mode), "cpu", offload_min_bytes=0)
        results[mode] = _saved_bytes(model)
        if mode == "offload":
            rep = handle.step_report()
            # the residual stream of blocks 1..3 (image and text streams) went to the host and came back;
            # block 0's inputs need no gradient (frozen embedders) and stay
            assert rep["offload_tensors"] == 6
            assert rep["offload_bytes_h2d"] == rep["offload_bytes_d2h"] > 0
        handle.remove()
    (plain, loss0), (blocks, loss1), (offload, loss2) = results["none"], results["blocks"], results["offload"]
    assert torch.equal(loss0, loss1) and torch.equal(loss0, loss2)
    assert blocks < plain / 3, (blocks, plain)
    assert offload < blocks, (offload, blocks)


def test_small_inputs_stay_on_device_by_default():
    model = lora_flux(seed=0)
    handle = apply_memory(model, FLUX_SPEC, Plan(checkpointing="offload"), "cpu")   # tiny: every input < 64 KiB
    _saved_bytes(model, shape=(8, 8))
    assert handle.step_report()["offload_tensors"] == 0
    handle.remove()


def _saved_count(model, shape=(8, 8)) -> int:
    """How many tensors an outer saved-tensor hook sees during a forward (inner hooks hide theirs)."""
    x, sigma, embeds, hw, target = make_batch(*shape, seed=0, text_dim=32)
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0), target)
    loss.backward()
    return count


def test_offload_hooks_skipped_when_no_input_would_move():
    """A checkpointed block none of whose inputs would go to the host (tiny model: all under the
    default 64 KiB) runs without the offloader's saved-tensor hooks: an outer hook sees exactly
    what it sees with plain block checkpointing (with the hooks, the offloader's pack took the
    block inputs that checkpoint saves). With a 0-byte threshold the hooks are installed."""
    counts = {}
    for mode, min_bytes in (("blocks", None), ("offload", None), ("offload", 0)):
        model = lora_flux(seed=0)
        kw = {} if min_bytes is None else {"offload_min_bytes": min_bytes}
        handle = apply_memory(model, FLUX_SPEC, Plan(checkpointing=mode), "cpu", **kw)
        counts[(mode, min_bytes)] = _saved_count(model)
        handle.remove()
    assert counts[("offload", None)] == counts[("blocks", None)]
    assert counts[("offload", 0)] < counts[("blocks", None)]


def test_no_grad_forward_is_not_checkpointed():
    base = lora_flux(seed=0)
    model = copy.deepcopy(base)
    handle = apply_checkpointing(model, FLUX_SPEC, offload=True, offload_min_bytes=0)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=1)
    with torch.no_grad():
        out = predict(model, x, sigma, embeds, hw, guidance=1.0)
        want = predict(base, x, sigma, embeds, hw, guidance=1.0)
    assert torch.equal(out, want)
    assert handle.report()["offload_tensors"] == 0
    remove_checkpointing(handle)
    assert not any("forward" in b.__dict__ for _, b in FLUX_SPEC.blocks(model))


def test_checkpoint_wrapper_wraps_outside_streaming():
    """The recompute must re-enter streaming: checkpointing's wrapper calls streaming's."""
    model = lora_flux(seed=0)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=("transformer_blocks.1",), checkpointing="blocks"),
                          "cpu")
    outer = model.transformer_blocks[1].__dict__["forward"]
    assert type(outer).__name__ == "_CheckpointedForward"
    assert type(outer.orig).__name__ == "StreamedForward"
    assert type(model.transformer_blocks[0].__dict__["forward"].orig).__name__ == "method"   # resident block
    handle.remove()


def test_diffusers_own_checkpointing_is_refused():
    model = lora_flux(seed=0)
    model.enable_gradient_checkpointing()
    with pytest.raises(ValueError, match=r"memory\.checkpointing"):
        apply_checkpointing(model, FLUX_SPEC)
