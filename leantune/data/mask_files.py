"""Which files of a dataset are its masks (data/masks.py), told apart from its training images.

Apart from masks.py because the dataset scan (dataset.py) needs it and masks.py needs the scan's
items: this module imports neither.
"""

from __future__ import annotations

from pathlib import Path


def mask_folder(dataset_cfg, base_dir) -> Path | None:
    from ..config import resolve_path

    return resolve_path(base_dir, getattr(dataset_cfg, "mask_path", None) or None)


def mask_file_test(dataset_cfg, base_dir):
    """A test of whether a file the dataset scan found is one of the dataset's masks (not a
    training image): named with its mask_suffix, or inside its mask_path."""
    suffix = getattr(dataset_cfg, "mask_suffix", None)
    folder = mask_folder(dataset_cfg, base_dir)
    real = folder.resolve() if folder is not None else None

    def is_mask(path: Path) -> bool:
        if suffix and path.stem.endswith(suffix) and len(path.stem) > len(suffix):
            return True
        return real is not None and real in path.resolve().parents
    return is_mask
