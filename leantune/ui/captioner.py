"""Captions for a dataset from a local image-to-text model the user points at.

`python -m leantune.ui.captioner MODEL FOLDER STATUS [--all] [--prompt TEXT] [--max-tokens N]`
loads a transformers image-text-to-text model from a folder on disk (AutoProcessor +
AutoModelForImageTextToText: BLIP, Florence-2, ... ; nothing is fetched from a hub), captions every
image of FOLDER that has no caption yet (every image with --all), and writes each caption as the
image's .txt atomically, the same write-back the page's caption boxes use, so the captions stay
editable there. It runs as its own process (the model's memory goes with it) and reports its
progress in STATUS (JSON: done, total, current, error), which the page polls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _status(path: Path, **data) -> None:
    from ..io import atomic_write_json

    atomic_write_json(path, {**data, "updated": time.time()})


def caption_folder(model: str, folder: str, status: Path, overwrite: bool = False, prompt: str = "",
                   max_tokens: int = 40) -> int:
    """Caption every readable image and clip of `folder` without a caption (all with `overwrite`);
    a clip is captioned from its first frame, as the page shows it."""
    from . import dataset_view, thumbs

    entries = dataset_view.scan(folder)
    todo = [e["name"] for e in entries if e["width"] and (overwrite or not e["caption"])]   # readable ones
    _status(status, done=0, total=len(todo), current="loading the captioning model", error=None, running=True)
    try:
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        processor = AutoProcessor.from_pretrained(model, local_files_only=True)
        net = AutoModelForImageTextToText.from_pretrained(model, local_files_only=True).eval()
    except Exception as e:      # transformers raises many types for a folder that is not a model
        _status(status, done=0, total=len(todo), current=None, running=False,
                error=f"{model}: not a local image-to-text model transformers can load ({type(e).__name__})")
        return 2
    for i, name in enumerate(todo):
        _status(status, done=i, total=len(todo), current=name, error=None, running=True)
        img = thumbs.picture(dataset_view.preview_path(folder, name))     # a clip: its first frame
        inputs = processor(images=img, text=prompt or None, return_tensors="pt")
        with torch.no_grad():
            ids = net.generate(**inputs, max_new_tokens=max_tokens)
        text = processor.batch_decode(ids, skip_special_tokens=True)[0].strip()
        if prompt and text.startswith(prompt):
            text = text[len(prompt):].strip()
        dataset_view.write_caption(folder, name, text)
    _status(status, done=len(todo), total=len(todo), current=None, error=None, running=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m leantune.ui.captioner")
    p.add_argument("model")
    p.add_argument("folder")
    p.add_argument("status")
    p.add_argument("--all", action="store_true", help="caption every image, replacing existing captions")
    p.add_argument("--prompt", default="", help="text given with each image (models that take a task prompt)")
    p.add_argument("--max-tokens", type=int, default=40)
    args = p.parse_args(argv)
    return caption_folder(args.model, args.folder, Path(args.status), args.all, args.prompt, args.max_tokens)


if __name__ == "__main__":
    sys.exit(main())
