"""Activation checkpointing per block, applied from outside, optionally with offloaded block inputs.

What it trades: compute for memory. A checkpointed block keeps only its inputs through the forward
and recomputes its internals in backward (about one extra forward of the blocks per step).

How it works:
- Each block's forward is replaced, on the instance, by a wrapper that calls torch's
  non-reentrant `checkpoint`. The diffusers model is untouched and must not have its own
  `gradient_checkpointing` switched on. Blocks are called with keyword arguments, and checkpoint
  would keep keyword tensors alive by closure; the wrapper therefore passes every tensor
  positionally, so checkpoint *saves* them as autograd saved tensors, and the offload hooks below
  can see them.
- Wrapping outside the streaming wrapper (engine.py fixes that order) makes the recompute re-enter
  streaming, which fetches the block's weights back before they are used.
- `offload=True`: the block inputs that checkpoint saves go to host memory (pinned on CUDA) through
  saved-tensor hooks around the checkpoint call, stacked in the offloader's host slabs
  (host_buffers.HostSlabs: 64 MiB slabs allocated and pinned once, an input's bytes at the next
  512-byte boundary of the stack, given back in backward order), not one power-of-two block of
  torch's caching host allocator per input (a 0.31 GiB Wan input would reserve 0.5 GiB). The
  device->host copy runs on a side stream after that stream waits for the compute stream; the
  device tensor is kept from being reused until then with `record_stream`. In backward, an identity autograd Function on the block's outputs starts the
  host->device copy of this block's inputs and of the previous block's (the next to be recomputed),
  so they arrive before the recompute asks for them. Only inputs that require a gradient (the
  residual stream) are offloaded; shared, gradient-free inputs such as rotary embeddings and the
  time embedding stay on the device, so they are not copied once per block. A block none of whose
  inputs would move (the first block of a LoRA run, small inputs) runs without the hooks.

kohya's `cpu_offload_checkpointing` copies synchronously from pageable memory and refuses to run
with block swap; here both compose.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from ..spec import ModelSpec
from .host_buffers import HostSlabs

MIN_OFFLOAD_BYTES = 64 * 1024     # smaller saved inputs stay on the device: not worth a copy


class _HostTensor:
    """One offloaded block input: its bytes in the offloader's host slabs (host_buffers.HostSlabs),
    and the device copy while it is being restored. Its extent goes back to the slabs when it dies
    (autograd drops it after the block's backward)."""

    def __init__(self, offloader: ActivationOffloader, t: torch.Tensor):
        self.off = offloader
        self.device, self.shape, self.dtype = t.device, t.shape, t.dtype
        self.nbytes = t.numel() * t.element_size()
        slabs = offloader.slabs_for(t.device)
        self.slabs = slabs
        self.ext = slabs.take(self.nbytes)
        src = _bytes_of(t)
        if t.device.type == "cuda":
            side = offloader.side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))   # t is produced on the compute stream
            with torch.cuda.stream(side):
                for off, piece in slabs.pieces(self.ext):
                    piece.copy_(src[off:off + piece.numel()], non_blocking=True)
            t.record_stream(side)                                  # keep t's memory until the copy is done
            if not t.is_contiguous():
                src.record_stream(side)                            # and the contiguous copy's
        else:
            for off, piece in slabs.pieces(self.ext):
                piece.copy_(src[off:off + piece.numel()])
        self.dev: torch.Tensor | None = None
        self.ready = None
        offloader.stats["bytes_d2h"] += self.nbytes
        offloader.stats["tensors"] += 1

    @property
    def host(self) -> torch.Tensor:
        """The first host bytes of this input (a view of a slab: where it waits)."""
        for _, piece in self.slabs.pieces(self.ext):
            return piece
        return torch.empty(0, dtype=torch.uint8, device=self.slabs.device)

    def prefetch(self) -> None:
        if self.dev is not None:
            return
        self.off.stats["bytes_h2d"] += self.nbytes
        # a fresh tensor on the compute device: the slab's bytes are reused once this input dies
        dev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dst = _bytes_of(dev)
        if self.device.type != "cuda":        # a synchronous copy (CPU, or the simulated device)
            for off, piece in self.slabs.pieces(self.ext):
                dst[off:off + piece.numel()].copy_(piece)
            self.dev = dev
            return
        compute = torch.cuda.current_stream(self.device)
        side = self.off.side_stream(self.device)
        side.wait_stream(compute)       # dev's memory may have been in use by earlier compute kernels
        with torch.cuda.stream(side):   # same side stream as the D2H copy: ordered after it
            for off, piece in self.slabs.pieces(self.ext):
                dst[off:off + piece.numel()].copy_(piece, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(side)
        # A prefetched input that is never used (backward interrupted, e.g. out of memory) is freed
        # without compute having waited for its copy: keep its memory until the copy is done.
        dev.record_stream(side)
        self.dev = dev

    def get(self) -> torch.Tensor:
        self.prefetch()
        t, self.dev = self.dev, None
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None
        return t

    def __del__(self):
        ext = getattr(self, "ext", None)
        if ext is not None:
            self.ext = None
            self.slabs.give_back(ext)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a non-contiguous one is copied first)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


@dataclass(eq=False)
class _Group:
    """The offloaded inputs of one checkpointed block call; linked to the previous call's group."""

    handles: list[_HostTensor] = field(default_factory=list)
    prev: object = None          # weakref to the previous group in forward order

    def prefetch(self) -> None:
        for h in self.handles:
            h.prefetch()


class ActivationOffloader:
    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES, host_device: torch.device | str = "cpu") -> None:
        self.min_bytes = min_bytes
        self.host_device = torch.device(host_device)    # where offloaded inputs wait (another device
        # than the compute device also off CUDA: the simulated device, memory/simulated.py)
        self.stats = {"bytes_d2h": 0, "bytes_h2d": 0, "tensors": 0}
        self._streams: dict = {}
        self._slabs: dict = {}
        self._last: weakref.ref | None = None

    def slabs_for(self, device: torch.device) -> HostSlabs:
        """The host slabs of inputs computed on `device` (pinned for a CUDA device, host in RAM)."""
        s = self._slabs.get(device)
        if s is None:
            pin = device.type == "cuda" and self.host_device.type == "cpu"
            s = self._slabs[device] = HostSlabs(self.host_device, pin=pin,
                                                cuda_device=device if device.type == "cuda" else None)
        return s

    def host_bytes(self) -> int:
        """Host bytes the offloaded inputs hold (their slabs, kept for the next steps)."""
        return sum(s.reserved for s in self._slabs.values())

    def side_stream(self, device: torch.device):
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def new_group(self) -> _Group:
        g = _Group(prev=self._last)
        self._last = weakref.ref(g)
        return g

    def offloads(self, t: torch.Tensor) -> bool:
        """Whether a saved `t` goes to the host: it needs a gradient (the residual stream; shared
        gradient-free inputs stay), is floating point and at least min_bytes."""
        return t.requires_grad and t.is_floating_point() and t.numel() * t.element_size() >= self.min_bytes

    def offloads_any(self, inputs: list[torch.Tensor]) -> bool:
        """Whether the hooks around a checkpoint of `inputs` could move anything: checkpoint saves
        its inputs under them (everything inside goes to checkpoint's own hooks). With
        min_bytes <= 0, some torch versions also save a 0-byte tensor that needs a gradient, which
        pack would move: then always."""
        return self.min_bytes <= 0 or any(self.offloads(t) for t in inputs)

    def hooks(self, group: _Group):
        def pack(t: torch.Tensor):
            if not self.offloads(t):
                return t
            h = _HostTensor(self, t)
            group.handles.append(h)
            return h

        def unpack(h):
            return h.get() if isinstance(h, _HostTensor) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def report(self) -> dict:
        out = {f"offload_{k}": v for k, v in self.stats.items()}
        self.stats = {k: 0 for k in self.stats}
        return out


class _PrefetchInputs(torch.autograd.Function):
    """Identity on a checkpointed block's outputs; in backward it starts restoring the inputs of
    this block and of the one before it, ahead of their recomputes."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        # the group is let go here: its inputs then live only as long as autograd keeps them (until
        # their block's backward is done), so their slab extents go back in backward order, not
        # when the whole graph is dropped
        group, ctx.group = ctx.group, None
        if group is None:                 # a second backward through a retained graph
            return (None, *grads)
        group.prefetch()
        prev = group.prev() if group.prev is not None else None
        if prev is not None:
            prev.prefetch()
        return (None, *grads)


class _CheckpointedForward:
    def __init__(self, module: nn.Module, offloader: ActivationOffloader | None):
        self.prev = module.__dict__.get("forward")
        self.orig = module.forward
        self.offloader = offloader

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():                # sampling: nothing to save, nothing to recompute
            return self.orig(*args, **kwargs)
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        template = [None if isinstance(x, torch.Tensor) else x for x in flat]   # no tensor refs kept
        tensors = [flat[i] for i in idx]
        del flat, args, kwargs
        orig = self.orig

        def run(*ts):
            f = list(template)
            for i, t in zip(idx, ts, strict=True):
                f[i] = t
            a, k = tree_unflatten(f, spec)
            return orig(*a, **k)

        if self.offloader is None:
            return checkpoint(run, *tensors, use_reentrant=False)
        group = self.offloader.new_group()
        if self.offloader.offloads_any(tensors):
            with self.offloader.hooks(group):
                out = checkpoint(run, *tensors, use_reentrant=False)
        else:                                          # every input stays: no hook per saved input
            out = checkpoint(run, *tensors, use_reentrant=False)
        del tensors
        oflat, ospec = tree_flatten(out)
        grad_out = [i for i, x in enumerate(oflat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if grad_out and group.handles:
            routed = _PrefetchInputs.apply(group, *[oflat[i] for i in grad_out])
            for i, x in zip(grad_out, routed, strict=True):
                oflat[i] = x
            out = tree_unflatten(oflat, ospec)
        return out


@dataclass
class CheckpointHandle:
    wrapped: list[tuple[nn.Module, _CheckpointedForward]]
    offloader: ActivationOffloader | None
    total_blocks: int

    def describe(self) -> str:
        how = "inputs offloaded to host memory (pinned on CUDA)" if self.offloader else "inputs kept on device"
        return f"checkpointing: {len(self.wrapped)}/{self.total_blocks} blocks, non-reentrant, {how}"

    def report(self) -> dict:
        return self.offloader.report() if self.offloader else {}


def apply_checkpointing(model: nn.Module, spec: ModelSpec, *, offload: bool = False,
                        blocks: list[str] | None = None, offload_min_bytes: int = MIN_OFFLOAD_BYTES,
                        host_device: torch.device | str = "cpu") -> CheckpointHandle:
    """Checkpoint every block of the spec (or the named ones). Apply after streaming.

    `offload_min_bytes`: saved inputs smaller than this stay on the device.
    `host_device`: where offloaded inputs are kept (host RAM).
    """
    if getattr(model, "gradient_checkpointing", False):
        raise ValueError(
            "memory.checkpointing: the model has diffusers' own gradient checkpointing switched on; "
            "leantune checkpoints blocks itself, so do not call enable_gradient_checkpointing()")
    all_blocks = spec.blocks(model)
    chosen = all_blocks if blocks is None else [(n, b) for n, b in all_blocks if n in set(blocks)]
    offloader = ActivationOffloader(offload_min_bytes, host_device) if offload else None
    wrapped = []
    for _, block in chosen:
        w = _CheckpointedForward(block, offloader)
        block.forward = w
        wrapped.append((block, w))
    return CheckpointHandle(wrapped, offloader, len(all_blocks))


def remove_checkpointing(handle: CheckpointHandle) -> None:
    for m, w in handle.wrapped:
        if m.__dict__.get("forward") is not w:
            raise RuntimeError(f"checkpointing: {type(m).__name__}.forward was replaced after checkpointing was "
                               f"applied; remove techniques in reverse order")
        if w.prev is None:
            del m.forward
        else:
            m.forward = w.prev
    handle.wrapped.clear()
