"""Aspect-ratio buckets and the resumable batch order.

Buckets. Training every image at a square crop throws away the edges of portraits and
landscapes and teaches the model square framing. Instead each training resolution `r` gets a
small set of (width, height) buckets of about `r * r` pixels, with aspect ratios from 1:4 to 4:1,
and every image is resized and center-cropped to the bucket nearest its own aspect ratio. Sides
are multiples of 16: the VAE divides by 8 and Flux packs 2x2 latent patches, so latent sides
must be even. The widths of one orientation step by about r/8 (r/8 rounded to 16), which gives
nine buckets per resolution: fine enough that a crop loses little, coarse enough that a small
dataset's batches are not all singletons.

Batch order. A batch never mixes buckets (tensors of one batch share a shape). For each epoch the
samples of each bucket are shuffled with a generator seeded by (seed, epoch), cut into batches,
and the batches of all buckets are shuffled together. Caption dropout is decided per sample when
its batch is produced, from a generator whose state is part of the position, so
`state_dict()` / `load_state_dict()` resume an interrupted run with exactly the batches (and
dropped captions) it would have seen.
"""

from __future__ import annotations

import hashlib
import math
import random
import warnings
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from PIL import Image

SIDE_MULTIPLE = 16
MAX_ASPECT = 4.0

Bucket = tuple[int, int]   # (width, height) in pixels


def _round_to(x: float, m: int) -> int:
    return max(m, int(round(x / m)) * m)


def bucket_sizes(resolution: int, max_aspect: float = MAX_ASPECT, multiple: int = SIDE_MULTIPLE) -> list[Bucket]:
    """The buckets of one training resolution, sorted from tallest to widest.

    Portrait widths step down from `resolution` to `resolution / sqrt(max_aspect)`; each height is
    the multiple of 16 nearest `resolution**2 / width`, then the set is mirrored for landscapes, so
    the square bucket is always present and the set is symmetric. `multiple`: a family whose latents
    need other sides (ModelFamily.side_multiple: Wan 2.2 TI2V-5B's 16x VAE and 2 x 2 patches, 32)
    steps and rounds by it instead of 16.
    """
    if resolution < 4 * SIDE_MULTIPLE or resolution % multiple:
        raise ValueError(f"resolution {resolution} must be a multiple of {multiple} "
                         f"of at least {4 * SIDE_MULTIPLE}")
    area = resolution * resolution
    step = _round_to(resolution / 8, multiple)
    min_width = resolution / math.sqrt(max_aspect)
    portrait: list[Bucket] = []
    w = resolution
    while w >= min_width - 1e-9:
        h = _round_to(area / w, multiple)
        if h / w <= max_aspect + 1e-9:
            portrait.append((w, h))
        w -= step
    sizes = set(portrait) | {(h, w) for w, h in portrait}
    return sorted(sizes, key=lambda b: b[0] / b[1])


def nearest_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is nearest the image's, compared on a log scale.

    Log scale makes 1:2 and 2:1 equally far from 1:1; ties go to the first bucket in the list,
    so the choice is deterministic.
    """
    target = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[0] / b[1]) - target))


def upscale_factor(width: int, height: int, bucket: Bucket) -> float:
    """How much `fit_to_bucket` enlarges a width x height image (below 1: it shrinks)."""
    return max(bucket[0] / width, bucket[1] / height)


def crop_fraction(width: int, height: int, bucket: Bucket) -> float:
    """The share of the image's area that `fit_to_bucket`'s center crop throws away."""
    scale = upscale_factor(width, height, bucket)
    return 1.0 - (bucket[0] / scale) * (bucket[1] / scale) / (width * height)


def fit_to_bucket(img: Image.Image, bucket: Bucket) -> Image.Image:
    """Center-crop `img` to the bucket's aspect ratio and resize it to the bucket, in one resample.

    PIL's `resize(box=...)` crops and scales together, so the image is filtered once (Lanczos)
    rather than cropped, then resized with a second rounding of the crop edges.
    """
    return img.resize(bucket, Image.Resampling.LANCZOS, box=bucket_crop(img.size, bucket))


def bucket_crop(size: tuple[int, int], bucket: Bucket) -> tuple[float, float, float, float]:
    """The (left, top, right, bottom) source box `fit_to_bucket` maps onto the bucket: the centred
    crop of the bucket's aspect ratio. A mask resized with the same box covers the same pixels."""
    bw, bh = bucket
    w, h = size
    scale = max(bw / w, bh / h)               # cover the bucket, then crop the overflow
    crop_w, crop_h = bw / scale, bh / scale   # source pixels that map onto the bucket
    left, top = (w - crop_w) / 2, (h - crop_h) / 2
    return (left, top, left + crop_w, top + crop_h)


# -- batch order ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchSlot:
    """One batch of an epoch: which samples, and whether each one trains with the empty caption."""

    epoch: int
    index: int                  # position within the epoch
    bucket: Bucket
    samples: tuple[int, ...]    # indices into the sample list the order was built from
    dropped: tuple[bool, ...]   # caption dropout decision per sample
    prior: bool = False         # a batch of prior (regularisation) images ([[data.datasets]] role = "prior")


class BatchOrder:
    """An endless, deterministic, resumable sequence of single-bucket batches.

    `buckets[i]` is sample i's bucket and `dropout[i]` its caption dropout probability. The order
    of an epoch depends only on (seed, epoch); the caption dropout draws come from one generator
    that advances by one draw per sample produced, and its state is saved with the position.
    `groups[i]` (default: the bucket) is what a batch must share beyond its bucket: an edit
    dataset's reference sizes, since a batch stacks one reference tensor per slot. Groups that
    split no bucket leave the order, and the layout a saved position is checked against, as they
    were without them.
    """

    def __init__(self, buckets: Sequence[Bucket], batch_size: int, seed: int, shuffle: bool = True,
                 dropout: Sequence[float] | None = None, groups: Sequence | None = None):
        if not buckets:
            raise ValueError("cannot batch an empty sample list")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.buckets = list(buckets)
        self.dropout = list(dropout) if dropout is not None else [0.0] * len(self.buckets)
        if len(self.dropout) != len(self.buckets):
            raise ValueError("dropout needs one probability per sample")
        if groups is not None and len(groups) != len(self.buckets):
            raise ValueError("groups needs one key per sample")
        self.groups = [(b, g) for b, g in zip(self.buckets, groups)] if groups is not None else self.buckets
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        # Identity of the sample list, so a position saved for another dataset is noticed on resume.
        identity = (self.buckets, self.dropout, batch_size, shuffle)
        if self.splits_buckets:
            identity += (self.groups,)
        digest = hashlib.sha256(repr(identity).encode()).hexdigest()
        self.layout = digest[:16]
        self.epoch = 0
        self.index = 0
        self._rng = random.Random(f"caption-dropout:{seed}")
        self._epoch_cache: tuple[int, list[tuple[Bucket, tuple[int, ...]]]] | None = None
        self.batches_per_epoch = len(self._epoch_batches(0))

    def _epoch_batches(self, epoch: int) -> list[tuple[Bucket, tuple[int, ...]]]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        by_bucket: dict = {}
        for i, g in enumerate(self.groups):
            by_bucket.setdefault(g, []).append(i)
        # A string seed is hashed with SHA-512 by `random`, so the order is the same in every process.
        rng = random.Random(f"order:{self.seed}:{epoch}")
        batches: list[tuple[Bucket, tuple[int, ...]]] = []
        for members in by_bucket.values():      # buckets (groups) in order of first appearance
            bucket = self.buckets[members[0]]
            if self.shuffle:
                rng.shuffle(members)
            # A bucket's last batch may be short: dropping it would starve rare aspect ratios.
            for start in range(0, len(members), self.batch_size):
                batches.append((bucket, tuple(members[start:start + self.batch_size])))
        if self.shuffle:
            rng.shuffle(batches)
        self._epoch_cache = (epoch, batches)
        return batches

    @property
    def splits_buckets(self) -> bool:
        """Whether `groups` part some bucket's samples into separate batches."""
        return len(set(self.groups)) > len(set(self.buckets))

    def __iter__(self) -> Iterator[BatchSlot]:
        return self

    def __next__(self) -> BatchSlot:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        bucket, samples = self._epoch_batches(self.epoch)[self.index]
        dropped = tuple(self._rng.random() < self.dropout[i] for i in samples)
        slot = BatchSlot(self.epoch, self.index, bucket, samples, dropped)
        self.index += 1
        return slot

    def state_dict(self) -> dict:
        """The position after the last batch produced; JSON-serialisable."""
        version, internal, gauss = self._rng.getstate()
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "layout": self.layout,
                "dropout_rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Continue from a saved position.

        A position saved for another seed or sample list (images added, repeats or batch size
        changed) cannot be resumed exactly: `strict` refuses it; otherwise a `UserWarning` is
        issued and the run continues at the start of the next epoch with the saved dropout state.
        """
        missing = {"epoch", "index", "seed", "layout", "dropout_rng"} - set(state)
        if missing:
            raise ValueError(f"batch position is missing {sorted(missing)}")
        problem = None
        if state["seed"] != self.seed:
            problem = f"batch position was saved with seed {state['seed']}, this run uses {self.seed}"
        elif state["layout"] != self.layout:
            problem = ("batch position was saved for a different sample list (images, buckets, repeats, "
                       "caption dropout or batch size changed)")
        version, internal, gauss = state["dropout_rng"]
        if problem and strict:
            raise ValueError(f"{problem}; it cannot be resumed exactly")
        self._rng.setstate((version, tuple(internal), gauss))
        if problem:
            warnings.warn(f"{problem}; continuing at the start of epoch {int(state['epoch']) + 1}", stacklevel=2)
            self.epoch, self.index = int(state["epoch"]) + 1, 0
        else:
            self.epoch, self.index = int(state["epoch"]), int(state["index"])


class MixedOrder:
    """Training batches with prior batches mixed in at `ratio`: optimizer batch k (0-based) is a
    prior batch when floor((k + 1) * ratio) > floor(k * ratio), so the share holds over every
    stretch of steps (0.25: every fourth batch) without a random draw to save. Each kind keeps its
    own BatchOrder over its own samples (their epochs run apart: prior sets are often larger or
    smaller than the training set); slots name samples by their index in the whole list, as a
    BatchOrder's do, so batch assembly and the split over processes are unchanged. The epoch
    reported is the training images'."""

    def __init__(self, train: BatchOrder, train_index: Sequence[int], prior: BatchOrder,
                 prior_index: Sequence[int], ratio: float):
        self.train, self.prior = train, prior
        self.train_index, self.prior_index = list(train_index), list(prior_index)
        self.ratio = float(ratio)
        self.count = 0
        self.seed = train.seed
        self.layout = hashlib.sha256(f"{train.layout}|{prior.layout}|{self.ratio!r}".encode()).hexdigest()[:16]
        self.batches_per_epoch = train.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.train.epoch

    def __iter__(self) -> Iterator[BatchSlot]:
        return self

    def _is_prior(self, k: int) -> bool:
        return math.floor((k + 1) * self.ratio) > math.floor(k * self.ratio)

    def __next__(self) -> BatchSlot:
        is_prior = self._is_prior(self.count)
        order, index = (self.prior, self.prior_index) if is_prior else (self.train, self.train_index)
        slot = next(order)
        self.count += 1
        return replace(slot, samples=tuple(index[i] for i in slot.samples), prior=is_prior)

    def state_dict(self) -> dict:
        return {"mixed": True, "count": self.count, "layout": self.layout, "seed": self.seed,
                "train": self.train.state_dict(), "prior": self.prior.state_dict()}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        if not state.get("mixed"):
            if strict:
                raise ValueError("batch position was saved without prior batches mixed in (a [[data.datasets]] "
                                 "role = \"prior\" was added); it cannot be resumed exactly")
            self.train.load_state_dict(state, strict=False)
            return
        if state.get("layout") != self.layout and strict:
            raise ValueError("batch position was saved for another mix of training and prior images (images, "
                             "[data] prior_ratio or batch size changed); it cannot be resumed exactly")
        self.train.load_state_dict(state["train"], strict=strict)
        self.prior.load_state_dict(state["prior"], strict=strict)
        self.count = int(state["count"])
