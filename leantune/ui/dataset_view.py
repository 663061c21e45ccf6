"""A dataset folder as the page shows it, and caption edits written back.

Each image comes with its caption (the same-stem .txt) and the warnings the trainer would give:
unreadable, no caption, smaller than the smallest training resolution. Captions are written
atomically (write, fsync, rename), and only for an image that is in the folder: a name with a path
in it is refused, so the page can never write outside the dataset.
"""

from __future__ import annotations

from pathlib import Path


class DatasetViewError(ValueError):
    """The folder or image the page asked about is not usable; the message names it."""


def folder_of(path: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise DatasetViewError(f"{folder}: not a folder")
    return folder.resolve()


def scan(path: str, min_resolution: int | None = None) -> list[dict]:
    """[{name, caption, width, height, warnings}] of every image in the folder (not recursive)."""
    from ..data.dataset import CaptionError, _image_files, inspect_image, read_caption

    folder = folder_of(path)
    out = []
    for image in _image_files(folder, recursive=False):
        entry = {"name": image.name, "caption": "", "width": None, "height": None, "warnings": []}
        try:
            _, entry["width"], entry["height"] = inspect_image(image)
        except Exception as e:    # PIL raises many types; the trainer skips such files the same way
            entry["warnings"].append(f"unreadable: {type(e).__name__}: {e}")
        if not image.with_suffix(".txt").is_file():
            entry["warnings"].append("no caption (.txt): trains with the trigger word only")
        else:
            try:
                entry["caption"] = read_caption(image, ".txt", "")
            except CaptionError as e:
                entry["warnings"].append(str(e))
        if min_resolution and entry["width"] and min(entry["width"], entry["height"]) < min_resolution:
            entry["warnings"].append(f"smaller than {min_resolution} px, the smallest training resolution")
        out.append(entry)
    return out


def image_path(folder: str, name: str) -> Path:
    """The image `name` inside `folder`, refusing names that leave it."""
    from ..data.dataset import IMAGE_EXTENSIONS

    base = folder_of(folder)
    if not name or Path(name).name != name or name.startswith("."):
        raise DatasetViewError(f"{name!r}: not a plain file name")
    image = base / name
    if image.suffix.lower() not in IMAGE_EXTENSIONS or not image.is_file():
        raise DatasetViewError(f"{image}: no such image")
    return image


def save_upload(folder: str, name: str, data: bytes) -> Path:
    """Add an uploaded image to the dataset folder, atomically. The name must be a plain image
    file name that is not there yet (nothing of the user's is overwritten), and the bytes must
    decode as an image, so a broken upload never lands in the dataset."""
    import io

    from PIL import Image

    from ..data.dataset import IMAGE_EXTENSIONS
    from ..io import atomic_write_bytes

    base = folder_of(folder)
    if not name or Path(name).name != name or name.startswith(".") or Path(name).suffix.lower() not in IMAGE_EXTENSIONS:
        raise DatasetViewError(f"{name!r}: not an image file name ({', '.join(IMAGE_EXTENSIONS)})")
    target = base / name
    if target.exists():
        raise DatasetViewError(f"{target}: exists already; rename the file to upload it")
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
    except Exception as e:     # PIL raises many types
        raise DatasetViewError(f"{name}: not a readable image ({type(e).__name__}: {e})") from None
    return atomic_write_bytes(target, data)


def write_caption(folder: str, name: str, caption: str) -> Path:
    """Write the caption of image `name` as its same-stem .txt, atomically; returns the .txt path."""
    from ..io import atomic_write_bytes

    text = " ".join(caption.split())
    return atomic_write_bytes(image_path(folder, name).with_suffix(".txt"), (text + "\n").encode())
