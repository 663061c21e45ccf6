"""Images out of the sampler: PNG files that say how they were made, and sample grids.

Every PNG carries its generation parameters as text chunks (prompt, seed, steps, guidance, size,
LoRAs with strengths, model), plus the same as one JSON chunk `leantune`, so an image found later
can be reproduced and a viewer shows where it came from. Writes are atomic.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..io import atomic_write

# Text chunks written to every sample, in this order.
METADATA_KEYS = ("prompt", "seed", "steps", "guidance", "width", "height", "loras", "model")


def save_png(image, path: str | Path, metadata: dict) -> Path:
    """Atomically write `image` (PIL) as PNG with every metadata item as a text chunk."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for key, value in metadata.items():
        info.add_text(str(key), value if isinstance(value, str) else json.dumps(value))
    info.add_text("leantune", json.dumps(metadata, sort_keys=True))
    return atomic_write(path, lambda tmp: image.save(tmp, format="PNG", pnginfo=info))


def read_png_metadata(path: str | Path) -> dict[str, str]:
    """The text chunks of a PNG file, as strings."""
    from PIL import Image

    with Image.open(path) as img:
        img.load()
        return dict(getattr(img, "text", {}) or img.info)


def format_loras(loras: list[tuple[str, float]]) -> str:
    """[('a.safetensors', 0.8)] -> 'a.safetensors:0.8' (comma separated), as the CLI accepts them."""
    return ", ".join(f"{path}:{strength:g}" for path, strength in loras)


def grid_shape(n: int, cols: int | None = None) -> tuple[int, int]:
    """(rows, cols) of a row-major grid of `n` tiles: `cols` per row (clamped to 1..n), by default
    the smallest square that holds them. Shared by image and video grids."""
    if cols is None:
        cols = 1
        while cols * cols < n:
            cols += 1
    cols = max(1, min(cols, n))
    return (n + cols - 1) // cols, cols


def make_grid(images: list, cols: int | None = None, pad: int = 0):
    """Tile equally sized PIL images into one image, row-major, `cols` per row (default: near square)."""
    from PIL import Image

    if not images:
        raise ValueError("make_grid needs at least one image")
    w, h = images[0].size
    for i, im in enumerate(images):
        if im.size != (w, h):
            raise ValueError(f"image {i} is {im.size[0]}x{im.size[1]}, expected {w}x{h} like image 0")
    rows, cols = grid_shape(len(images), cols)
    grid = Image.new("RGB", (cols * w + (cols - 1) * pad, rows * h + (rows - 1) * pad), "white")
    for i, im in enumerate(images):
        r, c = divmod(i, cols)
        grid.paste(im.convert("RGB"), (c * (w + pad), r * (h + pad)))
    return grid
