"""`leantune demo [--out DIR] [--steps N] [--mode lora|full] [--family flux|sd3|qwen-image|z-image|wan]`:
train a LoRA (or every weight) of a tiny Flux (or SD3.5, Qwen-Image, Z-Image; or Wan on clips) built
offline, on CPU."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    """--steps is checked by the parser, before anything is built."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: the demo needs at least 1 training step")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-output", help="folder for the model, images and run (default: demo-output)")
    p.add_argument("--steps", type=_positive_int, default=None, help="training steps (default: the quickstart config's)")
    p.add_argument("--keep", action="store_true", help="keep an existing demo folder instead of starting fresh")
    p.add_argument("--mode", choices=("lora", "full"), default="lora",
                   help="lora (default), or full: fine-tune every weight and export the whole model")
    p.add_argument("--family", choices=("flux", "sd3", "qwen-image", "z-image", "wan"), default="flux",
                   help="the tiny base model: flux (default), sd3 (SD3.5 Large-style), qwen-image, z-image or "
                        "wan (video: trains on short clips, samples videos); all but flux in lora mode")


def run(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    if args.family != "flux" and args.mode == "full":
        print(f"leantune demo: --family {args.family} runs in lora mode only; drop --mode full", file=sys.stderr)
        return 2
    config, result = run_demo(Path(args.out), steps=args.steps, fresh=not args.keep, mode=args.mode,
                              family=args.family)
    p = result.paths
    n = max(1, len(result.losses) // 10)
    first, last = sum(result.losses[:n]) / n, sum(result.losses[-n:]) / n
    print()
    print(f"demo finished: {result.final_step} steps, loss {first:.4f} (first {n} steps) -> {last:.4f} (last {n})")
    print(f"  config       {config}")
    for f in result.lora_files:
        print(f"  {'LoRA' if args.mode == 'lora' else 'model':<12} {f}")
    for f in result.sample_files:
        label = "before/after" if f.name == "before-after.png" else "samples"
        print(f"  {label:<13}{f}")
        if f.name == "before-after.png" and f.with_suffix(".mp4").exists():
            print(f"  {'before/after':<13}{f.with_suffix('.mp4')} (the videos; the png shows their first frames)")
    print(f"  loss plot    {p.loss_plot}")
    print(f"  memory plot  {p.memory_plot}")
    print(f"  TensorBoard  tensorboard --logdir {p.tensorboard}")
    print(f"  log          {p.log_file}")
    if (p.samples / "before-after.png").exists():
        from ..config import load_config
        from ..demo import before_after_match

        prompts = list(load_config(config).sample.prompts)
        match = before_after_match(p.samples, prompts)
        print("how the samples draw their prompts, before -> after training (share of the shape's pixels in the "
              "prompted colour; share of the pixels around it in the prompted background):")
        if "motion" in match["before"][0]:
            print("  (videos: of the first frame; motion: pixels the colour's centre moves, first to last frame, "
                  "the way the clips move it)")
        for prompt, b, a in zip(prompts, match["before"], match["after"]):
            moved = f", motion {b['motion']:+.0f} -> {a['motion']:+.0f} px" if "motion" in b else ""
            print(f"  {prompt!r}: shape {b['shape']:.0%} -> {a['shape']:.0%}, "
                  f"background {b['background']:.0%} -> {a['background']:.0%}{moved}")
    return 0
