"""Run on every process by torchrun in tests/test_distributed.py (not a test module itself).

`python -m torch.distributed.run --nproc_per_node 2 tests/dist_collectives_worker.py OUT` starts a
process group with NCCL's device restriction (tests/nccl_like.py), makes the run's DistContext the
way the trainer does (an Accelerator on the CPU), and calls every collective the trainer calls,
writing what this rank saw to OUT/rank<r>.json (or the error, so the test can show it).
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


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    init_group()
    from leantune.config import validate
    from leantune.distributed import DistContext, RankOutOfMemory

    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}}, "run.toml")
    seen = {}
    ctx = DistContext.from_config(cfg, torch.device("cpu"))

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
        p = torch.nn.Parameter(torch.zeros(3))
        q = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        p.grad = torch.full((3,), float(rank + 1))
        ctx.sync_gradients([p, q])                  # q has no gradient on either rank
        return [p.grad.tolist(), q.grad.tolist()]

    record("sync_gradients", grads)

    def oom_on_rank_1():
        def step():
            if rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            p = torch.nn.Parameter(torch.zeros(1))
            p.grad = torch.ones(1)
            ctx.sync_gradients([p])
            return "stepped"
        try:
            return ctx.agreed_step(step, 1)
        except RankOutOfMemory:
            return "RankOutOfMemory"
        except torch.OutOfMemoryError:
            return "OutOfMemoryError"

    record("agreed_step", oom_on_rank_1)
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    ctx.close(finished=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
