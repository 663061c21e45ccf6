"""Run several calls of one streamed model in lock step: every call through block i before block
i+1 is brought to the device, so a pass over N batches moves each block once, not N times.

Why: a text encoder streamed layer by layer (memory/blockwise.py, from host RAM or from its files)
used to be run once per batch of 8 captions, and each run moved every layer again: a caching pass
over 400 captions read a 24B encoder's files 50 times. Running the batches layer-major moves it
once.

How, without rewriting any model's forward. Each call (a family's whole `encode_prompts` for one
batch: tokenizer, model, post-processing) runs on a thread of its own, a *lane*; the lanes take
turns, one running at a time (a baton passed under one condition variable), so there is never
more than one thread issuing torch work and each call runs exactly the ops it runs alone: the
results are bit for bit those of the calls made one after another. A lane gives up the baton only
at a streamed block's forward pre-hook (`wait_block`), when it forks (`lanes`) or when it is done.
When no lane can go on, the pass moves to the block the waiting lanes want: the stream drops the
block it holds and installs the wanted one (prefetched while the previous one computed). Context
managers that place a model (blockwise streaming, a vision tower moved whole) are entered once
per pass through `shared` and left when the pass ends.

The bound. Between blocks each lane holds what its model's forward holds: the hidden states of
its batch (B, T, D), and, where the caller asks for every layer's output, one such tensor per
layer. A pass admits lanes at block 0 while its estimate, (blocks + 1) x the bytes of the lane's
hidden states as they enter block 0 (every layer's output kept: the worst case), summed over the
lanes admitted, stays within `state_budget` (the first lane is always admitted); the rest wait at
block 0 and go through in a later round, which moves every block again. `state_budget(device)`
gives half the device's free memory (CUDA), a quarter of the available host RAM (CPU). The caller
also bounds the lanes of one pass (data/cache.py: 128 captions), since a waiting lane holds its
embedded batch.

Outside a pass every helper here falls back to plain sequential calls.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch

READY, WAITING, JOINING, DONE = "ready", "waiting", "joining", "done"

_LANE: ContextVar["_Lane | None"] = ContextVar("leantune_lockstep_lane", default=None)


class _Aborted(BaseException):
    """Raised in the waiting lanes when another lane failed: unwinds them without running on."""


class _Lane:
    def __init__(self, fn: Callable[[], Any], parent: "_Lane | None", pass_: "Pass"):
        self.fn, self.parent, self.pass_ = fn, parent, pass_
        self.state = READY
        self.want: tuple[Any, int] | None = None     # (stream, block index) while WAITING
        self.state_bytes = 0                         # its hidden states as they entered block 0
        self.admitted = False                        # let past block 0 of the current round
        self.children = 0                            # forked lanes not done yet (JOINING)
        self.result: Any = None
        self.thread: threading.Thread | None = None


class Pass:
    """One lock-step pass: its lanes, the block each stream holds, the contexts entered for it."""

    def __init__(self, state_budget: int | None = None):
        self.state_budget = state_budget
        self.cond = threading.Condition()
        self.lanes: list[_Lane] = []
        self.running: _Lane | None = None
        self.error: BaseException | None = None
        self.stack = ExitStack()
        self.shared: dict[Any, Any] = {}
        self.entering = False
        self.transitions: list[tuple[Any, int]] = []     # (stream, block) moves, in order
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()

    # -- lanes --------------------------------------------------------------------------------
    def _start(self, fn: Callable[[], Any], parent: _Lane | None) -> _Lane:
        lane = _Lane(fn, parent, self)
        ctx = contextvars.copy_context()      # the caller's context vars (a RAM budget, ...)
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def body():
            _LANE.set(lane)
            with self.cond:
                self._wait_turn(lane, start=True)
            try:
                if lane.state != DONE:
                    # grad mode, inference mode and the current GPU are per thread: the caller's
                    with torch.inference_mode(self.inference) if self.inference else nullcontext(), \
                            torch.set_grad_enabled(self.grad), \
                            torch.cuda.device(cuda) if cuda is not None else nullcontext():
                        lane.result = lane.fn()
            except _Aborted:
                pass
            except BaseException as e:          # noqa: BLE001 - handed to the caller
                with self.cond:
                    if self.error is None:
                        self.error = e
                    self.cond.notify_all()
            finally:
                with self.cond:
                    lane.state = DONE
                    if lane.parent is not None:
                        lane.parent.children -= 1
                        if lane.parent.children == 0 and lane.parent.state == JOINING:
                            lane.parent.state = READY
                    if self.running is lane:
                        self._pass_on(lane)

        lane.thread = threading.Thread(target=ctx.run, args=(body,), name="leantune-lane", daemon=True)
        self.lanes.append(lane)
        return lane

    def _wait_turn(self, lane: _Lane, start: bool = False) -> None:
        """Block until `lane` holds the baton (cond held); raise _Aborted when the pass failed."""
        while self.running is not lane and self.error is None:
            self.cond.wait()
        if self.error is not None and not start:
            raise _Aborted()
        if self.error is not None:
            lane.state = DONE

    def _pass_on(self, lane: _Lane) -> None:
        """`lane` gives up the baton (cond held): to the next lane that can run, moving a stream
        to the next block when none can."""
        nxt = None
        if self.error is None:
            try:
                nxt = self._runnable(after=lane)
                if nxt is None:
                    nxt = self._transition()
            except BaseException as e:          # noqa: BLE001 - a failed copy or read stops the pass
                self.error, nxt = e, None
        self.running = nxt
        self.cond.notify_all()

    def _can_run(self, lane: _Lane) -> bool:
        if lane.state == READY:
            return True
        if lane.state != WAITING:
            return False
        stream, index = lane.want
        return stream.held == index and (index > 0 or lane.admitted)

    def _runnable(self, after: _Lane | None) -> _Lane | None:
        """The next lane after `after` in pass order that can run now (round robin)."""
        order = self.lanes
        k = order.index(after) + 1 if after in order else 0
        for lane in order[k:] + order[:k]:
            if self._can_run(lane):
                return lane
        return None

    def _transition(self) -> _Lane | None:
        """No lane can run: move a stream to the block the waiting lanes want. Lanes past block 0
        of their round go first (the round finishes before a new one starts)."""
        waiting = [lane for lane in self.lanes if lane.state == WAITING]
        if not waiting:
            return None
        in_round = [lane for lane in waiting if lane.admitted]
        first = (in_round or waiting)[0]
        stream, index = first.want
        stream.advance(index)
        self.transitions.append((stream, index))
        if index == 0:
            self._admit(stream, waiting)
        return self._runnable(after=None)

    def _admit(self, stream, waiting: list[_Lane]) -> None:
        """A new round at block 0 of `stream`: admit waiting lanes in order within the budget."""
        total = 0
        for lane in waiting:
            if lane.want != (stream, 0):
                continue
            cost = lane.state_bytes * (len(stream) + 1)
            if total and self.state_budget is not None and total + cost > self.state_budget:
                break
            lane.admitted = True
            total += cost

    # -- what lanes call ----------------------------------------------------------------------
    def wait_block(self, lane: _Lane, stream, index: int, state_bytes: int) -> None:
        """Called by a lane at block `index` of `stream`: returns once that block is on the device
        and it is this lane's turn."""
        with self.cond:
            if index == 0:
                lane.admitted, lane.state_bytes = False, state_bytes
            lane.state, lane.want = WAITING, (stream, index)
            self._pass_on(lane)                 # round robin: back to this lane when it is the only one
            self._wait_turn(lane)
            lane.state, lane.want = READY, None

    def fork(self, lane: _Lane, fns: list[Callable[[], Any]]) -> list[Any]:
        with self.cond:
            children = [self._start(fn, lane) for fn in fns]
            lane.children += len(children)
            lane.state = JOINING
            for child in children:
                child.thread.start()
            self._pass_on(lane)
            self._wait_turn(lane)
        return [child.result for child in children]

    def run(self, fns: list[Callable[[], Any]]) -> list[Any]:
        lanes = [self._start(fn, None) for fn in fns]
        with self.cond:
            for lane in lanes:
                lane.thread.start()
            self.running = lanes[0] if lanes else None
            self.cond.notify_all()
        for lane in lanes:
            lane.thread.join()
        for lane in list(self.lanes):          # forked lanes end before their parent, but be sure
            lane.thread.join()
        if self.error is not None:
            raise self.error
        return [lane.result for lane in lanes]


def current_lane() -> tuple[Pass, _Lane] | tuple[None, None]:
    lane = _LANE.get()
    return (lane.pass_, lane) if lane is not None else (None, None)


def in_pass() -> Pass | None:
    """The pass the calling thread runs in, or None."""
    return current_lane()[0]


def run_pass(fns: list[Callable[[], Any]], state_budget: int | None = None,
             report: Callable[[list], None] | None = None) -> list[Any]:
    """Run `fns` as the lanes of one lock-step pass and return their results in order; the
    contexts the lanes entered through `shared` are left when all are done. Inside a pass, the
    calls become lanes of the current one (`lanes`). An exception in a lane stops the others at
    their next block and is raised here. `report(transitions)`: told the (stream, block) moves the
    pass made, in order, once it ends."""
    if in_pass() is not None:
        return lanes(fns)
    p = Pass(state_budget)
    try:
        return p.run(fns)
    finally:
        p.stack.close()
        if report is not None:
            report(p.transitions)


def lanes(fns: list[Callable[[], Any]]) -> list[Any]:
    """`[fn() for fn in fns]`; inside a pass each call is a lane of its own, so that calls made one
    after another by one lane (Qwen-Image-Edit encodes its prompts one by one) go through each
    block together."""
    p, lane = current_lane()
    if p is None:
        return [fn() for fn in fns]
    return p.fork(lane, fns)


def shared(key: Any, factory: Callable[[], Any]):
    """`factory()` (a context manager) outside a pass; inside one, entered by the first lane that
    asks with `key` and left when the pass ends, the others getting a no-op context."""
    p = in_pass()
    if p is None or p.entering:         # a shared context entering others: they are part of it
        return factory()
    if key not in p.shared:
        p.entering = True
        try:
            p.shared[key] = p.stack.enter_context(factory())
        finally:
            p.entering = False
    return nullcontext(p.shared[key])


def wait_block(stream, index: int, state_bytes: int) -> bool:
    """At block `index` of a pass-owned `stream`: wait for the block and this lane's turn. False
    when the calling thread is not in the pass that owns the stream (then the caller streams the
    block itself)."""
    p, lane = current_lane()
    if p is None or getattr(stream, "pass_", None) is not p:
        return False
    p.wait_block(lane, stream, index, state_bytes)
    return True


def state_budget(device) -> int:
    """Bytes a pass may give the lanes' hidden states between blocks: half the free memory of a
    CUDA device, a quarter of the host RAM available otherwise."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    from ..host import host_ram

    return host_ram()[1] // 4


@contextmanager
def owned_by_pass(stream) -> Iterator[None]:
    """Mark `stream` as driven by the calling lane's pass (its blocks move on the pass's
    transitions) for the duration; a no-op outside a pass."""
    stream.pass_ = in_pass()
    try:
        yield
    finally:
        stream.pass_ = None
