"""Thumbnails of a dataset's images, made once and kept, so the dataset view moves kilobytes.

A grid of full-size images is what made a 200-image dataset download 84 MiB: the page now asks for
a thumbnail (at most SIDE px, JPEG) of each image and the full file only when one is enlarged. A
thumbnail is the image as the trainer reads it (data/dataset.py load_rgb: EXIF orientation
applied, transparency on white), so what the page shows is what trains. They are kept under the
runs folder, never beside the images (the trainer's scan reads the dataset folder), named by the
image's real path, size and modification time, so an edited or replaced image gets a new one.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

SIDE = 160                 # px, the longer side: the grid's cells are 150 px wide
QUALITY = 70               # JPEG: a 160 px photo is ~5 KB, so 1000 images stay under 5 MB
FOLDER = "_thumbs"


def thumbnail(image: Path, cache_dir: Path) -> bytes:
    """The JPEG thumbnail of `image` (a real path, already checked to be one the page may read),
    from `cache_dir` when it was made before for the same file, else made now and kept there."""
    from ..io import atomic_write_bytes

    stat = image.stat()
    key = hashlib.sha256(f"{image.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{SIDE}\0{QUALITY}".encode()).hexdigest()
    kept = cache_dir / f"{key[:40]}.jpg"
    try:
        return kept.read_bytes()
    except OSError:
        pass
    data = make(image)
    cache_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(kept, data)         # two requests at once both write whole files; either is right
    return data


def make(image: Path) -> bytes:
    from PIL import Image

    from ..data.dataset import load_rgb

    rgb = load_rgb(image)
    rgb.thumbnail((SIDE, SIDE), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=QUALITY, optimize=True)
    return out.getvalue()
