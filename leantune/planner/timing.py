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

The disk tier (Plan.disk_blocks, memory/disk_tier.py): a unit on disk is read on the staging
worker in 8 MiB chunks into two pinned staging buffers while the copy stream takes each filled
chunk on to the slot, so the read and the copy overlap and the unit arrives at the slower of the
disk's measured read rate (Machine.disk_read, planner/disk_rate.py) and the bus's, holding the
copy stream (and the staging worker: the units after it queue) that long. Like every copy it runs
ahead of compute through the ring, so a step is the longer of its compute and its copies and reads
where they overlap: what the disk costs a step is the exposed time it adds over the same plan with
those units in RAM (search.py reports it), and its bytes read per step are `disk_bytes`.

Full fine-tuning (`writeback`): a streamed unit holds trainable weights and their optimizer state;
its backward steps them in the slot, and when another unit claims that slot it is first copied
back device->host on a second stream (memory/trainable_streaming.py) at the D2H rate: the slot
takes no new copy before that write-back ends. A unit never evicted is not written back (it
stays current in its slot), and one used twice in backward (the non-block group: final layer,
then embedders) is written back once per claim, not once per use. The non-block
group is used once more at the end of backward (the embedders' backward). Copies that the engine
issues inline from pageable memory (fp32 masters, gradient accumulators: `inline_pageable` bytes)
are not hidden: they add to the exposed transfer.

Full fine-tuning with the optimizer step of streamed blocks on the host (`host_steps`, one
(gradient bytes, host seconds) per streamed unit): units carry weights only and nothing is written
back. After a unit's backward use its trained tensors' gradients go device->host on the second
stream at the D2H rate, then the CPU steps them: host steps run one after another on one worker
thread (overlapping the GPU's backward), each taking the unit's trained parameters over the host
optimizer rate measured on the planning machine's CPU (full_model.host_step_rate). The step
changes the host copy, so the unit's slot is stale: the unit is fetched afresh, and its next fetch
cannot start before its host step ended (the second simulated step shows that steady state). The
step ends when the last host step ends; the reported step is the time between two such ends.
The part of it the CPU's optimizer step adds (`host_step_s`: the step simulated again with host
steps that take no time, subtracted) is reported as the CPU optimizer step, apart from the exposed
transfer: at fp32 AdamW state it is most of the step, and it is the CPU's time, not the bus's.
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
    d2h_bytes: int = 0       # trained units written back (or, host step: gradients) per step, full mode
    host_step_s: float = 0.0  # the step waiting on the CPU's optimizer step (host step plans), not in exposed_s
    disk_bytes: int = 0      # read from the disk tier per step (part of h2d_bytes: they go on to the GPU)


def simulate_step(machine: Machine, calibration: Calibration, plan: Plan, prof: ActivationProfile,
                  ref: ActivationProfile, kinds: list[str], streamed: list[int], units: list[int], mode: str,
                  optimizer_bytes: int, writeback: bool = False, inline_pageable: int = 0,
                  host_steps: list[tuple[int, float]] | None = None, extra_forwards: float = 0.0,
                  disk: list[bool] | None = None, dequant: list[float] | None = None) -> StepTime:
    """One bucket's step time under `plan`; with `host_steps`, the CPU optimizer step's share apart
    (the module docstring). `extra_forwards`: forwards without a graph the recipe adds per step on
    average (a DOP prior step's base prediction, [validation]'s passes: Workload.dop_share,
    validation_forwards_per_step), each priced as the plan's own inference forward, streamed blocks
    and all (`recipe_forward`). `disk`: per unit, whether it is read from the disk tier. `dequant`:
    per block, the seconds an int8 / NF4 base's dequantization adds to each use of the block beyond
    fp8's (planner/base_formats.py): in the forward, the backward and a checkpointed recompute."""
    args = (machine, calibration, plan, prof, ref, kinds, streamed, units, mode, optimizer_bytes, writeback,
            inline_pageable)
    t = _simulate(*args, host_steps=host_steps, disk=disk, dequant=dequant)
    if host_steps:
        free_cpu = _simulate(*args, host_steps=[(grad, 0.0) for grad, _ in host_steps], disk=disk, dequant=dequant)
        host_s = max(0.0, t.step_s - free_cpu.step_s)
        t = t._replace(exposed_s=max(0.0, t.exposed_s - host_s), host_step_s=host_s)
    if extra_forwards > 0 and mode != "inference":
        t = with_forwards(t, recipe_forward(machine, calibration, plan, prof, ref, kinds, streamed, units, disk,
                                            dequant), extra_forwards)
    return t


def recipe_forward(machine: Machine, calibration: Calibration, plan: Plan, prof: ActivationProfile,
                   ref: ActivationProfile, kinds: list[str], streamed: list[int], units: list[int],
                   disk: list[bool] | None = None, dequant: list[float] | None = None) -> StepTime:
    """One forward without a graph under the training plan: the embedders, every block (a streamed
    block is fetched again: a DOP base prediction or a validation pass streams the model as the
    step's own forward does) and the final layer; no backward, no optimizer."""
    return _simulate(machine, calibration, plan, prof, ref, kinds, streamed, units, "inference", 0, disk=disk,
                     dequant=dequant)


def with_forwards(t: StepTime, forward: StepTime, n: float) -> StepTime:
    """`t` plus `n` forwards of `forward` (n may be fractional: an average over steps)."""
    return t._replace(step_s=t.step_s + n * forward.step_s, compute_s=t.compute_s + n * forward.compute_s,
                      exposed_s=t.exposed_s + n * forward.exposed_s, overhead_s=t.overhead_s + n * forward.overhead_s,
                      h2d_bytes=int(t.h2d_bytes + n * forward.h2d_bytes),
                      disk_bytes=int(t.disk_bytes + n * forward.disk_bytes))


def _simulate(machine: Machine, calibration: Calibration, plan: Plan, prof: ActivationProfile,
              ref: ActivationProfile, kinds: list[str], streamed: list[int], units: list[int], mode: str,
              optimizer_bytes: int, writeback: bool = False, inline_pageable: int = 0,
              host_steps: list[tuple[int, float]] | None = None, disk: list[bool] | None = None,
              dequant: list[float] | None = None) -> StepTime:
    """One bucket's step time under `plan`, the CPU step counted in the exposed time.

    `prof` is the probe of the plan's storage (fp8 or not), `ref` the probe without fp8 (their
    difference in memory traffic is the dequantisation cost); `kinds` the block kinds in
    execution order; `streamed` the sorted indices of streamed blocks; `units` the packed bytes of
    each streamed unit in the engine's order (non-block group first); `optimizer_bytes` the
    parameters, gradients and states the optimizer reads and writes once per step (on the device);
    `host_steps` (unit order) each streamed unit's gradient bytes and host step seconds when the
    streamed blocks step on the host (module docstring); `disk` (unit order) whether each unit is
    read from the disk tier (module docstring).
    """
    m = machine
    rate = m.flops * calibration.flops_scale
    bw = (calibration.h2d_pinned or m.h2d_pinned) if plan.pin_memory else m.h2d_pageable
    unit_of = {i: n + int(plan.stream_non_blocks) for n, i in enumerate(streamed)}
    nb_unit = 0 if plan.stream_non_blocks else None
    k_slots = max(1, min(plan.ring_slots, len(units))) if units else 1
    ckpt = plan.checkpointing != "none"
    offload = plan.checkpointing == "offload"
    host = host_steps is not None

    def dq(kind: str, phase: str) -> float:   # extra memory-bound traffic of fp8 dequantisation
        a, b = prof.kinds[kind], ref.kinds[kind]
        extra = (a.fwd_traffic - b.fwd_traffic) if phase == "fwd" else (a.bwd_traffic - b.bwd_traffic)
        return max(0, extra) / m.hbm

    # (unit, compute s, extra H2D bytes, overhead s, written back after this use)
    uses: list[tuple[int | None, float, int, float, bool]] = []
    uses.append((nb_unit, prof.nb_fwd_flops / rate, 0, 0.0, False))           # embedders
    for i, kind in enumerate(kinds):
        kp = prof.kinds[kind]
        uses.append((unit_of.get(i), kp.fwd_flops / rate, 0, dq(kind, "fwd") + (dequant[i] if dequant else 0.0),
                     False))
    uses.append((nb_unit, prof.nb_post_flops / rate, 0, 0.0, False))          # final norm and projection
    if mode != "inference":
        # The final layer's backward steps its weights: on the device that makes the group dirty.
        uses.append((nb_unit, prof.nb_bwd_flops / rate, 0, 0.0, writeback and not host))
        for i in reversed(range(len(kinds))):
            kind = kinds[i]
            kp = prof.kinds[kind]
            c = kp.bwd_flops / rate + (kp.fwd_flops / rate if ckpt else 0.0)
            extra_dq = dequant[i] if dequant else 0.0       # an int8 / NF4 base: its backward dequantizes too
            over = dq(kind, "bwd") + extra_dq + (dq(kind, "fwd") + extra_dq if ckpt else 0.0)
            uses.append((unit_of.get(i), c, kp.out if offload else 0, over, writeback or host))
        if writeback or host:
            uses.append((nb_unit, 0.0, 0, 0.0, True))                    # embedders' backward, then write-back
    owner = [None] * k_slots
    ready = [0.0] * k_slots
    free_at = [0.0] * k_slots
    t = copy_free = wb_free = host_free = 0.0
    host_done: dict[int, float] = {}          # unit -> end of its last host step
    dirty: set[int] = set()                   # units stepped on the device, not yet written back
    moved = written = read = 0
    # A unit on disk is read into pinned staging on the staging worker while the copy stream takes
    # the filled chunks to its slot: the two overlap chunk by chunk, so its copy runs at the slower
    # of the disk's and the bus's rates, and holds the copy stream that long.
    disk_bw = min(bw, m.disk_read) if disk and any(disk) and m.disk_read else bw
    step_start = compute = overhead = 0.0
    for step in range(2):
        if step == 1:
            # The step ends when its updates are done: with host steps, at the last one's end.
            step_start = max(t, wb_free, host_free) if host else t
            compute, overhead, moved, written, read = 0.0, 0.0, 0, 0, 0
        for unit, c, extra, over, wb in uses:
            need = 0.0
            if unit is not None:
                s = unit % k_slots
                if owner[s] != unit:
                    old = owner[s]
                    if old is not None and old in dirty:   # the claimed slot's update goes home first
                        wb_free = max(wb_free, free_at[s]) + units[old] / m.d2h
                        free_at[s] = wb_free
                        written += units[old]
                        dirty.discard(old)
                    start = max(copy_free, free_at[s], host_done.get(unit, 0.0))
                    from_disk = bool(disk) and disk[unit]
                    copy_free = start + units[unit] / (disk_bw if from_disk else bw)
                    owner[s], ready[s] = unit, copy_free
                    moved += units[unit]
                    read += units[unit] if from_disk else 0
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
                if wb and host:              # gradients to the host, then the CPU steps them
                    grad, secs = host_steps[unit]
                    wb_free = max(wb_free, t) + grad / m.d2h
                    host_free = max(host_free, wb_free) + secs
                    host_done[unit] = host_free
                    owner[unit % k_slots] = None        # the host copy changed: fetched afresh
                    written += grad
                elif wb:                     # written back when another unit claims the slot
                    dirty.add(unit)
    t = max(t, wb_free, host_free)                        # the step ends when its updates are home
    opt = 2 * optimizer_bytes / m.hbm                     # the optimizer reads and writes its tensors
    inline = inline_pageable / m.h2d_pageable             # masters, accumulators: not hidden
    step_s = t - step_start + opt + inline + (moved + written) / m.hbm   # copies also cost HBM bandwidth
    overhead += opt + (moved + written) / m.hbm
    return StepTime(step_s, compute, max(0.0, step_s - compute - overhead), overhead, moved, written,
                    disk_bytes=read)
