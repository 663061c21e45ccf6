"""Full-size Flux.1-dev on the CPU, as a new user without a GPU meets it: loading a ComfyUI fp8 file
with leantune and with diffusers' `from_single_file`, one sampling step and one LoRA training step
through the engine.

Files are written with random weights in the ComfyUI layout (BFL keys, block Linear weights in
float8_e4m3fn, everything else bf16) tensor by tensor, so writing never holds the model:

    python bench/cpu_fullsize.py write /tmp/flux-dev-fp8.safetensors                 # 19 + 38 blocks, 11.9 GB
    python bench/cpu_fullsize.py write /tmp/flux-mid-fp8.safetensors --blocks 5 10   # full width, 5 + 10 blocks

Loads run in a fresh process each, watched from outside: time to a usable model and the process's
peak RSS (VmHWM). A load whose RSS passes --rss-cap GiB is stopped and reported as such (the
machine is shared; diffusers upcasts an fp8 file to bf16, twice its size):

    python bench/cpu_fullsize.py load /tmp/flux-mid-fp8.safetensors --loader leantune
    python bench/cpu_fullsize.py load /tmp/flux-mid-fp8.safetensors --loader diffusers --rss-cap 17

One sampling step (64 px, short prompt) of the loaded model under the planner's inference plan on
the CPU, with the engine's streaming report and peak RSS against the planner's host-RAM prediction:

    python bench/cpu_fullsize.py sample /tmp/flux-dev-fp8.safetensors --vram 8

One LoRA training step (rank 16 on attention + MLP, AdamW, bf16 autocast, 64 px, 64 text tokens)
through the trainer's own `train_step`, under the plan the planner makes for a `--vram` budget,
in a fresh process watched from outside like a load (stopped above --rss-cap GiB); wall and CPU
seconds of the load and of the step, the streaming report, peak RSS against the planner's
host-RAM prediction:

    python bench/cpu_fullsize.py train-step /tmp/flux-dev-fp8.safetensors --vram 8 --rss-cap 18
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30
POOL = 2**26


def rss() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.MULTILINE)}


# -- writing a random ComfyUI fp8 file ---------------------------------------------------------------

def write(path: Path, blocks: tuple[int, int] | None) -> None:
    from leantune.io import save_safetensors_streamed
    from leantune.simulated_run import meta_flux_dev
    from leantune.models.flux import keys as bfl_keys

    model = meta_flux_dev(*(blocks or (None, None)))
    meta_state = bfl_keys.diffusers_to_bfl(model.state_dict())          # meta tensors: shapes only

    def dtype_of(key: str, t: torch.Tensor) -> torch.dtype:
        in_block = key.startswith(("double_blocks.", "single_blocks.")) and key.endswith(".weight") and t.dim() == 2
        return torch.float8_e4m3fn if in_block else torch.bfloat16

    layout = [(k, tuple(t.shape), dtype_of(k, t)) for k, t in meta_state.items()]
    # One pool of normal values per dtype, sliced at a rotating offset: drawing 12 B fresh values
    # would take minutes on a small CPU, and a loader cannot tell the difference.
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

    t0 = time.perf_counter()
    save_safetensors_streamed(path, layout, chunks(), metadata={"note": "random weights, leantune bench"})
    print(json.dumps({"file": str(path), "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0}))


# -- loading ------------------------------------------------------------------------------------------

def load_child(path: Path, loader: str) -> None:
    """Runs in its own process: load, then print time, peak RSS and the bytes the model holds."""
    from diffusers import FluxTransformer2DModel  # noqa: F401  (imports are not the load)

    import leantune.memory.fp8  # noqa: F401
    from leantune.models.flux.loading import FluxSources, load_transformer

    start = rss()["VmRSS"]
    t0 = time.perf_counter()
    if loader == "leantune":
        model = load_transformer(FluxSources(path, None, None, None, None, None), dtype=torch.bfloat16)
    else:
        import tempfile

        from diffusers import FluxTransformer2DModel

        from leantune.simulated_run import meta_flux_dev
        from leantune.models.weights import read_header

        # Offline, diffusers needs the architecture config next to the file: Flux.1-dev's, with the
        # block counts of this file (written before the clock starts).
        keys = [k for k in read_header(path)[0] if k != "__metadata__"]
        counts = [1 + max((int(k.split(".")[1]) for k in keys if k.startswith(prefix)), default=-1)
                  for prefix in ("double_blocks.", "single_blocks.")]
        config = tempfile.mkdtemp()
        meta_flux_dev(*counts).save_config(config)
        start = rss()["VmRSS"]
        t0 = time.perf_counter()
        model = FluxTransformer2DModel.from_single_file(str(path), config=config, torch_dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    r = rss()
    print(json.dumps({"loader": loader, "seconds": seconds, "peak_rss": r["VmHWM"], "rss_before": start,
                      "held": held}), flush=True)


def load(path: Path, loader: str, rss_cap: float) -> dict:
    """`load_child` in a fresh process, stopped when its RSS passes `rss_cap` GiB."""
    out = watched([sys.executable, __file__, "_load_child", str(path), "--loader", loader], rss_cap)
    return {"loader": loader, "file": str(path), **out}


def watched(cmd: list[str], rss_cap: float) -> dict:
    """Run `cmd` (which prints one JSON line last), stopped when its RSS passes `rss_cap` GiB: its
    result with the wall time, or where and when it was stopped."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak, stopped = 0, False
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            m = re.search(r"^VmRSS:\s+(\d+) kB", status.read_text(), re.MULTILINE)
        except OSError:
            m = None
        if m:
            peak = max(peak, int(m.group(1)) * 1024)
            if peak > rss_cap * GiB:
                proc.kill()
                stopped = True
                break
        time.sleep(0.2)
    out, _ = proc.communicate()
    wall = time.perf_counter() - t0
    if stopped:
        return {"stopped": True, "rss_cap": rss_cap * GiB, "peak_rss_seen": peak, "seconds_until_stopped": wall}
    if proc.returncode:
        return {"failed": proc.returncode, "peak_rss_seen": peak, "wall_s": wall}
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "wall_s": wall}


# -- one sampling step --------------------------------------------------------------------------------

def sample(path: Path, vram_gib: float, size: int, text_length: int) -> dict:
    """Load with leantune, plan an inference step for a `vram_gib` budget, apply it on the CPU (the
    ring slots are host buffers there), run one denoising step of the sampler, report."""
    from leantune.infer.sampler import denoise
    from leantune.models.schedule import FlowSchedule
    from leantune.memory.engine import apply_memory
    from leantune.models.flux import FLUX_SPEC, PromptEmbeds
    from leantune.models.flux.loading import FluxSources, load_transformer
    from leantune.planner.from_config import plan_memory
    from leantune.planner.workload import Budget, Workload

    t0 = time.perf_counter()
    model = load_transformer(FluxSources(path, None, None, None, None, None), dtype=torch.bfloat16)
    model = model.eval().requires_grad_(False)
    t_load = time.perf_counter() - t0
    rss_loaded = rss()
    workload = Workload(mode="inference", batch_size=1, buckets=((size, size),), text_length=text_length,
                        autocast=False, dtype=torch.bfloat16)
    plan = plan_memory(FLUX_SPEC, model, workload, Budget(vram=int(vram_gib * GiB)))
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu")
    handle.forward_only(True)
    rss_applied = rss()
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    embeds = PromptEmbeds(t5=torch.randn(1, text_length, cfg.joint_attention_dim, generator=g, dtype=torch.bfloat16),
                          pooled=torch.randn(1, cfg.pooled_projection_dim, generator=g, dtype=torch.bfloat16))
    t1 = time.perf_counter()
    with torch.no_grad():
        latents = denoise(model, [embeds], [0], width=size, height=size, steps=1, guidance=3.5,
                          schedule=FlowSchedule.for_variant("dev"), device="cpu", dtype=torch.bfloat16)
    t_step = time.perf_counter() - t1
    report = handle.step_report(wait=True)
    r = rss()
    notes = plan.notes
    return {"file": str(path), "plan": plan.describe(), "size": size, "text_length": text_length,
            "vram_budget": vram_gib * GiB, "load_s": t_load, "step_s": t_step, "finite": bool(latents.isfinite().all()),
            "rss_after_load": rss_loaded["VmRSS"], "rss_after_apply": rss_applied["VmRSS"], "peak_rss": r["VmHWM"],
            "predicted_peak_host": notes["predicted_peak_host"], "host_breakdown": notes["host_breakdown"],
            "stream_report": report}


# -- one LoRA training step ------------------------------------------------------------------------------

def train_step_child(path: Path, vram_gib: float, size: int, text_length: int, rank: int) -> dict:
    """Load with leantune, add the trainer's LoRA, plan a training step for a `vram_gib` budget,
    apply it on the CPU, run one step of the trainer's `train_step` on a random cached batch."""
    import resource
    from types import SimpleNamespace

    from leantune.config import validate
    from leantune.memory.engine import apply_memory
    from leantune.models.flux import FLUX_SPEC, PromptEmbeds
    from leantune.models.flux.loading import FluxSources, load_transformer
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.search import Planner
    from leantune.planner.workload import Budget
    from leantune.train.modes import make_mode
    from leantune.train.optim import build_scheduler
    from leantune.trainer import Trainee, train_step

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    cfg = validate({"model": {"path": str(path)}, "data": {"datasets": [{"path": "unused"}], "resolutions": [size],
                                                        "max_text_length": text_length},
                    "lora": {"rank": rank}, "train": {"device": "cpu"},
                    "memory": {"vram_budget": f"{vram_gib}GiB"}})
    t0, c0 = time.perf_counter(), cpu_s()
    model = load_transformer(FluxSources(path, None, None, None, None, None), dtype=torch.bfloat16)
    t_load, c_load = time.perf_counter() - t0, cpu_s() - c0
    rss_loaded = rss()
    mode = make_mode(cfg)
    params = mode.prepare(model, FLUX_SPEC)
    planner = Planner(FLUX_SPEC, model, workload_from_config(cfg, model))
    plan = planner.plan(Budget(vram=int(vram_gib * GiB), ram=2**62))     # host RAM reported, not limited
    t1 = time.perf_counter()
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu")
    t_apply = time.perf_counter() - t1
    rss_applied = rss()
    optimizer = mode.build_optimizer(params)
    c = model.config
    g = torch.Generator().manual_seed(0)
    batch = SimpleNamespace(latents=torch.randn(1, c.in_channels // 4, size // 8, size // 8, generator=g),
                            embeds=PromptEmbeds(t5=torch.randn(1, text_length, c.joint_attention_dim, generator=g),
                                                pooled=torch.randn(1, c.pooled_projection_dim, generator=g)),
                            bucket=(size, size))
    t = Trainee(transformer=model, params=params, optimizer=optimizer, scheduler=build_scheduler(optimizer, cfg.train),
                data=None, batches=iter(lambda: batch, None), generator=torch.Generator().manual_seed(0),
                device=torch.device("cpu"), dtype=torch.bfloat16, memory=handle, plan=plan, mode=mode)
    handle.step_report()                                          # counters from here on
    t2, c2 = time.perf_counter(), cpu_s()
    loss = train_step(t, cfg)
    t_step, c_step = time.perf_counter() - t2, cpu_s() - c2
    report = handle.step_report(wait=True)
    r = rss()
    notes = plan.notes
    return {"file": str(path), "plan": plan.describe(), "size": size, "text_length": text_length, "rank": rank,
            "vram_budget": vram_gib * GiB, "threads": torch.get_num_threads(),
            "load_s": t_load, "load_cpu_s": c_load, "apply_s": t_apply, "step_s": t_step, "step_cpu_s": c_step,
            "loss": loss, "finite": bool(math.isfinite(loss)) and all(p.grad is None or bool(p.grad.isfinite().all())
                                                                      for p in params),
            "held_after_load": sum(x.numel() * x.element_size() for x in list(model.parameters()) + list(model.buffers())),
            "rss_after_load": rss_loaded["VmRSS"], "rss_after_apply": rss_applied["VmRSS"], "peak_rss": r["VmHWM"],
            "predicted_peak_host": notes["predicted_peak_host"], "host_breakdown": notes["host_breakdown"],
            "stream_report": report, "fp8": handle.fp8.describe() if handle.fp8 else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("path", type=Path)
    w.add_argument("--blocks", type=int, nargs=2, default=None, metavar=("DOUBLE", "SINGLE"))
    ld = sub.add_parser("load")
    ld.add_argument("path", type=Path)
    ld.add_argument("--loader", choices=["leantune", "diffusers"], required=True)
    ld.add_argument("--rss-cap", type=float, default=17.0, help="GiB; the load is stopped above it")
    lc = sub.add_parser("_load_child")
    lc.add_argument("path", type=Path)
    lc.add_argument("--loader", required=True)
    s = sub.add_parser("sample")
    s.add_argument("path", type=Path)
    s.add_argument("--vram", type=float, default=8.0, help="GiB budget the plan is made for")
    s.add_argument("--size", type=int, default=64)
    s.add_argument("--text-length", type=int, default=64)
    for name in ("train-step", "_train_child"):
        tr = sub.add_parser(name)
        tr.add_argument("path", type=Path)
        tr.add_argument("--vram", type=float, default=8.0, help="GiB budget the plan is made for")
        tr.add_argument("--size", type=int, default=64)
        tr.add_argument("--text-length", type=int, default=64)
        tr.add_argument("--rank", type=int, default=16)
        tr.add_argument("--rss-cap", type=float, default=18.0, help="GiB; the run is stopped above it")
    args = p.parse_args(argv)
    if args.cmd == "write":
        write(args.path, tuple(args.blocks) if args.blocks else None)
    elif args.cmd == "_load_child":
        load_child(args.path, args.loader)
    elif args.cmd == "load":
        print(json.dumps(load(args.path, args.loader, args.rss_cap)))
    elif args.cmd == "_train_child":
        print(json.dumps(train_step_child(args.path, args.vram, args.size, args.text_length, args.rank), default=str),
              flush=True)
    elif args.cmd == "train-step":
        cmd = [sys.executable, __file__, "_train_child", str(args.path), "--vram", str(args.vram), "--size",
               str(args.size), "--text-length", str(args.text_length), "--rank", str(args.rank)]
        print(json.dumps(watched(cmd, args.rss_cap), default=str))
    else:
        print(json.dumps(sample(args.path, args.vram, args.size, args.text_length), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
