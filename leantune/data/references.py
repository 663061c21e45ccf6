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
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from .dataset import IMAGE_EXTENSIONS, DataError, ImageItem, inspect_image, listing

_NUMBERED = re.compile(r"(.+)_(\d+)")


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
    a reference folder are not targets). Datasets without reference_path give their items none."""
    folders = {i: reference_folder(d, base_dir) for i, d in enumerate(datasets)}
    for i, folder in folders.items():
        if folder is not None and not folder.is_dir():
            raise DataError(f"[[data.datasets]] #{i + 1} reference_path: {folder} is not a folder")
    indexes = {i: _index(f) for i, f in folders.items() if f is not None}
    out, missing = [], []
    for it in items:
        folder = folders.get(it.dataset)
        if folder is None:
            out.append(it)
            continue
        if folder.resolve() in it.path.resolve().parents:
            continue                                   # a reference, not a target
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
        out.append(replace(it, references=tuple(refs)))
    if missing:
        raise DataError(f"{len(missing)} image(s) have no reference image (same file stem, or stem_N) in their "
                        f"dataset's reference_path: {listing(missing)}")
    counts = {len(it.references) for it in out}
    if len(counts) > 1:
        odd = [it.path for it in out if len(it.references) != len(out[0].references)]
        raise DataError(f"targets have different numbers of reference images ({sorted(counts)}); every target of a "
                        f"run needs as many (a batch stacks one tensor per reference): {listing(odd)}")
    return out
