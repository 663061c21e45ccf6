"""Run on every process by `torchrun` in tests/test_distributed.py (not a test module itself).

`python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py OUT RUN.toml [RUN.toml ...]`
trains each config in turn on this rank (one process group for all of them, so the imports are
paid once) and writes what this rank saw to OUT/rank<r>.json: the losses, how often each encoder
was loaded, and how often the memory plan was re-applied. A config whose file name contains
"resume" trains 3 steps, then resumes to the end. One whose name contains "oom" makes rank 1's 5th
forward/backward fail as the CUDA allocator does, and makes the planner answer the re-plan with a
streaming + checkpointing plan (exact on CPU); "oomfull" (a full fine-tune) makes rank 1's 9th
forward/backward fail the same way, with no planner. The results are written after every config,
so a config that ends the processes leaves those of the configs before it.
"""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def main(out: str, *configs: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    from leantune.config import load_config
    from leantune.planner import search as planner_mod
    from leantune.models import flux_loading
    from leantune import trainer as trainer_mod

    counts = {"vae": 0, "text_encoders": 0, "replans": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return wrapper

    flux_loading.load_vae = counted("vae", flux_loading.load_vae)
    flux_loading.load_text_encoders = counted("text_encoders", flux_loading.load_text_encoders)
    trainer_mod._replan = counted("replans", trainer_mod._replan)
    real_forward, real_plan = trainer_mod.forward_backward, planner_mod.Planner.plan
    results = {}
    for path in configs:
        calls = {"forward": 0, "plan": 0}
        if "oomfull" in Path(path).name:
            def forward(t, c, batch, scale=1.0):
                calls["forward"] += 1
                if rank == 1 and calls["forward"] == 9:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
                return real_forward(t, c, batch, scale)

            trainer_mod.forward_backward, planner_mod.Planner.plan = forward, real_plan
        elif "oom" in Path(path).name:
            def forward(t, c, batch, scale=1.0):
                calls["forward"] += 1
                if rank == 1 and calls["forward"] == 5:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
                return real_forward(t, c, batch, scale)

            def plan(self, budget):
                calls["plan"] += 1
                first = real_plan(self, replace(budget, vram=8 * 2**30))
                if calls["plan"] == 1:
                    return first
                return replace(first, checkpointing="blocks", streamed_blocks=("transformer_blocks.1",))

            trainer_mod.forward_backward, planner_mod.Planner.plan = forward, plan
        else:
            trainer_mod.forward_backward, planner_mod.Planner.plan = real_forward, real_plan
        if "resume" in Path(path).name:          # stop after 3 steps, then resume in the same processes
            trainer_mod.train(load_config(path), stop_after=3, progress=False)
            result = trainer_mod.train(load_config(path), resume=True, progress=False)
        else:
            result = trainer_mod.train(load_config(path), progress=False)
        results[Path(path).stem] = {"losses": result.losses, **counts,
                                    "files": [str(f) for f in result.lora_files]}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()                   # no rank tears the group down while another's last op is in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
