"""The check on several processes: the whole plan on N ranks against one process with the N-times batch.

A run on N processes (`leantune train --gpus N`) trains each rank on its rows of a global batch of
`[data] batch_size x N` (distributed.py): every rank weights its loss by its share, and the
strategy turns the N shares into one step. So N processes must compute the step one process
computes with the N-times batch. The check runs both with the whole plan (streaming in poison
mode, as in the one-process variants): the one-process run here, the N ranks under torchrun, as
`leantune train --gpus N` starts them, each building the run with the trainer's own `_build` and
its `DistContext` (so each strategy's own engine), rank 0 recording what it can see whole. Per
strategy (distributed.resolve_strategy; the config refuses any other pairing):

- LoRA on DDP: the adapter gradients are all-reduced (DistContext.sync_gradients), so rank 0
  records them as its optimizer receives them, with the losses and the adapters after the last
  step: compared as the one-process variants are (`PROCESSES_TOLERANCE`).
- A full fine-tune on FSDP2 (`fully_shard` on every block and the root) or DeepSpeed ZeRO-2
  (`[distributed] offload_optimizer` included; stage 3 is refused by the config): the gradient is
  never whole on any rank (reduce-scattered into FSDP2's shards; reduced into ZeRO's partitions and
  freed inside its step), so the losses per step and the update the steps made (the weights
  gathered whole on rank 0 by the mode's own state(), minus the weights as loaded) are compared
  (compare.compare_updates, `FULL_TOLERANCE`). The one-process run is the one-process full mode
  (each weight stepped inside backward); it clips each parameter on its own where the sharded
  engines clip the global norm, so with [train] max_grad_norm > 0 both runs are made with clipping
  off, and the line says so.

Both runs are made in fp32 (weights and compute) where the run is not (`same_step`): bf16 moves
the comparison by bf16's resolution, which would hide a fault or report one that is not there.

Not bitwise: one process reduces the batch's rows inside each matmul and the loss mean, N ranks
each reduce their rows and the collective adds the N partial sums, so the float additions run in
another order (gloo's sum of two tensors is itself exact, but the partial sums are not the
one-process sum's partial sums); a full fine-tune's two AdamW implementations (the in-backward one
and torch's on the shards) round their arithmetic differently too. docs/check.md gives the
measured differences behind each tolerance.

The worker side is this module run by torchrun: `python -m leantune.check.processes JOB.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from .compare import Tolerance, UpdateTolerance, Verdict, compare, compare_updates
from .record import Record, record_variant
from .variants import Variant, variant_config

# Measured on the tiny Flux (4 blocks, rank 4 on every block Linear, fp32, 64 px, 2 steps, 2 CPU
# processes on gloo against one process at the doubled batch, 2026-12-04): 3 blocks streamed at batch
# 1 per process, seed 3: loss 4.4e-8 relative, gradients 3.6e-7 relative error, weights 5.5e-7;
# streaming + checkpointing at batch 2, seed 7: 1.3e-7, 2.0e-7, 2.1e-8; nothing streamed: as the
# first. A rank whose gradient share is scaled by 1.5 gives 0.42 on the gradients and 0.0079 on the
# weights. The bounds leave about 180x on the weights and 280x on the gradients.
PROCESSES_TOLERANCE = Tolerance(loss_rel=1e-4, grad_rel=1e-4, grad_cos=0.99999, weight_rel=1e-4)
# A full fine-tune on FSDP2 / ZeRO-2 against the one-process full mode (docs/check.md: measured
# on the tiny Flux as above, fp32 weights, AdamW).
FULL_TOLERANCE = UpdateTolerance(loss_rel=1e-4, update_rel=1e-3, weight_rel=1e-5)

# The module torchrun runs on every rank (tests point it at a wrapper that injects a fault first).
WORKER_MODULE = "leantune.check.processes"


def strategy_of(cfg) -> str:
    """The strategy the run trains with on several processes, as its report names it."""
    from ..distributed import resolve_strategy

    strategy = resolve_strategy(cfg.distributed.strategy, cfg.train.mode)
    if strategy != "deepspeed":
        return strategy
    from ..accelerate_setup import deepspeed_config

    try:
        stage = deepspeed_config(cfg, 2).get("zero_optimization", {}).get("stage", "?")
    except Exception:                       # noqa: BLE001 (an unreadable file: train names it)
        stage = "?"
    offload = " + optimizer offload" if cfg.distributed.offload_optimizer else ""
    return f"deepspeed ZeRO-{stage}{offload}"


def covered(cfg) -> str | None:
    """Why the run's several processes cannot be checked here, or None. Every strategy leantune
    trains with is: a config that `train --gpus N` itself refuses is said so instead of run."""
    from ..distributed import resolve_strategy

    strategy = resolve_strategy(cfg.distributed.strategy, cfg.train.mode)
    if cfg.train.mode == "lora":
        return None if strategy == "ddp" else f"a LoRA run on {strategy}: LoRA trains on DDP only"
    m = cfg.memory
    if m.streamed_blocks not in (0, [], "none") or m.stream_non_blocks or m.vram_budget is not None:
        return (f"a full fine-tune on several processes ({strategy}) runs without [memory] streamed_blocks / "
                f"stream_non_blocks / vram_budget (the sharded engines own where the weights live), and "
                f"`train --gpus N` refuses this config; remove those keys to check the run it would make")
    return None


def clipping_off(cfg) -> bool:
    """Whether both runs of a full fine-tune's check are made without clipping (module docstring)."""
    return cfg.train.mode == "full" and cfg.train.max_grad_norm > 0 and cfg.full.grad_clip == "parameter"


def same_step(cfg, gpus: int) -> tuple[dict, str]:
    """The keys both runs of the comparison set so that one process and N compute the same step
    up to the order of float additions, and what the line says of them (module docstring).

    In fp32: a bf16 model, or bf16 autocast, rounds each rank's partial sums to bf16 before the
    collective adds them, which moves the result by bf16's resolution, not by a fault (measured on
    the tiny Flux, docs/check.md: LoRA on DDP in bf16, gradients 0.0053 relative error; a full
    fine-tune on FSDP2 with bf16 weights, updates 0.82, with fp32 weights under bf16 autocast 0.017;
    a rank's update half wrong gives 0.35), and a full fine-tune's bf16 weights are stepped
    differently by each strategy by design (stochastic rounding in one process, fp32 masters in
    ZeRO-2, nearest rounding in FSDP2). In fp32 the same comparison is at float32's resolution.
    A full fine-tune's AdamW moments are fp32 in both (the sharded strategies keep them so); its
    clipping is off in both where one process clips each parameter on its own."""
    keys: dict = {"model": {}, "train": {}, "full": {}}
    said = []
    if cfg.model.dtype != "fp32" or cfg.train.mixed_precision != "no":
        keys["model"]["dtype"] = "fp32"
        keys["train"]["mixed_precision"] = "no"
        said.append(f"in fp32 (the run: [model] dtype {cfg.model.dtype}, [train] mixed_precision "
                    f"{cfg.train.mixed_precision}; bf16 rounds each rank's partial sums)")
    if cfg.train.mode == "full" and cfg.full.state_dtype != "fp32":
        keys["full"]["state_dtype"] = "fp32"
        said.append("AdamW moments fp32 in both")
    if clipping_off(cfg):
        keys["train"]["max_grad_norm"] = 0.0
        said.append(f"[train] max_grad_norm off in both: one process clips each parameter, {gpus} processes "
                    f"the global norm")
    return keys, "".join(f"; {s}" for s in said)


def label(gpus: int, batch_size: int, strategy: str = "ddp", note: str = "") -> str:
    return (f"several processes ({gpus}, {strategy}; the whole plan at batch {batch_size} per process, against one "
            f"process at batch {batch_size * gpus}{note})")


def check_processes(cfg, plan_variant: Variant, gpus: int, steps: int, tmp: Path, start: dict | None,
                    keep_blocks: dict | None, progress=None) -> tuple[Verdict, dict[str, Record]]:
    """Run `plan_variant` (the whole plan) in this process at `gpus` times the batch and on `gpus`
    processes at the config's batch; compare the ranks' record with this process's."""
    b = cfg.data.batch_size
    full = cfg.train.mode == "full"
    keys, _ = same_step(cfg, gpus)
    same = {"train": keys["train"], "model": keys["model"], "full": {**plan_variant.full, **keys["full"]}}
    one = replace(plan_variant, key="one process", data={"batch_size": b * gpus}, **same)
    if progress is not None:
        progress(f"check: running the whole plan in one process at batch {b * gpus} ...")
    ref = record_variant(variant_config(cfg, one, tmp), steps, start, keep_blocks=keep_blocks, weights_before=full)
    records = {"one process": ref}
    if ref.error is not None:
        return Verdict(False, f"the one-process run at batch {b * gpus} failed: {ref.error}", {}), records
    if progress is not None:
        progress(f"check: running the whole plan on {gpus} processes (torchrun) ...")
    several = replace(plan_variant, key="processes", **same)
    rec = launch(variant_config(cfg, several, tmp), gpus, steps, tmp / "processes-job",
                 None if full else (ref.initial or None), keep_blocks,
                 timeout_s=cfg.distributed.timeout_minutes * 60 + 600)
    records["processes"] = rec
    if full:
        return compare_updates(ref, rec, ref.before, FULL_TOLERANCE), records
    return compare(ref, rec, exact=False, tolerance=PROCESSES_TOLERANCE), records


def launch(cfg, gpus: int, steps: int, folder: Path, start: dict | None, keep_blocks: dict | None,
           timeout_s: float) -> Record:
    """torchrun with `gpus` processes of this module on `cfg`; rank 0's record (or the failure)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    start_file = None
    if start:
        start_file = folder / "start.safetensors"
        save_file({k: v.contiguous() for k, v in start.items()}, str(start_file))
    job = {"config": cfg.model_dump(mode="json", exclude_unset=True), "base_dir": str(cfg.base_dir),
           "steps": steps, "out": str(folder), "start": str(start_file) if start_file else None,
           "keep_blocks": {k: list(v) for k, v in keep_blocks.items()} if keep_blocks else None}
    (folder / "job.json").write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", WORKER_MODULE, str(folder / "job.json")]
    log_file = folder / "ranks.log"
    try:
        with open(log_file, "w") as out:
            run = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
        rc = run.returncode
    except subprocess.TimeoutExpired:
        # (the log is in the check's temporary folder: its last error is said here)
        return Record(error=f"the {gpus} processes did not finish within {timeout_s:.0f} s: {_last_error(log_file)}")
    rec = load_record(folder / "rank0") if (folder / "rank0.json").exists() else None
    if rc != 0 or rec is None:
        why = rec.error if rec is not None and rec.error else _last_error(log_file)
        return Record(error=f"torchrun with {gpus} processes exited with code {rc}: {why}")
    return rec


def _last_error(log_file: Path) -> str:
    lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]


# -- a record on disk (rank 0 to the launching process) ------------------------------------------------

def save_record(rec: Record, stem: Path) -> None:
    """`stem`.safetensors (gradients and weights) and `stem`.json (the rest), each written atomically."""
    from safetensors.torch import save_file

    tensors = {f"weight/{n}": w.contiguous() for n, w in rec.weights.items()}
    names = []
    for i, step in enumerate(rec.grads):
        names.append({n: g is not None for n, g in step.items()})
        tensors.update({f"grad/{i}/{n}": g.contiguous() for n, g in step.items() if g is not None})
    tmp = stem.with_suffix(".safetensors.tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, stem.with_suffix(".safetensors"))
    meta = {"losses": rec.losses, "grads": names, "step_s": rec.step_s, "peak_vram": rec.peak_vram,
            "report": {k: v for k, v in rec.report.items() if isinstance(v, (int, float, str, bool))},
            "started_from_reference": rec.started_from_reference, "error": rec.error,
            "out_of_memory": rec.out_of_memory}
    tmp = stem.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, stem.with_suffix(".json"))


def load_record(stem: Path) -> Record:
    from safetensors.torch import load_file

    meta = json.loads(stem.with_suffix(".json").read_text())
    tensors = load_file(str(stem.with_suffix(".safetensors"))) if stem.with_suffix(".safetensors").exists() else {}
    grads = [{n: (tensors[f"grad/{i}/{n}"] if has else None) for n, has in step.items()}
             for i, step in enumerate(meta["grads"])]
    weights = {k.removeprefix("weight/"): v for k, v in tensors.items() if k.startswith("weight/")}
    return Record(losses=meta["losses"], grads=grads, weights=weights, step_s=meta["step_s"],
                  peak_vram=meta["peak_vram"], report=meta["report"],
                  started_from_reference=meta["started_from_reference"], error=meta["error"],
                  out_of_memory=meta["out_of_memory"])


# -- each rank -----------------------------------------------------------------------------------------

def worker(job_file: str) -> int:
    """One rank: build the run as `train()` does (its DistContext from the launcher's environment),
    run the steps, and (rank 0, or a rank that failed) write what it recorded."""
    from safetensors.torch import load_file

    from ..config import validate
    from ..distributed import DistContext
    from ..trainer import pick_device

    job = json.loads(Path(job_file).read_text())
    cfg = validate(job["config"], source="the several-processes run of the check", base_dir=job["base_dir"])
    dist = DistContext.from_config(cfg, pick_device(cfg))
    finished = False
    try:
        start = load_file(job["start"]) if job["start"] else None
        keep = {k: list(v) for k, v in job["keep_blocks"].items()} if job["keep_blocks"] else None
        rec = record_variant(cfg, job["steps"], start, keep_blocks=keep, dist=dist)
        if dist.is_main or rec.error is not None:
            save_record(rec, Path(job["out"]) / f"rank{dist.rank}")
        finished = rec.error is None
    finally:
        dist.close(finished)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
