"""Does each recipe option learn? The demo's run (tiny Flux LoRA over coloured shapes, CPU) once
plainly and once per option, each reporting the demo's own measure: the mean loss of the first
tenth of the steps against the last tenth. Validation is reported by its held-out curve (first
and last measured value), EMA by the validation loss of the average against the live LoRA's at the
end (the same held-out images, fixed noise).

Options: masks (the shape's own outline as each image's mask, `mask_path`), priors (`dop`, prior
images of other shapes without the trigger word, every fourth step), EMA (decay 0.99), validation
(a tenth of the images held out, every 50 steps). Optimizers and adapter types are benched apart.

    python bench/recipe_options.py [--steps 300] [--out /tmp/recipe-bench]

Prints one line per option and a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
from PIL import Image


def _ratio(losses: list[float]) -> tuple[float, float]:
    n = max(1, len(losses) // 10)
    return sum(losses[:n]) / n, sum(losses[-n:]) / n


def _masks(images: Path, masks: Path) -> None:
    """Each image's shape as its mask: the pixels whose colour differs from the corner's (the
    background), white."""
    masks.mkdir(parents=True, exist_ok=True)
    for p in sorted(images.glob("*.png")):
        arr = np.asarray(Image.open(p).convert("RGB")).astype(int)
        background = arr[0, 0]
        mask = (np.abs(arr - background).sum(-1) > 60).astype(np.uint8) * 255
        Image.fromarray(mask, mode="L").save(masks / p.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path("/tmp/recipe-bench"))
    args = ap.parse_args()

    from leantune.config import load_config
    from leantune.demo import draw_shapes, one_thread, prepare
    from leantune.trainer import train

    if args.out.exists():
        shutil.rmtree(args.out)
    config = prepare(args.out / "demo", fresh=True)
    demo = config.parent
    _masks(demo / "images", demo / "masks")
    draw_shapes(demo / "prior", count=12, size=128, seed=11)       # other colours and places, no trigger
    base = [f"train.steps={args.steps}", "train.save_every=0", "sample.every=0", "train.log_every=1000"]
    held = ['validation.fraction=0.125', 'validation.every=50']
    options = {
        "plain": [],
        "masked loss (shape masks)": ['data.datasets=[{path="images", trigger_word="lnt", mask_path="masks", '
                                      'mask_floor=0.05}]'],
        "priors (dop, 1 in 4 steps)": ['data.datasets=[{path="images", trigger_word="lnt"}, '
                                       '{path="prior", role="prior"}]', 'data.prior_loss="dop"'],
        "validation (1/8 held out)": held,
        "EMA 0.99 (+ validation)": held + ["ema.enabled=true", "ema.decay=0.99"],
    }
    rows = []
    with one_thread():
        for name, extra in options.items():
            out = args.out / name.split()[0]
            cfg = load_config(config, base + extra + [f'output.dir="{out}"'])
            t0 = time.perf_counter()
            result = train(cfg, progress=False, overwrite=True)
            seconds = time.perf_counter() - t0
            first, last = _ratio(result.losses)
            history = json.loads(result.paths.loss_history.read_text())
            val = history.get("validation") or []
            note = ""
            if val:
                note = f"validation {val[0][1]:.4f} (step {val[0][0]}) -> {val[-1][1]:.4f} (step {val[-1][0]})"
            if cfg.ema.enabled:
                note += "; " + _ema_validation(cfg, result)
            rows.append((name, first, last, seconds, note))
            print(f"{name}: loss {first:.4f} -> {last:.4f} (x{last / first:.3f}) in {seconds:.0f} s; {note}", flush=True)
    print("\n| option | loss, first 10% | loss, last 10% | last / first | s | held-out |")
    print("|---|---|---|---|---|---|")
    for name, first, last, seconds, note in rows:
        print(f"| {name} | {first:.4f} | {last:.4f} | {last / first:.3f} | {seconds:.0f} | {note or '-'} |")


def _ema_validation(cfg, result) -> str:
    """The held-out loss of the EMA file against the live one's last measured value: the EMA's
    weights loaded into the trained model's place."""
    import torch

    from leantune.data.cache import model_dtype, prepare_caches
    from leantune.models.family import get_family
    from leantune.train.lora import apply_lora, read_lora
    from leantune.train.validation import validation_loss
    from leantune.trainer import _autocast, _loss

    family = get_family(cfg.model.family)
    data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", model_dtype(cfg.model), validation=cfg.validation)
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    transformer = family.load_transformer(sources, dtype=model_dtype(cfg.model), device="cpu")
    apply_lora(transformer, read_lora(result.paths.root / f"{cfg.output.name}_ema_comfyui.safetensors"))

    class T:
        pass

    t = T()
    t.transformer, t.device, t.dtype = transformer, torch.device("cpu"), model_dtype(cfg.model)
    value = validation_loss(t, cfg, data.validation_batches(), _loss, _autocast)
    return f"EMA file's held-out loss {value:.4f}"


if __name__ == "__main__":
    main()
