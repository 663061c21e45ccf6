"""Training images and their captions: folder scanning, caption rules, image decoding.

A dataset is a folder of images (png, jpg/jpeg, webp) with a same-stem caption file next to each
(`cat.png` + `cat.txt`). Scanning decodes every image fully once: PIL's `open` only reads the
header, so a truncated jpg or a text file named `.png` would otherwise pass the scan and fail hours
later inside the cache pass. The same read gives the bytes' hash (the identity of the image in the
latent cache), so each file is read exactly once at startup.

Unreadable files are skipped and reported together in one warning; a dataset left with no image
is an error naming its folder, never a silent empty epoch. Symlinked sub-folders are followed,
each real folder once (a link loop or a second link to one folder is skipped and named), and a
link that resolves nowhere is reported like an unreadable image (`_image_files`).

Nothing trains wrong without a word: every PIL mode is converted to 8-bit RGB by its real range
(a 16-bit grayscale PNG is not clipped to white), captions with a byte-order mark decode (UTF-8
BOM, UTF-16), an undecodable caption skips its image like an unreadable one, and images that
would train on the trigger word alone, be upscaled past `min_size`, or lose more than half
their area to the bucket crop are reported, each kind in one warning with the count and the
first paths (`require_captions = true` turns missing captions into an error).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .reading import FIRST_PATHS, DataError, DataWarning, listing, load_rgb  # noqa: F401 (the scan's names, imported from here)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)   # EXIF orientations that swap width and height


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
    too_small_for: frozenset = frozenset()   # training resolutions this image is skipped at (min_size)
    references: tuple = ()   # its reference images (data/references.py ReferenceImage), an edit dataset's
    mask: object = None      # its loss mask (data/masks.py MaskImage), a masked dataset's


@dataclass(frozen=True)
class VideoItem:
    """One usable clip of a dataset (data/video.py: a video file, or a folder of numbered frames),
    with the caption beside it (`walk.mp4` + `walk.txt`, `seq/` + `seq.txt`) as an image has.

    Its fields mirror ImageItem's where they mean the same (path, caption, size, content hash,
    dataset, repeats, dropout, min_size skips), so the caption and size checks treat both alike.
    `num_frames` is its frame bucket: the longest 4k+1 window it holds at [data] target_fps, capped
    at [data] max_frames (video.frame_bucket); a batch holds clips of one frame bucket.
    """

    path: Path
    caption: str
    width: int
    height: int
    sha256: str              # of the file (of every frame file, in order, for a sequence)
    dataset: int
    repeats: int
    caption_dropout: float
    fps: object              # the source's frame rate (Fraction); a sequence's is sequence_fps
    frame_count: int         # source frames
    num_frames: int          # frames it trains with at [data] target_fps
    too_small_for: frozenset = frozenset()
    references: tuple = ()
    mask: object = None


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


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB PIL image -> (3, H, W) float32 in [-1, 1], the range the VAE was trained on."""
    arr = np.asarray(img, dtype=np.uint8)                 # (H, W, 3)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 127.5 - 1.0


class CaptionError(DataError):
    """A caption file that is not text leantune can decode; its image is skipped."""


_BOMS = ((b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\xef\xbb\xbf", "utf-8-sig"),
         (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))


def decode_caption(data: bytes, path: Path) -> str:
    """Caption bytes as text: a byte-order mark picks UTF-8/16/32 (and is dropped, never fed to the
    text encoders as U+FEFF); without one the text must be UTF-8."""
    encoding = next((enc for bom, enc in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        what = "UTF-8 text (or UTF-16/32 with a byte-order mark)" if encoding == "utf-8" else f"valid {encoding}"
        raise CaptionError(f"caption file {path.name} is not {what} ({e.reason} at byte {e.start})") from None


def read_caption(image: Path, extension: str, default: str) -> str:
    """The caption next to `image` (`cat.png` -> `cat.txt`), whitespace collapsed; `default` if absent.

    Raises `CaptionError` for a file that does not decode."""
    caption_path = image.with_suffix(extension)
    if not caption_path.is_file():
        return default
    text = decode_caption(caption_path.read_bytes(), caption_path)
    # Line breaks in caption files are formatting, not meaning: one caption per image.
    return " ".join(text.split())


# Control characters (NUL, escape, DEL, C1) that are not whitespace; whitespace is collapsed anyway.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# No token of the T5 or CLIP vocabularies spans more characters than this, so a caption cut to
# this many characters per token the encoders read still gives them every token they would read.
CHARS_PER_TOKEN_BOUND = 64


def strip_control(text: str) -> tuple[str, bool]:
    """The text without control characters, and whether it had any."""
    clean = _CONTROL.sub("", text)
    return clean, clean != text


def with_trigger(caption: str, trigger: str) -> str:
    """'trigger, caption'; just the trigger when the caption is empty."""
    trigger = trigger.strip()
    if not trigger:
        return caption
    return f"{trigger}, {caption}" if caption else trigger


# A dataset path of / (or a home folder) would be walked and every image in it decoded; past this
# many files the scan stops and says so. Training sets are far smaller (thousands).
MAX_SCAN_FILES = 200_000


class _TooManyFiles(Exception):
    def __init__(self, seen: int, images: int):
        self.seen, self.images = seen, images


def _resolves(path: Path) -> Path | None:
    """Where a path really is (every symlink followed), or None for a broken link or a link loop."""
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError):     # ELOOP / ENOENT; RuntimeError: a loop on older Pythons
        return None


@dataclass
class _Walk:
    """What one folder scan found: image paths, and the links it followed or could not (reported)."""

    files: list[Path]
    followed: list[str]          # "sub -> /real/folder": symlinked folders whose images are included
    repeated: list[str]          # folders reached a second time (a link loop, two links to one folder)
    dangling: list[Path]         # symlinks that resolve nowhere (broken, or a loop of links)


def _image_files(folder: Path, recursive: bool) -> _Walk:
    """The image files under `folder`, hidden files and folders left out (".DS_Store", "._cat.jpg"
    resource forks, ".git" are never data); `_TooManyFiles` past MAX_SCAN_FILES entries.

    Symlinked sub-folders are followed: linking a folder of images into a dataset instead of
    copying it is common, and leaving it out without a word trained on half the images. Each real
    folder is scanned once, by its resolved path, so a link back up the tree or two links to one
    folder neither loop nor count images twice; the scan says which links it followed and which
    folders it skipped as already scanned. A symlink that resolves nowhere (a broken link, or
    `a.png -> b.png -> a.png`) is returned in `dangling`, never dropped silently."""
    walk = _Walk([], [], [], [])
    scanned = {_resolves(folder) or folder: folder}
    seen = 0
    for top, dirs, names in os.walk(folder, followlinks=True):
        kept = []
        for d in (sorted(d for d in dirs if not d.startswith(".")) if recursive else []):
            sub = Path(top) / d
            real = _resolves(sub)
            if real is None:
                walk.dangling.append(sub)
            elif real in scanned:
                walk.repeated.append(f"{sub} -> {real} (already scanned as {scanned[real]})")
            else:
                scanned[real] = sub
                kept.append(d)
                if sub.is_symlink():
                    walk.followed.append(f"{sub} -> {real}")
        dirs[:] = kept
        for name in names:
            seen += 1
            if seen > MAX_SCAN_FILES:
                raise _TooManyFiles(seen - 1, len(walk.files))
            if name.startswith("."):
                continue
            p = Path(top) / name
            if p.is_symlink() and _resolves(p) is None:
                walk.dangling.append(p)      # os.walk lists a looping or broken link as a file
            elif p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file():
                walk.files.append(p)
    walk.files.sort()
    return walk


def _report_links(walk: _Walk, bad: list[tuple[Path, str]]) -> None:
    """The links a scan followed or skipped, one warning per kind; a dangling image link joins the
    unreadable images (`bad`), a dangling folder link (or other name) is warned about."""
    if walk.followed:
        warnings.warn(f"followed {len(walk.followed)} symlinked folder(s) into the dataset: "
                      f"{listing(walk.followed)}", DataWarning, stacklevel=4)
    if walk.repeated:
        warnings.warn(f"skipped {len(walk.repeated)} folder(s) reached a second time (a symlink loop, or two "
                      f"links to one folder; each folder's images are used once): {listing(walk.repeated)}",
                      DataWarning, stacklevel=4)
    other = []
    for p in walk.dangling:
        if p.suffix.lower() in IMAGE_EXTENSIONS:
            bad.append((p, "a symlink that resolves nowhere (broken, or a loop of links)"))
        else:
            other.append(p)
    if other:
        warnings.warn(f"skipped {len(other)} symlink(s) that resolve nowhere (broken, or a loop of links): "
                      f"{listing(other)}", DataWarning, stacklevel=4)


def scan_dataset(cfg, index: int = 0, base_dir: str | Path = ".",
                 clip_folders: frozenset = frozenset()) -> tuple[list[ImageItem], list[tuple[Path, str]]]:
    """Scan one [[data.datasets]] entry; return (usable items, [(unreadable path, reason)]).

    `cfg` is a `DatasetConfig`. Relative paths resolve against `base_dir` (the TOML file's folder).
    Images inside `clip_folders` (image sequences a clip scan took) are frames of a clip, not images.
    """
    folder = Path(cfg.path).expanduser()
    if not folder.is_absolute():
        folder = Path(base_dir) / folder
    if not folder.is_dir():
        raise DataError(f"[[data.datasets]] #{index + 1}: path {folder} is not a folder")
    items: list[ImageItem] = []
    bad: list[tuple[Path, str]] = []
    controlled: list[Path] = []
    try:
        walk = _image_files(folder, cfg.recursive)
    except _TooManyFiles as e:
        raise DataError(f"[[data.datasets]] #{index + 1}: path {folder} holds more than {MAX_SCAN_FILES} files "
                        f"(stopped scanning after {e.seen}, {e.images} of them images); point path at the folder "
                        f"of training images") from None
    _report_links(walk, bad)
    from .mask_files import mask_file_test

    is_mask = mask_file_test(cfg, base_dir)
    for path in walk.files:
        if is_mask(path):      # a dataset's mask, not a training image
            continue
        if clip_folders and path.parent in clip_folders:     # a frame of an image-sequence clip
            continue
        try:
            digest, w, h = inspect_image(path)
        except Exception as e:   # PIL raises many types (OSError, SyntaxError, DecompressionBombError...)
            bad.append((path, f"{type(e).__name__}: {e}"))
            continue
        try:
            text = read_caption(path, cfg.caption_extension, cfg.default_caption)
        except CaptionError as e:
            bad.append((path, str(e)))
            continue
        text, had_control = strip_control(text)
        if had_control:
            controlled.append(path)
        items.append(ImageItem(path=path, caption=with_trigger(text, cfg.trigger_word), width=w, height=h,
                               sha256=digest, dataset=index, repeats=cfg.repeats,
                               caption_dropout=cfg.caption_dropout))
    if controlled:
        warnings.warn(f"removed control characters (NUL, escape, ...) from {len(controlled)} caption(s): "
                      f"{listing(controlled)}", DataWarning, stacklevel=3)
    return items, bad


def _own_caption_missing(item: ImageItem, cfg) -> bool:
    """No caption file, or one with only whitespace (the default caption does not count)."""
    path = item.path.with_suffix(cfg.caption_extension)
    try:
        return not path.is_file() or not read_caption(item.path, cfg.caption_extension, "")
    except CaptionError:
        return True


def cut_long_captions(items: list[ImageItem], max_text_length: int) -> list[ImageItem]:
    """Captions far longer than the text encoders read (`max_text_length` tokens) cut before they
    are tokenized (a 10 MB caption took 80 s in T5 and sat in the cache header), with one warning."""
    limit = CHARS_PER_TOKEN_BOUND * max_text_length
    cut = [it.path for it in items if len(it.caption) > limit]
    if not cut:
        return items
    warnings.warn(f"{len(cut)} caption(s) are longer than the text encoders read ({max_text_length} tokens) and "
                  f"were cut to {limit} characters: {listing(cut)}", DataWarning, stacklevel=3)
    return [replace(it, caption=it.caption[:limit]) if len(it.caption) > limit else it for it in items]


def _noun(items: list) -> str:
    """What a list of items is called in a message: image(s), clip(s), or both."""
    kinds = {type(it) for it in items}
    if kinds == {VideoItem}:
        return "clip(s)"
    return "image(s)/clip(s)" if VideoItem in kinds else "image(s)"


def check_captions(items: list[ImageItem], datasets) -> None:
    """`require_captions` datasets: an image (or clip) without its own caption is an error; elsewhere
    one that would train on the trigger word alone (no caption, no default) is reported in one warning."""
    required = [it for it in items if datasets[it.dataset].require_captions
                and _own_caption_missing(it, datasets[it.dataset])]
    if required:
        raise DataError(f"{len(required)} {_noun(required)} have no caption file or an empty one, and their "
                        f"[[data.datasets]] sets require_captions = true: {listing([it.path for it in required])}")
    bare = [it for it in items if not datasets[it.dataset].default_caption.strip()
            and _own_caption_missing(it, datasets[it.dataset])]
    if bare:
        warnings.warn(f"{len(bare)} {_noun(bare)} have no caption file or an empty one and train on the trigger word "
                      f"alone: {listing([it.path for it in bare])} (set require_captions = true to make this an "
                      f"error, or default_caption to give them one)", DataWarning, stacklevel=3)


def check_sizes(items: list[ImageItem], datasets, resolutions: list[int]) -> list[ImageItem]:
    """Mark each image too small for a training resolution (upscaled by more than 1 / min_size to
    its bucket) to be skipped there; drop images too small for all of them; warn once about the
    skipped and once about images whose bucket crop drops more than half of them."""
    from .buckets import bucket_sizes, crop_fraction, upscale_factor, nearest_bucket

    bucket_sets = {r: bucket_sizes(r) for r in resolutions}
    kept, small, cropped, small_items, cropped_items = [], [], [], [], []
    for it in items:
        min_size = datasets[it.dataset].min_size
        skip = set()
        heavy = False
        for r, sizes in bucket_sets.items():
            bucket = nearest_bucket(it.width, it.height, sizes)
            if min_size and upscale_factor(it.width, it.height, bucket) > 1.0 / min_size:
                skip.add(r)
            elif crop_fraction(it.width, it.height, bucket) > 0.5:
                heavy = True
        if skip:
            small.append(f"{it.path} ({it.width}x{it.height}, at {', '.join(str(r) for r in sorted(skip))})")
            small_items.append(it)
        if heavy:
            cropped.append(it.path)
            cropped_items.append(it)
        if len(skip) < len(resolutions):
            kept.append(replace(it, too_small_for=frozenset(skip)) if skip else it)
    if small:
        warnings.warn(f"skipped {len(small)} {_noun(small_items)} smaller than min_size of their bucket's side "
                      f"(they would be upscaled): {listing(small)}", DataWarning, stacklevel=3)
    if cropped:
        warnings.warn(f"{len(cropped)} {_noun(cropped_items)} lose more than half their area to the crop into their "
                      f"aspect bucket (aspect beyond 1:4 / 4:1): {listing(cropped)}", DataWarning, stacklevel=3)
    return kept


def scan_datasets(data_cfg, base_dir: str | Path = ".") -> list[ImageItem]:
    """Scan every dataset of a `DataConfig`. Unreadable images are listed in one `DataWarning`.

    Raises `DataError` naming the folder if a dataset has no usable image.
    """
    return _scan_all(data_cfg, base_dir, clips=False)[0]


def scan_media(data_cfg, base_dir: str | Path = ".") -> tuple[list[ImageItem], list[VideoItem]]:
    """Scan every dataset for images and clips together (a video family's run): (images, clips).

    Clips are video files (data/video.py VIDEO_EXTENSIONS) and image-sequence folders (numbered
    frames); a sequence folder's frames are not also taken as images. Clips that cannot be
    decoded, are too short at [data] target_fps or have a variable frame rate are skipped with a
    named warning (video.scan_clips). A dataset with neither an image nor a clip is an error.
    """
    return _scan_all(data_cfg, base_dir, clips=True)


def _dataset_folder(ds, base_dir) -> Path:
    folder = Path(ds.path).expanduser()
    return folder if folder.is_absolute() else Path(base_dir) / folder


def _clip_folders(root: Path, recursive: bool) -> list[Path]:
    """The folders a clip scan reads: `root`, and with `recursive` every non-hidden sub-folder
    that is not itself an image sequence (each real folder once, symlinks followed as for images)."""
    from .video import sequence_frames

    out, seen, todo = [], set(), [root]
    while todo:
        folder = todo.pop()
        real = _resolves(folder)
        if real is None or real in seen:
            continue
        seen.add(real)
        out.append(folder)
        if recursive:
            todo.extend(sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")
                                and not sequence_frames(p)), reverse=True))
    return out


def sequence_folders(cfg, base_dir) -> frozenset[Path]:
    """The image-sequence folders of a dataset (data/video.py's rule: a sub-folder of numbered
    frames), usable or not: their frames are a clip's, never training images of a video run."""
    from .video import sequence_frames

    folder = _dataset_folder(cfg, base_dir)
    if not folder.is_dir():
        return frozenset()
    return frozenset(p for sub in _clip_folders(folder, cfg.recursive) for p in sub.iterdir()
                     if p.is_dir() and not p.name.startswith(".") and sequence_frames(p))


def scan_clip_dataset(cfg, index: int, base_dir, target_fps,
                      max_frames: int) -> tuple[list[VideoItem], list[tuple[Path, str]]]:
    """The clips of one [[data.datasets]] entry, with their captions (read and cleaned as an image's
    are) and frame buckets; [(clip, reason)] for clips whose caption does not decode."""
    from .video import scan_clips

    items: list[VideoItem] = []
    bad: list[tuple[Path, str]] = []
    controlled: list[Path] = []
    folder = _dataset_folder(cfg, base_dir)
    if not folder.is_dir():
        raise DataError(f"[[data.datasets]] #{index + 1}: path {folder} is not a folder")
    for sub in _clip_folders(folder, cfg.recursive):
        for clip in scan_clips(sub, target_fps=target_fps, max_frames=max_frames,
                               caption_extension=cfg.caption_extension):
            text = cfg.default_caption
            if clip.caption_path is not None:
                try:
                    text = " ".join(decode_caption(clip.caption_path.read_bytes(), clip.caption_path).split())
                except CaptionError as e:
                    bad.append((clip.info.path, str(e)))
                    continue
            text, had_control = strip_control(text)
            if had_control:
                controlled.append(clip.info.path)
            info = clip.info
            items.append(VideoItem(path=info.path, caption=with_trigger(text, cfg.trigger_word), width=info.width,
                                   height=info.height, sha256=info.sha256, dataset=index, repeats=cfg.repeats,
                                   caption_dropout=cfg.caption_dropout, fps=info.fps,
                                   frame_count=info.frame_count, num_frames=clip.num_frames))
    if controlled:
        warnings.warn(f"removed control characters (NUL, escape, ...) from {len(controlled)} clip caption(s): "
                      f"{listing(controlled)}", DataWarning, stacklevel=3)
    return items, bad


def _scan_all(data_cfg, base_dir, clips: bool) -> tuple[list[ImageItem], list[VideoItem]]:
    items: list[ImageItem] = []
    videos: list[VideoItem] = []
    bad: list[tuple[Path, str]] = []
    empty: list[str] = []
    for i, ds in enumerate(data_cfg.datasets):
        found_clips: list[VideoItem] = []
        if clips:
            found_clips, unreadable = scan_clip_dataset(ds, i, base_dir, data_cfg.target_fps, data_cfg.max_frames)
            bad.extend(unreadable)
        found, unreadable = scan_dataset(ds, i, base_dir, sequence_folders(ds, base_dir) if clips else frozenset())
        bad.extend(unreadable)
        if not found and not found_clips:
            note = f" ({len(unreadable)} unreadable)" if unreadable else ""
            kinds = f"image ({', '.join(IMAGE_EXTENSIONS)})" + (" or clip" if clips else "")
            empty.append(f"[[data.datasets]] #{i + 1}: no usable {kinds} in {_dataset_folder(ds, base_dir)}{note}")
        items.extend(found)
        videos.extend(found_clips)
    if bad:
        lines = "\n  ".join(f"{p}: {reason}" for p, reason in bad)
        warnings.warn(f"skipped {len(bad)} unreadable image(s){' or clip(s)' if clips else ''}:\n  {lines}",
                      DataWarning, stacklevel=3)
    if empty:
        raise DataError("\n".join(empty))
    both = check_captions_and_sizes(items + videos, data_cfg)
    items = [it for it in both if isinstance(it, ImageItem)]
    videos = [it for it in both if isinstance(it, VideoItem)]
    if not both:
        raise DataError(f"every image{' and clip' if clips else ''} is smaller than min_size of its bucket at every "
                        f"training resolution; lower [[data.datasets]] min_size or [data] resolutions")
    return items, videos


def check_captions_and_sizes(items: list, data_cfg) -> list:
    """The caption rules, the caption length cut and the min_size skips, for images and clips alike."""
    check_captions(items, data_cfg.datasets)
    items = cut_long_captions(items, data_cfg.max_text_length)
    return check_sizes(items, data_cfg.datasets, list(data_cfg.resolutions))
