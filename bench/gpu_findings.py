"""The GPU checks of issue 20's findings that no CPU test can make (run by bench/gpu_checks.sh).

    python bench/gpu_findings.py fp32-stream [--blocks 2 2] [--size 512]   # finding 5 on a real GPU
    python bench/gpu_findings.py oom-step1 [--blocks 2 2] [--size 512]     # findings 6 and 8
    python bench/gpu_findings.py two-gpu-guard                             # finding 10 (needs 2 GPUs)
    python bench/gpu_findings.py <part> --smoke                            # tiny model on the CPU: checks the script

fp32-stream: a full fine-tune step of Flux-dev's full width (`--blocks` double and single blocks)
with fp32 weights, every block streamed and checkpointed, bf16 autocast, through the trainer's own
`train_step`: the step's peak allocated VRAM against the planner's prediction for that plan. With
autocast's cast cache on, the forward would hold a bf16 copy of every streamed weight.

oom-step1: the same model and plan under the OOM guard, with an out-of-memory error injected in the
first step's forward: the guard re-plans and redoes the step. Reported: host RSS before, after
the re-plan and after the step (a re-plan must not hold a second copy of the streamed blocks: RSS
stays within the plan's host figure plus one unit), the redone step's peak, and whether a
calibration from that step was stored (it must not be).

two-gpu-guard: on cuda:1, a host-step engine runs a step and frees its pinned buffers; no CUDA
context may appear on GPU 0 (torch.cuda.list_gpu_processes). Skipped with fewer than two GPUs.

Each part prints one JSON line (the result) and exits non-zero when its check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def build(a, weights: torch.dtype, half: bool = False):
    """A full-mode Trainee on a randomly initialised model, every block streamed and checkpointed."""
    from leantune.config import validate
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.simulated_run import meta_model
    from leantune.models.family import get_family
    from leantune.train.modes import make_mode
    from leantune.train.optim import build_scheduler
    from leantune.trainer import Trainee

    device = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        from leantune import tiny

        model = tiny.flux_transformer(seed=0, dtype=weights)
        size = 64
    else:
        model = meta_model("flux-dev", tuple(a.blocks)).to_empty(device="cpu").to(weights)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        size = a.size
    family = get_family("flux")
    spec = family.spec
    cfg = validate({"model": {"path": "unused", "dtype": "fp32" if weights == torch.float32 else "bf16"},
                    "data": {"datasets": [{"path": "unused"}], "resolutions": [size], "batch_size": 1},
                    "train": {"mode": "full", "mixed_precision": "bf16"},
                    "memory": {"vram_budget": f"{a.budget}GiB"}}, "gpu_findings")
    mode = make_mode(cfg)
    params = mode.prepare(model, spec)
    blocks = tuple(n for n, _ in spec.blocks(model))
    if half:                                 # half the blocks streamed: an OOM re-plan streams more
        blocks = blocks[::2]
    plan = Plan(streamed_blocks=blocks, checkpointing="blocks", ring_slots=2)
    handle = apply_memory(model, spec, plan, device, **mode.memory_options())
    optimizer = mode.build_optimizer(params)
    h = w = size // 8
    g = torch.Generator().manual_seed(0)
    conf = model.config
    text = 64 if a.smoke else 512
    from leantune.models.flux import PromptEmbeds

    batch = SimpleNamespace(latents=torch.randn(1, 16, h, w, generator=g),
                            embeds=PromptEmbeds(t5=torch.randn(1, text, conf.joint_attention_dim, generator=g).to(weights),
                                                pooled=torch.randn(1, conf.pooled_projection_dim, generator=g).to(weights)),
                            bucket=(size, size))

    class Batches:
        def __iter__(self):
            return self

        def __next__(self):
            return batch

        def state_dict(self):
            return {}

        def load_state_dict(self, state, strict=True):
            pass

    t = Trainee(transformer=model, params=params, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg.train),
                data=None, batches=Batches(), generator=torch.Generator().manual_seed(0), device=device,
                dtype=weights, memory=handle, plan=plan, mode=mode)
    return t, cfg, spec, plan


def predicted_peak(t, cfg, spec, plan) -> int:
    from leantune.planner.corrections import Calibration
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.machine import probe_machine
    from leantune.planner.search import Planner

    planner = Planner(spec, t.transformer, workload_from_config(cfg, t.transformer), probe_machine(), Calibration())
    est = planner.estimate(plan)
    return int(est.peak_vram)


def _phase(part: str, phase: str, **values) -> None:
    """One phase's numbers printed as it ends (a part stopped at its budget still leaves them)."""
    print(json.dumps({"part": part, "phase": phase, **values}, default=str), flush=True)


def fp32_stream(a) -> dict:
    from leantune.trainer import train_step

    t, cfg, spec, plan = build(a, torch.float32)
    _phase("fp32-stream", "built", plan=plan.describe() if hasattr(plan, "describe") else str(plan))
    out = {"part": "fp32-stream", "blocks": a.blocks, "size": a.size}
    losses = [train_step(t, cfg)]
    _phase("fp32-stream", "step 1", loss=losses[-1])
    if t.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses.append(train_step(t, cfg))
    _phase("fp32-stream", "step 2", loss=losses[-1],
           peak=torch.cuda.max_memory_allocated() if t.device.type == "cuda" else None)
    out["losses"] = losses
    if t.device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated()
        out["predicted"] = predicted_peak(t, cfg, spec, plan)
        out["ok"] = out["peak"] <= out["predicted"]
    else:
        out["ok"] = all(x == x for x in losses)            # smoke: it ran, losses are numbers
    return out


def oom_step1(a) -> dict:
    from leantune.planner.corrections import Calibration, CalibrationStore
    from leantune.planner.feedback.calibrate import PlanCalibrator
    from leantune.planner.feedback.oom import OomGuard
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.machine import assumed_machine, probe_machine
    from leantune.planner.search import Planner
    from leantune.planner.workload import Budget
    from leantune import trainer

    t, cfg, spec, plan = build(a, torch.bfloat16, half=True)
    _phase("oom-step1", "built", rss=rss())
    machine = replace(assumed_machine(), workspace=0) if a.smoke else probe_machine()
    planner = Planner(spec, t.transformer, workload_from_config(cfg, t.transformer), machine, Calibration())
    # The budget the running plan was chosen under: its predicted peak (a re-plan must stream more).
    first = planner.estimate(plan).peak_vram
    budget = Budget(vram=first, ram=2**50, min_margin=0)
    budget = Budget(vram=budget.needed_for(first), ram=2**50, min_margin=0)
    t.guard = OomGuard(planner, budget, plan, lambda new: trainer._replan(t, new))
    store = CalibrationStore(Path(os.environ.get("OUT", ".")) / "oom-step1-calibration.json")
    t.calibrator = PlanCalibrator(t.guard, store)
    real = trainer.forward_backward
    calls = {"n": 0}
    rss_at = {"before": rss()}

    def failing(tr, c, b, scale=1.0):
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if calls["n"] == 2:
            rss_at["after_replan"] = rss()
        return real(tr, c, b, scale)

    trainer.forward_backward = failing
    if t.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loss = trainer._guarded_step(t, cfg, 1)
    trainer.forward_backward = real
    rss_at["after_step"] = rss()
    _phase("oom-step1", "step 1 redone", loss=loss, replans=t.guard.replans, rss=rss_at)
    host = (t.guard.plan.notes or {}).get("predicted_peak_host")
    out = {"part": "oom-step1", "loss": loss, "replans": t.guard.replans, "plan": t.guard.plan.describe(),
           "rss": rss_at, "plan_host_peak": host}
    if t.device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated()
        t.calibrator.observe((a.size, a.size), out["peak"])
    out["calibration_stored"] = store.path.exists() if hasattr(store, "path") else None
    grew = rss_at["after_replan"] - rss_at["before"]
    out["rss_growth_at_replan"] = grew
    out["ok"] = t.guard.replans >= 1 and not out["calibration_stored"] and (host is None or rss_at["after_step"] <= host)
    return out


def two_gpu_guard(a) -> dict:
    if a.smoke or torch.cuda.device_count() < 2:
        return {"part": "two-gpu-guard", "skipped": f"needs 2 GPUs, {torch.cuda.device_count()} visible", "ok": True}
    from leantune.memory.trainable_streaming import host_step_worker

    torch.cuda.set_device(1)
    pool = host_step_worker(torch.device("cuda", 1))
    pool.submit(lambda: torch.cuda.Event().synchronize()).result()
    pinned = torch.empty(1 << 20, pin_memory=True)
    pool.submit(lambda: pinned.copy_(torch.ones(1 << 20, device="cuda:1"), non_blocking=False)).result()
    pool.shutdown(wait=True)
    on_gpu0 = torch.cuda.list_gpu_processes(0)
    mine = str(os.getpid()) in on_gpu0
    return {"part": "two-gpu-guard", "gpu0_processes": on_gpu0, "ok": not mine}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=("fp32-stream", "oom-step1", "two-gpu-guard"))
    ap.add_argument("--blocks", type=int, nargs=2, default=[2, 2], help="double and single blocks of full width")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--budget", type=int, default=70, help="GiB of VRAM the planner may use")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, not the GPU")
    a = ap.parse_args()
    out = {"fp32-stream": fp32_stream, "oom-step1": oom_step1, "two-gpu-guard": two_gpu_guard}[a.part](a)
    print(json.dumps(out, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
