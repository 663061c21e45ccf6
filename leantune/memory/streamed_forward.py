"""The per-block hook of weight streaming: the forward that replaces a streamed module's own, and
the two autograd boundaries it puts around the unit, which tell the schedule (memory/streaming.py)
when the unit's weights are needed.

A unit is *held* while its weights are in use: during its forward; in backward from the moment its
output gradients arrive (`_Leave`, an identity autograd Function on its outputs) until its input
gradients are computed (`_Enter`, an identity Function on its grad-requiring inputs; created first
in the block, it has the lowest sequence number, so autograd's ready queue runs it after every
other node of the block). A unit none of whose inputs needs a gradient (the first trainable block)
is held until the end of backward (an engine callback), as FSDP2 does for the same reason.

Frozen weights are saved by autograd as themselves and read from the slot in backward, after
`_Leave` took the hold and checked once that the unit is resident; trained weights without
checkpointing go through the saved-tensor hooks (memory/saved_tensors.py). With checkpointing, the
recompute re-enters this forward, which re-acquires the unit; checkpointing therefore wraps
*outside* streaming (see engine.py for the full order).

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
        ctx.engine.check_resident(ctx.unit)          # once per block, before any of its saved weights is read
        return (None, None, None, *grads)


def _direct_apply(cls):
    """`cls.apply` without torch.autograd.Function.apply's Python wrapper (a setup_context check and
    a walk of the arguments for dead functorch wrappers, a third of the cost of the two boundaries on
    a small block). That walk matters only under functorch transforms (vmap, grad, jvp), where the
    wrapper still runs."""
    direct = super(torch.autograd.Function, cls).apply

    def apply(*args):
        if torch._C._are_functorch_transforms_active():
            return cls.apply(*args)
        return direct(*args)

    return apply


_enter = _direct_apply(_Enter)
_leave = _direct_apply(_Leave)


# Leaf types a block's arguments and outputs commonly carry besides tensors: pytree treats them as
# leaves too. Any other type (a namedtuple, an OrderedDict, a registered pytree node, an unknown
# object) sends the whole call to torch's pytree, so the tensors routed are always pytree's.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, torch.dtype, torch.device})


def _grad_tensors(tree, found: list) -> bool:
    """Append the grad-requiring tensors of `tree` (tuples, lists, dicts, tensors and atoms) to
    `found`, in pytree's order; False if `tree` holds another type (then nothing is decided here).

    Why not tree_flatten: it is the largest part of the per-block cost of the wrapper on a small
    model (a spec object per container, a namedtuple check per node), twice per streamed call."""
    if isinstance(tree, torch.Tensor):
        if tree.requires_grad:
            found.append(tree)
        return True
    t = type(tree)
    if t is tuple or t is list:
        for x in tree:
            if not _grad_tensors(x, found):
                return False
        return True
    if t is dict:
        for x in tree.values():
            if not _grad_tensors(x, found):
                return False
        return True
    return t in _ATOMS


def _substitute(tree, routed):
    """`tree` with its grad-requiring tensors replaced, in order, by the items of iterator `routed`
    (the same walk as _grad_tensors, which accepted `tree`); containers without one are kept."""
    if isinstance(tree, torch.Tensor):
        return next(routed) if tree.requires_grad else tree
    t = type(tree)
    if t is tuple or t is list:
        items = [_substitute(x, routed) for x in tree]
        if all(a is b for a, b in zip(items, tree)):
            return tree
        return tuple(items) if t is tuple else items
    if t is dict:
        items = {k: _substitute(x, routed) for k, x in tree.items()}
        if all(items[k] is x for k, x in tree.items()):
            return tree
        return items
    return tree


def _route(tree, fn):
    """(`tree` with its grad-requiring tensors passed through `fn(*tensors)`, whether any was)."""
    found: list = []
    if _grad_tensors(tree, found):
        if not found:
            return tree, False
        return _substitute(tree, iter(fn(*found))), True
    flat, spec = tree_flatten(tree)
    idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return tree, False
    for i, x in zip(idx, fn(*[flat[i] for i in idx]), strict=True):
        flat[i] = x
    return tree_unflatten(flat, spec), True


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
            (args, kwargs), grad_in = _route((args, kwargs), lambda *xs: _enter(eng, unit, *xs))
            if not grad_in and not unit.trainable():
                return self.orig(*args, **kwargs)     # nothing here needs these weights in backward
            if unit.checkpointed or not eng.saved_views_as_handles:
                out = self.orig(*args, **kwargs)      # checkpoint's recompute re-enters this wrapper
            else:
                with eng.saved_tensors.installed():
                    out = self.orig(*args, **kwargs)
            out, grad_out = _route(out, lambda *xs: _leave(eng, unit, not grad_in, *xs))
            if grad_out:
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
