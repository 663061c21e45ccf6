"""The order of a check's runs and its report.

The reference runs first. Where it does not fit the device (the planner's estimate of the plain
model over the budget on CUDA, or the reference running out of memory), every run of the check is
made on a few of the model's own blocks instead (models/block_subset.py: the first blocks the plan
streams and one it keeps resident, per block list): the techniques act block by block, so the
proof on those blocks, with their real weights, shapes and recipe, is the proof the whole model
cannot give on this machine; the report says which blocks. Only when even that reference does not
fit does the check give up (exit code 3) rather than compare against something else. Each
variant runs with the same seed and steps, and is compared as soon as it finished (compare.py);
its memory is released before the next is built.

Exit codes: 0 every technique held, 1 one differs, 3 the reference does not fit, not even on a
subset of the blocks (2, a config error, comes from the command layer as for every command).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..config import RunConfig
from .compare import FP8_TOLERANCE, TOLERANCES, Verdict, compare
from .record import Record, record_variant
from .variants import Variant, run_plan, variant_config, variants

REFERENCE_DOES_NOT_FIT = 3
log = logging.getLogger("leantune")


@dataclass
class CheckResult:
    rc: int
    lines: list[str] = field(default_factory=list)
    verdicts: dict[str, Verdict] = field(default_factory=dict)   # by Variant.key
    records: dict[str, Record] = field(default_factory=dict)
    seconds: float = 0.0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _reference_too_big(plan, planner, budget, device_type: str) -> str | None:
    """Under a VRAM budget on CUDA: why the plain model does not fit (the planner's estimate of the
    plan without techniques over the budget), else None."""
    if planner is None or budget is None or device_type != "cuda":
        return None
    from ..memory.plan import Plan

    need = planner.estimate(Plan(ring_slots=plan.ring_slots, pin_memory=plan.pin_memory)).peak_vram
    if need <= budget.usable_vram:
        return None
    return (f"the reference (the run with nothing streamed, no fp8, no checkpointing) would need about {_gib(need)} "
            f"of VRAM by the planner's estimate, over the {_gib(budget.usable_vram)} usable of [memory] vram_budget")


def _performance(plan, rec: Record, device_type: str) -> str:
    """The whole plan's measured step time and peak beside the plan's prediction."""
    notes = plan.notes or {}
    step = rec.step_s[-1] if rec.step_s else None
    parts = [f"step time {step:.3f} s (last of {len(rec.step_s)})" if step is not None else "no step timed"]
    if notes.get("predicted_step_s") is not None:
        parts[-1] += f", predicted {notes['predicted_step_s']:.3f} s"
    if device_type == "cuda" and rec.peak_vram is not None:
        peak = f"peak VRAM {_gib(rec.peak_vram)}"
        if notes.get("predicted_peak_vram") is not None:
            peak += f", predicted {_gib(notes['predicted_peak_vram'])}"
        parts.append(peak)
    else:
        parts.append("VRAM not measured (the check ran on the CPU)")
    if not notes:
        parts.append("no prediction (explicit [memory] keys; set [memory] vram_budget for a planned run)")
    return "measured with the whole plan: " + "; ".join(parts)


def run_check(cfg: RunConfig, steps: int = 2, emit: Callable[[str], None] = print,
              work_dir: Path | None = None, repeat_reference: bool | None = None,
              progress: Callable[[str], None] | None = None, gpus: int | None = None,
              nodes=None) -> CheckResult:
    """Check `cfg`'s plan on its own model and data (module docstring); `emit` gets each line as it
    is known; `progress` gets "running <variant>" before each run (a real model takes minutes to
    load; the command prints these on stderr). `work_dir`: where the variants' output folders go
    (default: a temporary folder).

    `repeat_reference` (default: on CUDA): run the reference twice first. A GPU's kernels need not
    be bitwise reproducible (an atomic-add reduction in an attention backward), and then no
    technique can be held to the bits: the check says so and compares the exact techniques within
    the fp8 tolerance instead (NaN, missing and zero gradients are still failures). On the CPU the
    plain run is reproducible, so it runs once.

    `gpus` (`--gpus N`, N > 1: the run trains on N processes): after the one-process variants the
    whole plan runs on N processes under torchrun and is compared with one process at the N-times
    batch (processes.py).

    `nodes` (distributed.Nodes, this machine 0 of several, `check --nodes M`): first of all, before
    any one-process run, the whole plan runs on the M machines' `gpus` processes each (default 1)
    and is compared with one process at the whole world's batch (processes.check_machines); the
    other machines run processes.follow."""
    from ..models.family import get_family
    from ..trainer import pick_device
    from .variants import meta_model

    t0 = time.perf_counter()
    result = CheckResult(0)

    def say(line: str) -> None:
        result.lines.append(line)
        emit(line)

    keep: dict | None = None                 # a block subset, once the whole reference does not fit

    def record(v: Variant, **kwargs) -> Record:
        if progress is not None:
            progress(f"check: running {v.label} ...")
        return _record(cfg, v, steps, Path(tmp), keep_blocks=keep, **kwargs)

    from ..models import block_subset

    spec = get_family(cfg.model.family).spec
    meta = meta_model(cfg)
    plan, planner, budget = run_plan(cfg, meta)
    device = pick_device(cfg)
    full = cfg.train.mode == "full"
    total = len(list(spec.blocks(meta)))
    subset = block_subset.choose(spec, meta, plan.streamed_blocks, plan.ring_slots)
    del meta
    runs = variants(plan, total, full, cfg.memory.fp8_modulation)
    machines = nodes is not None
    if machines:
        gpus = gpus or 1
    several = gpus is not None and gpus > 1 and not machines
    say(f"check: {'planned' if planner is not None else 'explicit [memory] keys'}: {plan.describe(lora=not full)}; "
        f"{steps} step(s) from seed {cfg.train.seed} on {device.type}, {len(runs) - 1} variant(s) against the "
        f"reference" + (f", then the whole plan on {gpus} processes" if several else "")
        + (f", after the whole plan on {nodes.count} machines x {gpus} process(es)" if machines else ""))
    checked_plan = plan                      # the plan the several processes run (the subset's, on a subset)
    if len(runs) == 1 and not several and not machines:
        say("nothing to compare: the plan uses no technique (nothing streamed, no fp8, no checkpointing)")
        result.seconds = time.perf_counter() - t0
        return result

    def on_subset(why: str) -> list[Variant]:
        """The runs on the block subset, said first: the whole reference does not fit."""
        nonlocal keep, checked_plan
        keep = subset
        kept = sum(len(v) for v in subset.values())
        names = ", ".join(f"{attr} {', '.join(map(str, idx))}" for attr, idx in subset.items())
        say(f"the whole reference does not fit: {why}; every run of the check is made on {kept} of the model's "
            f"{total} blocks instead ({names}), with the plan's techniques on them")
        sub_plan = replace(plan, streamed_blocks=block_subset.renamed(subset, plan.streamed_blocks))
        checked_plan = sub_plan
        return variants(sub_plan, kept, full, cfg.memory.fp8_modulation)

    too_big = _reference_too_big(plan, planner, budget, device.type)
    if too_big is not None:
        runs = on_subset(too_big)
    with tempfile.TemporaryDirectory(prefix="leantune-check-") if work_dir is None else _keep(work_dir) as tmp:
        if machines:        # first: the other machines' ranks are waiting in the rendezvous
            _machines(cfg, result, say, checked_plan, gpus, nodes, steps, Path(tmp), keep, progress)
        ref_variant, others = runs[0], runs[1:]
        ref = record(ref_variant, raise_build=True)
        if ref.error is not None and ref.out_of_memory and keep is None:
            runs = on_subset(f"the reference ran out of memory ({ref.error})")
            ref_variant, others = runs[0], runs[1:]
            ref = record(ref_variant, raise_build=True)
        result.records[ref_variant.key] = ref
        if ref.error is not None:
            if ref.out_of_memory:
                return _not_fit(result, say, f"the reference ran out of memory, even on a subset of the blocks "
                                             f"({ref.error})", t0)
            say(f"reference: the run failed: {ref.error}")
            result.rc = 1
            result.seconds = time.perf_counter() - t0
            return result
        bitwise = True
        if repeat_reference if repeat_reference is not None else device.type == "cuda":
            again = compare(ref, record(ref_variant), exact=True)
            bitwise = again.held
            say("reference run twice: bitwise reproducible on this device" if bitwise else
                f"reference run twice: NOT bitwise reproducible on this device ({again.text}); the exact "
                f"techniques are compared within the fp8 tolerance instead, which a small schedule fault "
                f"could pass (NaN, missing or zero gradients still fail)")
        for v in others:
            rec = record(v, start=ref.initial or None)
            result.records[v.key] = rec
            if rec.started_from_reference:
                which = "the whole plan" if v.key == "plan" else v.key
                say(f"note: with {which} the same seed built {len(rec.started_from_reference)} adapter tensor(s) "
                    f"otherwise (e.g. {rec.started_from_reference[0]}); this variant starts from the reference's")
            base = result.records[v.against]
            verdict = (compare(base, rec, v.exact and bitwise, TOLERANCES[v.storage]) if base.error is None else
                       Verdict(False, f"not compared: the {v.against} variant it is compared with failed", {}))
            result.verdicts[v.key] = verdict
            say(f"{v.label}: {'held' if verdict.held else 'differs'}"
                f"{' — ' if verdict.held else ': '}{verdict.text}")
            if not verdict.held:
                result.rc = 1
        if several:
            _several(cfg, result, say, checked_plan, gpus, steps, Path(tmp), ref, keep, progress)
        whole = result.records.get("plan") or (result.records[others[-1].key] if others else None)
        if whole is not None:
            say(_performance(plan, whole, device.type))
    result.seconds = time.perf_counter() - t0
    say(f"check: {'every technique held' if result.rc == 0 else 'a technique differs'} "
        f"({result.seconds:.1f} s)")
    return result


def _several(cfg: RunConfig, result: CheckResult, say, plan, gpus: int, steps: int, tmp: Path, ref: Record,
             keep: dict | None, progress) -> None:
    """The whole plan on `gpus` processes against one process at the `gpus`-times batch: its line."""
    from .processes import check_processes, covered, label, same_step, strategy_of
    from .variants import memory_keys

    why_not = covered(cfg)
    if why_not is not None:
        say(f"several processes ({gpus}): not checked — {why_not}")
        return
    _, note = same_step(cfg, gpus)
    whole = Variant("processes", label(gpus, cfg.data.batch_size, strategy_of(cfg), note),
                    memory_keys(plan, poison=True, modulation=cfg.memory.fp8_modulation))
    verdict, records = check_processes(cfg, whole, gpus, steps, tmp, ref.initial or None, keep, progress)
    result.records.update(records)
    result.verdicts["processes"] = verdict
    say(f"{whole.label}: {'held' if verdict.held else 'differs'}{' — ' if verdict.held else ': '}{verdict.text}")
    if not verdict.held:
        result.rc = 1


def _machines(cfg: RunConfig, result: CheckResult, say, plan, gpus: int, nodes, steps: int, tmp: Path,
              keep: dict | None, progress) -> None:
    """The whole plan on several machines against one process at the whole world's batch: its line."""
    from .processes import check_machines, covered, machines_label, same_step, strategy_of
    from .variants import memory_keys

    world = gpus * nodes.count
    why_not = covered(cfg)
    if why_not is not None:             # (the other machines' commands say the same and launch nothing)
        say(f"several machines ({nodes.count}): not checked — {why_not}")
        return
    _, note = same_step(cfg, world)
    whole = Variant("processes", machines_label(gpus, nodes, cfg.data.batch_size, strategy_of(cfg), note),
                    memory_keys(plan, poison=True, modulation=cfg.memory.fp8_modulation))
    verdict, records = check_machines(cfg, whole, gpus, nodes, steps, tmp, keep, progress)
    result.records.update(records)
    result.verdicts["processes"] = verdict
    say(f"{whole.label}: {'held' if verdict.held else 'differs'}{' — ' if verdict.held else ': '}{verdict.text}")
    if not verdict.held:
        result.rc = 1


def _not_fit(result: CheckResult, say, why: str, t0: float) -> CheckResult:
    say(f"check not done: {why}; run the check with a larger budget or on a machine with more memory")
    result.rc = REFERENCE_DOES_NOT_FIT
    result.seconds = time.perf_counter() - t0
    return result


def _record(cfg: RunConfig, v: Variant, steps: int, tmp: Path, start=None, raise_build: bool = False,
            keep_blocks: dict | None = None) -> Record:
    log.info("check: running the %s variant", v.key)
    return record_variant(variant_config(cfg, v, tmp), steps, start, raise_build, keep_blocks)


class _keep:
    """A given folder as a context (not deleted after)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def __enter__(self) -> str:
        self.path.mkdir(parents=True, exist_ok=True)
        return str(self.path)

    def __exit__(self, *exc) -> None:
        return None


__all__ = ["CheckResult", "run_check", "REFERENCE_DOES_NOT_FIT", "FP8_TOLERANCE"]
