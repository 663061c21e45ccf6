"""Run on every process by torchrun in tests/test_gpu_nccl_round2.py (not a test module itself).

FSDP2 with `[distributed] fsdp_cpu_offload` keeps its shards as CPU DTensors, which meet the
default process group at the step's gradient clipping and at every save's `full_tensor()`. This
worker starts the group leantune starts for such a run under NCCL (`group_backend`), with NCCL
emulated as gloo registered for "cuda" only (tests/nccl_like.py: no CPU backend, NCCL's error),
and runs those two operations on CPU DTensors sharded over the ranks, writing what it saw (or the
error) to OUT/rank<r>.json.

`--nccl` (bench/gpu_checks.sh, window 4, on GPUs): real NCCL started as leantune starts it, the
device cuda:LOCAL_RANK, and besides the DTensors above a real FSDP2 `fully_shard` with
CPUOffloadPolicy (which needs CUDA) through a backward, the clipping and a full state dict; exit
status 1 on an error. With one GPU the group has one rank: NCCL refuses a host tensor at any
world size, so that is the finding's check too.
"""

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def main(out: str, *flags: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from leantune.accelerate_setup import group_backend
    from leantune.config import validate

    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}, "train": {"mode": "full"},
                    "distributed": {"strategy": "fsdp2", "fsdp_cpu_offload": True}}, "run.toml")
    wanted = group_backend(cfg.distributed, cpu=False, strategy="fsdp2")      # what a GPU run starts
    # NCCL on this CPU machine: gloo for "cuda" only (a plain "nccl" has no CPU backend either).
    nccl = "--nccl" in flags
    emulated = ",".join("cuda:gloo" if part in ("nccl", "cuda:nccl") else part for part in wanted.split(","))
    if nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(wanted if nccl else emulated)
    rank = dist.get_rank()
    seen = {"backend": wanted, "emulated": dist.get_backend_config()}
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        weight = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.full((4, 2), 3.0), mesh, [Shard(0)])
        seen["norm"] = float(torch.nn.utils.clip_grad_norm_([weight], 1.0))
        seen["full"] = weight.detach().full_tensor().tolist()
        if nccl:
            seen["fsdp2_offload"] = _fsdp2_offload_step()
    except Exception as exc:                   # noqa: BLE001 - the test reads the error
        seen["error"] = f"{type(exc).__name__}: {exc}"[:600]
        seen["where"] = traceback.format_exc()[-1500:]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.barrier()              # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()
    if "error" in seen:
        print(seen["error"], seen["where"], file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # Past this point only the interpreter's teardown is left, where a gloo/DTensor thread of torch
    # 2.13 can abort the process now and then ("terminate called without an active exception",
    # about 1 run in 4 here): what was checked is written, so end without it.
    os._exit(1 if "error" in seen else 0)


def _fsdp2_offload_step() -> dict:
    """A two-layer model under FSDP2 with CPUOffloadPolicy on the GPU: forward, backward, the
    clipping the step does and a save's full state dict (what finding 1 crashed at)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for m in (*model, model):
        fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy())
    model(torch.randn(4, 64, device="cuda")).square().sum().backward()
    norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"norm": norm, "shard_device": str(model[0].weight.to_local().device), "saved": sorted(full)}


if __name__ == "__main__":
    main(*sys.argv[1:])
