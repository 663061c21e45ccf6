"""Run a module on a device with its repeated blocks resident only during their own forward.

A text encoder runs once per request or per caching pass, so it does not need the training
engine's ring of slots: `blockwise_offload` keeps everything outside the blocks (the embedding,
the final norm) on the device and brings one block at a time, dropping it after its forward. That
bounds the device at the resident parts, the block running and the next one arriving, plus
activations (T5-XXL for sampling; Qwen-Image's 7B Qwen2.5-VL in the caching phase as well).

`blockwise_from_source` does the same for a model that is not in host RAM at all (FLUX.2-dev's 24B
Mistral is 48 GB in bf16, more than a 64 GB machine can hold beside everything else): its
parameters are meta placeholders and every tensor is read from the checkpoint files just before
it is used, so host RAM holds the block being read and the device the block running and the next.

The copies (issue 40, finding 6). Block i+1 is brought while block i computes: on a worker thread,
into a buffer of its own on the device's copy stream, and compute waits on the event recorded
after the copy, never on a synchronize. A host block (pageable: the encoder as `from_pretrained`
loaded it) goes through memory/host_buffers.py's `Stager`: its tensors gathered into two pinned
staging buffers, each copied asynchronously, into one flat device buffer the block's weights are
views of. A block from the files is read by the worker (reads, dequantisation) under the copy
stream. The device buffer is allocated on the copy stream and recorded on the compute stream when
installed, so the allocator reuses it only after the compute that reads it. On CPU the same
workers, staging and buffers run with no streams and no events.

Inside a lock-step pass (memory/lockstep.py: several batches of captions run layer-major) a block
is installed when the pass moves to it and kept until the pass moves on, so every batch of the
pass runs through it on one copy; the context is entered once per pass (`lockstep.shared`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext

import torch
from torch import nn

from . import lockstep
from .copy_streams import CopyBackend
from .host_buffers import STAGING_CHUNK, Stager
from .streaming_stats import StreamStats

ALIGN = 256           # bytes between tensors in a block's flat device buffer (any dtype's view is aligned)


def _state_bytes(args, kwargs) -> int:
    """Bytes of a block's hidden states (its first floating tensor argument), for lockstep's bound."""
    for t in (*args, kwargs.get("hidden_states")):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.numel() * t.element_size()
    return 0


class BlockStream:
    """The blocks of one blockwise context: which one is installed, the one arriving next.

    `fetch(i)` starts bringing block i's tensors and returns a Future of ({identity: tensor on the
    device}, the CUDA event after the copy or None); `install(i, tensors)` points the block's
    modules at them, `evict(i)` at empty placeholders. `loads` counts the fetches per block (what
    the pass saves: one per block per pass instead of one per batch)."""

    def __init__(self, blocks: nn.ModuleList, backend: CopyBackend,
                 fetch: Callable[[int], Future], install: Callable[[int, dict], None],
                 evict: Callable[[int], None]):
        self.blocks, self.backend = list(blocks), backend
        self._fetch, self._install, self._evict = fetch, install, evict
        self.pending: dict[int, Future] = {}
        self.held: int | None = None
        self.loads: Counter = Counter()
        self.pass_ = None                 # the lock-step pass driving this stream, if any

    def __len__(self) -> int:
        return len(self.blocks)

    def prefetch(self, i: int) -> None:
        if 0 <= i < len(self.blocks) and i not in self.pending and i != self.held:
            self.loads[i] += 1
            self.pending[i] = self._fetch(i)

    def acquire(self, i: int) -> None:
        """Block i on the device (the prefetched copy, else fetched now), then i+1 on its way."""
        if self.held == i:
            return
        if self.held is not None:
            self.release(self.held)
        if i not in self.pending:
            self.prefetch(i)
        tensors, done = self.pending.pop(i).result()
        be = self.backend
        if be.cuda:
            compute = be.compute_stream()
            if done is not None:
                compute.wait_event(done)
            for t in tensors.values():
                t.record_stream(compute)
        self._install(i, tensors)
        self.held = i
        self.prefetch(i + 1)

    def release(self, i: int) -> None:
        self._evict(i)
        if self.held == i:
            self.held = None

    advance = acquire                      # what a lock-step pass calls to move to block i

    def hooks(self, blocks: nn.ModuleList) -> list:
        """Forward hooks that stream the blocks: outside a pass, each block fetched (or taken from
        the prefetch) before its forward and dropped after it, the next one then on its way;
        inside the pass that owns this stream, a lane waits for the pass to install the block."""
        index = {id(b): k for k, b in enumerate(blocks)}

        def pre(block, args, kwargs):
            i = index[id(block)]
            if not lockstep.wait_block(self, i, _state_bytes(args, kwargs)):
                self.acquire(i)

        def post(block, args, kwargs, out):
            if self.pass_ is not None and lockstep.in_pass() is self.pass_:
                return
            i = index[id(block)]
            self.release(i)
            self.prefetch(i + 1)

        handles = []
        for block in blocks:
            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
        return handles

    def close(self) -> None:
        """Wait for copies still in flight (a prefetched block never used) and drop them."""
        for fut in self.pending.values():
            fut.exception()
        self.pending.clear()


def _copy_stream(be: CopyBackend):
    """The worker's context: the copy stream on CUDA, nothing on CPU."""
    if not be.cuda:
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.cuda.device(be.device))
    stack.enter_context(torch.cuda.stream(be.copy_stream))
    return stack


def blockwise_offload(model: nn.Module, blocks: nn.ModuleList, device):
    """Run `model` on `device` with its `blocks` resident only during their own forward (inside a
    lock-step pass: while the pass is at that block).

    Everything outside `blocks` moves to `device` for the duration. Each block's host tensors are
    kept aside and copied to `device` through pinned staging ahead of the block's forward; a
    forward hook swaps in empty placeholders again. On exit every tensor is back on the host, as it
    was. Entered once per pass inside a lock-step pass."""
    dev = torch.device(device)
    return lockstep.shared(("blockwise_offload", id(model), id(blocks), str(dev)),
                           lambda: _offload(model, blocks, dev))


@contextmanager
def _offload(model: nn.Module, blocks: nn.ModuleList, device: torch.device) -> Iterator[None]:
    in_blocks = {id(t) for b in blocks for t in list(b.parameters()) + list(b.buffers())}
    # Host copies of every tensor we touch, restored on exit: (owner module, attribute, host tensor,
    # is-parameter, identity). Tied weights (T5's shared embedding) appear twice with one identity.
    saved: list[tuple[nn.Module, str, torch.Tensor, bool, int]] = []
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                saved.append((mod, name, p.data, True, id(p)))
        for name, b in list(mod._buffers.items()):
            if b is not None:
                saved.append((mod, name, b, False, id(b)))

    def _set(mod: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
        if is_param:
            mod._parameters[name].data = value
        else:
            mod._buffers[name] = value

    block_slots: list[list[tuple[nn.Module, str, torch.Tensor, bool, int]]] = []
    layouts: list[tuple[list[tuple[int, torch.Tensor, int, int]], int]] = []   # ([(ident, bytes, offset, n)], total)
    for block in blocks:
        mods = {id(m) for m in block.modules()}
        slots = [s for s in saved if id(s[0]) in mods]
        block_slots.append(slots)
        layout, seen, off = [], set(), 0
        for _, _, host, _, ident in slots:
            if ident in seen:
                continue
            seen.add(ident)
            flat = host.detach().contiguous().reshape(-1).view(torch.uint8)   # the tensor's bytes
            layout.append((ident, flat, off, flat.numel()))
            off += -(-flat.numel() // ALIGN) * ALIGN
        layouts.append((layout, off))
    hosts = {s[4]: s[2] for s in saved}

    be = CopyBackend(device)
    largest = max((total for _, total in layouts), default=0)
    stager = Stager(be, StreamStats(), chunk=max(ALIGN, min(STAGING_CHUNK, largest)))

    def fetch(i: int) -> Future:
        layout, total = layouts[i]

        def fill(stage: torch.Tensor, off: int) -> None:
            # bytes [off, off + len(stage)) of the block's flat layout, gathered from its tensors
            end = off + stage.numel()
            for _, flat, start, n in layout:
                lo, hi = max(start, off), min(start + n, end)
                if lo < hi:
                    stage[lo - off:hi - off].copy_(flat[lo - start:hi - start])

        def job():
            with _copy_stream(be):
                dst = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
            done = stager._run(fill, total, dst, None)
            views = {}
            for ident, _, start, n in layout:
                host = hosts[ident]
                views[ident] = dst[start:start + n].view(host.dtype).view(host.shape)
            return views, done

        return stager.pool.submit(job)

    def install(i: int, tensors: dict) -> None:
        for mod, name, _, is_param, ident in block_slots[i]:
            _set(mod, name, tensors[ident], is_param)

    def evict(i: int) -> None:
        for mod, name, host, is_param, _ in block_slots[i]:
            _set(mod, name, torch.empty(0, dtype=host.dtype, device=device), is_param)

    stream = BlockStream(blocks, be, fetch, install, evict)
    handles = []
    try:
        # Outside the blocks: resident on the device (tied weights are moved once: same tensor id).
        moved: dict[int, torch.Tensor] = {}
        for mod, name, host, is_param, ident in saved:
            if ident in in_blocks:
                continue
            if ident not in moved:
                moved[ident] = host.to(device)
            _set(mod, name, moved[ident], is_param)
        for k in range(len(blocks)):
            evict(k)
        handles = stream.hooks(blocks)
        with lockstep.owned_by_pass(stream):
            stream.prefetch(0)
            yield stream
    finally:
        for h in handles:
            h.remove()
        stream.close()
        stager.close()
        for mod, name, host, is_param, _ in saved:
            _set(mod, name, host, is_param)


def blockwise_from_source(model: nn.Module, blocks: nn.ModuleList, device,
                          read: Callable[[str, torch.Tensor], torch.Tensor]):
    """Run `model`, whose weights live only in their files, on `device` one block at a time.

    `model` was built with its parameters on the meta device (no host copy at all; buffers that
    `__init__` computes, such as a rotary table, are real). `read(name, placeholder)` returns the
    tensor of the parameter or buffer `name` (its qualified name in `model`) on `device`: the
    caller reads it from the checkpoint files, so host RAM holds at most the block being read.
    Everything outside `blocks` is read once on entry and stays on `device`; block i+1 is read on a
    worker thread while block i runs, and a block's tensors are dropped after its forward (inside a
    lock-step pass: when the pass moves on), so the device holds two blocks at a time and the host
    none. Real buffers move to `device` for the duration. On exit the model is back as it was (meta
    parameters), holding nothing. Entered once per pass inside a lock-step pass.
    """
    dev = torch.device(device)
    return lockstep.shared(("blockwise_from_source", id(model), id(blocks), str(dev)),
                           lambda: _from_source(model, blocks, dev, read))


@contextmanager
def _from_source(model: nn.Module, blocks: nn.ModuleList, device: torch.device,
                 read: Callable[[str, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    in_blocks = {id(t) for b in blocks for t in list(b.parameters()) + list(b.buffers())}
    # (owner module, attribute, original tensor, is-parameter, identity, qualified name); a tied
    # tensor appears under each owner with one identity and is read once.
    saved: list[tuple[nn.Module, str, torch.Tensor, bool, int, str]] = []
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is not None:
                saved.append((mod, name, p, True, id(p), f"{prefix}.{name}" if prefix else name))
        for name, b in list(mod._buffers.items()):
            if b is not None:
                saved.append((mod, name, b, False, id(b), f"{prefix}.{name}" if prefix else name))
    first_name: dict[int, str] = {}
    for *_, ident, qual in saved:
        first_name.setdefault(ident, qual)

    def _set(mod: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
        # a meta Parameter cannot take real data (set_data refuses): a new Parameter per tensor,
        # shared by the owners of a tied tensor; the original objects come back on exit
        if is_param and not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        (mod._parameters if is_param else mod._buffers)[name] = value

    def get(tensor: torch.Tensor, ident: int) -> torch.Tensor:
        if tensor.device.type == "meta":
            got = read(first_name[ident], tensor)
            if tuple(got.shape) != tuple(tensor.shape):
                raise ValueError(f"{first_name[ident]}: the source gave shape {tuple(got.shape)}, the model "
                                 f"expects {tuple(tensor.shape)}")
            return nn.Parameter(got, requires_grad=False) if isinstance(tensor, nn.Parameter) else got
        return tensor.to(device)

    block_slots: list[list] = []
    for block in blocks:
        mods = {id(m) for m in block.modules()}
        block_slots.append([s for s in saved if id(s[0]) in mods])

    be = CopyBackend(device)
    reader = ThreadPoolExecutor(1, thread_name_prefix="leantune-read")

    def fetch(i: int) -> Future:
        def job():
            fetched: dict[int, torch.Tensor] = {}
            with _copy_stream(be):
                for _, _, orig, _, ident, _ in block_slots[i]:
                    if ident not in fetched:
                        fetched[ident] = get(orig, ident)
                done = be.event()
                if done is not None:
                    done.record(be.copy_stream)
            return fetched, done
        return reader.submit(job)

    def install(i: int, tensors: dict) -> None:
        for mod, name, _, is_param, ident, _ in block_slots[i]:
            _set(mod, name, tensors[ident], is_param)

    def evict(i: int) -> None:
        for mod, name, orig, is_param, _, _ in block_slots[i]:
            _set(mod, name, torch.empty(0, dtype=orig.dtype, device=device), is_param)

    stream = BlockStream(blocks, be, fetch, install, evict)
    handles = []
    try:
        resident: dict[int, torch.Tensor] = {}
        for mod, name, orig, is_param, ident, _ in saved:
            if ident in in_blocks:
                continue
            if ident not in resident:
                resident[ident] = get(orig, ident)
            _set(mod, name, resident[ident], is_param)
        del resident
        for k in range(len(blocks)):
            evict(k)
        handles = stream.hooks(blocks)
        with lockstep.owned_by_pass(stream):
            stream.prefetch(0)
            yield stream
    finally:
        for h in handles:
            h.remove()
        stream.close()
        reader.shutdown(wait=True)
        for mod, name, orig, is_param, _, _ in saved:
            (mod._parameters if is_param else mod._buffers)[name] = orig
