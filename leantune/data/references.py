"""Reference images of an edit dataset: (target, one or more references, caption) triples.

`[[data.datasets]] reference_path` names a folder of reference images matched to the targets by
file stem: target `cat.png` is conditioned on `cat.<ext>` there, or, for several references, on
`cat_0.<ext>`, `cat_1.<ext>`, ... (numbered from 0 or 1, in that order). Only a family with
reference conditioning (models/family.py ReferenceConditioning) trains on them; the seam is
described in docs/reference-images.md.

Each reference is inspected like a target (decoded fully, hashed: its bytes are its identity in
the latent cache). A target without a reference, one with more than the family takes, and a run
whose targets have different numbers of references (a batch stacks one tensor per reference slot)
are errors that name the file.

What can be checked before any model loads is (the cache pass runs first): a reference_path on a
family without reference conditioning, a reference folder that is the dataset's own (every image
would be a reference, none a target), a reference of an aspect no family resizes sensibly, and
one the family would encode with a side under `MIN_REFERENCE_SIDE` at a training resolution.
References of different sizes in one bucket are batched apart (data/cache.py CachedData._order).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from .dataset import IMAGE_EXTENSIONS, DataError, ImageItem, inspect_image, listing

_NUMBERED = re.compile(r"(.+)_(\d+)")

# A reference more than this many times wider than tall (or taller than wide) is refused: no edit
# model is trained on such strips, and Qwen-Image-Edit's text encoder, which sees a reference at
# 384^2 pixels of area with sides rounded to 32, would round its short side to nothing past ~1:576.
MAX_REFERENCE_ASPECT = 64
# The smallest side a reference may be encoded at: one token of every family with references
# (8 px latents in 2x2 patches, or FLUX.2's 16 px cells). A side rounded to 0 fails in the VAE.
MIN_REFERENCE_SIDE = 16


@dataclass(frozen=True)
class ReferenceImage:
    path: Path
    sha256: str
    width: int
    height: int


def reference_folder(dataset_cfg, base_dir) -> Path | None:
    value = getattr(dataset_cfg, "reference_path", None)
    if not value:
        return None
    folder = Path(value).expanduser()
    return folder if folder.is_absolute() else Path(base_dir) / folder


def check_reference_keys(datasets, base_dir, family) -> None:
    """Before the datasets are scanned: a reference_path on a family that takes no references, one
    that is not a folder, or one that is (or holds) the dataset's own folder; each a `DataError`
    naming the key. `family` is the run's ModelFamily."""
    for i, d in enumerate(datasets):
        folder = reference_folder(d, base_dir)
        if folder is None:
            continue
        key = f"[[data.datasets]] #{i + 1} reference_path"
        if family.references is None:
            raise DataError(f"{key}: family = \"{family.name}\" takes no reference images (an edit family does, "
                            f"e.g. qwen-image-edit or flux2-dev); remove the key")
        if family.references.first_frame is not None:
            raise DataError(f"{key}: family = \"{family.name}\" conditions on each clip's own first frame (an "
                            f"image-to-video model), not on reference images of a folder; remove the key")
        if not folder.is_dir():
            raise DataError(f"{key}: {folder} is not a folder")
        own = Path(d.path).expanduser()
        own = (own if own.is_absolute() else Path(base_dir) / own).resolve()
        if folder.resolve() == own or folder.resolve() in own.parents:
            raise DataError(f"{key}: {folder} is {'the' if folder.resolve() == own else 'a folder holding the'} "
                            f"dataset's own folder (path = {d.path!r}), so every image there would be a reference "
                            f"and none a target; put the references in a folder of their own (a sub-folder of "
                            f"path works: its images are not trained on as targets)")


def check_aspect(ref: ReferenceImage, what: str) -> None:
    """A `DataError` for a reference beyond MAX_REFERENCE_ASPECT; `what` names it (its file and key)."""
    long, short = max(ref.width, ref.height), min(ref.width, ref.height)
    if long > MAX_REFERENCE_ASPECT * short:
        raise DataError(f"{what} is {ref.width}x{ref.height} px, more than {MAX_REFERENCE_ASPECT} times as "
                        f"{'wide as tall' if ref.width > ref.height else 'tall as wide'}: an edit model is not "
                        f"conditioned on such a strip (its resize would round a side to nothing); crop it, or "
                        f"remove it")


def encoded_size(ref: ReferenceImage, target: Path, bucket: tuple[int, int], family, index: int) -> tuple[int, int]:
    """(width, height) `family` VAE-encodes `ref` at for its target `target` in `bucket`; a
    `DataError` naming the file and the key when a side would be under MIN_REFERENCE_SIDE."""
    w, h = family.references.size(ref.width, ref.height, bucket)
    if min(w, h) < MIN_REFERENCE_SIDE:
        raise DataError(f"reference image {ref.path} (of {target}, [[data.datasets]] #{index + 1} reference_path) is "
                        f"{ref.width}x{ref.height} px: {family.name} would encode it at {w}x{h} px for the "
                        f"{bucket[0]}x{bucket[1]} bucket, a side under {MIN_REFERENCE_SIDE} px; use a reference of a "
                        f"less extreme aspect or a larger [data] resolutions")
    return w, h


def _index(folder: Path) -> dict[str, list[tuple[int, Path]]]:
    """stem -> [(order, path)]: `cat.png` is order -1 (alone), `cat_2.png` order 2 under `cat`."""
    out: dict[str, list[tuple[int, Path]]] = {}
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.suffix.lower() not in IMAGE_EXTENSIONS:
            continue
        out.setdefault(path.stem, []).append((-1, path))
        m = _NUMBERED.fullmatch(path.stem)
        if m:
            out.setdefault(m.group(1), []).append((int(m.group(2)), path))
    return out


def find_references(index: dict[str, list[tuple[int, Path]]], stem: str) -> list[Path]:
    """The references of a target with file stem `stem`: the one named so, else the numbered ones."""
    entries = index.get(stem, [])
    alone = [p for order, p in entries if order == -1]
    if alone:
        return alone[:1]
    return [p for _, p in sorted(entries)]


def attach_references(items: list[ImageItem], datasets, base_dir, most: int) -> list[ImageItem]:
    """The items with their `references` filled from their dataset's reference folder (images inside
    a reference folder are not targets). Datasets without reference_path give their items none.
    The folders were checked by `check_reference_keys`; a dataset left without targets (all its
    images lie in its reference folder) is an error naming the key."""
    folders = {i: reference_folder(d, base_dir) for i, d in enumerate(datasets)}
    targets = {i: 0 for i, f in folders.items() if f is not None}
    indexes = {i: _index(f) for i, f in folders.items() if f is not None}
    out, missing = [], []
    for it in items:
        folder = folders.get(it.dataset)
        if folder is None:
            out.append(it)
            continue
        if folder.resolve() in it.path.resolve().parents:
            continue                                   # a reference, not a target
        targets[it.dataset] += 1
        paths = find_references(indexes[it.dataset], it.path.stem)
        if not paths:
            missing.append(it.path)
            continue
        if len(paths) > most:
            raise DataError(f"{it.path}: {len(paths)} reference images in {folder} ({listing(paths)}); this model "
                            f"family takes at most {most}")
        refs = []
        for p in paths:
            try:
                digest, w, h = inspect_image(p)
            except Exception as e:
                raise DataError(f"reference image {p} (of {it.path}) cannot be read: {type(e).__name__}: {e}") from None
            refs.append(ReferenceImage(p, digest, w, h))
            check_aspect(refs[-1], f"reference image {p} (of {it.path}, [[data.datasets]] #{it.dataset + 1} "
                                   f"reference_path)")
        out.append(replace(it, references=tuple(refs)))
    empty = [i for i, n in targets.items() if n == 0]
    if empty:
        i = empty[0]
        raise DataError(f"[[data.datasets]] #{i + 1} reference_path: every image of the dataset lies in its reference "
                        f"folder {folders[i]}, so none is left as a target; put the targets outside it")
    if missing:
        raise DataError(f"{len(missing)} image(s) have no reference image (same file stem, or stem_N) in their "
                        f"dataset's reference_path: {listing(missing)}")
    counts = {len(it.references) for it in out}
    if len(counts) > 1:
        odd = [it.path for it in out if len(it.references) != len(out[0].references)]
        raise DataError(f"targets have different numbers of reference images ({sorted(counts)}); every target of a "
                        f"run needs as many (a batch stacks one tensor per reference): {listing(odd)}")
    return out
