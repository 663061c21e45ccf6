"""Calibration: correct the memory and timing model with what the first real steps measure.

What it trades: nothing at run time (a comparison per early step) for plans that start right on
the next run. The activation probe is exact for the code it traces, but a GPU's allocator, its
kernels' workspaces and its real FLOP/s and PCIe rates are not visible on the meta device. So the
trainer reports the first steps' peak allocated VRAM, step time and measured host->GPU rate;
`PlanCalibrator` compares them with the prediction and, when the peak is off by more than the
budget's margin, rescales the activation term to match and searches the plan again, once. The
corrections themselves, and their store, are in ../corrections.py.
"""

from __future__ import annotations

import logging

from ...memory.plan import Plan
from ..corrections import CalibrationStore, activation_key, bucket_key
from ..workload import InfeasibleBudget, gib
from .oom import NoPlanFits, OomGuard

log = logging.getLogger("leantune")


class PlanCalibrator:
    """Compares the first steps' measurements with the running plan's prediction; re-plans once if off.

    The plan and the budget are the OomGuard's (its one owner): the calibrator compares the plan in
    use, re-plans within the budget in use (tightened after an out-of-memory error) and switches
    plans through the guard. The trainer calls `observe` after each early step with the bucket it
    trained, the step's peak allocated VRAM (torch.cuda.max_memory_allocated, reset once after setup
    and after each step's reading) and its seconds, plus the streaming engine's step_report
    (measured H2D rate and stall). When the measured peak differs from the prediction by more than
    the budget's margin, the activation term is rescaled to match, the calibration is stored (not
    after an out-of-memory error in this run) and, once, the plan is searched again: a different plan is applied through the guard and returned,
    otherwise None. After an out-of-memory error a peak below the prediction corrects nothing: the
    device has shown that the prediction was not too high, and lowering it would plan back towards
    the plan that failed.
    """

    def __init__(self, guard: OomGuard, store: CalibrationStore | None = None, steps: int = 3):
        self.guard, self.store, self.steps = guard, store, steps
        self.seen = 0
        self.replanned = False
        self.changes: list[str] = []

    def observe(self, bucket: tuple[int, int], peak_allocated: int, step_s: float | None = None,
                report: dict | None = None) -> Plan | None:
        self.seen += 1
        if self.replanned or self.seen > self.steps:
            return None
        planner, plan, budget = self.guard.planner, self.guard.plan, self.guard.budget
        cal = planner.calibration
        bucket = self._nearest(bucket)
        predicted_bucket = planner.memory(plan)[2][bucket_key(bucket)]
        predicted, act = predicted_bucket["peak_vram"], predicted_bucket["activations"]
        error = peak_allocated - predicted
        if report and report.get("h2d_GBps"):
            cal.h2d_pinned = float(report["h2d_GBps"]) * 1e9
        if step_s and self.seen > 1:            # the first step also pays for warm-up
            est = planner.estimate(plan)
            stall = float((report or {}).get("stall_s") or 0.0)
            busy = max(step_s - stall - est.overhead_s, 1e-9)
            cal.flops_scale = cal.flops_scale * est.compute_s / busy
        off = abs(error) > budget.margin_bytes and not (error < 0 and self.guard.replans)
        if off and act > 0:
            key = activation_key(bucket, plan.checkpointing, plan.split_blocks)
            old = cal.activation_scale.get(key, 1.0)
            cal.activation_scale[key] = max(0.25, old * (act + error) / act)
            cal.activation_scale[f"{bucket_key(bucket)}:*"] = cal.activation_scale[key]
        if self.store is not None and not self.guard.replans:
            # After an out-of-memory error this run's readings come from a fragmented, near-full
            # device: they correct this run's plan, but are not kept for the next runs.
            self.store.put(planner.key, cal)
        if not off:
            return None
        self.replanned = True
        planner.forget_estimates()
        try:
            new = planner.plan(budget)
        except InfeasibleBudget as e:
            raise NoPlanFits(f"measured peak {gib(peak_allocated)} at {bucket[1]}x{bucket[0]} is above the "
                             f"prediction, and with that correction {e}") from None
        what = (f"re-planned from [{plan.describe()}] to [{new.describe()}]" if new != plan
                else f"recalibrated; the plan [{new.describe()}] still fits")
        self.changes.append(f"measured peak {gib(peak_allocated)} vs predicted {gib(predicted)} at "
                            f"{bucket[1]}x{bucket[0]}: {what}")
        log.info("planner: %s", self.changes[-1])
        if new == plan:
            return None
        return self.guard.switch(new)

    def _nearest(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """The planned bucket with the closest pixel count (aspect buckets of one resolution share
        their square's token count, and activation memory follows the token count)."""
        buckets = self.guard.planner.workload.buckets
        if bucket in buckets:
            return bucket
        return min(buckets, key=lambda b: abs(b[0] * b[1] - bucket[0] * bucket[1]))
