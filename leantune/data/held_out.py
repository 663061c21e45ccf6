"""The held-out images of [validation]: a folder of their own, or a fixed share of the training images.

A share is chosen by content, not by position: the images whose sha256 (salted with
[validation] seed) sorts first, so adding an image to the folder leaves the others' roles as they
were, and the same images are held out in every run over the same data. They are removed from
training. A folder is scanned as a dataset is (same-stem captions, with the first dataset's
caption suffix, trigger word and default caption, so a held-out caption reads as the trained ones
do); it cannot hold reference images, so an edit family holds out a share instead.
"""

from __future__ import annotations

import hashlib
import math

from .dataset import DataError, ImageItem, scan_dataset


def split_held_out(items: list[ImageItem], validation, data_cfg, base_dir, family) -> tuple[list[ImageItem], list[ImageItem]]:
    """(training items, held-out items) for the run's [validation]."""
    if validation.fraction is not None:
        distinct = sorted({it.sha256 for it in items}, key=lambda sha: hashlib.sha256(
            f"{validation.seed}:{sha}".encode()).hexdigest())
        count = max(1, math.floor(validation.fraction * len(distinct)))
        if count >= len(distinct):
            raise DataError(f"[validation] fraction = {validation.fraction}: holding out {count} of {len(distinct)} "
                            f"distinct image(s) would leave none to train on; add images or use [validation] path")
        chosen = set(distinct[:count])
        return [it for it in items if it.sha256 not in chosen], [it for it in items if it.sha256 in chosen]
    if family.references is not None and any(getattr(d, "reference_path", None) for d in data_cfg.datasets):
        raise DataError("[validation] path: a folder of held-out images has no reference images, which this edit "
                        "dataset's images are trained with; hold out a share of them instead ([validation] "
                        "fraction = 0.1)")
    first = data_cfg.datasets[0]
    folder_cfg = type(first)(path=validation.path, caption_extension=first.caption_extension,
                             trigger_word=first.trigger_word, default_caption=first.default_caption,
                             recursive=first.recursive)
    found, unreadable = scan_dataset(folder_cfg, len(data_cfg.datasets), base_dir)
    if unreadable:
        raise DataError(f"[validation] path: {len(unreadable)} held-out image(s) cannot be read: "
                        + "; ".join(f"{p}: {why}" for p, why in unreadable[:5]))
    if not found:
        raise DataError(f"[validation] path {validation.path}: no image to hold out in it")
    trained = {it.sha256 for it in items}
    both = [it.path for it in found if it.sha256 in trained]
    if both:
        raise DataError(f"[validation] path: {len(both)} held-out image(s) are also training images (same bytes), "
                        f"so their loss would not measure what the model learned beyond its data: {both[:5]}")
    return items, found
