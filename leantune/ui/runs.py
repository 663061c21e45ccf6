"""The runs under `leantune ui --runs DIR`, read from their folders.

Each run is DIR/<name>/ with the config the page wrote (config.toml), the plan it showed
(plan.json), the process record (process.json, launcher.py) and the trainer's run folder (run/).
Everything the page watches comes from files the trainer writes anyway: the step lines of train.log
(loss, s/it, VRAM, RSS), samples/*.png, the LoRA/model files and checkpoints/. So the page can be
closed and reopened, or restarted, without losing sight of a run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import launcher

CONFIG_FILE = "config.toml"
PLAN_FILE = "plan.json"
RUN_DIR = "run"
GiB = 2**30

# an optimizer's own scalars may follow the lr ("lr 1 d 2.1e-06 d_lr 2.1e-06": Prodigy's estimate)
STEP_LINE = re.compile(r"\bstep (\d+) loss (\S+) lr \S+(?: [\w*]+ \S+)*? ([\d.]+)s/it(.*)$")
VRAM = re.compile(r"vram ([\d.]+)/([\d.]+) GiB \(peak ([\d.]+)\)")
RSS = re.compile(r"rss ([\d.]+) GiB")
VALIDATION_LINE = re.compile(r"\bstep (\d+) validation loss (\S+)")


QUEUED_FILE = "queued.json"
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ \w+ ")


def run_folders(runs_dir: Path) -> list[Path]:
    if not runs_dir.is_dir():
        return []
    return sorted(p for p in runs_dir.iterdir() if (p / CONFIG_FILE).is_file())


def run_folder(runs_dir: Path, name: str) -> Path:
    """DIR/<name>, refusing names that leave DIR."""
    from .form import NAME, FormError

    if not NAME.match(name):
        raise FormError(f"run name {name!r}: letters, digits, '-', '_' or '.'")
    return runs_dir / name


def parse_log(text: str) -> list[dict]:
    """The step lines of a train.log: [{step, loss, s_it, vram, vram_peak, rss}] (GiB; None if absent)."""
    out = []
    for line in text.splitlines():
        m = STEP_LINE.search(line)
        if not m:
            continue
        try:
            loss = float(m.group(2))
        except ValueError:
            continue
        rest = m.group(4)
        vram, rss = VRAM.search(rest), RSS.search(rest)
        out.append({"step": int(m.group(1)), "loss": loss, "s_it": float(m.group(3)),
                    "vram": float(vram.group(1)) if vram else None,
                    "vram_peak": float(vram.group(3)) if vram else None,
                    "rss": float(rss.group(1)) if rss else None})
    by_step = {entry["step"]: entry for entry in out}      # a resumed run logs steps again: keep the last
    return [by_step[s] for s in sorted(by_step)]


def parse_validation(text: str) -> list[list]:
    """The held-out losses of a train.log ([validation], train/validation.py): [[step, loss]],
    the last measurement of a step kept (a resumed run may measure it again)."""
    by_step = {}
    for line in text.splitlines():
        m = VALIDATION_LINE.search(line)
        if m:
            try:
                by_step[int(m.group(1))] = float(m.group(2))
            except ValueError:
                continue
    return [[s, by_step[s]] for s in sorted(by_step)]


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def outputs(folder: Path) -> dict:
    """Sample grids (a video family's: .mp4 grid videos), exported weights (final and per step) and
    checkpoints of a run."""
    root = folder / RUN_DIR
    samples = sorted(p.name for p in (root / "samples").iterdir()
                     if p.is_file() and p.suffix in SAMPLE_SUFFIXES) if (root / "samples").is_dir() else []
    weights = sorted(p.name for p in root.glob("*.safetensors")) if root.is_dir() else []
    checkpoints = sorted(p.name for p in (root / "checkpoints").iterdir()) if (root / "checkpoints").is_dir() else []
    return {"samples": samples, "weights": weights, "checkpoints": checkpoints}


def state(folder: Path) -> str:
    """running | queued | finished | failed (the last process exited with an error) | stopped (resumable) | new."""
    info = launcher.read_process(folder)
    if launcher.is_alive(info, folder):
        return "running"
    if (folder / QUEUED_FILE).is_file():
        return "queued"
    out = outputs(folder)
    final = [w for w in out["weights"] if "-step" not in w]
    if final:
        return "finished"
    if info and info.get("exit_code") not in (None, 0, 130):     # 130: stopped by SIGINT after saving
        return "failed"
    if out["checkpoints"]:
        return "stopped"
    return "new"


def total_steps(folder: Path) -> int | None:
    from ..config import read_toml

    try:
        return int(read_toml(folder / CONFIG_FILE).get("train", {}).get("steps"))
    except Exception:
        return None


def predicted(folder: Path) -> dict:
    try:
        plan = json.loads((folder / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: plan.get(k) for k in ("peak_vram_gib", "peak_host_gib", "step_s", "message", "assumed_machine")}


def activity(log: str, console: str) -> str:
    """What the trainer is doing now, in its own words: the last line of train.log (or, before the
    log exists, of its console: loading, caching captions 12/24, ...), without the timestamp."""
    for text in (log, console):
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith("$ ")]
        if lines:
            return TIMESTAMP.sub("", lines[-1].strip().split("\r")[-1])[:200]
    return "starting the trainer"


def timing(folder: Path, steps: list[dict], total: int | None, now: float | None = None) -> dict:
    """Elapsed seconds of the run across its launches (Stop and Resume carry the time before over,
    launcher.time_before) and the ETA from the measured s/it of the last steps."""
    import time

    info = launcher.read_process(folder) or {}
    started = info.get("started")
    end = info.get("ended") or (now if now is not None else time.time())
    elapsed = launcher.time_before({**info, "ended": None}) + (end - started) if started else None
    eta = None
    if steps and total and launcher.is_alive(info, folder):
        recent = [s["s_it"] for s in steps[-20:]]
        eta = max(0, total - steps[-1]["step"]) * sum(recent) / len(recent)
    return {"elapsed_s": elapsed, "eta_s": eta}


SAMPLE_SUFFIXES = (".png", ".mp4")   # image grids, and a video family's grid videos (their .webp previews aside)


def gallery(folder: Path, samples: list[str]) -> dict:
    """The run's sample grids by step and prompt: {"prompts": [...], "steps": [{"step", "file",
    "video"}]}; a video step's file is the grid video of every prompt (not cut per prompt)."""
    from ..config import read_toml

    try:
        prompts = list(read_toml(folder / CONFIG_FILE).get("sample", {}).get("prompts", []))
    except Exception:
        prompts = []
    steps = []
    for name in samples:
        m = re.search(r"(\d+)", name)
        steps.append({"step": int(m.group(1)) if m else 0, "file": name, "video": name.endswith(".mp4")})
    return {"prompts": prompts, "steps": sorted(steps, key=lambda s: s["step"])}


def samples_zip(folder: Path) -> Path:
    """Every file of the run's samples folder (grids, videos, previews) in one zip, written beside
    the run (atomically; stored, not compressed again: PNG and mp4 are) and returned. Only plain
    files directly in the folder, never a link."""
    import io as _io
    import zipfile

    from ..io import atomic_write_bytes

    samples = folder / RUN_DIR / "samples"
    target = folder / "samples.zip"
    buf = _io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        if samples.is_dir():
            for p in sorted(samples.iterdir()):
                if p.is_file() and not p.is_symlink():
                    z.write(p, arcname=p.name)
    atomic_write_bytes(target, buf.getvalue())
    return target


def sample_tile(folder: Path, file: str, index: int) -> bytes:
    """Image `index` (prompt `index`) of a sample grid, as PNG: the grid's metadata gives each
    image's size, so the tile is cut where the sampler pasted it (row-major)."""
    import io
    import json as _json

    from PIL import Image

    path = folder / RUN_DIR / "samples" / Path(file).name
    with Image.open(path) as grid:
        meta = {}
        for value in grid.info.values():
            try:
                found = _json.loads(value) if isinstance(value, str) and value.startswith("{") else None
            except ValueError:
                found = None
            if isinstance(found, dict) and "width" in found:
                meta = found
        w, h = int(meta.get("width", grid.height)), int(meta.get("height", grid.height))
        cols = max(1, grid.width // w)
        r, c = divmod(int(index), cols)
        if index < 0 or (r + 1) * h > grid.height:
            raise ValueError(f"{file}: no image {index}")
        tile = grid.crop((c * w, r * h, (c + 1) * w, (r + 1) * h))
        buf = io.BytesIO()
        tile.save(buf, format="PNG")
        return buf.getvalue()


def progress(folder: Path, log_lines: int = 40) -> dict:
    """Everything the watch screen draws, from the run's files."""
    root = folder / RUN_DIR
    text = _tail(root / "train.log", 100000)
    steps = parse_log(text)
    info = launcher.read_process(folder) or {}
    log, console = _tail(root / "train.log", log_lines), _tail(folder / launcher.CONSOLE_FILE, log_lines)
    total = total_steps(folder)
    out = outputs(folder)
    return {"name": folder.name, "state": state(folder), "steps": steps, "validation": parse_validation(text),
            "total_steps": total,
            "predicted": predicted(folder), "log": log, "console": console, "exit_code": info.get("exit_code"),
            "activity": activity(log, console), **timing(folder, steps, total), "gallery": gallery(folder, out["samples"]),
            **out}


def listing(runs_dir: Path) -> list[dict]:
    """[{name, state, step, total_steps}] of every run under runs_dir."""
    out = []
    for folder in run_folders(runs_dir):
        steps = parse_log(_tail(folder / RUN_DIR / "train.log", 100000))
        out.append({"name": folder.name, "state": state(folder), "step": steps[-1]["step"] if steps else 0,
                    "total_steps": total_steps(folder)})
    return out
