"""The per-block hook of weight streaming: the forward that replaces a streamed module's own, and
the one backward boundary it leaves on the call's outputs, which tells the schedule
(memory/streaming.py) when the unit's weights are needed again.

A unit is *held* while its weights are in use: during its forward, and in backward from the moment
the first of its output nodes is about to run until the boundary of an earlier call fires (or
backward ends).

Why one boundary per call is enough: autograd creates nodes with increasing sequence numbers and,
on one device's ready queue, always runs the ready node with the highest one. So when a node runs,
every node reachable in this backward with a higher sequence number has already run: the backward
visits a call's nodes strictly after those of every later call. The boundary of call k (a pre-hook
on its output nodes, the last nodes the call created) therefore fires after the backward of every
later call is complete and before any node of call k that reads a weight: it releases the holds
taken since (their backward is done) and takes call k's. An output that is a view (a slice, a
reshape) of a tensor the call made is hooked at that tensor's node, so a single block's two
outputs, slices of one tensor, need one pre-hook: the views' own nodes read no weight.

The earlier design needed two identity autograd Functions per call (one on the outputs to take the
hold, one on the inputs to drop it): each is a Python node of its own, created in forward and run in
backward, and the two were most of the engine's CPU time per block on a small model
(bench/engine_overhead.py, docs/benchmarks.md). The first call whose
outputs need a gradient has no earlier boundary to release it: the end of backward does (an engine
callback), as FSDP2 does for the same reason.

A node pre-hook needs the call's own output nodes. Where an output needing a gradient has none made
by the call (a leaf, or an input passed through unchanged), an identity autograd Function on the
outputs carries the same boundary instead; so it does under functorch transforms.

Frozen weights are saved by autograd as themselves and read from the slot in backward, after the
boundary took the hold and checked once that the unit is resident; trained weights without
checkpointing go through the saved-tensor hooks (memory/saved_tensors.py). With checkpointing, the
recompute re-enters this forward, which re-acquires the unit; checkpointing therefore wraps
*outside* streaming (see engine.py for the full order).

Under no_grad (sampling) the unit is only held around the call. A grad-enabled call in forward-only
mode is refused rather than silently losing the streamed blocks' gradients.

The ordering above holds on one device's ready queue, which one thread runs. Two cheap guards keep
it so: an output needing a gradient on another device than the engine's is refused (its nodes would
run on that device's queue and thread, out of the one order), and every boundary of one backward
must fire on the thread the first one fired on.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .streaming_units import StreamedUnit


_next_sequence_nr = torch.autograd._get_sequence_nr     # the sequence number the next node will get


class Boundary:
    """The backward boundary of one streamed call: fired once per backward, by the first of the
    call's output nodes to run (or by _Routed), it hands the schedule the unit to hold."""

    __slots__ = ("engine", "unit", "epoch")

    def __init__(self, engine, unit: StreamedUnit):
        self.engine, self.unit = engine, unit
        self.epoch = -1                               # the backward it last fired in (engine.backward_epoch)

    def __call__(self, grad_outputs):                # a node pre-hook: None leaves the gradients as they are
        eng = self.engine
        here = threading.get_ident()
        if not eng.callback_queued:                   # this backward's first boundary
            eng.boundary_thread = here
        elif getattr(eng, "boundary_thread", here) != here:
            raise RuntimeError(f"streamed {self.unit.name}: its backward boundary ran on another thread than this "
                               f"backward's first boundary: the nodes of one step are on more than one device "
                               f"queue, and the streaming order (memory/streamed_forward.py) does not hold")
        eng.backward_boundary(self)


class _Routed(torch.autograd.Function):
    """Identity on a call's outputs that carries its boundary, where the outputs have no node of the
    call's own to hook (module docstring)."""

    @staticmethod
    def forward(ctx, boundary, *xs):
        ctx.boundary = boundary
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.boundary(grads)
        return (None, *grads)


# Leaf types a block's arguments and outputs commonly carry besides tensors: pytree treats them as
# leaves too. Any other type (a namedtuple, an OrderedDict, a registered pytree node, an unknown
# object) sends the whole walk to torch's pytree, so the tensors found are always pytree's.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, torch.dtype, torch.device})


def _grad_tensors(tree, found: list) -> bool:
    """Append the grad-requiring tensors of `tree` (tuples, lists, dicts, tensors and atoms) to
    `found`, in pytree's order; False if `tree` holds another type (then nothing is decided here).

    Why not tree_flatten: it is the largest part of the per-block cost of the wrapper on a small
    model (a spec object per container, a namedtuple check per node), and runs on every streamed
    call's arguments and outputs."""
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


def _grad_leaves(tree) -> list:
    """The grad-requiring tensors of `tree`, in pytree's order."""
    found: list = []
    if _grad_tensors(tree, found):
        return found
    flat, _ = tree_flatten(tree)
    return [x for x in flat if isinstance(x, torch.Tensor) and x.requires_grad]


# Autograd nodes of ops that only select or reshape: one input, nothing saved but sizes, so no
# weight is read in their backward. An output reached through them from a node the call made is
# hooked at that node: a single block's two outputs (its text and image rows, slices of one tensor)
# then need one pre-hook, not two. Their own nodes run before the hook fires, which is harmless.
_VIEW_NODES = frozenset({"SliceBackward0", "SelectBackward0", "ViewBackward0", "UnsafeViewBackward0",
                         "ReshapeAliasBackward0", "TransposeBackward0", "PermuteBackward0", "SplitBackward0",
                         "SplitWithSizesBackward0", "UnsqueezeBackward0", "SqueezeBackward0",
                         "SqueezeBackward1", "AliasBackward0"})


def _made_by_call(fn, start: int) -> bool:
    """Whether autograd node `fn` was created by the call that began at sequence number `start`
    (a leaf's AccumulateGrad has the largest sequence number of all, and is no call's)."""
    return fn is not None and fn._sequence_nr() >= start and type(fn).__name__ != "AccumulateGrad"


def _own_node(fn, start: int):
    """The node to hook for an output whose node `fn` the call made: `fn`, or the node of the call's
    that the output is a view of (through _VIEW_NODES only)."""
    while type(fn).__name__ in _VIEW_NODES:
        nxt = fn.next_functions
        if len(nxt) != 1 or not _made_by_call(nxt[0][0], start):
            return fn
        fn = nxt[0][0]
    return fn


def _mark_boundary(out, boundary: Boundary, start: int):
    """(`out`, whether backward will need the call's weights): `boundary` put on the call's output
    nodes as a pre-hook, or on an identity Function over `out`'s grad-requiring tensors where one
    of them has no node made by the call (made before sequence number `start`, or a leaf)."""
    found = _grad_leaves(out)
    if not found:
        return out, False
    _same_device(found, boundary)
    if torch._C._are_functorch_transforms_active():
        return _route(out, boundary)
    nodes: list = []
    for t in found:
        if not _made_by_call(t.grad_fn, start):
            return _route(out, boundary)
        fn = _own_node(t.grad_fn, start)
        if not any(fn is n for n in nodes):
            nodes.append(fn)
    for fn in nodes:
        fn.register_prehook(boundary)
    return out, True


def _same_device(found: list, boundary: Boundary) -> None:
    """Refuse a grad-requiring output off the engine's device (module docstring: one device queue)."""
    device = boundary.engine.backend.device
    for t in found:
        d = t.device
        if d.type != device.type or (device.index is not None and d.index is not None and d.index != device.index):
            raise RuntimeError(f"streamed {boundary.unit.name} returned a tensor needing a gradient on {d}, while "
                               f"the memory engine streams to {device}: its backward would run on another device's "
                               f"queue, out of the order weight streaming relies on; keep the module's outputs "
                               f"on {device}")


def _route(tree, boundary: Boundary):
    """(`tree` with its grad-requiring tensors passed through _Routed, whether any was)."""
    flat, spec = tree_flatten(tree)
    idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return tree, False
    for i, x in zip(idx, _Routed.apply(boundary, *[flat[i] for i in idx]), strict=True):
        flat[i] = x
    return tree_unflatten(flat, spec), True


class StreamedForward:
    """Instance-level forward of a streamed module: hold the unit around the original forward and
    leave the backward boundary on its outputs. `engine`: the module's StreamingEngine
    (memory/streaming.py)."""

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
            if not unit.trainable() and not _grad_leaves((args, kwargs)):
                return self.orig(*args, **kwargs)     # nothing here needs these weights in backward
            start = _next_sequence_nr()
            if unit.checkpointed or not eng.saved_views_as_handles:
                out = self.orig(*args, **kwargs)      # checkpoint's recompute re-enters this wrapper
            else:
                with eng.saved_tensors.installed():
                    out = self.orig(*args, **kwargs)
            out, tracked = _mark_boundary(out, Boundary(eng, unit), start)
            if tracked:
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
