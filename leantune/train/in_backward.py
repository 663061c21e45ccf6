"""The optimizer step inside backward: each weight is updated as soon as its gradient is complete.

A post-accumulate-grad hook on every trained parameter takes the gradient, frees `p.grad` at once
and runs `FusedOptimizer.step_param`, so at any moment the device holds the gradients of the
parameters whose backward is in flight (at most one block's), never the model's. Autograd runs a
parameter's AccumulateGrad node as soon as its gradient is ready (it has the highest priority in
the ready queue), before the rest of its block's backward finishes, which is also what keeps a
streamed block resident until its own weights are stepped (see memory/trainable_streaming.py).

Why in-place updates are safe here: the order of the graph, not autograd's version counter. The
update writes through `p.data` (or the streamed weight's slot or host copy), an alias with a
version counter of its own, so a saved `p` read after the update would NOT raise: it would
silently compute with the new value. What makes that impossible is that a weight's AccumulateGrad
runs only after every node that contributes to its gradient, and every node that saved the weight
for backward contributes to that gradient (it requires grad; the linear/attention backward
computes the weight's and the input's gradients in one node). Two things would break this and are
not done here: a forward that saves a weight without differentiating through it (a detached use),
and activation checkpointing that re-runs a block's forward after one of its weights stepped (the
recompute of block k runs before block k's gradients exist, so its weights have not stepped yet).
tests/test_full_finetune.py compares the in-backward step with the plain optimizer step.

Gradient accumulation over N micro-batches: the gradient of micro-batches 1..N-1 is added into an
fp32 accumulator in host memory and freed on the device; on micro-batch N it is added back and the
weight steps (`g_N + (g_1 + ... + g_{N-1})`, the same sum the plain loop forms, so the result is
bitwise equal in fp32). Clipping by the global norm would need every gradient first; instead each
parameter's gradient is clipped to `max_grad_norm` on its own (documented in docs/config.md).
The cost on CUDA: the copy of a gradient into pageable host memory returns only when the device
has finished everything queued before it, so micro-batches 1..N-1 synchronize once per weight
(the GPU idles while the host copies and adds); a stream-ordered accumulator in pinned memory
would remove that and is not built yet.

A weight whose gradient came only from earlier micro-batches steps in `finish_step`, after backward,
when a streamed weight's block is no longer resident (its slot may hold another block, or poison):
`hold` (the streaming engine's `holding`) fetches the block around that update and writes it back.

A streamed weight whose block steps on the host (Plan.optimizer_on_host): `host(p)` returns the
streaming engine, which copies the gradient to the host and runs `_step` there on the weight's host
copy (memory/trainable_streaming.py), clipping included; an accumulator is added to the gradient on
the host, not brought to the device.

A step redone after an out-of-memory error (the trainer's OOM guard) skips the weights that were
already updated in the failed attempt, so each weight steps once per optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ContextManager

import torch

from .fused_optim import FusedOptimizer


class InBackwardStep:
    def __init__(self, optimizer: FusedOptimizer, params: list[torch.nn.Parameter], *, accumulation: int = 1,
                 max_grad_norm: float = 0.0, on_step: Callable[[torch.nn.Parameter], None] | None = None,
                 hold: Callable[[torch.nn.Parameter], ContextManager] | None = None,
                 host: Callable[[torch.nn.Parameter], object | None] | None = None):
        self.optimizer = optimizer
        self.params = list(params)
        self.accum = accumulation
        self.max_grad_norm = max_grad_norm
        self.on_step = on_step
        self.hold = hold                      # keeps a weight's streamed block resident (finish_step)
        self.host = host                      # the engine that steps p on the host, or None
        self.micro = 0
        self.acc: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.stepped: set[torch.nn.Parameter] = set()
        self.open = False                     # a step began and has not finished (an OOM retry if so)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    # -- the hook ------------------------------------------------------------------------------------
    def _hook(self, p: torch.nn.Parameter) -> None:
        g = p.grad
        p.grad = None
        if g is None or p in self.stepped:
            return
        if self.micro < self.accum - 1:
            a = self.acc.get(p)
            if a is None:
                self.acc[p] = g.detach().to("cpu", torch.float32, copy=True)
            else:
                a.add_(g.detach().to("cpu", torch.float32))
            return
        a = self.acc.pop(p, None)
        engine = self.host(p) if self.host is not None else None
        if engine is not None:
            self._update_on_host(engine, p, g, a)
            return
        if a is not None:
            g = g + a.to(g.device, g.dtype)
        self._update(p, g)

    def _update(self, p: torch.nn.Parameter, g: torch.Tensor) -> None:
        self._step(p, g)
        self._stepped(p)

    def _stepped(self, p: torch.nn.Parameter) -> None:
        self.stepped.add(p)
        if self.on_step is not None:
            self.on_step(p)

    def _update_on_host(self, engine, p: torch.nn.Parameter, g: torch.Tensor | None, acc: torch.Tensor | None) -> None:
        """Step `p` on the host: `g` (on the device, or None when only accumulated micro-batches
        gave a gradient) plus the host accumulator `acc`, in the order the plain loop sums them."""
        lr = self.optimizer.param_groups[0]["lr"]

        def step(weight: torch.Tensor, grad: torch.Tensor | None, grad_norm: float | None) -> None:
            if grad is None:
                grad = acc.to(weight.dtype)
            elif acc is not None:
                grad = grad + acc.to(grad.dtype)
            self._step(p, grad, weight, lr, grad_norm)

        # The device takes the clipping norm of a gradient that is the whole gradient (no host
        # accumulator to add first), for an optimizer that clips by it: the host's pass over the
        # gradient is then the update's alone.
        norm = self.max_grad_norm > 0 and acc is None and g is not None \
            and self.optimizer.clips_by_given_norm()
        engine.step_on_host(p, g, step, norm=norm)
        self._stepped(p)

    def _step(self, p: torch.nn.Parameter, g: torch.Tensor, weight: torch.Tensor | None = None,
              lr: float | None = None, grad_norm: float | None = None) -> None:
        self.optimizer.step_param(p, g, weight, lr, max_grad_norm=self.max_grad_norm, grad_norm=grad_norm)

    # -- a step --------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start an optimizer step (or redo one that failed: its updated weights are kept)."""
        if not self.open:
            self.stepped.clear()
        self.acc.clear()
        self.open = True

    def finish_step(self) -> None:
        """Weights that had a gradient in an earlier micro-batch but none in the last step now."""
        for p in [p for p in self.params if p in self.acc]:
            a = self.acc.pop(p)
            engine = self.host(p) if self.host is not None else None
            if engine is not None:            # the host copy is stepped: no need for the block
                self._update_on_host(engine, p, None, a)
                continue
            with self.hold(p) if self.hold is not None else contextlib.nullcontext():
                self._update(p, a.to(p.device, p.dtype))
        self.open = False

    def drop_partial(self) -> None:
        self.acc.clear()
        for p in self.params:
            p.grad = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
