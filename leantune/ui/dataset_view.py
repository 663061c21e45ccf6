"""A dataset folder as the page shows it, and caption edits written back.

Each image (and each video clip, clips.py) comes with its caption (the same-stem .txt) and the
warnings the trainer would give: unreadable, no caption, smaller than the smallest training
resolution; an image's size is kept once decoded, so opening a 1000-image view again decodes nothing. Captions are written
atomically (write, fsync, rename), and only for an image that is in the folder: a name with a path
in it is refused, so the page can never write outside the dataset.

The page passes the data roots chosen at start (`leantune ui --data DIR`, default the folder it was
started in): a folder is usable only when its real path (symlinks followed) lies under one of them,
so no request can read or write a folder elsewhere on disk; a file of the folder (an image, a
caption) that is a symlink out of the roots is not read either, only named in a warning. Uploads are bounded twice: in bytes
(the server stops reading past MAX_UPLOAD_BYTES) and in decoded pixels (checked from the header,
before anything is decoded), since a small PNG can decode to gigabytes.
"""

from __future__ import annotations

from pathlib import Path


MAX_UPLOAD_BYTES = 64 * 2**20
MAX_PIXELS = 50_000_000          # 8K x 6K; a 16000 x 11000 image (176 MP, 704 MB as RGBA) is refused


class DatasetViewError(ValueError):
    """The folder or image the page asked about is not usable; the message names it."""


class OutsideRoots(DatasetViewError):
    """A folder outside the page's data roots."""


def within(path: Path, roots) -> bool:
    """Whether real path `path` is one of `roots` or below one (roots resolved by the caller)."""
    return any(path.is_relative_to(root) for root in roots)


def folder_of(path: str, roots=None) -> Path:
    """The real folder `path` names; with `roots`, only when it lies under one of them."""
    folder = Path(path).expanduser()
    if not folder.is_absolute():          # relative to the first data root (where the page was started)
        folder = (list(roots)[0] if roots else Path.cwd()) / folder
    if not folder.is_dir():
        raise DatasetViewError(f"{folder}: not a folder")
    real = folder.resolve()
    if roots is not None and not within(real, roots):
        raise OutsideRoots(f"{folder}: outside the folders this page may use ({', '.join(map(str, roots))}); "
                           f"start `leantune ui --data DIR` to add one")
    return real


def scan(path: str, min_resolution: int | None = None, roots=None, target_fps: float | None = None,
         max_frames: int | None = None) -> list[dict]:
    """[{name, kind, caption, width, height, warnings}] of every image and video clip in the folder
    (not recursive); a clip ("kind": "clip") also has its frames, duration_s, fps and the
    train_frames the trainer takes at [data] target_fps and max_frames (clips.py)."""
    from ..data.dataset import CaptionError, _image_files, read_caption
    from . import clips

    folder = folder_of(path, roots)
    out = []
    found = _image_files(folder, recursive=False)
    # data/ returns a scan record (its .files, and the links it followed) or, before that, the list
    media = sorted([*getattr(found, "files", found), *clips.clip_files(folder)], key=lambda p: p.name)
    for image in media:
        clip = clips.is_clip(image) or image.is_dir()          # a video file or an image-sequence folder
        entry = {"name": image.name, "kind": "clip" if clip else "image", "caption": "", "width": None,
                 "height": None, "warnings": []}
        real = _inside(image, roots, folder)
        if real is None:
            entry["warnings"].append(f"{image.name} links outside the folders this page may use: not read")
        elif clip:
            entry.update(clips.describe(real, target_fps, max_frames))
        else:
            try:
                entry["width"], entry["height"] = _size(real)
            except Exception as e:    # PIL raises many types; the trainer skips such files the same way
                entry["warnings"].append("unreadable: the file does not decode as an image (the trainer skips it)")
        caption = image.with_suffix(".txt")
        if not caption.is_file():
            entry["warnings"].append("no caption (.txt): trains with the trigger word only")
        elif (real := _inside(caption, roots, folder)) is None:
            entry["warnings"].append(f"{caption.name} links outside the folders this page may use: not shown")
        else:
            try:
                # the trainer's own reader, given the checked file itself (its suffix: the same path)
                entry["caption"] = read_caption(real, real.suffix, "")
            except CaptionError as e:
                entry["warnings"].append(str(e))
        if min_resolution and entry["width"] and min(entry["width"], entry["height"]) < min_resolution:
            entry["warnings"].append(f"smaller than {min_resolution} px, the smallest training resolution")
        out.append(entry)
    return out


_SIZES: dict[tuple, tuple[int, int]] = {}


def _size(real: Path) -> tuple[int, int]:
    """The displayed size of an image, decoded in full as the trainer decodes it (data/dataset.py
    inspect_image: a file that does not decode to its end raises), kept by path, size and
    modification time: a dataset view opened again decodes only what changed."""
    from ..data.dataset import inspect_image

    stat = real.stat()
    key = (str(real), stat.st_size, stat.st_mtime_ns)
    if key not in _SIZES:
        if len(_SIZES) >= 50_000:
            _SIZES.clear()
        _, width, height = inspect_image(real)
        _SIZES[key] = (width, height)
    return _SIZES[key]


def _inside(path: Path, roots, real_folder: Path | None = None) -> Path | None:
    """The real path of a file of the folder (symlinks followed), or None when it lies outside
    `roots`: the file read is then the one checked, not a link that could be swapped after.
    `real_folder`: the folder's real path, known to the caller; a file right in it that is no link
    is then its own real path (one lstat, not a resolve per file: a 1000-image listing)."""
    if real_folder is not None and path.parent == real_folder and not path.is_symlink():
        return path if roots is None or within(path, roots) else None
    real = path.resolve()
    return real if roots is None or within(real, roots) else None


def image_path(folder: str, name: str, roots=None, real: bool = False) -> Path:
    """The image or video clip `name` inside `folder`, refusing names that leave it; with `real`, the file it is
    (links followed), as checked: what a reader should open, so a link swapped after the check
    is not followed again."""
    from ..data.dataset import IMAGE_EXTENSIONS
    from .clips import VIDEO_EXTENSIONS

    base = folder_of(folder, roots)
    if not name or Path(name).name != name or name.startswith("."):
        raise DatasetViewError(f"{name!r}: not a plain file name")
    image = base / name
    if image.is_dir() and sequence_folder(image, roots) is not None:     # an image-sequence clip
        return image.resolve() if real else image
    if image.suffix.lower() not in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS or not image.is_file():
        raise DatasetViewError(f"{image}: no such image")
    checked = _inside(image, roots)
    if checked is None:                                                # a symlinked image
        raise OutsideRoots(f"{image}: links outside the folders this page may use")
    return checked if real else image


def sequence_folder(path: Path, roots=None) -> Path | None:
    """The real path of image-sequence folder `path`, or None when it is no sequence or it (or a
    frame of it) lies outside `roots`."""
    from .clips import is_sequence, sequence_frames

    real = _inside(path, roots)
    if real is None or not is_sequence(real):
        return None
    return real if all(_inside(f, roots) is not None for f in sequence_frames(real)) else None


def preview_path(folder: str, name: str, roots=None) -> Path:
    """The file the page shows for `name` (checked as image_path checks it): the image or clip file
    itself, or an image-sequence clip's first frame."""
    from .clips import sequence_frames

    media = image_path(folder, name, roots, real=True)
    return sequence_frames(media)[0].resolve() if media.is_dir() else media


def save_upload(folder: str, name: str, data: bytes, roots=None) -> Path:
    """Add an uploaded image to the dataset folder, atomically. The name must be a plain image
    file name that is not there yet (nothing of the user's is overwritten), and the bytes must
    decode as an image of at most MAX_PIXELS pixels, so a broken upload never lands in the dataset."""
    import io

    from PIL import Image

    from ..data.dataset import IMAGE_EXTENSIONS
    from ..io import atomic_write_bytes

    base = folder_of(folder, roots)
    if len(data) > MAX_UPLOAD_BYTES:
        raise DatasetViewError(f"{name}: {len(data) / 2**20:.0f} MiB, more than the {MAX_UPLOAD_BYTES // 2**20} MiB "
                               f"an upload may be")
    if not name or Path(name).name != name or name.startswith(".") or Path(name).suffix.lower() not in IMAGE_EXTENSIONS:
        raise DatasetViewError(f"{name!r}: not an image file name ({', '.join(IMAGE_EXTENSIONS)})")
    target = base / name
    if target.exists():
        raise DatasetViewError(f"{target}: exists already; rename the file to upload it")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_PIXELS:
                raise DatasetViewError(f"{name}: {img.width}x{img.height} pixels, more than the "
                                       f"{MAX_PIXELS / 1e6:.0f} million an upload may decode to; downscale it first")
            img.load()
    except DatasetViewError:
        raise
    except Exception as e:     # PIL raises many types
        raise DatasetViewError(f"{name}: not a readable image (the file does not decode as PNG, JPEG or WebP)") from None
    return atomic_write_bytes(target, data)


REMOVED = ".removed"        # where removed images go, inside the dataset folder (hidden: no scan reads it)


def remove_images(folder: str, names: list[str], roots=None) -> dict:
    """Take images (or clips) out of the dataset without deleting anything: each named file, with
    its same-stem caption, moves into `<folder>/.removed/<time>/` (a hidden folder the trainer's scan
    and this view skip), so a wrong click is undone by moving the files back. A name that is not an
    image of the folder is refused before anything moves. Returns {"moved": [...], "to": folder}."""
    import time

    if not names:
        raise DatasetViewError("no images given to remove")
    media = [image_path(folder, n, roots) for n in dict.fromkeys(names)]        # all checked first
    base = folder_of(folder, roots)
    target = base / REMOVED / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while target.exists():                   # two removals within a second: each its own folder
        n += 1
        target = target.with_name(f"{target.name.split('~')[0]}~{n}")
    target.mkdir(parents=True)
    moved = []
    for path in media:
        for part in (path, path.with_suffix(".txt")):
            if part.exists() or part.is_symlink():
                part.rename(target / part.name)                # a link moves as the link, not its target
                moved.append(part.name)
    return {"moved": moved, "to": str(target)}


def write_caption(folder: str, name: str, caption: str, roots=None) -> Path:
    """Write the caption of image `name` as its same-stem .txt, atomically; returns the .txt path."""
    from ..io import atomic_write_bytes

    text = " ".join(caption.split())
    return atomic_write_bytes(image_path(folder, name, roots).with_suffix(".txt"), (text + "\n").encode())
