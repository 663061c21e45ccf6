"""The per-block hook of weight streaming: the forward that replaces a streamed module's own, and
the two autograd boundaries it puts around the unit, which tell the schedule (memory/streaming.py)
when the unit's weights are needed.

A unit is *held* while its weights are in use: during its forward; in backward from the moment its
output gradients arrive (`_Leave`, an identity autograd Function on its outputs) until its input
gradients are computed (`_Enter`, an identity Function on its grad-requiring inputs; created first
in the block, it has the lowest sequence number, so autograd's ready queue runs it after every
other node of the block). A unit none of whose inputs needs a gradient (the first trainable block)
is held until the end of backward (an engine callback), as FSDP2 does for the same reason.

Without checkpointing, the tensors autograd saves inside the unit go through the saved-tensor
hooks (memory/saved_tensors.py). With checkpointing, the recompute re-enters this forward, which
re-acquires the unit; checkpointing therefore wraps *outside* streaming (see engine.py for the
full order).

Under no_grad (sampling) the unit is only held around the call. A grad-enabled call in forward-only
mode is refused rather than silently losing the streamed blocks' gradients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .streaming_units import StreamedUnit


class _Enter(torch.autograd.Function):
    """Identity on a unit's grad-requiring inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, engine, unit, *xs):
        ctx.engine, ctx.unit = engine, unit
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.backward_end(ctx.unit)
        return (None, None, *grads)


class _Leave(torch.autograd.Function):
    """Identity on a unit's outputs; its backward runs just before the unit's backward starts."""

    @staticmethod
    def forward(ctx, engine, unit, release_at_end, *xs):
        ctx.engine, ctx.unit, ctx.release_at_end = engine, unit, release_at_end
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.backward_begin(ctx.unit, ctx.release_at_end)
        return (None, None, None, *grads)


class StreamedForward:
    """Instance-level forward of a streamed module: hold the unit around the original forward and
    wire the backward holds. `engine`: the module's StreamingEngine (memory/streaming.py)."""

    def __init__(self, engine, unit: StreamedUnit, module: nn.Module):
        self.engine, self.unit = engine, unit
        self.prev = module.__dict__.get("forward")    # an earlier instance-level forward, if any
        self.orig = module.forward

    def __call__(self, *args, **kwargs):
        eng, unit = self.engine, self.unit
        if not torch.is_grad_enabled():
            return self._held(self.orig, args, kwargs)
        if eng.mode.forward_only:
            raise RuntimeError("memory engine is in forward-only (sampling) mode but autograd is on: sample "
                               "under torch.no_grad(), or call forward_only(False) before training")
        eng.acquire(unit)
        try:
            flat, spec = tree_flatten((args, kwargs))
            grad_in = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not grad_in and not unit.trainable():
                return self.orig(*args, **kwargs)     # nothing here needs these weights in backward
            if grad_in:
                routed = _Enter.apply(eng, unit, *[flat[i] for i in grad_in])
                for i, x in zip(grad_in, routed, strict=True):
                    flat[i] = x
                args, kwargs = tree_unflatten(flat, spec)
            if unit.checkpointed:
                out = self.orig(*args, **kwargs)      # checkpoint's recompute re-enters this wrapper
            else:
                with eng.saved_tensors.installed():
                    out = self.orig(*args, **kwargs)
            oflat, ospec = tree_flatten(out)
            grad_out = [i for i, x in enumerate(oflat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if grad_out:
                routed = _Leave.apply(eng, unit, not grad_in, *[oflat[i] for i in grad_out])
                for i, x in zip(grad_out, routed, strict=True):
                    oflat[i] = x
                out = tree_unflatten(oflat, ospec)
                eng.note_tracked(unit)
            return out
        finally:
            eng.release(unit)

    def _held(self, fn, args, kwargs):
        self.engine.acquire(self.unit)
        try:
            return fn(*args, **kwargs)
        finally:
            self.engine.release(self.unit)
