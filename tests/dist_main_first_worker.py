"""Run on every process by torchrun in tests/test_gpu_nccl_round2.py (not a test module itself).

`python -m torch.distributed.run --nproc_per_node 2 tests/dist_main_first_worker.py OUT`: a gloo
group whose collectives time out after 2 s, and rank 0's part of `main_first` taking 4 s (a
caching phase longer than the group's timeout). Each rank writes OUT/rank<r>.json: when its own
part started and ended, for two contexts in the same group (the second goes on counting keys),
and whether a plain barrier behind such a phase timed out, as main_first's barrier did before.
"""

import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leantune.distributed import DistContext  # noqa: E402

torch.set_num_threads(1)
RANK_0_PART_S = 4.0


def part(rank: int, seen: list) -> str:
    start = time.time()
    if rank == 0:
        time.sleep(RANK_0_PART_S)
    seen.append([start, time.time()])
    return f"rank {rank}'s result"


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    result: dict = {}
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
        for name in ("first", "second"):
            ctx = DistContext(rank=rank, world_size=2, local_rank=rank, local_world_size=2, strategy="ddp",
                              backend="gloo")
            seen: list = []
            result[name] = {"returned": ctx.main_first(lambda: part(rank, seen), "the test's part"), "part": seen[0]}
        if rank == 0:
            time.sleep(RANK_0_PART_S)            # the same phase, then a plain barrier: the old wait
        try:
            dist.barrier()
            result["barrier"] = "passed"
        except Exception as e:                   # noqa: BLE001
            result["barrier"] = f"{type(e).__name__}: {e}"[:300]
    except Exception:                            # noqa: BLE001
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)                                  # a timed-out gloo group cannot be destroyed cleanly


if __name__ == "__main__":
    main(sys.argv[1])
