"""What every dataset reader shares: its errors and warnings, the image as displayed, and the
one-line listing of paths in a summary. Kept apart from dataset.py so the clip reader
(data/video.py), which dataset.py's scan calls, depends on these and not on the scan itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


class DataError(ValueError):
    """A dataset problem (missing folder, no usable image, unreadable caption), naming the path."""


class DataWarning(UserWarning):
    """Something in a dataset was skipped; training continues without it."""


def _eight_bit(img: Image.Image) -> Image.Image:
    """A single-channel image of more than 8 bits (I;16*, I, F) as 8-bit L, scaled by its range.

    PIL's own convert("RGB") clips these to 0..255, so a 16-bit PNG (0..65535) turns near-white.
    I;16 is 16-bit by definition. I (32-bit) holds 16-bit PNGs on some PIL versions and 8-bit data
    on others: values above 255 mean 16-bit. F is taken as 0..1 when nothing exceeds 1 (the
    float convention), else like I.
    """
    arr = np.asarray(img).astype(np.float64)
    peak = float(arr.max()) if arr.size else 0.0
    if img.mode.startswith("I;16") or (img.mode in ("I", "F") and peak > 255):
        arr = arr / 257.0                         # 65535 -> 255, 33025 -> 128.5
    elif img.mode == "F" and peak <= 1.0:
        arr = arr * 255.0
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")


def load_rgb(path: Path) -> Image.Image:
    """The image as displayed (EXIF orientation applied), RGB; transparency composited on white.

    White rather than black because transparent product shots and logos are meant to be seen on
    a light page; a black matte would teach the model dark halos. CMYK goes through PIL's
    conversion; high-bit-depth grayscale through `_eight_bit`.
    """
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I") or img.mode == "F":
            return _eight_bit(img).convert("RGB")
        if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")


def load_rgba(path: Path) -> Image.Image:
    """The image as displayed (EXIF orientation applied), RGBA with its own alpha (opaque where it
    has none): what a family whose VAE encodes the alpha channel trains on (ModelFamily.rgba,
    Qwen-Image-2.1, whose pipeline hands its VAE `img.convert("RGBA")`). High-bit-depth grayscale
    goes through `_eight_bit` as in load_rgb."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I") or img.mode == "F":
            return _eight_bit(img).convert("RGBA")
        return img.convert("RGBA")


def load_image(path: Path, rgba: bool = False) -> Image.Image:
    """load_rgba for a family that trains on the alpha channel (ModelFamily.rgba), else load_rgb."""
    return load_rgba(path) if rgba else load_rgb(path)


FIRST_PATHS = 5     # how many paths a summary warning lists before "and N more"


def listing(paths: list[Path], first: int = FIRST_PATHS) -> str:
    """'a.png, b.png (and 3 more)': the first paths of a long list, for one-line summaries."""
    shown = ", ".join(str(p) for p in paths[:first])
    return shown + (f" (and {len(paths) - first} more)" if len(paths) > first else "")
