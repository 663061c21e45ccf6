"""Masked loss: a mask image per training image weights the loss where the image matters.

`[[data.datasets]] mask_path` names a folder of masks matched to the images by file stem (`cat.png`
-> `cat.<ext>` there); `mask_suffix` puts each mask beside its image (`cat.png` -> `cat_mask.png`
for "_mask"), and such files are masks, not training images (dataset.py leaves them out of the
scan). A mask is read as grayscale: white trains, black is ignored, grey in between; an alpha
channel multiplies it (transparent is black). `mask_floor` is the weight black keeps, so the
background is still learned a little (a floor of 0 leaves it to the base model).

A mask is cropped and resized with the very box its image is (buckets.bucket_crop), straight to
the latent grid with an area filter: each latent cell's weight is the mean of the mask pixels it
covers. The grid is cached beside the latents, keyed by the mask's bytes and the bucket, so a
changed mask is recomputed and an unchanged one never is.

Every image of a masked dataset needs its mask, of its image's size, readable: each failure is a
`DataError` naming the file, raised while the datasets are scanned, before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from .buckets import Bucket, bucket_crop
from .dataset import IMAGE_EXTENSIONS, DataError, ImageItem, inspect_image, listing
from .mask_files import mask_folder


@dataclass(frozen=True)
class MaskImage:
    path: Path
    sha256: str          # the mask's bytes: its identity in the mask cache
    floor: float         # the dataset's mask_floor: the weight where the mask is black


def _by_stem(folder: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS:
            out.setdefault(path.stem, []).append(path)
    return out


def _candidates(item: ImageItem, dataset_cfg, index: dict[str, list[Path]] | None) -> list[Path]:
    if index is not None:
        return index.get(item.path.stem, [])
    stem = item.path.stem + dataset_cfg.mask_suffix
    return [p for p in sorted(item.path.parent.glob(f"{stem}.*")) if p.suffix.lower() in IMAGE_EXTENSIONS]


def attach_masks(items: list[ImageItem], datasets, base_dir) -> list[ImageItem]:
    """The items with their `mask` filled for the datasets that name masks; the others unchanged.
    A mask folder that is not a folder, an image without its mask (or with two), a mask that does
    not decode or is not its image's size: each a `DataError` naming the files."""
    indexes: dict[int, dict | None] = {}
    for i, d in enumerate(datasets):
        folder = mask_folder(d, base_dir)
        if folder is not None:
            if not folder.is_dir():
                raise DataError(f"[[data.datasets]] #{i + 1}: mask_path {folder} is not a folder")
            indexes[i] = _by_stem(folder)
        elif getattr(d, "mask_suffix", None):
            indexes[i] = None
    if not indexes:
        return items
    out, missing = [], []
    for it in items:
        if it.dataset not in indexes:
            out.append(it)
            continue
        ds = datasets[it.dataset]
        found = _candidates(it, ds, indexes[it.dataset])
        if not found:
            missing.append(it.path)
            continue
        if len(found) > 1:
            raise DataError(f"{it.path}: {len(found)} masks match it ({listing(found)}); keep one")
        path = found[0]
        try:
            digest, w, h = inspect_image(path)
        except Exception as e:      # PIL raises many types
            raise DataError(f"mask {path} (of {it.path}) cannot be read: {type(e).__name__}: {e}") from None
        if (w, h) != (it.width, it.height):
            raise DataError(f"mask {path} is {w}x{h} px but its image {it.path} is {it.width}x{it.height}; a mask "
                            f"covers its image pixel for pixel (same size, same orientation)")
        out.append(replace(it, mask=MaskImage(path, digest, float(ds.mask_floor))))
    if missing:
        where = {i: (f"mask_path {mask_folder(datasets[i], base_dir)}" if idx is not None
                     else f"mask_suffix {datasets[i].mask_suffix!r} beside each image")
                 for i, idx in indexes.items()}
        first = next(it for it in items if it.path == missing[0])
        raise DataError(f"{len(missing)} image(s) have no mask (looked for by {where[first.dataset]}): "
                        f"{listing(missing)}; give each image its mask, or move the images without one to a "
                        f"dataset without masks")
    return out


def _grayscale(path: Path) -> np.ndarray:
    """The mask as displayed (EXIF orientation applied), float in [0, 1]: luminance times alpha."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I") or img.mode == "F":
            from .reading import _eight_bit

            img = _eight_bit(img)
        la = img.convert("LA")
        arr = np.asarray(la, dtype=np.float32) / 255.0
    return arr[..., 0] * arr[..., 1]


def mask_grid(mask: MaskImage, bucket: Bucket, vae_scale_factor: int) -> torch.Tensor:
    """(1, h, w) float32 in [0, 1]: the mask cropped as its image is for `bucket` and averaged over
    each latent cell (h, w = the bucket's sides / the VAE's scale factor)."""
    gray = _grayscale(mask.path)
    img = Image.fromarray(gray, mode="F")
    grid = (bucket[0] // vae_scale_factor, bucket[1] // vae_scale_factor)
    small = img.resize(grid, Image.Resampling.BOX, box=bucket_crop(img.size, bucket))
    return torch.from_numpy(np.asarray(small, dtype=np.float32).copy()).clamp(0.0, 1.0)[None]


def loss_weights(grid: torch.Tensor, floor: float) -> torch.Tensor:
    """The per-cell loss weight: `floor` where the mask is black, 1 where it is white."""
    return floor + (1.0 - floor) * grid
