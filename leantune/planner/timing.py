"""Step time of a plan: compute, plus the part of the host->GPU copies compute cannot hide.

What it trades: a few microseconds of simulation per candidate for a search that prefers plans
whose copies hide behind compute, instead of simply streaming as little as possible. Compute time
is the probe's FLOPs over the machine's sustained FLOP/s. Copies run on a copy stream at the
measured or assumed host->GPU bandwidth (pageable units at the pageable rate: the engine stages
them through pinned buffers on a worker thread) and are simulated through the engine's ring over
two steps: unit i uses slot i mod K; a copy waits for its slot's last use to end; a block's
compute waits for its copy; a unit still in its slot is not copied again. The second (steady)
step is reported. Step time = compute + exposed transfer + overhead, the overhead being fp8
dequantisation (the extra bytes the probe saw memory-bound ops move, at HBM bandwidth), the
copies' own HBM traffic and the optimizer's read and write of its tensors.
"""

from __future__ import annotations

from typing import NamedTuple

from .activations import ActivationProfile
from .corrections import Calibration
from .machine import Machine
from ..memory.plan import Plan


class StepTime(NamedTuple):
    step_s: float
    compute_s: float
    exposed_s: float         # compute waiting on copies
    overhead_s: float        # fp8 dequantisation, copies' HBM traffic, the optimizer step
    h2d_bytes: int           # weights (and offloaded inputs) copied per step


def simulate_step(machine: Machine, calibration: Calibration, plan: Plan, prof: ActivationProfile,
                  ref: ActivationProfile, kinds: list[str], streamed: list[int], units: list[int], mode: str,
                  optimizer_bytes: int) -> StepTime:
    """One bucket's step time under `plan`.

    `prof` is the probe of the plan's storage (fp8 or not), `ref` the probe without fp8 (their
    difference in memory traffic is the dequantisation cost); `kinds` the block kinds in
    execution order; `streamed` the sorted indices of streamed blocks; `units` the packed bytes of
    each streamed unit in the engine's order (non-block group first); `optimizer_bytes` the
    parameters, gradients and states the optimizer reads and writes once per step.
    """
    m = machine
    rate = m.flops * calibration.flops_scale
    bw = (calibration.h2d_pinned or m.h2d_pinned) if plan.pin_memory else m.h2d_pageable
    unit_of = {i: n + int(plan.stream_non_blocks) for n, i in enumerate(streamed)}
    nb_unit = 0 if plan.stream_non_blocks else None
    k_slots = max(1, min(plan.ring_slots, len(units))) if units else 1
    ckpt = plan.checkpointing != "none"
    offload = plan.checkpointing == "offload"

    def dq(kind: str, phase: str) -> float:   # extra memory-bound traffic of fp8 dequantisation
        a, b = prof.kinds[kind], ref.kinds[kind]
        extra = (a.fwd_traffic - b.fwd_traffic) if phase == "fwd" else (a.bwd_traffic - b.bwd_traffic)
        return max(0, extra) / m.hbm

    uses: list[tuple[int | None, float, int, float]] = []   # (unit, compute s, extra H2D bytes, overhead s)
    uses.append((nb_unit, prof.nb_fwd_flops / rate, 0, 0.0))           # embedders
    for i, kind in enumerate(kinds):
        kp = prof.kinds[kind]
        uses.append((unit_of.get(i), kp.fwd_flops / rate, 0, dq(kind, "fwd")))
    uses.append((nb_unit, prof.nb_post_flops / rate, 0, 0.0))          # final norm and projection
    if mode != "inference":
        uses.append((nb_unit, prof.nb_bwd_flops / rate, 0, 0.0))
        for i in reversed(range(len(kinds))):
            kind = kinds[i]
            kp = prof.kinds[kind]
            c = kp.bwd_flops / rate + (kp.fwd_flops / rate if ckpt else 0.0)
            over = dq(kind, "bwd") + (dq(kind, "fwd") if ckpt else 0.0)
            uses.append((unit_of.get(i), c, kp.out if offload else 0, over))
    owner = [None] * k_slots
    ready = [0.0] * k_slots
    free_at = [0.0] * k_slots
    t = copy_free = 0.0
    moved = 0
    step_start = compute = overhead = 0.0
    for step in range(2):
        if step == 1:
            step_start, compute, overhead, moved = t, 0.0, 0.0, 0
        for unit, c, extra, over in uses:
            need = 0.0
            if unit is not None:
                s = unit % k_slots
                if owner[s] != unit:
                    start = max(copy_free, free_at[s])
                    copy_free = start + units[unit] / bw
                    owner[s], ready[s] = unit, copy_free
                    moved += units[unit]
                need = ready[s]
            if extra:
                copy_free = max(copy_free, t) + extra / m.h2d_pinned
                need = max(need, copy_free)
                moved += extra
            t = max(t, need) + c + over
            compute += c
            overhead += over
            if unit is not None:
                free_at[unit % k_slots] = t
    opt = 2 * optimizer_bytes / m.hbm                     # the optimizer reads and writes its tensors
    step_s = t - step_start + opt + moved / m.hbm         # copies also cost device-memory bandwidth
    overhead += opt + moved / m.hbm
    return StepTime(step_s, compute, max(0.0, step_s - compute - overhead), overhead, moved)
