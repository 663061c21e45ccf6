"""The page's Sample form as a `leantune sample` process.

Each request gets its own folder DIR/_samples/<n>/ with the command's output (console.log) and the
images it writes; the page polls the folder. Like training, sampling runs in its own process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from . import launcher

SAMPLES_DIR = "_samples"


def uses_cfg(family: str) -> bool:
    """True when `family` samples with classifier-free guidance (SD3.5), the guidance a negative
    prompt belongs to (models/family.py Sampling.guidance)."""
    from ..models.family import get_family

    return get_family(family).sampling.guidance == "cfg"


def cfg_families() -> list[str]:
    """The families whose Sample form shows a negative-prompt field."""
    from .form import families

    return [f for f in families() if uses_cfg(f)]


def model_family(model: str) -> str | None:
    """The family of the Sample form's model from its metadata (family.guess_family), or None."""
    from ..models.family import guess_family

    return guess_family(model) if model else None


def command(fields: dict, out: Path) -> list[str]:
    """`leantune sample` arguments from the form: model, family (blank: from the model), prompts,
    negative prompt (families with classifier-free guidance only), seed, steps, guidance, size,
    LoRAs ("file:strength" lines), a VRAM budget and, for a video family, the frames per sample."""
    from .form import FormError, families

    model = str(fields.get("model_path", "")).strip()
    prompts = [p.strip() for p in str(fields.get("prompts", "")).splitlines() if p.strip()]
    if not model:
        raise FormError("model_path: give the model folder or single .safetensors file")
    if not prompts:
        raise FormError("prompts: give at least one prompt (one a line)")
    family = str(fields.get("family", "") or "").strip()
    if family and family not in families():
        raise FormError(f"family: {family!r} is not a model family; choose one of {families()} or leave it blank")
    negative = str(fields.get("negative_prompt", "") or "").strip()
    cmd = [sys.executable, "-m", "leantune", "sample", "--model", model, "--out", str(out)]
    if family:
        cmd += ["--family", family]
    for p in prompts:
        cmd += ["--prompt", p]
    if negative:
        known = family or model_family(model)     # unknown: `leantune sample` finds the family and decides
        if known is not None and not uses_cfg(known):
            raise FormError(f"negative_prompt: family {known!r} samples with distilled guidance, which takes no "
                            f"negative prompt; leave it empty")
        cmd += ["--negative-prompt", negative]
    for key, flag, kind in (("seed", "--seed", int), ("steps", "--steps", int), ("guidance", "--guidance", float),
                            ("width", "--width", int), ("height", "--height", int), ("frames", "--frames", int)):
        value = fields.get(key)
        if value not in (None, ""):
            try:
                cmd += [flag, str(kind(value))]
            except (TypeError, ValueError):
                raise FormError(f"{key}: {value!r} is not a number") from None
    for lora in str(fields.get("loras", "")).splitlines():
        if lora.strip():
            cmd += ["--lora", lora.strip()]
    if str(fields.get("vram", "")).strip():
        cmd += ["--vram", str(fields["vram"]).strip()]
    text_length = str(fields.get("text_length", "") or "").strip()
    if text_length:
        if not text_length.isdigit() or not 1 <= int(text_length) <= 512:
            raise FormError(f"text_length: {text_length!r} is not a token count from 1 to 512")
        cmd += ["--set", f"max_text_length={int(text_length)}"]
    dtype = str(fields.get("dtype", "") or "").strip()
    if dtype:
        from .form import choices

        if dtype not in choices("model", "dtype"):
            raise FormError(f"dtype: {dtype!r} is not one of {', '.join(choices('model', 'dtype'))}")
        cmd += ["--set", f"model.dtype={dtype}"]
    return cmd


def run_fields(folder: Path) -> dict:
    """The Sample form for a run ("sample this run"): its model, family, dtype and text length,
    its [sample] settings, and its newest LoRA (the final file, else the latest step's), so the
    sample draws what the run's own samples draw."""
    from ..config import load_config

    from . import runs

    cfg = load_config(folder / runs.CONFIG_FILE)
    out = runs.outputs(folder)
    loras = [w for w in out["weights"] if w.endswith("_comfyui.safetensors")] or out["weights"]
    final = [w for w in loras if "-step" not in w]
    newest = final[-1] if final else (loras[-1] if loras else None)
    fields = {"model_path": str(cfg.resolve(cfg.model.path)), "family": cfg.model.family, "dtype": cfg.model.dtype,
              "text_length": cfg.data.max_text_length, "prompts": "\n".join(cfg.sample.prompts),
              "negative_prompt": cfg.sample.negative_prompt, "seed": cfg.sample.seed, "steps": cfg.sample.steps,
              "guidance": cfg.sample.guidance, "width": cfg.sample.width, "height": cfg.sample.height,
              "frames": cfg.sample.frames or "",
              "loras": f"{folder / runs.RUN_DIR / newest}:1.0" if newest and cfg.train.mode == "lora" else ""}
    if cfg.train.mode == "full" and final:
        fields["model_path"] = str(folder / runs.RUN_DIR / final[-1])      # a full fine-tune samples its own model
    return fields


def start(runs_dir: Path, fields: dict) -> dict:
    base = runs_dir / SAMPLES_DIR
    base.mkdir(parents=True, exist_ok=True)
    n = 1 + max((int(p.name) for p in base.iterdir() if p.name.isdigit()), default=0)
    out = base / str(n)
    cmd = command(fields, out)
    out.mkdir()
    with open(out / "console.log", "wb") as console:
        proc = subprocess.Popen(cmd, cwd=out, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    launcher._write_process(out, {"pid": proc.pid, "proc_start": launcher.start_time(proc.pid), "command": cmd,
                                  "exit_code": None})
    threading.Thread(target=proc.wait, daemon=True).start()         # reaped, so it never lingers as a zombie
    return {"job": n, "pid": proc.pid}


def result(runs_dir: Path, job: int) -> dict:
    out = runs_dir / SAMPLES_DIR / str(int(job))
    images = sorted(p.name for p in out.glob("*.png")) if out.is_dir() else []
    videos = sorted(p.name for p in out.glob("*.mp4")) if out.is_dir() else []       # a video family's samples
    try:
        console = "\n".join((out / "console.log").read_text(errors="replace").splitlines()[-20:])
    except OSError:
        console = ""
    running = launcher.alive(out)
    return {"job": job, "images": images, "videos": videos, "console": console, "running": running}
