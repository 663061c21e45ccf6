"""Training images and their captions: folder scanning, caption rules, image decoding.

A dataset is a folder of images (png, jpg/jpeg, webp) with a same-stem caption file next to each
(`cat.png` + `cat.txt`). Scanning decodes every image fully once: PIL's `open` only reads the
header, so a truncated jpg or a text file named `.png` would otherwise pass the scan and fail hours
later inside the cache pass. The same read gives the bytes' hash (the identity of the image in the
latent cache), so each file is read exactly once at startup.

Unreadable files are skipped and reported together in one warning; a dataset left with no image
is an error naming its folder, never a silent empty epoch.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)   # EXIF orientations that swap width and height


class DataError(ValueError):
    """A dataset problem (missing folder, no usable image, unreadable caption), naming the path."""


class DataWarning(UserWarning):
    """Something in a dataset was skipped; training continues without it."""


@dataclass(frozen=True)
class ImageItem:
    """One usable image of a dataset, with the caption it trains with."""

    path: Path
    caption: str             # trigger word already prepended; may be empty
    width: int               # after EXIF orientation, i.e. as the image is displayed
    height: int
    sha256: str              # of the file's bytes: the image's identity in the latent cache
    dataset: int             # index into [[data.datasets]]
    repeats: int
    caption_dropout: float


def _orientation(img: Image.Image) -> int:
    try:
        return int(img.getexif().get(_EXIF_ORIENTATION, 1))
    except Exception:     # a malformed EXIF block must not make a decodable image unusable
        return 1


def inspect_image(path: Path) -> tuple[str, int, int]:
    """Decode `path` fully; return (sha256 of the bytes, displayed width, displayed height).

    Raises whatever PIL raises for a file that does not decode to the end.
    """
    data = path.read_bytes()
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        # PIL's own message names the in-memory buffer ("<_io.BytesIO object at 0x...>"), not the file.
        raise UnidentifiedImageError("not an image format PIL can read") from None
    with img:
        img.load()        # full decode: catches truncated files that `open` accepts
        w, h = img.size
        if _orientation(img) in _TRANSPOSING_ORIENTATIONS:
            w, h = h, w
    return hashlib.sha256(data).hexdigest(), w, h


def load_rgb(path: Path) -> Image.Image:
    """The image as displayed (EXIF orientation applied), RGB; transparency composited on white.

    White rather than black because transparent product shots and logos are meant to be seen on
    a light page; a black matte would teach the model dark halos.
    """
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) float32 in [-1, 1], the range the VAE was trained on."""
    arr = np.asarray(img, dtype=np.uint8)                 # (H, W, 3)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 127.5 - 1.0


def read_caption(image: Path, extension: str, default: str) -> str:
    """The caption next to `image` (`cat.png` -> `cat.txt`), whitespace collapsed; `default` if absent."""
    caption_path = image.with_suffix(extension)
    if not caption_path.is_file():
        return default
    try:
        text = caption_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{caption_path}: caption file is not UTF-8 text ({e.reason} at byte {e.start})") from None
    # Line breaks in caption files are formatting, not meaning: one caption per image.
    return " ".join(text.split())


def with_trigger(caption: str, trigger: str) -> str:
    """'trigger, caption'; just the trigger when the caption is empty."""
    trigger = trigger.strip()
    if not trigger:
        return caption
    return f"{trigger}, {caption}" if caption else trigger


def _image_files(folder: Path, recursive: bool) -> list[Path]:
    pattern = folder.rglob("*") if recursive else folder.glob("*")
    files = []
    for p in pattern:
        rel = p.relative_to(folder)
        # Hidden files and folders (".DS_Store", "._cat.jpg" resource forks, ".git") are never data.
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file():
            files.append(p)
    return sorted(files)


def scan_dataset(cfg, index: int = 0, base_dir: str | Path = ".") -> tuple[list[ImageItem], list[tuple[Path, str]]]:
    """Scan one [[data.datasets]] entry; return (usable items, [(unreadable path, reason)]).

    `cfg` is a `DatasetConfig`. Relative paths resolve against `base_dir` (the TOML file's folder).
    """
    folder = Path(cfg.path).expanduser()
    if not folder.is_absolute():
        folder = Path(base_dir) / folder
    if not folder.is_dir():
        raise DataError(f"[[data.datasets]] #{index + 1}: path {folder} is not a folder")
    items: list[ImageItem] = []
    bad: list[tuple[Path, str]] = []
    for path in _image_files(folder, cfg.recursive):
        try:
            digest, w, h = inspect_image(path)
        except Exception as e:   # PIL raises many types (OSError, SyntaxError, DecompressionBombError...)
            bad.append((path, f"{type(e).__name__}: {e}"))
            continue
        caption = with_trigger(read_caption(path, cfg.caption_extension, cfg.default_caption), cfg.trigger_word)
        items.append(ImageItem(path=path, caption=caption, width=w, height=h, sha256=digest, dataset=index,
                               repeats=cfg.repeats, caption_dropout=cfg.caption_dropout))
    return items, bad


def scan_datasets(data_cfg, base_dir: str | Path = ".") -> list[ImageItem]:
    """Scan every dataset of a `DataConfig`. Unreadable images are listed in one `DataWarning`.

    Raises `DataError` naming the folder if a dataset has no usable image.
    """
    items: list[ImageItem] = []
    bad: list[tuple[Path, str]] = []
    empty: list[str] = []
    for i, ds in enumerate(data_cfg.datasets):
        found, unreadable = scan_dataset(ds, i, base_dir)
        bad.extend(unreadable)
        if not found:
            folder = Path(ds.path) if Path(ds.path).is_absolute() else Path(base_dir) / ds.path
            note = f" ({len(unreadable)} unreadable)" if unreadable else ""
            empty.append(f"[[data.datasets]] #{i + 1}: no usable image ({', '.join(IMAGE_EXTENSIONS)}) "
                         f"in {folder}{note}")
        items.extend(found)
    if bad:
        lines = "\n  ".join(f"{p}: {reason}" for p, reason in bad)
        warnings.warn(f"skipped {len(bad)} unreadable image(s):\n  {lines}", DataWarning, stacklevel=2)
    if empty:
        raise DataError("\n".join(empty))
    return items
