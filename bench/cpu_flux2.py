"""FLUX.2 at full width on the CPU: host RAM of a LoRA training step, measured (process peak RSS)
against the planner's host-RAM prediction, as bench/cpu_qwen_image.py does for Qwen-Image.

A random diffusers transformer folder (`transformer/config.json` + one safetensors file, diffusers'
names; block Linear weights e4m3 as an fp8 checkpoint stores them, the rest bf16) is written tensor
by tensor; fewer blocks of full width (`--blocks DOUBLE SINGLE`) keep the measurement within a small
shared machine, and the planner's prediction for the same folder is what is compared:

    python bench/cpu_flux2.py write /tmp/klein9b-2x6 --model flux2-klein-9b --blocks 2 6
    python bench/cpu_flux2.py train-step /tmp/klein9b-2x6 --model flux2-klein-9b --vram 8 --rss-cap 12

The step (rank-16 LoRA on attention + MLP, AdamW, bf16 autocast, 64 px, 64 text rows) runs in a
fresh process through the trainer's own `train_step` under the plan the planner makes for the
`--vram` budget, applied on the CPU; it is stopped above --rss-cap GiB.

On a lent GPU the same step runs on the device (`--device cuda`, bench/gpu_checks.sh's flux2-klein
part): the plan is the planner's for the probed machine, `--steps` steps run (the first creates the
optimizer state), and the device peak of the later ones (torch.cuda.max_memory_allocated /
_reserved) is reported beside the predicted peak VRAM and the predicted step time:

    python bench/cpu_flux2.py write /tmp/klein4b --model flux2-klein-4b
    python bench/cpu_flux2.py train-step /tmp/klein4b --model flux2-klein-4b --vram 6 --size 1024 \
        --text-length 512 --device cuda --steps 3 --rss-cap 60
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_fullsize import GiB, POOL, rss, watched  # noqa: E402

BLOCK_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.")


def write(folder: Path, model_name: str, blocks: tuple[int, int] | None) -> None:
    from leantune.io import save_safetensors_streamed
    from leantune.models.component_files import packaged_config
    from leantune.simulated_run import MODELS, meta_model

    model = meta_model(model_name, blocks)
    state = model.state_dict()

    def dtype_of(key: str, t: torch.Tensor) -> torch.dtype:
        in_block = key.startswith(BLOCK_PREFIXES) and key.endswith(".weight") and t.dim() == 2
        return torch.float8_e4m3fn if in_block else torch.bfloat16

    layout = [(k, tuple(t.shape), dtype_of(k, t)) for k, t in state.items()]
    g = torch.Generator().manual_seed(0)
    pools = {torch.bfloat16: torch.randn(POOL, generator=g).mul_(0.05).to(torch.bfloat16),
             torch.float8_e4m3fn: torch.randn(POOL, generator=g).mul_(8.0).to(torch.float8_e4m3fn)}

    def chunks():
        offset = 0
        for key, shape, dtype in layout:
            n = math.prod(shape)
            flat = torch.empty(n, dtype=dtype)
            done = 0
            while done < n:
                start = offset % (POOL - 1)
                m = min(n - done, POOL - start)
                flat[done:done + m] = pools[dtype][start:start + m]
                done, offset = done + m, offset + 7919 * m + 1
            yield {key: flat.view(shape)}

    sub = folder / "transformer"
    sub.mkdir(parents=True, exist_ok=True)
    config = dict(packaged_config(MODELS[model_name][1]))
    if blocks:
        config.update(num_layers=blocks[0], num_single_layers=blocks[1])
    (sub / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "_comment"}, indent=1))
    t0 = time.perf_counter()
    path = sub / "diffusion_pytorch_model.safetensors"
    save_safetensors_streamed(path, layout, chunks(), metadata={"note": "random weights, leantune bench"})
    print(json.dumps({"folder": str(folder), "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0}))


def train_step_child(folder: Path, model_name: str, vram_gib: float, size: int, text_length: int, rank: int,
                     device_name: str = "cpu", steps: int = 1) -> dict:
    from types import SimpleNamespace

    from leantune.config import validate
    from leantune.memory.engine import apply_memory
    from leantune.models.family import PromptEmbeds, get_family
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.search import Planner
    from leantune.planner.workload import Budget
    from leantune.train.modes import make_mode
    from leantune.train.optim import build_scheduler
    from leantune.trainer import Trainee, train_step

    family = get_family(model_name)
    cfg = validate({"model": {"path": str(folder), "family": model_name},
                    "data": {"datasets": [{"path": "unused"}], "resolutions": [size], "max_text_length": text_length},
                    "lora": {"rank": rank}, "train": {"device": device_name},
                    "memory": {"vram_budget": f"{vram_gib}GiB"}})
    t0 = time.perf_counter()
    model = family.load_transformer(family.resolve_sources(cfg.model, Path("/")), dtype=torch.bfloat16)
    t_load = time.perf_counter() - t0
    rss_loaded = rss()
    mode = make_mode(cfg)
    params = mode.prepare(model, family.spec)
    device = torch.device(device_name)
    machine = None
    if device.type == "cuda":
        from leantune.planner.machine import probe_machine

        machine = probe_machine(device)              # the rates the planner prices this GPU's step at
    plan = Planner(family.spec, model, workload_from_config(cfg, model), machine=machine).plan(
        Budget(vram=int(vram_gib * GiB), ram=2**62))
    handle = apply_memory(model, family.spec, plan, device)
    rss_applied = rss()
    optimizer = mode.build_optimizer(params)
    c = model.config
    g = torch.Generator().manual_seed(0)
    f = family.vae_scale_factor
    batch = SimpleNamespace(latents=torch.randn(1, family.latent_channels, size // f, size // f, generator=g),
                            embeds=PromptEmbeds(t5=torch.randn(1, text_length, c.joint_attention_dim, generator=g),
                                                pooled=torch.zeros(1, 0)),
                            bucket=(size, size))
    t = Trainee(transformer=model, params=params, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg.train),
                data=None, batches=iter(lambda: batch, None), generator=torch.Generator().manual_seed(0),
                device=device, dtype=torch.bfloat16, memory=handle, plan=plan, mode=mode)
    handle.step_report()
    times, losses, device_peaks = [], [], []
    for i in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t2 = time.perf_counter()
        losses.append(train_step(t, cfg))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            device_peaks.append({"allocated": torch.cuda.max_memory_allocated(device),
                                 "reserved": torch.cuda.max_memory_reserved(device)})
        times.append(time.perf_counter() - t2)
        # each step's numbers to the log as it ends (stderr: stdout is the one result line), so a
        # run stopped at its budget still leaves them
        print(json.dumps({"step": i + 1, "loss": losses[-1], "seconds": times[-1],
                          **(device_peaks[-1] if device_peaks else {})}), file=sys.stderr, flush=True)
    t_step, loss = times[0], losses[-1]
    r = rss()
    notes = plan.notes
    gpu = {}
    if device_peaks:
        later = device_peaks[1:] or device_peaks      # the first step creates the optimizer state
        gpu = {"device": torch.cuda.get_device_name(device), "step_s": times, "losses": losses,
               "peak_allocated": max(p["allocated"] for p in later), "peak_reserved": max(p["reserved"] for p in later),
               "predicted_peak_vram": notes["predicted_peak_vram"], "predicted_step_s": notes.get("predicted_step_s"),
               "allocated_over_predicted": max(p["allocated"] for p in later) / notes["predicted_peak_vram"],
               "budget": int(vram_gib * GiB)}
    return {"folder": str(folder), "model": model_name, "blocks": [c.num_layers, c.num_single_layers],
            "plan": plan.describe(), "size": size, "text_length": text_length, "rank": rank, "load_s": t_load,
            "step_s": t_step, "loss": loss, "finite": bool(math.isfinite(loss)),
            "held_after_load": sum(x.numel() * x.element_size() for x in list(model.parameters()) + list(model.buffers())),
            "rss_after_load": rss_loaded["VmRSS"], "rss_after_apply": rss_applied["VmRSS"], "peak_rss": r["VmHWM"],
            "predicted_peak_host": notes["predicted_peak_host"], "host_breakdown": notes["host_breakdown"], **gpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("folder", type=Path)
    w.add_argument("--model", default="flux2-klein-9b")
    w.add_argument("--blocks", type=int, nargs=2, default=None, metavar=("DOUBLE", "SINGLE"))
    for name in ("train-step", "_train_child"):
        tr = sub.add_parser(name)
        tr.add_argument("folder", type=Path)
        tr.add_argument("--model", default="flux2-klein-9b")
        tr.add_argument("--vram", type=float, default=8.0)
        tr.add_argument("--size", type=int, default=64)
        tr.add_argument("--text-length", type=int, default=64)
        tr.add_argument("--rank", type=int, default=16)
        tr.add_argument("--rss-cap", type=float, default=12.0)
        tr.add_argument("--device", default="cpu", help="cpu, or cuda on a lent GPU")
        tr.add_argument("--steps", type=int, default=1, help="steps run (on a GPU the peak of those after the first)")
    args = p.parse_args(argv)
    if args.cmd == "write":
        write(args.folder, args.model, tuple(args.blocks) if args.blocks else None)
    elif args.cmd == "_train_child":
        print(json.dumps(train_step_child(args.folder, args.model, args.vram, args.size, args.text_length, args.rank,
                                          args.device, args.steps), default=str), flush=True)
    else:
        cmd = [sys.executable, __file__, "_train_child", str(args.folder), "--model", args.model, "--vram",
               str(args.vram), "--size", str(args.size), "--text-length", str(args.text_length), "--rank",
               str(args.rank), "--device", args.device, "--steps", str(args.steps)]
        print(json.dumps(watched(cmd, args.rss_cap), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
