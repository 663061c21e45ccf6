"""Benchmark: loading a transformer file into what an fp8 LoRA run keeps, beside its peers.

    python bench/load.py                         # make the random files (once), then every loader on each
    python bench/load.py --files flux-bf16 --repeat 2 --out bench/results/load.json
    SD_SCRIPTS=/tmp/sd-scripts python bench/load.py          # where sd-scripts' library/ lies

Files (random values, written once to --dir, tensor by tensor): `flux-bf16` a BFL Flux file at full
width (3072, 24 heads of 128, T5 width 4096) with 3 double + 8 single blocks, 4.43 GB in bf16;
`flux-fp8` the same with its block Linear weights in plain e4m3 (a ComfyUI fp8 file); `sd3-bf16` a
Stability SD3.5 Large file (width 2432, 38 heads of 64) with 8 joint blocks.

Loaders, each in a fresh process, the file in the page cache (a first untimed read warms it):
- `leantune`: load_transformer with family.fp8_load_options([memory] fp8 = true), then what the
  engine does with plan.fp8 (apply_fp8_storage) and a rank-16 LoRA (add_lora): the trainable model.
- `leantune-torch`: `leantune` as it was before the C quantizer (issue 21): the torch-op
  quantization (LEANTUNE_HOST_KERNELS=0), so a before/after pair runs interleaved under the same
  machine load.
- `leantune-old`: the path before loads quantized: the whole model loaded in bf16, then quantized.
- `leantune-fp8mod`: `leantune` with `[memory] fp8_modulation = true`: the modulation (adaLN)
  Linears in e4m3 too, as sd-scripts' fp8_base keeps them, so the two keep the same precision and
  nearly the same bytes (leantune adds its block scales). The default keeps those Linears in bf16
  (38 % of what a Flux load keeps), a precision choice, not a loader cost.
- `sd-scripts`: kohya-ss/sd-scripts' `flux_utils.load_flow_model` as its flux_train_network runs it
  with --fp8_base (dtype None: the file's own, mmapped; then `model.to(float8_e4m3fn)` for a bf16
  file), run from a checkout of its public repository (never copied here). Its library imports
  cv2 and torchvision for image helpers the loader never calls; where they are not installed the
  child process stands empty modules in for them.
- `diffusers`: `FluxTransformer2DModel/SD3Transformer2DModel.from_single_file` (bf16) and then
  diffusers' own fp8 storage, `enable_layerwise_casting(storage_dtype=float8_e4m3fn)`.

Reported per run: wall and CPU seconds (all threads) of the load to what is kept (imports and the
LoRA excluded: the peers' loaders add no adapter; leantune's add_lora is timed apart as lora_s),
peak anonymous memory above the
process's baseline (RssAnon polled every 2 ms), peak RSS above baseline (VmHWM, reset before the
load; file-backed pages of an mmapped file count here), and the bytes kept (the model's tensors).
Targets (issue 21): wall <= 1.2x sd-scripts'; anonymous peak <= 1.1x kept + one block.

The headline (wall_s) is the load alone; a run has not started training when it ends. With
--first-step, each leantune loader goes on to what a LoRA run does before its first step, every
phase timed apart (wall and CPU seconds): `lora_s` add_lora (rank 16, the bench's adapter, as
before), `memory_s` apply_memory with the plan of `[memory] fp8 = true` (fp8_modulation = true for
`leantune-fp8mod`) on the CPU (fp8 storage of the Linears already e4m3, the CPU's fp32 Linears,
placement; nothing streamed, no checkpointing), and `step_s` one forward + backward of the
smallest input (--step-size px, 64: Flux 16 image tokens, SD3 8 x 8 latents; --step-text tokens of
random text embeddings, 16; bf16 autocast as the trainer runs it; loss = mean squared
prediction); `to_first_step_s` is their sum with the load. The peers' loaders report none of these
(they add no adapter here). `peak_anon_first_step` is the anonymous peak up to the end of the step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = ("flux-bf16", "flux-fp8", "sd3-bf16")
LOADERS = {"flux": ("leantune", "leantune-fp8mod", "leantune-torch", "leantune-old", "sd-scripts", "diffusers"),
           "sd3": ("leantune", "leantune-fp8mod", "leantune-torch", "leantune-old", "diffusers")}
FLUX_CONFIG = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=3, num_single_layers=8,
                   attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
SD3_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=8, attention_head_dim=64,
                  num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                  pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
                  dual_attention_layers=())


# -- the files -----------------------------------------------------------------------------------------

def _meta_state(cls, config: dict) -> dict:
    with torch.device("meta"):
        return cls(**config).state_dict()


def _write(path: Path, state: dict, fp8_key=lambda k: False, metadata: dict | None = None) -> None:
    """A safetensors file of random bf16 values (e4m3 where fp8_key), written tensor by tensor."""
    from leantune.io import save_safetensors_streamed

    layout = [(k, tuple(t.shape), torch.float8_e4m3fn if fp8_key(k) else torch.bfloat16) for k, t in state.items()]
    g = torch.Generator().manual_seed(0)

    def chunks():
        for key, shape, dtype in layout:
            t = torch.randn(shape, generator=g, dtype=torch.float32).mul_(0.02)
            yield {key: t.to(dtype) if dtype != torch.float8_e4m3fn else (t * 448 / 0.1).clamp_(-448, 448).to(dtype)}

    save_safetensors_streamed(path, layout, chunks(), metadata=metadata)


def make_files(folder: Path, names) -> None:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    from leantune.models.flux import keys as bfl_keys
    from leantune.models.sd3 import keys as sd3_keys

    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / f"{name}.safetensors"
        if path.exists():
            continue
        print(f"writing {path} ...", flush=True)
        if name.startswith("flux"):
            state = bfl_keys.diffusers_to_bfl(_meta_state(FluxTransformer2DModel, FLUX_CONFIG))
            fp8 = name.endswith("fp8")
            _write(path, state, lambda k: fp8 and k.startswith(("double_blocks.", "single_blocks."))
                   and k.endswith(".weight") and len(state[k].shape) == 2)
        else:
            state = sd3_keys.diffusers_to_stability(_meta_state(SD3Transformer2DModel, SD3_CONFIG))
            _write(path, {"model.diffusion_model." + k: v for k, v in state.items()})
        _diffusers_config(folder, name)


def _diffusers_config(folder: Path, name: str) -> Path:
    """A config folder for diffusers' from_single_file (it otherwise asks a hub for one)."""
    cls = "FluxTransformer2DModel" if name.startswith("flux") else "SD3Transformer2DModel"
    cfg = dict(FLUX_CONFIG if name.startswith("flux") else SD3_CONFIG, _class_name=cls)
    out = folder / f"{name}-config"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# -- measuring in the child ----------------------------------------------------------------------------

def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0]) * 1024
    return out


class _Poller(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak_anon, self.stop = 0, threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.peak_anon = max(self.peak_anon, _status()["RssAnon"])
            time.sleep(0.002)


def _kept(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.state_dict(keep_vars=True).values()):
        key = (t.untyped_storage().data_ptr(), t.data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _largest_block(model, spec) -> int:
    return max(sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in spec.blocks(model))


def _leantune(path: Path, family: str, old: bool, modulation: bool = False):
    from leantune.config import LoraConfig, MemoryConfig
    from leantune.memory.fp8 import apply_fp8_storage
    from leantune.models.flux import loading as flux_loading
    from leantune.models.sd3 import loading as sd3_loading
    from leantune.models.family import fp8_load_options
    from leantune.models.flux.spec import FLUX_SPEC
    from leantune.models.sd3.spec import SD3_SPEC
    from leantune.train.lora import add_lora

    mod, spec = (flux_loading, FLUX_SPEC) if family == "flux" else (sd3_loading, SD3_SPEC)
    sources = (mod.FluxSources(path, None, None, None, None, None) if family == "flux"
               else mod.SD3Sources(path, None, None, None, None, None, None, None))
    options = {} if old else fp8_load_options(MemoryConfig(fp8=True, fp8_modulation=modulation))

    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel  # noqa: F401  imported before the clock
    import peft  # noqa: F401

    def run():
        model = mod.load_transformer(sources, dtype=torch.bfloat16, **options)
        model.requires_grad_(False)
        apply_fp8_storage(model, spec)                      # the engine with plan.fp8 (nothing left to do when new)
        return model

    def after(model):
        add_lora(model, spec, LoraConfig(rank=16))          # timed apart: the peers' loaders add no adapter

    return run, spec, after


def _first_step(family: str, modulation: bool, size: int, text_length: int):
    """(apply_memory, one forward + backward) for a leantune model with its adapters: the two
    phases a LoRA run goes through after the load and before its first optimizer step."""
    from leantune.config import MemoryConfig
    from leantune.memory.engine import apply_memory, resolve_plan
    from leantune.models.family import PromptEmbeds, get_family

    fam = get_family(family)

    def memory(model):
        plan = resolve_plan(MemoryConfig(fp8=True, fp8_modulation=True if modulation else "auto"), fam.spec, model)
        return apply_memory(model, fam.spec, plan, "cpu")

    def step(model):
        c = model.config
        g = torch.Generator().manual_seed(0)
        h = w = size // fam.vae_scale_factor
        noisy = fam.pack_latents(torch.randn(1, fam.latent_channels, h, w, generator=g))
        embeds = PromptEmbeds(t5=torch.randn(1, text_length, c.joint_attention_dim, generator=g),
                              pooled=torch.randn(1, c.pooled_projection_dim, generator=g))
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            pred = fam.predict(model, noisy.to(torch.bfloat16), torch.full((1,), 0.5), embeds, (h, w), 3.5)
        loss = pred.float().pow(2).mean()
        loss.backward()
        trained = [p for p in model.parameters() if p.requires_grad]
        return bool(loss.isfinite()) and all(p.grad is not None and bool(p.grad.isfinite().all()) for p in trained)

    return memory, step


def _sd_scripts(path: Path):
    import importlib.machinery
    import types

    import diffusers.schedulers.scheduling_euler_ancestral_discrete  # noqa: F401  before the stand-ins
    from transformers import CLIPTextModel, T5EncoderModel  # noqa: F401

    for name in ("cv2", "torchvision", "torchvision.transforms"):       # image helpers the loader never calls
        try:
            __import__(name)
        except ImportError:
            m = types.ModuleType(name)
            m.__spec__ = importlib.machinery.ModuleSpec(name, None)
            sys.modules[name] = m
    if not hasattr(sys.modules["torchvision"], "transforms"):
        sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.path.insert(0, os.environ.get("SD_SCRIPTS", "/tmp/sd-scripts"))
    from library import flux_utils

    def run():
        _, model = flux_utils.load_flow_model(str(path), None, "cpu")       # --fp8_base: the file's dtype
        if model.dtype != torch.float8_e4m3fn:
            model.to(torch.float8_e4m3fn)                                   # flux_train_network: "Cast FLUX model to fp8"
        return model

    return run, None, None


def _diffusers(path: Path, family: str):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = FluxTransformer2DModel if family == "flux" else SD3Transformer2DModel
    config = str(path.parent / f"{path.stem}-config")

    def run():
        model = cls.from_single_file(str(path), config=config, torch_dtype=torch.bfloat16, local_files_only=True)
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        return model

    return run, None, None


def child(loader: str, path: Path, first_step: tuple[int, int] | None = None) -> dict:
    """One load in this process; `first_step` (size px, text tokens): then apply_memory and one
    forward + backward as well (leantune loaders only)."""
    import ctypes
    import resource

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    family = "flux" if path.name.startswith("flux") else "sd3"
    if loader == "leantune-torch":
        os.environ["LEANTUNE_HOST_KERNELS"] = "0"                          # before any kernel is built
    if loader.startswith("leantune"):
        run, spec, after = _leantune(path, family, loader == "leantune-old", loader == "leantune-fp8mod")
    elif loader == "sd-scripts":
        run, spec, after = _sd_scripts(path)
    else:
        run, spec, after = _diffusers(path, family)
    phases = None
    if first_step is not None and loader.startswith("leantune"):
        phases = _first_step(family, loader == "leantune-fp8mod", *first_step)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status()
    Path("/proc/self/clear_refs").write_text("5")                          # VmHWM from here
    poller = _Poller()
    poller.start()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    model = run()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    t1, c1 = time.perf_counter(), cpu_s()
    if after is not None:
        after(model)
    after_s, after_cpu = time.perf_counter() - t1, cpu_s() - c1
    end = _status()
    peak_anon = max(poller.peak_anon, end["RssAnon"])          # the load's (and the adapters') peak
    first = {}
    if phases is not None:
        memory, step = phases
        t2, c2 = time.perf_counter(), cpu_s()
        memory(model)
        t3, c3 = time.perf_counter(), cpu_s()
        finite = step(model)
        t4, c4 = time.perf_counter(), cpu_s()
        first = {"lora_cpu_s": round(after_cpu, 2), "memory_s": round(t3 - t2, 2), "memory_cpu_s": round(c3 - c2, 2),
                 "step_s": round(t4 - t3, 2), "step_cpu_s": round(c4 - c3, 2), "step_finite": finite,
                 "step_size": first_step[0], "step_text": first_step[1],
                 "to_first_step_s": round(wall + after_s + (t4 - t2), 2),
                 "to_first_step_cpu_s": round((r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
                                              + after_cpu + (c4 - c2), 2)}
    poller.stop.set()
    poller.join()
    if phases is not None:
        first["peak_anon_first_step"] = max(poller.peak_anon, _status()["RssAnon"]) - base["RssAnon"]
    from leantune.models.flux.spec import FLUX_SPEC
    from leantune.models.sd3.spec import SD3_SPEC

    block = None
    if spec is not None:
        block = _largest_block(model, spec)
    elif loader == "diffusers":
        block = _largest_block(model, FLUX_SPEC if family == "flux" else SD3_SPEC)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"loader": loader, "file": path.stem, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "lora_s": round(after_s, 2) if after is not None else None, "threads": torch.get_num_threads(),
            "peak_anon": peak_anon - base["RssAnon"],
            "peak_rss": end["VmHWM"] - base["VmRSS"], "kept": _kept(model), "block": block,
            "file_bytes": path.stat().st_size, **first}


# -- the parent -----------------------------------------------------------------------------------------

def _warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 * 2**20):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/leantune-bench-load"))
    ap.add_argument("--files", nargs="*", default=list(FILES), choices=FILES)
    ap.add_argument("--loaders", nargs="*", default=None)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--first-step", action="store_true",
                    help="leantune loaders: then apply_memory and one forward + backward, each timed (to_first_step_s)")
    ap.add_argument("--step-size", type=int, default=64, help="--first-step: image size in px (64: the smallest)")
    ap.add_argument("--step-text", type=int, default=16, help="--first-step: text tokens")
    ap.add_argument("--child", nargs=2, metavar=("LOADER", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    first_step = (args.step_size, args.step_text) if args.first_step else None
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), first_step)), flush=True)
        return
    make_files(args.dir, args.files)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    results = []
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}, ISA: {_isa()}", flush=True)
    step_flags = (["--first-step", "--step-size", str(args.step_size), "--step-text", str(args.step_text)]
                  if first_step else [])
    for name in args.files:
        path = args.dir / f"{name}.safetensors"
        loaders = [lo for lo in LOADERS[name.split("-")[0]] if args.loaders is None or lo in args.loaders]
        for _ in range(args.repeat):
            for loader in loaders:                                          # interleaved across repeats
                _warm(path)
                out = subprocess.run([sys.executable, __file__, "--child", loader, str(path), *step_flags], env=env,
                                     capture_output=True, text=True)
                if out.returncode:
                    print(f"{name} {loader}: failed\n{out.stderr[-2000:]}", flush=True)
                    continue
                r = json.loads(out.stdout.strip().splitlines()[-1])
                r["load_average"] = os.getloadavg()[0]
                results.append(r)
                gb = lambda n: f"{n / 1e9:.2f}" if n is not None else "-"   # noqa: E731
                print(f"{name:10s} {loader:13s} wall {r['wall_s']:6.2f} s  cpu {r['cpu_s']:6.2f} s  peak anon {gb(r['peak_anon'])} GB  "
                      f"peak rss {gb(r['peak_rss'])} GB  kept {gb(r['kept'])} GB  block {gb(r['block'])} GB  "
                      f"anon/(1.1 kept + block) {r['peak_anon'] / (1.1 * r['kept'] + (r['block'] or 0)):.2f}  "
                      f"load {r['load_average']:.1f}", flush=True)
                if "to_first_step_s" in r:
                    print(f"{'':10s} {'':13s} to first step {r['to_first_step_s']:6.2f} s wall, "
                          f"{r['to_first_step_cpu_s']:6.2f} CPU s: load {r['wall_s']:.2f} + adapters {r['lora_s']:.2f} "
                          f"+ apply_memory {r['memory_s']:.2f} + forward/backward {r['step_s']:.2f} s "
                          f"({r['step_size']} px, {r['step_text']} text tokens; finite {r['step_finite']}); "
                          f"peak anon to the step {gb(r['peak_anon_first_step'])} GB", flush=True)
    if args.out:
        for r in results:
            r["isa"] = _isa()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


def _isa() -> str:
    """The instruction-set flags load rates depend on (the C quantizer is built -march=native)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return " ".join(f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16") if f in flags) or "none"



if __name__ == "__main__":
    main()
