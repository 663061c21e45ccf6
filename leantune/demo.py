"""The demo: everything a newcomer needs to see leantune work, built offline on CPU.

It writes a tiny Flux of the real diffusers classes (with tiny CLIP/T5 encoders, tokenizers trained
on the spot, and a tiny VAE built to reconstruct its images: demo_vae.py) as a diffusers folder,
draws a small captioned image set of coloured shapes, and trains a LoRA with the shipped quickstart
config — the same `train()` a real run uses. Then it samples the quickstart's prompts with the base
model and with the trained LoRA (same seeds) and puts them side by side: the picture a newcomer
looks at shows what training changed.
`mode="full"` fine-tunes every weight instead (quickstart_full.toml: step inside backward, two
streamed trainable blocks) and exports the whole model as a BFL / ComfyUI file.
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


def draw_shapes(folder: Path, count: int = 24, size: int = 128, seed: int = 0, cycle: bool = False) -> list[Path]:
    """`count` PNGs of one coloured shape each, with a same-stem .txt caption describing it.

    Colours and backgrounds are drawn at random, or with `cycle` in a fixed round: image i has
    colour i % 6, each colour its own shape, and the background switches every 6 images, so 24
    images hold every combination twice (the demo's prompts name two of them)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        colour, shape, bg = rng.choice(list(COLOURS)), SHAPES[i % len(SHAPES)], rng.choice(list(BACKGROUNDS))
        if cycle:
            colour, bg = list(COLOURS)[i % len(COLOURS)], list(BACKGROUNDS)[(i // len(COLOURS)) % len(BACKGROUNDS)]
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


def colour_match(image, prompt: str, tolerance: float = 60.0) -> tuple[float, float]:
    """(share of pixels near the prompt's shape colour, share near its background colour) of a PIL
    image: how well a sample draws "a red circle on a white background". `tolerance` is a
    Euclidean RGB distance in 0..255 levels."""
    import numpy as np

    words = prompt.replace(",", " ").split()
    colour = next(w for w in words if w in COLOURS)
    background = next(w for w in words if w in BACKGROUNDS)
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32).reshape(-1, 3)

    def share(rgb) -> float:
        return float((np.linalg.norm(pixels - np.array(rgb, dtype=np.float32), axis=1) < tolerance).mean())

    return share(COLOURS[colour]), share(BACKGROUNDS[background])


def before_after_match(samples: Path, prompts: list[str]) -> dict[str, list[tuple[float, float]]]:
    """colour_match of each prompt's image in samples/before and samples/after (prompt order)."""
    from PIL import Image

    out = {}
    for which in ("before", "after"):
        files = sorted((samples / which).glob("*.png"))
        out[which] = [colour_match(Image.open(f), prompt) for f, prompt in zip(files, prompts)]
    return out


CONFIGS = {"lora": "quickstart.toml", "full": "quickstart_full.toml"}


def quickstart_text(mode: str = "lora") -> str:
    return resources.files("leantune.resources").joinpath(CONFIGS[mode]).read_text()


MARKER = ".leantune-demo"
DEMO_ENTRIES = ("model", "images", "cache", "run", "quickstart.toml", "quickstart_full.toml")


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


def prepare(out: Path, fresh: bool = False, mode: str = "lora") -> Path:
    """Write model, images and config into `out`; returns the config path. Reuses what exists.

    `fresh` first removes what an earlier demo wrote into `out` (see `_clear`).
    """
    from .demo_vae import save_shape_vae
    from .models import tiny

    _check_ours(out)
    if fresh and out.exists():
        _clear(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `leantune demo`; `leantune demo` may clear this folder's demo files\n")
    if not (out / "model" / "model_index.json").exists():
        tiny.save_flux_folder(out / "model", seed=0)
        save_shape_vae(out / "model" / "vae")          # a VAE that reconstructs the shapes
    if not any((out / "images").glob("*.png")):
        draw_shapes(out / "images", cycle=True)
    config = out / CONFIGS[mode]
    config.write_text(quickstart_text(mode))
    return config


def run_demo(out: Path, steps: int | None = None, fresh: bool = True, progress: bool = True, mode: str = "lora"):
    from .config import load_config
    from .train.trainer import train

    config = prepare(out, fresh=fresh, mode=mode)
    overrides = [] if steps is None else [f"train.steps={steps}"]
    cfg = load_config(config, overrides)
    result = train(cfg, progress=progress, overwrite=True)     # the demo owns its run folder
    if mode == "lora" and not result.interrupted and result.lora_files and cfg.sample.prompts:
        result.sample_files.append(before_after(cfg, result.lora_files[0], result.paths.samples))
    return config, result


def before_after(cfg, lora_file: Path, folder: Path, device: str = "cpu") -> Path:
    """Sample the run's prompts with the base model and with `lora_file` (same seeds, same
    settings as the training samples) and write them as one picture: before on top, after below.
    The single images stay in folder/before and folder/after, each with its PNG metadata."""
    from PIL import Image

    from .infer.images import make_grid, save_png
    from .infer.request import validate_request
    from .infer.run import run_sampling

    s = cfg.sample
    rows = {}
    for name, loras in (("before", []), ("after", [{"path": str(lora_file), "strength": 1.0}])):
        out = folder / name
        for old in out.glob("*.png"):           # numbered per run: keep only this run's
            old.unlink()
        request = validate_request({"model": {"path": str(cfg.resolve(cfg.model.path)), "dtype": cfg.model.dtype},
                                    "prompts": list(s.prompts), "seed": s.seed, "steps": s.steps,
                                    "guidance": s.guidance, "width": s.width, "height": s.height,
                                    "max_text_length": cfg.data.max_text_length, "lora": loras, "out": str(out),
                                    "device": device}, "demo")
        rows[name] = [Image.open(f).convert("RGB") for f in run_sampling(request).files]
    grid = make_grid(rows["before"] + rows["after"], cols=len(s.prompts), pad=4)
    return save_png(grid, folder / "before-after.png",
                    {"prompt": list(s.prompts), "seed": s.seed, "steps": s.steps,
                     "rows": "top: base model (before training); bottom: with the trained LoRA",
                     "loras": f"{lora_file}:1"})
