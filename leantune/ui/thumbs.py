"""Thumbnails of a dataset's images, made once and kept, so the dataset view moves kilobytes.

A grid of full-size images is what made a 200-image dataset download 84 MiB: the page now asks for
a thumbnail (at most SIDE px, JPEG) of each image and the full file only when one is enlarged. A
thumbnail is the image as the trainer reads it (data/dataset.py load_rgb: EXIF orientation
applied, transparency on white), so what the page shows is what trains; a video clip's is its
first frame. They are kept under the
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
    stat = image.stat()
    key = hashlib.sha256(f"{image.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{SIDE}\0{QUALITY}".encode()).hexdigest()
    kept = cache_dir / f"{key[:40]}.jpg"
    try:
        data = kept.read_bytes()
        if _whole(data):
            return data
    except OSError:
        pass
    data = make(image)
    cache_dir.mkdir(parents=True, exist_ok=True)
    _keep(kept, data)                      # two requests at once both write whole files; either is right
    return data


def _whole(data: bytes) -> bool:
    """A kept file is a whole JPEG (its start and end markers): one cut short by a crash is remade."""
    return data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9"


def _keep(path: Path, data: bytes) -> None:
    """Written to a temporary name and renamed over `path`, without the fsyncs of io.atomic_write:
    a thumbnail is a cache (_whole checks it when read), and two fsyncs per image made the first
    view of a 1000-image folder wait on the disk for seconds."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make(image: Path) -> bytes:
    """The thumbnail's JPEG bytes; a video clip's is its first frame as the trainer decodes it."""
    from PIL import Image

    rgb = picture(image)
    rgb.thumbnail((SIDE, SIDE), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=QUALITY, optimize=True)
    return out.getvalue()


def picture(path: Path):
    """The RGB picture the page shows for a dataset file (dataset_view.preview_path's): an image as
    the trainer reads it, a video clip's first frame as the trainer decodes it."""
    from ..data.dataset import load_rgb
    from .clips import is_clip

    return _first_frame(path) if is_clip(path) else load_rgb(path)


def _first_frame(clip: Path):
    from PIL import Image

    from ..data.video import first_frame

    frame = first_frame(clip)                               # (3, H, W) in [-1, 1]
    pixels = ((frame + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
    return Image.fromarray(pixels, "RGB")
