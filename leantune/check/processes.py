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

Several machines (`leantune check --nodes M --node-rank R --master HOST:PORT [--gpus N]`, on each
machine, as `leantune train --nodes M` is started): machine 0 launches its ranks *first*, before
any one-process run, so the other machines' torchrun never waits in the rendezvous for machine 0's
variants; the job (the whole plan as a Variant, the steps, the block subset) reaches the other
machines' ranks through torchrun's own rendezvous store (rank 0 sets it, every other rank reads
it), and each applies it to its own machine's config, so paths stay each machine's. The ranks
start from the seed's adapters; the one-process run at the (N x M)-times batch then runs on machine
0 from rank 0's adapters as built (the reverse of one machine's order), while the ranks wait; rank 0
hands the verdict to every rank through the store, and each machine's command exits with it (0
held, 1 differs), so `train --check --nodes M` trains on every machine or on none.

The worker side is this module run by torchrun: `python -m leantune.check.processes JOB.json`
(machine 0's ranks), `python -m leantune.check.processes --follow CONFIG [--set K=V ...]` (the ranks
of the other machines).
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
FOLLOW = "--follow"                       # the worker's first argument on the machines other than 0
JOB_KEY = "leantune/check/job"            # rendezvous store keys (several machines)
VERDICT_KEY = "leantune/check/verdict"
VERDICTS = ("held", "differs", "failed")


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


def machines_label(gpus: int, nodes, batch_size: int, strategy: str, note: str = "") -> str:
    world = gpus * nodes.count
    return (f"several machines ({nodes.count} x {gpus} process{'es' if gpus > 1 else ''}, {strategy}; the whole plan "
            f"at batch {batch_size} per process, against one process at batch {batch_size * world}{note})")


def check_machines(cfg, plan_variant: Variant, gpus: int, nodes, steps: int, tmp: Path, keep_blocks: dict | None,
                   progress=None) -> tuple[Verdict, dict[str, Record]]:
    """Machine 0's side of the check on `nodes.count` machines of `gpus` processes each (module
    docstring): the ranks first, then one process at the whole world's batch from rank 0's adapters
    as built, the verdict handed to every rank."""
    b = cfg.data.batch_size
    world = gpus * nodes.count
    full = cfg.train.mode == "full"
    keys, _ = same_step(cfg, world)
    same = {"train": keys["train"], "model": keys["model"], "full": {**plan_variant.full, **keys["full"]}}
    several = replace(plan_variant, key="processes", **same)
    if progress is not None:
        progress(f"check: running the whole plan on {nodes.count} machines x {gpus} processes (torchrun; start "
                 f"`leantune check --nodes {nodes.count} --node-rank R ...` on the others now) ...")
    timeout_s = cfg.distributed.timeout_minutes * 60 + 600
    ranks = MachineLaunch(variant_config(cfg, several, tmp), several, gpus, nodes, steps, tmp / "machines-job",
                          keep_blocks, timeout_s)
    rec = ranks.record()
    records = {"processes": rec}
    if rec.error is not None:
        ranks.finish("failed")
        return Verdict(False, f"the ranks failed: {rec.error}", {}), records
    if progress is not None:
        progress(f"check: running the whole plan in one process at batch {b * world} (the ranks wait) ...")
    one = replace(plan_variant, key="one process", data={"batch_size": b * world}, **same)
    ref = record_variant(variant_config(cfg, one, tmp), steps, None if full else (rec.initial or None),
                         keep_blocks=keep_blocks, weights_before=full)
    records["one process"] = ref
    if ref.error is not None:
        verdict = Verdict(False, f"the one-process run at batch {b * world} failed: {ref.error}", {})
    elif full:
        verdict = compare_updates(ref, rec, ref.before, FULL_TOLERANCE)
    else:
        verdict = compare(ref, rec, exact=False, tolerance=PROCESSES_TOLERANCE)
    rc = ranks.finish("held" if verdict.held else "differs")
    if rc != 0 and verdict.held:
        return Verdict(False, f"the ranks ended with exit code {rc} after the comparison held: "
                              f"{_last_error(ranks.log_file)}", verdict.measured), records
    return verdict, records


class MachineLaunch:
    """Machine 0's torchrun for a check on several machines, running in the background: its ranks
    record the steps and wait for the verdict (the file `verdict.json` in the job folder, which rank
    0, on this machine, hands to every rank through the rendezvous store)."""

    def __init__(self, cfg, variant: Variant, gpus: int, nodes, steps: int, folder: Path, keep_blocks: dict | None,
                 timeout_s: float):
        from dataclasses import asdict

        from ..distributed import Nodes, torchrun_command

        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.timeout_s, self.gpus = folder, timeout_s, gpus
        job = {"config": cfg.model_dump(mode="json", exclude_unset=True), "base_dir": str(cfg.base_dir),
               "steps": steps, "out": str(folder), "start": None, "variant": asdict(variant),
               "keep_blocks": {k: list(v) for k, v in keep_blocks.items()} if keep_blocks else None,
               "machines": nodes.count, "timeout_s": timeout_s}
        (folder / "job.json").write_text(json.dumps(job))
        here = Nodes(count=nodes.count, rank=0, host=nodes.host, port=nodes.port)
        cmd = torchrun_command(gpus, [], here)
        cmd = cmd[:cmd.index("-m", cmd.index(f"--nproc_per_node={gpus}"))] + ["-m", WORKER_MODULE, str(folder / "job.json")]
        self.log_file = folder / "ranks.log"
        self._out = open(self.log_file, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)

    def record(self) -> Record:
        """Rank 0's record once it wrote it (or the failure: torchrun ended first, or the time ran out)."""
        import time

        deadline = time.monotonic() + self.timeout_s
        done = self.folder / "rank0.json"
        while not done.exists():
            if self.proc.poll() is not None:
                time.sleep(0.5)             # a record written just before the exit
                if done.exists():
                    break
                return Record(error=f"torchrun on this machine exited with code {self.proc.returncode} before rank 0 "
                                    f"recorded its steps: {_last_error(self.log_file)}")
            if time.monotonic() > deadline:
                self.proc.kill()
                return Record(error=f"the ranks did not record their steps within {self.timeout_s:.0f} s (did every "
                                    f"machine start `leantune check --nodes ...`?): {_last_error(self.log_file)}")
            time.sleep(0.2)
        return load_record(self.folder / "rank0")

    def finish(self, verdict: str) -> int:
        """Hand `verdict` to the ranks; torchrun's exit code."""
        tmp = self.folder / "verdict.json.tmp"
        tmp.write_text(json.dumps({"verdict": verdict}))
        os.replace(tmp, self.folder / "verdict.json")
        try:
            rc = self.proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._out.close()
        return rc


def follow(nodes, gpus: int, config: str, overrides: list[str]) -> int:
    """Machine `nodes.rank` (not 0) of a check on several machines: its `gpus` ranks join machine 0's
    and run the job it hands them on this machine's own config (`config` and `overrides`, as this
    machine's `leantune check` was given them); the verdict's exit code."""
    from ..distributed import torchrun_command

    cmd = torchrun_command(gpus, [], nodes)
    cmd = cmd[:cmd.index("-m", cmd.index(f"--nproc_per_node={gpus}"))] + [
        "-m", WORKER_MODULE, FOLLOW, str(Path(config).resolve()), *[a for o in overrides for a in ("--set", o)]]
    return subprocess.run(cmd).returncode


def follow_machine_0(cfg, nodes, gpus: int, config: str, overrides: list[str]) -> int:
    """A machine other than 0 of a check on several machines: its ranks run the job machine 0 hands
    them; the verdict machine 0 reached is this command's exit code (machine 0 prints the line)."""
    why_not = covered(cfg)
    if why_not is not None:
        print(f"several machines ({nodes.count}): not checked — {why_not}", flush=True)
        return 0
    print(f"check: machine {nodes.rank} of {nodes.count}: {gpus} process(es) joining machine 0's at "
          f"{nodes.host}:{nodes.port} ...", file=sys.stderr, flush=True)
    rc = follow(nodes, gpus, config, overrides)
    print(f"check: machine {nodes.rank} of {nodes.count}: "
          + ("the whole plan on every machine held (machine 0 prints the comparison)" if rc == 0 else
             f"the check did not hold or its ranks failed (exit code {rc}; machine 0 prints why)"), flush=True)
    return 0 if rc == 0 else 1


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
    tensors.update({f"initial/{n}": w.contiguous() for n, w in rec.initial.items()})
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
    initial = {k.removeprefix("initial/"): v for k, v in tensors.items() if k.startswith("initial/")}
    return Record(losses=meta["losses"], grads=grads, weights=weights, initial=initial, step_s=meta["step_s"],
                  peak_vram=meta["peak_vram"], report=meta["report"],
                  started_from_reference=meta["started_from_reference"], error=meta["error"],
                  out_of_memory=meta["out_of_memory"])


# -- each rank -----------------------------------------------------------------------------------------

def worker(job_file: str, follow_args: list[str] | None = None) -> int:
    """One rank: build the run as `train()` does (its DistContext from the launcher's environment),
    run the steps, and (rank 0, or a rank that failed) write what it recorded. On several machines
    (the job's "machines"), rank 0 puts the job in the rendezvous store for the other machines'
    ranks (`job_file` FOLLOW, `follow_args` their machine's config and overrides), and every rank
    exits with the verdict machine 0 reaches (MachineLaunch.finish)."""
    import tempfile

    from safetensors.torch import load_file

    from ..config import load_config, validate
    from ..distributed import DistContext
    from ..trainer import pick_device

    local_tmp = None
    if job_file == FOLLOW:
        job = json.loads(_store(600).get(JOB_KEY))
        config, overrides = follow_args[0], [v for k, v in zip(follow_args[1::2], follow_args[2::2]) if k == "--set"]
        local_tmp = tempfile.TemporaryDirectory(prefix="leantune-check-rank-")
        cfg = variant_config(load_config(config, overrides), Variant(**job["variant"]), Path(local_tmp.name))
        out = Path(local_tmp.name)
    else:
        job = json.loads(Path(job_file).read_text())
        cfg = validate(job["config"], source="the several-processes run of the check", base_dir=job["base_dir"])
        out = Path(job["out"])
        if job.get("machines") and int(os.environ.get("RANK", "0")) == 0:
            _store(600).set(JOB_KEY, json.dumps({k: job[k] for k in ("steps", "variant", "keep_blocks", "machines",
                                                                       "timeout_s")}))
    dist = DistContext.from_config(cfg, pick_device(cfg))
    finished = False
    try:
        start = load_file(job["start"]) if job.get("start") else None
        keep = {k: list(v) for k, v in job["keep_blocks"].items()} if job["keep_blocks"] else None
        rec = record_variant(cfg, job["steps"], start, keep_blocks=keep, dist=dist)
        if dist.is_main or rec.error is not None:
            save_record(rec, out / f"rank{dist.rank}")
        finished = rec.error is None
    finally:
        rank = dist.rank
        dist.close(finished)
    if not job.get("machines"):
        return 0 if finished else 1
    verdict = _verdict(rank, out, job["timeout_s"]) if finished else "failed"
    if local_tmp is not None:
        local_tmp.cleanup()
    return 0 if verdict == "held" else 1


def _store(timeout_s: float):
    """A client of torchrun's rendezvous store (hosted by machine 0's agent at MASTER_ADDR:MASTER_PORT
    for as long as any machine's agent runs: torchrun's exit barrier)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timedelta(seconds=timeout_s))


def _verdict(rank: int, out: Path, timeout_s: float) -> str:
    """The verdict of a check on several machines: rank 0 waits for machine 0's launcher to write
    it and puts it in the store; every other rank reads it there."""
    import time

    store = _store(timeout_s)
    if rank != 0:
        return store.get(VERDICT_KEY).decode()
    deadline, path = time.monotonic() + timeout_s, out / "verdict.json"
    while not path.exists():
        if time.monotonic() > deadline:
            store.set(VERDICT_KEY, "failed")
            return "failed"
        time.sleep(0.2)
    verdict = json.loads(path.read_text())["verdict"]
    store.set(VERDICT_KEY, verdict if verdict in VERDICTS else "failed")
    return verdict


if __name__ == "__main__":
    if sys.argv[1] == FOLLOW:
        sys.exit(worker(FOLLOW, sys.argv[2:]))
    sys.exit(worker(sys.argv[1]))
