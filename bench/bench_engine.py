"""Benchmark the memory engine: Flux-dev LoRA training steps under each memory plan.

    python bench/bench_engine.py --out docs/bench-engine.md                  # every row (about 15 min)
    python bench/bench_engine.py --configs resident-fp8 stream-all-fp8       # some rows; results accumulate
    python bench/bench_engine.py --report --out docs/bench-engine.md         # table from stored results only
    python bench/bench_engine.py --smoke                                     # tiny model on CPU: checks the script

Model: the full-size Flux.1-dev transformer (19 double + 38 single blocks, 24 heads x 128, joint
attention 4096, pooled 768, guidance embedder) built on the meta device and materialized with random
weights (nothing is downloaded); LoRA rank 16 on attention + MLP (leantune.train.lora.add_lora),
AdamW, batch 1, 512 T5 tokens, at 512 and 1024 px, checkpointing on.

Rows: all resident (bf16, fp8); a quarter, half and all blocks streamed (bf16, fp8; "all" also
streams the non-block modules); each with checkpointed inputs on the device and offloaded to host.
Columns: seconds per step (median), peak reserved VRAM, host RSS, bytes streamed per step, the
engine's measured copy and stall time, and the lower bound
    bound = max(resident step at the same precision and offload, streamed bytes per step / pinned H2D bandwidth)
with the measured step as a multiple of it. H2D bandwidth is measured here, pinned and pageable.
Targets: all blocks streamed, fp8, 1024 px: step <= 1.10 x bound and peak reserved <= 6 GiB.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from leantune.config import LoraConfig
from leantune.io import atomic_write_bytes, atomic_write_json
from leantune.memory.engine import apply_memory, even_spread
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, pack_latents, predict

GiB = 2**30
# Flux.1-dev's transformer configuration (as in its diffusers folder).
FLUX_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
# name -> (fp8, fraction of blocks streamed)
CONFIGS = {
    "resident-bf16": (False, 0.0), "resident-fp8": (True, 0.0),
    "stream-quarter-bf16": (False, 0.25), "stream-quarter-fp8": (True, 0.25),
    "stream-half-bf16": (False, 0.5), "stream-half-fp8": (True, 0.5),
    "stream-all-bf16": (False, 1.0), "stream-all-fp8": (True, 1.0),
}


# -- model ------------------------------------------------------------------------------------------

def build_model(smoke: bool, device: torch.device):
    """Full-size Flux-dev on meta, materialized in host RAM with N(0, 0.02) weights drawn on the GPU
    (a CPU generator takes minutes for 12 B values); norm weights 1, biases 0."""
    from diffusers import FluxTransformer2DModel

    if smoke:
        from leantune import tiny

        model = tiny.flux_transformer(dtype=torch.bfloat16)
    else:
        with torch.device("meta"):
            model = FluxTransformer2DModel(**FLUX_DEV)
        model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)   # still on meta: free
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, device=device, dtype=torch.bfloat16).mul_(0.02).cpu())
    model.requires_grad_(False)
    return model


def add_adapter(model) -> list[torch.nn.Parameter]:
    from leantune.train.lora import add_lora

    return add_lora(model, FLUX_SPEC, LoraConfig(rank=16, targets="attention_mlp"))


def make_batch(px: int, device, smoke: bool):
    h = w = px // 8                                     # latent size
    text_dim, pooled_dim, text_len = (32, 32, 8) if smoke else (4096, 768, 512)
    g = torch.Generator().manual_seed(0)
    x = pack_latents(torch.randn(1, 16, h, w, generator=g)).to(device, torch.bfloat16)
    embeds = PromptEmbeds(torch.randn(1, text_len, text_dim, generator=g),
                          torch.randn(1, pooled_dim, generator=g)).to(device, torch.bfloat16)
    sigma = torch.rand(1, generator=g).to(device)
    target = torch.randn(x.shape, generator=g).to(device)
    return x, sigma, embeds, (h, w), target


# -- measurements -------------------------------------------------------------------------------------

def h2d_bandwidth(pinned: bool, nbytes: int = GiB, reps: int = 5) -> float:
    """Host->device copy bandwidth in GB/s (1e9), from an exact-size buffer pinned as the engine pins."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if pinned:
        rc = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 0))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister failed ({rc})")
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dev.copy_(host, non_blocking=pinned)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    return nbytes * reps / seconds / 1e9


def host_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def plan_for(name: str, offload: bool, names: list[str]) -> Plan:
    fp8, fraction = CONFIGS[name]
    streamed = tuple(even_spread(names, round(fraction * len(names))))
    return Plan(streamed_blocks=streamed, stream_non_blocks=fraction >= 1.0, fp8=fp8,
                checkpointing="offload" if offload else "blocks", ring_slots=2, pin_memory=True)


def run_config(model, name: str, offload: bool, resolutions: list[int], device, steps: int, warmup: int,
               smoke: bool) -> list[dict]:
    cuda = device.type == "cuda"
    plan = plan_for(name, offload, [n for n, _ in FLUX_SPEC.blocks(model)])
    if cuda:
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    handle = apply_memory(model, FLUX_SPEC, plan, device)
    apply_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    rows = []
    try:
        for px in resolutions:
            x, sigma, embeds, hw, target = make_batch(px, device, smoke)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(warmup + steps):
                if i == warmup:
                    handle.step_report(wait=True)      # count only the measured steps
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                pred = predict(model, x, sigma, embeds, hw, guidance=3.5)
                loss = torch.nn.functional.mse_loss(pred.float(), target)
                loss.backward()
                opt.step()
                if cuda:
                    torch.cuda.synchronize()
                if i >= warmup:
                    times.append(time.perf_counter() - t)
            rep = handle.step_report(wait=True)
            rows.append(dict(
                config=name, offload=offload, px=px, fp8=plan.fp8, streamed=len(plan.streamed_blocks),
                s_per_step=statistics.median(times), steps=steps,
                peak_reserved=torch.cuda.max_memory_reserved() if cuda else 0, host_rss=host_rss(),
                bytes_per_step=rep["bytes_h2d"] / steps, copy_s=rep["copy_s"] / steps,
                stall_s=rep["stall_s"] / steps, offload_bytes_per_step=rep.get("offload_bytes_d2h", 0) / steps,
                demand_fetches=rep["demand_fetches"], apply_s=apply_s, loss=float(loss.detach()),
            ))
            print(f"{name:22s} offload={offload!s:5s} {px:5d}px  {rows[-1]['s_per_step']:.3f} s/step  "
                  f"peak reserved {rows[-1]['peak_reserved'] / GiB:.2f} GiB  "
                  f"{rows[-1]['bytes_per_step'] / 1e9:.2f} GB/step streamed", flush=True)
    finally:
        handle.remove(device="cpu")
        del opt, params
    return rows


# -- report -------------------------------------------------------------------------------------------

def bound_rows(results: list[dict], bandwidth: float) -> list[dict]:
    resident = {(r["fp8"], r["offload"], r["px"]): r["s_per_step"] for r in results if r["streamed"] == 0}
    out = []
    for r in results:
        base = resident.get((r["fp8"], r["offload"], r["px"]))
        transfer = r["bytes_per_step"] / (bandwidth * 1e9) if bandwidth else 0.0
        bound = max(base, transfer) if base is not None else None
        out.append({**r, "bound": bound, "ratio": (r["s_per_step"] / bound) if bound else None})
    return out


def render(meta: dict, results: list[dict]) -> str:
    rows = bound_rows(results, meta.get("h2d_pinned_GBps") or 0.0)
    lines = [
        "# Memory engine benchmark", "",
        f"- device: {meta['device']}; date: {meta['date']}; commit: {meta['commit']}",
        f"- torch {meta['torch']}, CUDA {meta['cuda']}; host: {meta['host']}",
        f"- command: `{meta['command']}`",
        (f"- measured H2D bandwidth: pinned {meta.get('h2d_pinned_GBps', 0):.1f} GB/s, "
         f"pageable {meta.get('h2d_pageable_GBps', 0):.1f} GB/s"),
        "- Flux.1-dev (random weights), LoRA r16 attention + MLP, AdamW, batch 1, 512 T5 tokens, checkpointing on",
        "",
        ("| config | act. offload | px | s/step | peak reserved GiB | host RSS GiB | streamed GB/step "
         "| copy s/step | stall s/step | bound s | × bound |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["px"], r["offload"], list(CONFIGS).index(r["config"]))):
        bound = f"{r['bound']:.3f}" if r["bound"] else "–"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "–"
        lines.append(f"| {r['config']} | {'yes' if r['offload'] else 'no'} | {r['px']} | {r['s_per_step']:.3f} "
                     f"| {r['peak_reserved'] / GiB:.2f} | {r['host_rss'] / GiB:.1f} | {r['bytes_per_step'] / 1e9:.2f} "
                     f"| {r['copy_s']:.3f} | {r['stall_s']:.3f} | {bound} | {ratio} |")
    lines += ["", "Targets (all blocks streamed, fp8, 1024 px):"]
    for r in rows:
        if r["config"] == "stream-all-fp8" and r["px"] == 1024:
            ok_t = r["ratio"] is not None and r["ratio"] <= 1.10
            ok_m = r["peak_reserved"] <= 6 * GiB
            lines.append(f"- offload={'yes' if r['offload'] else 'no'}: step {r['ratio'] or float('nan'):.2f} × bound "
                         f"({'meets' if ok_t else 'misses'} ≤ 1.10), peak reserved {r['peak_reserved'] / GiB:.2f} GiB "
                         f"({'meets' if ok_m else 'misses'} ≤ 6 GiB)")
    return "\n".join(lines) + "\n"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git on this machine)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--offload", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--resolutions", nargs="+", type=int, default=[512, 1024])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "bench_engine.json"),
                    help="JSON file the measured rows accumulate in (one device per file)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench-engine.md"), help="markdown report to write")
    ap.add_argument("--report", action="store_true", help="only render --out from --results")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, to check the script")
    args = ap.parse_args(argv)

    if args.smoke:
        device = torch.device("cpu")
        args.resolutions, args.steps, args.warmup = [64], 1, 1
        args.results = args.results.replace(".json", "-smoke.json")
        args.out = args.out.replace(".md", "-smoke.md")
    elif not torch.cuda.is_available():
        print("bench_engine: needs a CUDA GPU (this machine has none); run with --smoke to check the script on CPU",
              file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())

    results_path = Path(args.results)
    stored = json.loads(results_path.read_text()) if results_path.exists() else {"meta": {}, "rows": []}
    if not args.report:
        meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
                    date=datetime.date.today().isoformat(), commit=_commit(), torch=torch.__version__,
                    cuda=torch.version.cuda, host=f"{platform.node()} {os.cpu_count()} CPUs",
                    command="python bench/bench_engine.py " + " ".join(argv if argv is not None else sys.argv[1:]))
        if device.type == "cuda":
            meta["h2d_pinned_GBps"] = h2d_bandwidth(True)
            meta["h2d_pageable_GBps"] = h2d_bandwidth(False)
            print(f"H2D: pinned {meta['h2d_pinned_GBps']:.1f} GB/s, pageable {meta['h2d_pageable_GBps']:.1f} GB/s")
        t0 = time.perf_counter()
        model = build_model(args.smoke, device)
        add_adapter(model)
        print(f"model built in {time.perf_counter() - t0:.0f} s", flush=True)
        offloads = {"no": [False], "yes": [True], "both": [False, True]}[args.offload]
        for name in args.configs:
            for off in offloads:
                rows = run_config(model, name, off, args.resolutions, device, args.steps, args.warmup, args.smoke)
                keep = [r for r in stored["rows"]
                        if not (r["config"] == name and r["offload"] == off and r["px"] in args.resolutions)]
                stored = {"meta": {**stored["meta"], **meta}, "rows": keep + rows}
                atomic_write_json(results_path, stored)
    if not stored["rows"]:
        print(f"bench_engine: no results in {results_path}", file=sys.stderr)
        return 1
    atomic_write_bytes(args.out, render(stored["meta"], stored["rows"]).encode())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
