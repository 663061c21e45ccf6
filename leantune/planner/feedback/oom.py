"""Out of memory during a step: recognise it, re-plan tighter, redo the same step.

What it trades: one failed step's time for a run that survives a prediction that was too low. A
CUDA out-of-memory (or a cuBLAS/cuDNN allocation failure) inside a training step is caught by
`OomGuard`, which frees what the failed step held, asks the planner for a plan predicted to need
less than the one that failed, has the caller apply it and redoes the step with the same batch,
so no sample is skipped or counted twice. When no plan fits a tighter budget, `NoPlanFits` stops
the run and the caller saves a resumable state.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ...memory.plan import Plan
from ..workload import Budget, InfeasibleBudget, gib

if TYPE_CHECKING:
    from ..search import Planner

log = logging.getLogger("leantune")


class NoPlanFits(RuntimeError):
    """Out of memory and no tighter plan fits: the run must stop (after saving a resumable state)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA allocator failure (torch.OutOfMemoryError) or an out-of-memory from cuBLAS/cuDNN."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text)


class OomGuard:
    """Runs training steps; on a CUDA out-of-memory it frees, re-plans tighter and redoes the step.

    `apply_plan(plan)` must rebuild the memory setup for a plan (remove the engine's handle, apply the
    new plan) and clear the failed step's partial gradients, so the redone step uses the same batch
    and no sample is lost. Each retry shrinks the budget by `shrink` until the planner returns a
    different plan; when no plan fits (or after `max_replans`), NoPlanFits is raised and the caller
    saves a resumable state.
    """

    def __init__(self, planner: Planner, budget: Budget, plan: Plan, apply_plan: Callable[[Plan], None],
                 shrink: float = 0.9, max_replans: int = 4):
        self.planner, self.budget, self.plan, self.apply_plan = planner, budget, plan, apply_plan
        self.shrink, self.max_replans = shrink, max_replans
        self.replans = 0
        self.events: list[str] = []

    def run(self, step_fn: Callable, *args, step: int | None = None, **kwargs):
        while True:
            try:
                return step_fn(*args, **kwargs)
            except Exception as exc:  # only out-of-memory is handled; everything else propagates
                if not is_out_of_memory(exc):
                    raise
                where = f"step {step}" if step is not None else "a step"
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                del exc
                _free_memory()
                self.plan = self._tighter(where, first_line)
                self.apply_plan(self.plan)

    def _tighter(self, where: str, error: str) -> Plan:
        previous = self.plan
        while True:
            if self.replans >= self.max_replans:
                raise NoPlanFits(f"out of memory at {where} ({error}) after {self.replans} re-plans; last budget "
                                 f"{gib(self.budget.vram)}. Lower the resolution, batch size or LoRA rank, or raise "
                                 f"[memory] vram_budget; the last saved state is resumable.")
            self.replans += 1
            # The failed plan's predicted peak did not really fit: ask for a plan predicted to need
            # `shrink` times less, whatever the nominal budget was.
            failed = (previous.notes or {}).get("predicted_peak_vram") or self.planner.estimate(previous).peak_vram
            vram = min(self.budget.vram, self.budget.needed_for(failed))
            self.budget = replace(self.budget, vram=int(vram * self.shrink))
            try:
                plan = self.planner.plan(self.budget)
            except InfeasibleBudget as e:
                raise NoPlanFits(f"out of memory at {where} ({error}), and no plan fits a tighter budget of "
                                 f"{gib(self.budget.vram)}: {e} The last saved state is resumable.") from None
            if plan != previous:
                msg = (f"out of memory at {where}: re-planned with a budget of {gib(self.budget.vram)}: "
                       f"[{previous.describe()}] -> [{plan.describe()}]; redoing the step")
                self.events.append(msg)
                log.warning("planner: %s", msg)
                return plan


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
