"""A tiny clip dataset shared by the Wan tests (this module holds no tests itself): squares that
move over a flat colour, written as real H.264 mp4 files with same-stem captions, and a still
image beside them (a video family trains on both)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def moving_square(kind: int, frames: int, side: int = 64) -> np.ndarray:
    """`frames` RGB frames (frames, side, side, 3) of a 16 px square moving 5 px a frame (kind 0:
    right over blue, kind 1: down over red)."""
    out = np.empty((frames, side, side, 3), np.uint8)
    for i in range(frames):
        out[i] = (30, 60, 200) if kind == 0 else (200, 60, 30)
        x = 4 + 5 * i
        if kind == 0:
            out[i, 24:40, x:x + 16] = 250
        else:
            out[i, x:x + 16, 24:40] = 250
    return out


def write_media(folder: Path, frames: int, fps: int, side: int = 64) -> Path:
    """`folder` (created) with clip0.mp4 / clip1.mp4 (the two squares) and still.png (the first
    square's fifth frame), each with its caption."""
    from PIL import Image

    from leantune.data.video_write import write_mp4

    folder.mkdir(parents=True)
    for i, caption in enumerate(("a square moving right", "a square moving down")):
        write_mp4(folder / f"clip{i}.mp4", moving_square(i, frames, side), fps)
        (folder / f"clip{i}.txt").write_text(caption)
    Image.fromarray(moving_square(0, frames, side)[4]).save(folder / "still.png")
    (folder / "still.txt").write_text("a square standing still")
    return folder


RUN = """
[model]
family = "{family}"
path = "{folder}"
dtype = "fp32"
{model_extra}
[data]
resolutions = [64]
batch_size = 2
cache_dir = "{cache}"
max_text_length = 32
{data_extra}max_frames = 9

[[data.datasets]]
path = "{media}"

[lora]
rank = 4
alpha = 4

[train]
steps = {steps}
learning_rate = {lr}
mixed_precision = "no"
seed = 3
{train_extra}
[output]
dir = "{out}"
name = "{name}"
formats = ["diffusers"]
{extra}"""


def wan_run(path: Path, *, family: str, folder, media, cache, out, name: str, steps: int = 2, lr: float = 1e-3,
            save_every: int | None = None, target_fps: int | None = None, model_extra: str = "",
            extra: str = "") -> Path:
    """A tiny Wan LoRA run's config on a clip folder (rank 4, batch 2, 64 px, 9 frames), written to
    `path`: the config the Wan tests train from."""
    path.write_text(RUN.format(
        family=family, folder=folder, media=media, cache=cache, out=out, name=name, steps=steps, lr=lr,
        model_extra=model_extra, extra=extra,
        data_extra=f"target_fps = {target_fps}\n" if target_fps is not None else "",
        train_extra=f"save_every = {save_every}\n" if save_every is not None else ""))
    return path
