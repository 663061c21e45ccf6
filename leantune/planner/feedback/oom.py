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

from ...errors import is_out_of_memory
from ...memory.plan import Plan
from ..workload import Budget, InfeasibleBudget, gib

if TYPE_CHECKING:
    from ..search import Planner

log = logging.getLogger("leantune")


class NoPlanFits(RuntimeError):
    """Out of memory and no tighter plan fits: the run must stop (after saving a resumable state)."""


class OomGuard:
    """The one owner of a run's plan and budget: runs training steps under an out-of-memory guard,
    and switches plans (its own re-plans, and calibration's through `switch`).

    `apply_plan(plan)` must rebuild the memory setup for a plan (take the engine's weights home to
    the host, apply the new plan) and clear the failed step's partial gradients, so the redone step
    uses the same batch and no sample is lost. Applying a plan is itself guarded: if it runs out of
    memory, the guard re-plans tighter again. Each retry shrinks the budget by `shrink` until the
    planner returns a different plan; when no plan fits (or after `max_replans`), NoPlanFits is
    raised and the caller saves a resumable state. `plan` and `budget` are always the plan in use
    and the budget it was chosen under, so calibration (calibrate.py) compares and re-plans against
    them, never against a plan that already ran out of memory.
    """

    def __init__(self, planner: Planner, budget: Budget, plan: Plan, apply_plan: Callable[[Plan], None],
                 shrink: float = 0.9, max_replans: int = 4):
        self.planner, self.budget, self.plan, self.apply_plan = planner, budget, plan, apply_plan
        self.shrink, self.max_replans = shrink, max_replans
        self.replans = 0
        self.events: list[str] = []

    def run(self, step_fn: Callable, *args, step: int | None = None, **kwargs):
        """`step_fn(*args, **kwargs)`, redone under a tighter plan after each out-of-memory error."""
        where = f"step {step}" if step is not None else "a step"
        return self._guarded(lambda: step_fn(*args, **kwargs), where, None)

    def switch(self, plan: Plan) -> Plan:
        """Apply `plan` (a calibrated re-plan) as the run's plan, under the guard; returns the plan in use."""
        self._guarded(lambda: None, "switching plans", plan)
        return self.plan

    def _guarded(self, fn: Callable, where: str, pending: Plan | None):
        while True:
            try:
                if pending is not None:
                    self.apply_plan(pending)       # may itself run out of memory
                    self.plan, pending = pending, None
                return fn()
            except Exception as exc:  # only out-of-memory is handled; everything else propagates
                if not is_out_of_memory(exc):
                    raise
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            # Freed here, out of the handler: inside it the traceback still holds the failed
            # attempt's frames and their tensors (the step's graph), so nothing could be freed and
            # the peak counter would restart at the near-OOM level the calibration then reads.
            _free_memory()
            pending = self._tighter(where, first_line, pending or self.plan)

    def _tighter(self, where: str, error: str, failed: Plan) -> Plan:
        while True:
            if self.replans >= self.max_replans:
                raise NoPlanFits(f"out of memory at {where} ({error}) after {self.replans} re-plans; last budget "
                                 f"{gib(self.budget.vram)}. Lower the resolution, batch size or LoRA rank, or raise "
                                 f"[memory] vram_budget; the last saved state is resumable.")
            self.replans += 1
            # The failed plan's predicted peak did not really fit: ask for a plan predicted to need
            # `shrink` times less, whatever the nominal budget was.
            peak = (failed.notes or {}).get("predicted_peak_vram") or self.planner.estimate(failed).peak_vram
            vram = min(self.budget.vram, self.budget.needed_for(peak))
            self.budget = replace(self.budget, vram=int(vram * self.shrink))
            try:
                plan = self.planner.plan(self.budget)
            except InfeasibleBudget as e:
                raise NoPlanFits(f"out of memory at {where} ({error}), and no plan fits a tighter budget of "
                                 f"{gib(self.budget.vram)}: {e} The last saved state is resumable.") from None
            if plan != failed:
                msg = (f"out of memory at {where}: re-planned with a budget of {gib(self.budget.vram)}: "
                       f"[{failed.describe()}] -> [{plan.describe()}]; redoing it")
                self.events.append(msg)
                log.warning("planner: %s", msg)
                return plan


def _free_memory() -> None:
    """Free what the failed attempt held; its peak is not the redone step's, so the peak statistics
    start again (the calibration reads the redone step's peak)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
