"""Run on every process by torchrun in tests/test_gpu_nccl_round2.py (not a test module itself).

FSDP2 with `[distributed] fsdp_cpu_offload` keeps its shards as CPU DTensors, which meet the
default process group at the step's gradient clipping and at every save's `full_tensor()`. This
worker starts the group leantune starts for such a run under NCCL (`group_backend`), with NCCL
emulated as gloo registered for "cuda" only (tests/nccl_like.py: no CPU backend, NCCL's error),
and runs those two operations on CPU DTensors sharded over the ranks, writing what it saw (or the
error) to OUT/rank<r>.json. FSDP2's CPUOffloadPolicy itself needs a CUDA device: the run with it
is bench/gpu_checks.sh's.
"""

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def main(out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from leantune.accelerate_setup import group_backend
    from leantune.config import validate

    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}, "train": {"mode": "full"},
                    "distributed": {"strategy": "fsdp2", "fsdp_cpu_offload": True}}, "run.toml")
    wanted = group_backend(cfg.distributed, cpu=False, strategy="fsdp2")      # what a GPU run starts
    # NCCL on this CPU machine: gloo for "cuda" only (a plain "nccl" has no CPU backend either).
    emulated = ",".join("cuda:gloo" if part in ("nccl", "cuda:nccl") else part for part in wanted.split(","))
    dist.init_process_group(emulated)
    rank = dist.get_rank()
    seen = {"backend": wanted, "emulated": dist.get_backend_config()}
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        weight = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.full((4, 2), 3.0), mesh, [Shard(0)])
        seen["norm"] = float(torch.nn.utils.clip_grad_norm_([weight], 1.0))
        seen["full"] = weight.detach().full_tensor().tolist()
    except Exception as exc:                   # noqa: BLE001 - the test reads the error
        seen["error"] = f"{type(exc).__name__}: {exc}"[:600]
        seen["where"] = traceback.format_exc()[-1500:]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
