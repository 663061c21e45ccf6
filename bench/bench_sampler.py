"""Benchmark the staged sampler: Flux-dev (random weights) at 1024x1024, 28 steps, with a LoRA.

    python bench/bench_sampler.py                       # every row below, markdown table on stdout
    python bench/bench_sampler.py --part training       # only samples-during-training
    python bench/bench_sampler.py --smoke               # tiny models on the CPU: checks the script only

Rows (sampling): fully resident bf16, fully resident fp8, and VRAM budgets of 4 / 6 / 8 / 12 GiB
chosen by the planner. For each: seconds per image (denoising steps + decode, models already in
host memory), the steady per-step time, peak reserved VRAM of each stage (encode / denoise /
decode), bytes streamed per step, and the lower bound of a step,
    bound = max(resident step time at the same precision, streamed bytes per step / H2D bandwidth),
with the measured step time as a multiple of it. Target at 6 GB: peak <= 6 GiB, step <= 1.10 x bound.

Rows (training): time per sample grid (4 prompts, 20 steps, 1024^2) from a LoRA-training model, fully
resident versus under a 12 GiB training plan (streamed blocks), through `sample_during_training`.

Weights are random (nothing is downloaded): the architectures come from leantune/models/configs,
materialised from one pool of normal values, so building a 12 B model takes seconds; tokenizers are
the tiny offline ones (prompt token ids are valid in the real vocabularies).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leantune.models.flux import FLUX_SPEC

GiB = 2**30
PROMPT = "a photo of a cat"


# -- random full-size components ------------------------------------------------------------------------

class _Pool:
    """Normal(0, std) values reused to fill every tensor: materialising 12 B parameters with a
    sequential generator takes minutes, copying from a pool takes seconds; timings do not care."""

    def __init__(self, n: int = 1 << 26, std: float = 0.02):
        g = torch.Generator().manual_seed(0)
        self.values = (torch.randn(n, generator=g) * std).to(torch.bfloat16)

    def fill(self, t: torch.Tensor, salt: int) -> None:
        flat = t.view(-1)
        n, start = flat.numel(), (salt * 7919) % self.values.numel()
        done = 0
        while done < n:
            k = min(n - done, self.values.numel() - start)
            flat[done:done + k].copy_(self.values[start:start + k])
            done, start = done + k, 0


def _materialize(build, dtype: torch.dtype, pool: _Pool):
    """Build a model with parameters on meta (buffers such as position ids keep their real values),
    then give each parameter host memory filled from the pool (norm weights = 1)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    made: dict[int, torch.nn.Parameter] = {}      # tied parameters (T5's shared embedding) stay tied
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=False)
            m._parameters[name] = made[id(p)]
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if "norm" in name and p.dim() == 1 and name.endswith("weight"):
                p.fill_(1.0)
            else:
                pool.fill(p.data, i)
    model = model.to(dtype)                         # floating buffers to the compute dtype too
    return model.eval().requires_grad_(False)


class RandomFlux:
    """run_sampling's `components` with random full-size (or, for --smoke, tiny) weights.

    The transformer is materialised once and deep-copied per request (the engine rewrites the
    copy it is given); encoders and VAE are rebuilt per request (a few seconds)."""

    def __init__(self, variant: str = "dev", smoke: bool = False):
        from leantune import tiny

        self.smoke, self.variant, self.schedule_folder = smoke, variant, None
        self.pool = _Pool(1 << 16 if smoke else 1 << 26)
        self.tok, self.tok2 = tiny.clip_tokenizer(), tiny.t5_tokenizer()
        self._transformer = self._build_transformer()

    def _build_transformer(self):
        from diffusers import FluxTransformer2DModel

        from leantune import tiny
        from leantune.models.component_files import packaged_config

        if self.smoke:
            return tiny.flux_transformer(dtype=torch.bfloat16).eval().requires_grad_(False)
        cfg = {k: v for k, v in packaged_config(f"flux1_{self.variant}").items() if not k.startswith("_")}
        return _materialize(lambda: FluxTransformer2DModel.from_config(cfg), torch.bfloat16, self.pool)

    def transformer(self, dtype):
        return copy.deepcopy(self._transformer).to(dtype)

    def text_encoders(self, dtype):
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        from leantune import tiny
        from leantune.models.component_files import packaged_config

        if self.smoke:
            clip, t5 = tiny.clip_text_encoder(self.tok, dtype=dtype), tiny.t5_text_encoder(self.tok2, dtype=dtype)
        else:
            ccfg = {k: v for k, v in packaged_config("clip_l").items() if k not in ("architectures", "model_type")}
            ccfg.update(eos_token_id=self.tok.eos_token_id, bos_token_id=self.tok.bos_token_id,
                        pad_token_id=self.tok.pad_token_id)
            tcfg = {k: v for k, v in packaged_config("t5_xxl").items() if k not in ("architectures", "model_type")}
            clip = _materialize(lambda: CLIPTextModel(CLIPTextConfig(**ccfg)), dtype, self.pool)
            t5 = _materialize(lambda: T5EncoderModel(T5Config(**tcfg)), dtype, self.pool)
        return SimpleNamespace(tokenizer=self.tok, text_encoder=clip.eval(), tokenizer_2=self.tok2,
                               text_encoder_2=t5.eval())

    def vae(self, dtype, device):
        from diffusers import AutoencoderKL

        from leantune import tiny
        from leantune.models.component_files import packaged_config

        if self.smoke:
            return tiny.vae(dtype=dtype).eval().to(device)
        cfg = {k: v for k, v in packaged_config("flux_vae").items() if not k.startswith("_")}
        return _materialize(lambda: AutoencoderKL.from_config(cfg), dtype, self.pool).to(device)


def write_lora(transformer, rank: int, folder: Path) -> Path:
    """A random rank-`rank` LoRA on the attention + MLP Linears of every block (diffusers format)."""
    import re

    from leantune.train.lora import LoraModule, LoraWeights, save_lora

    regex = FLUX_SPEC.lora_target_regex("attention_mlp")
    g = torch.Generator().manual_seed(1)
    mods = {}
    for name, m in transformer.named_modules():
        if re.fullmatch(regex, name):
            mods[name] = LoraModule(torch.randn(rank, m.in_features, generator=g) * 0.01,
                                    torch.randn(m.out_features, rank, generator=g) * 0.01, float(rank))
    return save_lora(LoraWeights(modules=mods), folder / "bench-lora.safetensors", "diffusers",
                     dtype=torch.bfloat16)


# -- measuring ---------------------------------------------------------------------------------------------

class StepClock:
    """Per-denoising-step times from CUDA events on the compute stream (no device-wide sync, so the
    engine's copies keep overlapping across step boundaries); wall clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def __call__(self, done: int, total: int) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def step_times(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def h2d_bandwidth(pinned: bool) -> float:
    """Measured host->device copy rate (bytes/s) for 256 MiB buffers."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty_like(src, device="cuda")
    for _ in range(2):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - t)


def run_row(name: str, components, base: dict, memory: dict, out: Path, cuda: bool) -> dict:
    from leantune.infer.request import validate_request
    from leantune.infer.run import run_sampling

    req = validate_request({**base, "memory": memory, "out": str(out / name.replace(" ", "_"))}, f"bench:{name}")
    clock = StepClock(cuda)
    t = time.perf_counter()
    res = run_sampling(req, progress=clock, components=components)
    wall = time.perf_counter() - t
    steps = clock.step_times()
    n_images = len(res.files)
    per_step = statistics.median(steps) if steps else float("nan")
    n_steps = len(steps) + 1
    return {"name": name, "plan": res.plan.describe(), "fp8": res.plan.fp8, "pinned": res.plan.pin_memory,
            "per_step": per_step, "s_per_image": (res.timings["denoise.steps"] + res.timings["decode"]) / n_images,
            "wall": wall, "peaks": res.stage_peaks, "bytes_per_step": res.stream_report.get("bytes_h2d", 0) / n_steps,
            "stream_t5": res.stream_t5, "tile": res.decode_tile, "timings": res.timings}


def sampling_rows(args, components, out: Path, cuda: bool) -> list[dict]:
    lora = write_lora(components._transformer, args.lora_rank, out)
    base = {"model": {"path": "random-flux-dev", "variant": args.variant, "dtype": "bf16"}, "prompts": [PROMPT],
            "seed": 0, "steps": args.steps, "width": args.size, "height": args.size,
            "lora": [{"path": str(lora), "strength": 1.0}], "device": "cuda" if cuda else "cpu",
            **({"max_text_length": 32} if args.smoke else {})}
    rows = []

    def row(name: str, memory: dict) -> None:
        """One row, its numbers printed as it ends (stderr; stdout is the table), so a run stopped
        at its budget still leaves the rows it finished."""
        rows.append(run_row(name, components, base, memory, out, cuda))
        print(json.dumps({"row": name, **{k: v for k, v in rows[-1].items() if isinstance(v, (int, float, str))}}),
              file=sys.stderr, flush=True)

    row("resident bf16", {})
    row("resident fp8", {"fp8": True})
    for b in args.budgets:
        row(f"budget {b:g} GiB", {"vram_budget": f"{b}GiB"})
    bw = {True: h2d_bandwidth(True), False: h2d_bandwidth(False)} if cuda else {True: float("inf"), False: float("inf")}
    resident = {False: rows[0]["per_step"], True: rows[1]["per_step"]}
    for r in rows:
        r["bound"] = max(resident[r["fp8"]], r["bytes_per_step"] / bw[r["pinned"]])
        r["ratio"] = r["per_step"] / r["bound"] if r["bound"] else float("nan")
        r["h2d_GBps"] = bw[r["pinned"]] / 1e9
    return rows


def training_rows(args, components, cuda: bool) -> list[dict]:
    """Time per sample grid from a model set up for LoRA training, resident vs a 12 GiB training plan."""
    from leantune.config import LoraConfig, SampleConfig
    from leantune.infer.sampler import sample_during_training
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.planner.from_config import plan_memory
    from leantune.planner.workload import Budget, Workload
    from leantune.models.flux import PromptEmbeds
    from leantune.train.lora import add_lora

    device = "cuda" if cuda else "cpu"
    n, size = (4, args.size) if not args.smoke else (2, 64)
    cfg = SampleConfig(prompts=[PROMPT] * n, seed=0, steps=20 if not args.smoke else 2, guidance=3.5,
                       width=size, height=size)
    t5_dim = components._transformer.config.joint_attention_dim
    clip_dim = components._transformer.config.pooled_projection_dim
    g = torch.Generator().manual_seed(0)
    text_len = 512 if not args.smoke else 32
    embeds = [PromptEmbeds(torch.randn(1, text_len, t5_dim, generator=g).to(torch.bfloat16),
                           torch.randn(1, clip_dim, generator=g).to(torch.bfloat16)) for _ in range(n)]
    rows = []
    for name in ("resident", "12 GiB training plan"):
        t = components.transformer(torch.bfloat16)
        lora_cfg = LoraConfig(rank=args.lora_rank)
        add_lora(t, FLUX_SPEC, lora_cfg)
        if name == "resident":
            plan = Plan()
        else:
            wl = Workload(mode="lora", rank=args.lora_rank, buckets=((size, size),), text_length=text_len)
            plan = plan_memory(FLUX_SPEC, t, wl, Budget(vram=12 * GiB))
        handle = apply_memory(t, FLUX_SPEC, plan, device)
        t.train()
        vae = lambda: components.vae(torch.bfloat16, "cpu")
        sample_during_training(t, vae, embeds[:1], SampleConfig(prompts=[PROMPT], steps=1, width=size,
                                                                height=size), memory_handle=handle, device=device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        sample_during_training(t, vae, embeds, cfg, memory_handle=handle, device=device)
        if cuda:
            torch.cuda.synchronize()
        rows.append({"name": name, "plan": plan.describe(), "seconds": time.perf_counter() - start,
                     "peak": torch.cuda.max_memory_reserved() if cuda else 0})
        handle.release()
        del t, handle
        if cuda:
            torch.cuda.empty_cache()
    return rows


# -- report -----------------------------------------------------------------------------------------------

def markdown(args, sampling: list[dict], training: list[dict], device_name: str) -> str:
    title = (f"### Sampler: Flux-{args.variant} random weights, {args.size}x{args.size}, {args.steps} steps, "
             f"LoRA rank {args.lora_rank} ({device_name}, {time.strftime('%Y-%m-%d')})")
    lines = [title, ""]
    if sampling:
        lines += [("| run | plan | s/image | step s | bound s | step / bound | peak GiB (enc / denoise / dec) | "
                   "GB streamed / step | T5 streamed | VAE tile |"),
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sampling:
            p = r["peaks"]
            peaks = " / ".join(f"{p.get(k, 0) / GiB:.2f}" for k in ("encode", "denoise", "decode"))
            lines.append(f"| {r['name']} | {r['plan']} | {r['s_per_image']:.2f} | {r['per_step']:.3f} | "
                         f"{r['bound']:.3f} | {r['ratio']:.2f} | {peaks} | {r['bytes_per_step'] / 1e9:.2f} | "
                         f"{'yes' if r['stream_t5'] else 'no'} | {r['tile'] or '-'} |")
        bw = sampling[0]["h2d_GBps"]
        lines += ["", f"H2D bandwidth measured: {bw:.1f} GB/s ({'pinned' if sampling[0]['pinned'] else 'pageable'})", ""]
    if training:
        lines += ["| samples during training | plan | s per grid | peak reserved GiB |", "|---|---|---|---|"]
        for r in training:
            lines.append(f"| {r['name']} | {r['plan']} | {r['seconds']:.1f} | {r['peak'] / GiB:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("sampling", "training", "all"), default="all")
    ap.add_argument("--variant", choices=("dev", "schnell"), default="dev")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--budgets", type=float, nargs="*", default=[4, 6, 8, 12], help="VRAM budgets in GiB")
    ap.add_argument("--out", type=Path, help="also write the markdown table to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (checks the script, not speed)")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("bench_sampler: needs a CUDA GPU and none is visible (use --smoke to check the script on CPU)",
              file=sys.stderr)
        return 2
    if args.smoke:
        args.size, args.steps, args.lora_rank, args.budgets = 64, 3, 2, [0.5]
    device_name = torch.cuda.get_device_name() if cuda else "CPU smoke run"
    components = RandomFlux(args.variant, smoke=args.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        sampling = sampling_rows(args, components, Path(tmp), cuda) if args.part in ("sampling", "all") else []
        training = training_rows(args, components, cuda) if args.part in ("training", "all") else []
    text = markdown(args, sampling, training, device_name)
    print(text)
    if args.out:
        from leantune.io import atomic_write_bytes

        atomic_write_bytes(args.out, text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
