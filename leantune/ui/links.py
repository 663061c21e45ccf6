"""The links a run's datasets hold, kept inside the page's data roots.

confine.py checks every path the merged config names, but a dataset folder inside `--data` can
hold symlinks the config never names: the trainer's scan (data/dataset.py `_image_files`) follows
symlinked sub-folders and opens images and their captions through links, and the reference index
(data/references.py `_index`) opens reference files the same way. A link that points out of the
data roots would be trained on, and its pictures come back in the run's samples, as if the page
had let the user name that folder. So before a run starts or resumes, each dataset is walked with
the trainer's own scan (and each reference folder with its own index), and the first followed
folder, image, caption or reference whose real path lies outside the roots refuses the run with
one sentence naming the dataset's key, the link and where it points. It is the walk only: names
are listed and links resolved, no image is opened or decoded, so a dataset of thousands costs a
directory listing. What the scan skips (hidden files, broken links, a folder reached twice) is not
read by the trainer either, so it is not checked.
"""

from __future__ import annotations

from pathlib import Path

from .confine import where
from .dataset_view import DatasetViewError, OutsideRoots, within


def _link(entry) -> Path:
    """The symlinked folder of one entry of the scan's `followed` ("sub -> /real/folder"); the
    split is taken where the left side is a symlink, so a folder name holding " -> " still parses."""
    if isinstance(entry, (tuple, list)):
        return Path(entry[0])
    parts = str(entry).split(" -> ")
    for n in range(1, len(parts)):
        left = Path(" -> ".join(parts[:n]))
        if left.is_symlink():
            return left
    return Path(parts[0])


def _refuse_outside(key: str, value: str, what: str, path: Path, roots: list[Path]) -> None:
    """OutsideRoots naming the key, the link and where it points, when `path` resolves outside `roots`."""
    real = path.resolve()
    if within(real, roots):
        return
    raise OutsideRoots(f"{key} = {value!r}: the trainer's scan follows the {what} {path} to {real}, outside the "
                       f"folders this page may use ({', '.join(map(str, roots))}): links inside a dataset must stay "
                       f"within the --data folders (point the link inside them, copy the files in, or start "
                       f"`leantune ui --data DIR` with its folder)")


def check(cfg, data_roots) -> None:
    """Raise OutsideRoots for the first folder, image, caption or reference file the trainer would
    read through a link out of `data_roots`, for `cfg` a validated RunConfig whose own paths
    confine.check has passed."""
    from ..config import resolve_path
    from ..data.dataset import MAX_SCAN_FILES, _image_files, _TooManyFiles
    from ..data.mask_files import mask_folder
    from ..data.masks import _by_stem
    from ..data.references import _index, reference_folder

    roots = [Path(r).resolve() for r in data_roots]
    for i, ds in enumerate(cfg.data.datasets):
        key = where(("data", "datasets", i, "path"))
        folder = resolve_path(cfg.base_dir, ds.path)
        if folder.is_dir():                        # not a folder: the trainer refuses it by name
            try:
                walk = _image_files(folder, ds.recursive)
            except _TooManyFiles:
                raise DatasetViewError(f"{key} = {ds.path!r}: {folder} holds more than {MAX_SCAN_FILES} files, too "
                                       f"many to check its links (the trainer stops scanning there too); point path "
                                       f"at the folder of training images") from None
            for entry in getattr(walk, "followed", ()):
                _refuse_outside(key, ds.path, "symlinked folder", _link(entry), roots)
            for image in getattr(walk, "files", walk):
                _refuse_outside(key, ds.path, "image link", image, roots)
                caption = image.with_suffix(ds.caption_extension)
                if caption.is_file():                  # what read_caption opens
                    _refuse_outside(key, ds.path, "caption link", caption, roots)
        refs = reference_folder(ds, cfg.base_dir)
        if refs is not None and refs.is_dir():
            ref_key = where(("data", "datasets", i, "reference_path"))
            for path in sorted({p for entries in _index(refs).values() for _, p in entries}):
                _refuse_outside(ref_key, ds.reference_path, "reference image link", path, roots)
        masks = mask_folder(ds, cfg.base_dir)
        if masks is not None and masks.is_dir():        # the masks the loss reads (data/masks.py)
            mask_key = where(("data", "datasets", i, "mask_path"))
            for paths in _by_stem(masks).values():
                for path in paths:
                    _refuse_outside(mask_key, ds.mask_path, "mask link", path, roots)
    _check_validation_folder(cfg, roots)


def _check_validation_folder(cfg, roots: list[Path]) -> None:
    """[validation] path is scanned as a dataset is (data/held_out.py): its links stay inside too."""
    from ..config import resolve_path
    from ..data.dataset import _image_files

    value = cfg.validation.path
    if not value:
        return
    folder = resolve_path(cfg.base_dir, value)
    if not folder.is_dir():
        return
    key = "[validation] path"
    first = cfg.data.datasets[0]
    walk = _image_files(folder, first.recursive)
    for entry in getattr(walk, "followed", ()):
        _refuse_outside(key, value, "symlinked folder", _link(entry), roots)
    for image in walk.files:
        _refuse_outside(key, value, "image link", image, roots)
        caption = image.with_suffix(first.caption_extension)
        if caption.is_file():
            _refuse_outside(key, value, "caption link", caption, roots)
