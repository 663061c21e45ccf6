"""Run on every process by `torchrun` in tests/test_distributed.py (not a test module itself).

`python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py OUT [--plain-gloo] RUN.toml [RUN.toml ...]`
trains each config in turn on this rank (one process group for all of them, so the imports are
paid once) and writes what this rank saw to OUT/rank<r>.json: the losses, how often each encoder
was loaded, and how often the memory plan was re-applied. A config whose file name contains
"resume" trains 3 steps, then resumes to the end. One whose name contains "oom" makes rank 1's 5th
forward/backward fail as the CUDA allocator does, and makes the planner answer the re-plan with a
streaming + checkpointing plan (exact on CPU); "oomfull" (a full fine-tune) makes rank 1's 9th
forward/backward fail the same way, with no planner; "optstep" makes rank 1's first optimizer step
fail that way (after the gradient vote); "probe" makes the ranks' machine probes report different free
VRAM and records the budgets and plans each rank chose. The results are written after every config,
so a config that ends the processes leaves those of the configs before it.

The process group has NCCL's device restriction (tests/nccl_like.py): a host tensor handed to the
default group fails as under NCCL. `--plain-gloo` (first argument after OUT) starts plain gloo for
the FSDP2 / DeepSpeed runs, whose own collectives carry the model's tensors (CPU ones here; CUDA
ones, served by NCCL, on a GPU: bench/gpu_checks.sh runs those under NCCL).

Every patch a config makes (the probe, the optimizer, forward_backward, the planner) is undone
before the next config, so a config's behaviour does not depend on the configs before it.
"""

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nccl_like import init_group  # noqa: E402

torch.set_num_threads(1)


def main(out: str, *configs: str) -> None:
    rank = int(os.environ["RANK"])
    plain = configs[:1] == ("--plain-gloo",)
    configs = configs[1:] if plain else configs
    # The transformer's loading path (diffusers' model classes, peft, and the transformers and
    # torch._dynamo modules they pull in: seconds of CPU) imported here, on every rank at once:
    # inside the first run, rank 1 would import it only after rank 0 has filled the caches, and
    # rank 0 would wait for it.
    from diffusers import FluxTransformer2DModel  # noqa: F401
    from peft.tuners import lora  # noqa: F401
    init_group(plain=plain)
    from leantune.config import load_config
    from leantune.planner import from_config as from_config_mod
    from leantune.planner import search as planner_mod
    from leantune.planner.machine import assumed_machine
    from leantune.models.flux import loading as flux_loading
    from leantune import trainer as trainer_mod
    from leantune.train import lora_mode as modes_mod

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
    real_build_optimizer, real_probe = modes_mod.build_optimizer, from_config_mod.probe_machine
    results = {}
    for path in configs:
        calls = {"forward": 0, "plan": 0}
        modes_mod.build_optimizer, from_config_mod.probe_machine = real_build_optimizer, real_probe
        if "probe" in Path(path).name:
            # The ranks' GPUs report different free VRAM (another process on rank 1's GPU):
            # [memory] vram_budget = "auto" must still give one plan, the same on every rank.
            def probe(device=None, quick=True):
                free = (10 if rank == 0 else 3) * 2**30
                return replace(assumed_machine(), vram_total=12 * 2**30, vram_free=free)

            def plan(self, budget):
                calls["budgets"] = calls.get("budgets", []) + [budget.vram]
                chosen = real_plan(self, budget)
                calls["plans"] = calls.get("plans", []) + [chosen.describe()]
                return chosen

            from_config_mod.probe_machine = probe
            trainer_mod.forward_backward, planner_mod.Planner.plan = real_forward, plan
        elif "optstep" in Path(path).name:
            # Rank 1's first optimizer step fails as AdamW's state allocation would, after the
            # ranks agreed on the step's gradients.
            def build_optimizer(params, tc):
                opt = real_build_optimizer(params, tc)

                def fail(optimizer, args, kwargs):
                    calls["forward"] += 1
                    if rank == 1 and calls["forward"] == 1:
                        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
                opt.register_step_pre_hook(fail)
                return opt

            modes_mod.build_optimizer = build_optimizer
            trainer_mod.forward_backward, planner_mod.Planner.plan = real_forward, real_plan
        elif "oomfull" in Path(path).name:
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
        results[Path(path).stem] = {"losses": result.losses, **counts, "budgets": calls.get("budgets"),
                                    "plans": calls.get("plans"),
                                    "files": [str(f) for f in result.lora_files]}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    # No rank tears the group down while another's last op is in flight (over a group that serves
    # host tensors: the default one may not).
    dist.barrier(group=dist.new_group(backend="gloo"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
