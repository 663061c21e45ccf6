"""Each multi-process strategy through real NCCL, on the tiny Flux (run by bench/gpu_checks.sh).

    python bench/gpu_strategy_runs.py OUT [--gpus 2] [--smoke]

DDP LoRA, FSDP2 full and DeepSpeed ZeRO-2 full, each `leantune train ... --gpus N` (torchrun, the
Accelerator's NCCL group) for 4 steps on the tiny Flux at 64 px with a saved step: every step ends
with the loss sum, the gradient vote and the observation's gather, the collectives finding 1 of
issue 20 was about. Needs N >= 2 GPUs (one process takes the one-process path, without a group;
bench/gpu_checks.sh's nccl-collectives part covers one GPU). `--smoke`: one process on the CPU,
checks the script. Prints one JSON line per run; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {
    "ddp-lora": "",
    "fsdp2-full": '[distributed]\nstrategy = "fsdp2"\n',
    "zero2-full": '[distributed]\nstrategy = "deepspeed"\n',
}


def config(folder: Path, model: Path, images: Path, name: str, extra: str) -> Path:
    full = name.endswith("full")
    text = (f'[model]\npath = "{model}"\ndtype = "{"bf16" if name == "zero2-full" else "fp32"}"\n\n'
            f'[data]\nresolutions = [64]\nbatch_size = 1\ncache_dir = "{folder}/cache"\nmax_text_length = 32\n\n'
            f'[[data.datasets]]\npath = "{images}"\n\n'
            f'[train]\nmode = "{"full" if full else "lora"}"\nsteps = 4\nsave_every = 2\nlearning_rate = 1e-4\n'
            + ('\n[full]\nexclude = ["*norm*"]\n' if full else "\n[lora]\nrank = 4\n")
            + f'\n{extra}\n[output]\ndir = "{folder / name}"\nname = "m"\n')
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    from leantune.demo import draw_shapes
    from leantune import tiny

    a.out.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="leantune-strategies-"))
    model = tiny.save_flux_folder(folder / "flux-tiny")
    images = folder / "images"
    draw_shapes(images, count=4, size=64, seed=5)
    failed = 0
    runs = {"ddp-lora": RUNS["ddp-lora"]} if a.smoke else RUNS
    for name, extra in runs.items():
        if name == "zero2-full":
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                print(json.dumps({"run": name, "skipped": "deepspeed is not installed"}))
                continue
        cfg = config(folder, model, images, name, extra)
        cmd = [sys.executable, "-m", "leantune", "train", str(cfg), "--no-progress"]
        if not a.smoke:
            cmd += ["--gpus", str(a.gpus)]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
        (a.out / f"strategy-{name}.log").write_text(run.stdout + "\n--- stderr ---\n" + run.stderr)
        ok = run.returncode == 0 and (folder / name / "loss.json").exists()
        failed += not ok
        print(json.dumps({"run": name, "ok": ok, "rc": run.returncode, "seconds": round(time.perf_counter() - t0, 1),
                          "tail": run.stderr.strip().splitlines()[-1:] if not ok else []}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
