"""Does each recipe option learn? The demo's run (tiny Flux LoRA over coloured shapes, CPU) once
plainly and once per option, each reporting the demo's own measure: the mean loss of the first
tenth of the steps against the last tenth. Validation is reported by its held-out curve (first
and last measured value), EMA by the validation loss of the average against the live LoRA's at the
end (the same held-out images, fixed noise).

Three groups (`--only`, comma-separated; default `options`, the table docs/benchmarks.md has
under "The recipe options learn"):

- `options`: masks (the shape's own outline as each image's mask, `mask_path`), priors (`dop`,
  prior images of other shapes without the trigger word, every fourth step), EMA (decay 0.99),
  validation (`fraction` 0.125 held out: 4 of the demo's 24 images, every 50 steps), against the
  plain run.
- `adapters`: `[lora] type` = lokr (its default factor, -1), loha, dora, against plain lora.
- `optimizers`: `[train] optimizer` = prodigy (learning_rate 1.0, the multiplier of its own
  estimate d, as its docs say; the run's final d is reported), schedulefree_adamw (constant
  "schedule": it refuses a scheduler and warms up itself), came, adamw8bit, against the default
  adamw, all at the quickstart's settings otherwise (learning rate 4e-3, cosine, 20 warm-up
  steps). Two more rows each: prodigy with the settings its README gives for diffusion models
  (safeguard_warmup, bias correction, weight decay 0.01), since the quickstart's warm-up makes it
  overestimate d; came at 4e-4 and 1e-4, since its instability average (third beta 0.9999, no
  bias correction) starts near zero and multiplies its early steps far past the learning rate.

The adapter and optimizer rows all hold the same images out (as the validation row): their loss
ratios come from different parametrisations and step rules, so the held-out loss at fixed noise is
the measure that compares across rows. Their tables add each run's highest step loss (a run that
blew up early and recovered has a high first tenth, so a small last / first: the ratio alone would
flatter it) and its trained parameter count. Their baseline (lora, adamw) is one run shared by both.

    python bench/recipe_options.py [--steps 300] [--only options|adapters|optimizers,...] [--out /tmp/recipe-bench]

Prints one line per run and a markdown table per group for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import numpy as np
from PIL import Image

GROUPS = ("options", "adapters", "optimizers")
HELD = ['validation.fraction=0.125', 'validation.every=50']


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


def group_runs(group: str, steps: int) -> dict[str, list[str]]:
    """name -> config overrides of each run in `group` (besides the bench's base overrides)."""
    if group == "options":
        return {
            "plain": [],
            "masked loss (shape masks)": ['data.datasets=[{path="images", trigger_word="lnt", mask_path="masks", '
                                          'mask_floor=0.05}]'],
            "priors (dop, 1 in 4 steps)": ['data.datasets=[{path="images", trigger_word="lnt"}, '
                                           '{path="prior", role="prior"}]', 'data.prior_loss="dop"'],
            "validation (1/8 held out)": HELD,
            "EMA 0.99 (+ validation)": HELD + ["ema.enabled=true", "ema.decay=0.99"],
        }
    # The last step logs its line (Prodigy's d is in it: trainer._log_step).
    held = HELD + [f"train.log_every={steps}"]
    baseline = {"lora, adamw (quickstart, + validation)": held}
    if group == "adapters":
        return baseline | {
            "lokr (factor -1)": held + ['lora.type="lokr"'],
            "loha": held + ['lora.type="loha"'],
            "dora": held + ['lora.type="dora"'],
        }
    if group == "optimizers":
        return baseline | {
            "prodigy (lr 1.0)": held + ['train.optimizer="prodigy"', "train.learning_rate=1.0"],
            "prodigy (lr 1.0, its README's diffusion settings)": held + [
                'train.optimizer="prodigy"', "train.learning_rate=1.0", "train.prodigy_safeguard_warmup=true",
                "train.prodigy_use_bias_correction=true", "train.weight_decay=0.01"],
            "schedulefree_adamw (constant)": held + ['train.optimizer="schedulefree_adamw"',
                                                     'train.lr_scheduler="constant"'],
            "came": held + ['train.optimizer="came"'],
            "came (lr 4e-4)": held + ['train.optimizer="came"', "train.learning_rate=4e-4"],
            "came (lr 1e-4)": held + ['train.optimizer="came"', "train.learning_rate=1e-4"],
            "adamw8bit": held + ['train.optimizer="adamw8bit"'],
        }
    raise ValueError(f"--only: {group!r} is not one of {', '.join(GROUPS)}")


def _groups(text: str) -> list[str]:
    groups = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        raise argparse.ArgumentTypeError(f"{text!r}: one or more of {', '.join(GROUPS)}, comma-separated")
    return groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--only", type=_groups, default=["options"], help=f"comma-separated groups: {', '.join(GROUPS)}")
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
    done: dict[tuple[str, ...], dict] = {}          # overrides -> run: a run shared by two groups runs once
    tables = {}
    with one_thread():
        for group in args.only:
            rows = []
            for name, extra in group_runs(group, args.steps).items():
                if tuple(extra) not in done:
                    out = args.out / group / re.sub(r"\W+", "-", name).strip("-")
                    done[tuple(extra)] = _run(load_config(config, base + extra + [f'output.dir="{out}"']), train)
                run = done[tuple(extra)]
                rows.append((name, run))
                print(f"{group} / {name}: loss {run['first']:.4f} -> {run['last']:.4f} "
                      f"(x{run['last'] / run['first']:.3f}), highest {run['peak']:.4g} at step {run['peak_step']}, "
                      f"in {run['seconds']:.0f} s; held-out {run['held_out'] or '-'}; {run['adapter']}; "
                      f"{run['d'] or ''}", flush=True)
            tables[group] = rows
    for group, rows in tables.items():
        print(f"\n{group}\n")
        if group == "options":
            print("| option | loss, first 10% | loss, last 10% | last / first | s | held-out |")
            print("|---|---|---|---|---|---|")
            for name, r in rows:
                print(f"| {name} | {r['first']:.4f} | {r['last']:.4f} | {r['last'] / r['first']:.3f} | "
                      f"{r['seconds']:.0f} | {r['held_out'] or '-'} |")
            continue
        # The highest step loss shows what a ratio hides: a run that blew up early and recovered has
        # a high first tenth, so a small last / first.
        print("| run | loss, first 10% | loss, last 10% | last / first | highest step loss (step) | held-out loss "
              "| trained parameters | s |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r in rows:
            held = r["held_out"] + (f"; Prodigy's final d {r['d']}" if r["d"] else "")
            print(f"| {name} | {r['first']:.4f} | {r['last']:.4f} | {r['last'] / r['first']:.3f} | "
                  f"{r['peak']:.4g} ({r['peak_step']}) | {held or '-'} | {r['adapter']} | {r['seconds']:.0f} |")


def _run(cfg, train) -> dict:
    """One training run and what the tables report of it."""
    t0 = time.perf_counter()
    result = train(cfg, progress=False, overwrite=True)
    seconds = time.perf_counter() - t0
    first, last = _ratio(result.losses)
    history = json.loads(result.paths.loss_history.read_text())
    val = history.get("validation") or []
    held = f"{val[0][1]:.4f} (step {val[0][0]}) -> {val[-1][1]:.4f} (step {val[-1][0]})" if val else ""
    if cfg.ema.enabled:
        held += "; " + _ema_validation(cfg, result)
    peak = max(result.losses)
    return {"first": first, "last": last, "seconds": seconds, "held_out": held, "peak": peak,
            "peak_step": result.losses.index(peak) + 1, "adapter": _adapter_size(result.paths.log_file),
            "d": _last_logged(result.paths.log_file, "d") if cfg.train.optimizer == "prodigy" else None}


def _last_logged(log_file: Path, key: str) -> str:
    """The value of `key` on the run's last step line ("step N loss ... lr ... d 0.0123 ..."): the
    scalars trainer._log_step writes beside the learning rate."""
    lines = [ln for ln in log_file.read_text().splitlines() if re.search(r" step \d+ loss ", ln)]
    found = re.search(rf" {re.escape(key)} (\S+)", lines[-1]) if lines else None
    if found is None:
        raise ValueError(f"{log_file}: no step line with {key!r} (is train.log_every a divisor of the steps?)")
    return found.group(1)


def _adapter_size(log_file: Path) -> str:
    """The trained parameter count the run logged with its adapter ("lora: lokr rank 32 ...: 100
    tensors, 0.34M parameters"): the adapter types differ in size at one rank."""
    found = re.search(r" lora: .*?(\S+) parameters", log_file.read_text())
    if found is None:
        raise ValueError(f"{log_file}: no adapter line (\"lora: ... parameters\")")
    return found.group(1)


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
