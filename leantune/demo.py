"""The demo: everything a newcomer needs to see leantune work, built offline on CPU.

It writes a tiny Flux of the real diffusers classes (with tiny CLIP/T5 encoders, tokenizers trained
on the spot and a tiny VAE) as a diffusers folder, draws a small captioned image set of coloured
shapes, and trains a LoRA with the shipped quickstart config — the same `train()` a real run uses.
"""

from __future__ import annotations

import random
import shutil
from importlib import resources
from pathlib import Path

COLOURS = {
    "red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 60), "yellow": (235, 210, 40),
    "purple": (140, 60, 180), "orange": (240, 140, 30),
}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("circle", "square", "triangle")


def draw_shapes(folder: Path, count: int = 24, size: int = 128, seed: int = 0) -> list[Path]:
    """`count` PNGs of one coloured shape each, with a same-stem .txt caption describing it."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        colour, shape, bg = rng.choice(list(COLOURS)), SHAPES[i % len(SHAPES)], rng.choice(list(BACKGROUNDS))
        img = Image.new("RGB", (size, size), BACKGROUNDS[bg])
        d = ImageDraw.Draw(img)
        r = rng.randint(size // 5, size // 3)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        if shape == "circle":
            d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
        elif shape == "square":
            d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
        else:
            d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
        path = folder / f"shape_{i:03d}.png"
        img.save(path)
        path.with_suffix(".txt").write_text(f"a {colour} {shape} on a {bg} background")
        paths.append(path)
    return paths


def quickstart_text() -> str:
    return resources.files("leantune.resources").joinpath("quickstart.toml").read_text()


MARKER = ".leantune-demo"
DEMO_ENTRIES = ("model", "images", "cache", "run", "quickstart.toml")


class DemoFolderError(ValueError):
    """The demo was pointed at a folder it did not make; it never deletes a user's files."""


def _check_ours(out: Path) -> None:
    """`out` must be new, empty, or a folder an earlier demo made (it carries the marker). Anything
    else is refused before a file is written or removed: `--out .` or `--out ~/data` must never
    cost the user their files, nor train on their images."""
    if not out.exists():
        return
    if not out.is_dir():
        raise DemoFolderError(f"--out {out}: exists and is not a folder")
    if any(out.iterdir()) and not (out / MARKER).exists() and not _unmarked_earlier_demo(out):
        raise DemoFolderError(f"--out {out}: the folder is not empty and was not made by `leantune demo` (it has "
                              f"no {MARKER} file); give a new or empty folder (nothing was changed)")


def _unmarked_earlier_demo(out: Path) -> bool:
    """A demo folder from before the marker existed: the shipped quickstart config, unchanged, beside
    a model folder. No folder of the user's own matches that."""
    try:
        same_config = (out / "quickstart.toml").read_text() == quickstart_text()
    except OSError:
        return False
    return same_config and (out / "model" / "model_index.json").is_file()


def _clear(out: Path) -> None:
    """Remove what an earlier demo wrote into `out` (checked by `_check_ours` first), nothing else."""
    for name in DEMO_ENTRIES:
        entry = out / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()


def prepare(out: Path, fresh: bool = False) -> Path:
    """Write model, images and config into `out`; returns the config path. Reuses what exists.

    `fresh` first removes what an earlier demo wrote into `out` (see `_clear`).
    """
    from .models import tiny

    _check_ours(out)
    if fresh and out.exists():
        _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `leantune demo`; `leantune demo` may clear this folder's demo files\n")
    if not (out / "model" / "model_index.json").exists():
        tiny.save_flux_folder(out / "model", seed=0)
    if not any((out / "images").glob("*.png")):
        draw_shapes(out / "images")
    config = out / "quickstart.toml"
    config.write_text(quickstart_text())
    return config


def run_demo(out: Path, steps: int | None = None, fresh: bool = True, progress: bool = True):
    from .config import load_config
    from .train.trainer import train

    config = prepare(out, fresh=fresh)
    overrides = [] if steps is None else [f"train.steps={steps}"]
    cfg = load_config(config, overrides)
    result = train(cfg, progress=progress, overwrite=True)     # the demo owns its run folder
    return config, result
