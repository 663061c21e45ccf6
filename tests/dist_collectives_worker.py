"""Run on every process by torchrun in tests/test_distributed.py (not a test module itself).

`python -m torch.distributed.run --nproc_per_node 2 tests/dist_collectives_worker.py OUT` starts a
process group with NCCL's device restriction (tests/nccl_like.py), makes the run's DistContext the
way the trainer does (an Accelerator on the CPU), and calls every collective the trainer calls,
writing what this rank saw to OUT/rank<r>.json (or the error, so the test can show it).

`--nccl` (bench/gpu_checks.sh, on GPUs): real NCCL instead, the run's device cuda:LOCAL_RANK, and
the results checked here (exit status 1 on a difference). With one GPU (one process) the context
is told it is distributed, so every collective still runs, over a real one-rank NCCL group: a host
tensor handed to NCCL fails at any world size, which is what finding 1 is about.
"""

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nccl_like import init_group  # noqa: E402

torch.set_num_threads(1)


def main(out: str, *flags: str) -> None:
    rank = int(os.environ["RANK"])
    nccl = "--nccl" in flags
    if nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    else:
        init_group()
    from leantune.config import validate
    from leantune.distributed import DistContext, RankOutOfMemory

    world = int(os.environ["WORLD_SIZE"])
    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}}, "run.toml")
    seen = {}
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    ctx = DistContext.from_config(cfg, device)
    if world == 1:                       # one GPU: run every collective over the one-rank group anyway
        from leantune.distributed import host_group_for_default

        ctx = _forced_context(rank=0, world_size=1, strategy="ddp", device=device,
                              _host_group=host_group_for_default())

    def record(name, fn):
        try:
            seen[name] = fn()
        except Exception as exc:                  # noqa: BLE001 - the test reads the error
            seen[name] = {"error": f"{type(exc).__name__}: {exc}", "where": traceback.format_exc()[-1500:]}

    record("sum", lambda: ctx.sum(1.5 + rank))
    record("vote", lambda: [ctx.vote(True), ctx.vote(rank == 0)])
    record("gather", lambda: ctx.gather(10.0 * rank))
    record("observation", lambda: list(ctx.agree_observation(100 + rank, 1.0 + rank, {"r": rank})))
    record("barrier", lambda: ctx.barrier() or "ok")
    record("main_first", lambda: ctx.main_first(lambda: rank))

    def grads():
        p = torch.nn.Parameter(torch.zeros(3, device=device))
        q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64, device=device))
        p.grad = torch.full((3,), float(rank + 1), device=device)
        ctx.sync_gradients([p, q])                  # q has no gradient on either rank
        return [p.grad.tolist(), q.grad.tolist()]

    record("sync_gradients", grads)

    def oom_on_rank_1():
        def step():
            if rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            p = torch.nn.Parameter(torch.zeros(1, device=device))
            p.grad = torch.ones(1, device=device)
            ctx.sync_gradients([p])
            return "stepped"
        try:
            return ctx.agreed_step(step, 1)
        except RankOutOfMemory:
            return "RankOutOfMemory"
        except torch.OutOfMemoryError:
            return "OutOfMemoryError"

    record("agreed_step", oom_on_rank_1)
    record("step_total", lambda: ctx.step_total(1.0))
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    ctx.close(finished=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if nccl:
        want = {"sum": sum(1.5 + r for r in range(world)), "vote": [True, world == 1],
                "gather": [10.0 * r for r in range(world)], "barrier": "ok",
                "sync_gradients": [[float(sum(r + 1 for r in range(world)))] * 3, [0.0, 0.0]],
                "step_total": float(world)}
        wrong = {k: (seen.get(k), v) for k, v in want.items() if seen.get(k) != v}
        print(json.dumps({"rank": rank, "world": world, "wrong": wrong, "seen": seen}))
        if wrong:
            sys.exit(1)


def _forced_context(**fields):
    """A DistContext that counts as distributed at world size 1 (its collectives run, over the group)."""
    from leantune.distributed import DistContext

    class Forced(DistContext):
        @property
        def distributed(self) -> bool:
            return True

    return Forced(**fields)


if __name__ == "__main__":
    main(*sys.argv[1:])
