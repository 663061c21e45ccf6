"""How long the page's dataset view of 1000 images takes to open, and how many bytes it moves (issue 42).

It writes N photo-like JPEGs (a gradient with grain, W x H), then asks the page's app, in-process
through ASGI as a browser would (tests/asgi_get.py), for the listing and the thumbnails:
- cold: the first open of the folder (every image decoded once, every thumbnail made and kept);
- the grid's first screen: the listing and the first 40 thumbnails (the grid loads lazily);
- warm: the same folder opened again (sizes and thumbnails kept).
Bytes are the responses' bodies and headers. Run: python bench/ui_dataset_view.py [--n 1000] [--size 1024x768]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from asgi_get import asgi_get, asgi_get_many  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--size", default="1024x768")
    args = ap.parse_args()
    w, h = map(int, args.size.split("x"))
    from leantune.ui.app import create_app

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        rng = np.random.default_rng(0)
        y, x = np.mgrid[0:h, 0:w]
        grains = [rng.integers(-20, 21, (h, w, 3)) for _ in range(5)]
        for i in range(args.n):
            base = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, (i * 37) % 256)], -1)
            Image.fromarray(np.clip(base + grains[i % 5], 0, 255).astype(np.uint8)).save(data / f"img{i:05d}.jpg",
                                                                                          quality=90)
            (data / f"img{i:05d}.txt").write_text(f"photo {i}\n")

        def one_open(first: int | None) -> tuple[float, int]:
            app = create_app(Path(tmp) / "runs", "t", [data])
            start = time.perf_counter()
            _, _, moved = asgi_get(app, "/api/dataset", {"path": str(data)}, "t")
            names = sorted(p.name for p in data.glob("*.jpg"))[:first]
            for _, _, size in asgi_get_many(app, [("/api/dataset/thumb", {"path": str(data), "name": n}) for n in names], "t"):
                moved += size
            return time.perf_counter() - start, moved

        cold, cold_bytes = one_open(None)
        screen, screen_bytes = one_open(40)
        warm, warm_bytes = one_open(None)
    print(f"{args.n} images of {w}x{h}: cold open (listing + every thumbnail made) {cold:.2f} s, {cold_bytes / 1e6:.2f} MB")
    print(f"  first screen (listing + 40 thumbnails, kept) {screen:.2f} s, {screen_bytes / 1e6:.2f} MB")
    print(f"  warm open (listing + every thumbnail, kept) {warm:.2f} s, {warm_bytes / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
