"""Video clips as training data: probe, pick a Wan-valid length, decode a window as a stream.

A clip is a video file (VIDEO_EXTENSIONS) or an image sequence: a folder of numbered frames
(png/jpg/webp) named like the clip, with its same-stem caption beside the folder. Clips are
probed from container packets (no decoding), so a scan of a large folder stays cheap; frames are
decoded only when a window is read, one at a time from PyAV's decode generator, each resized as it
arrives, and decoding stops once the window is full -- a long clip never sits in memory whole.

Wan's VAE compresses time 4:1 after the first frame, so a clip trains at 4k+1 frames.
"""
from __future__ import annotations

import hashlib
import re
import warnings
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import av
import numpy as np
import torch
from PIL import Image

from leantune.data.buckets import fit_to_bucket
from leantune.data.reading import DataWarning, listing, load_rgb

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")
FRAME_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
SEQUENCE_FPS = 16            # an image sequence carries no rate; Wan 2.x trains at 16 fps
MIN_FRAMES = 5               # the smallest 4k+1 above a single image
VFR_TOLERANCE = 0.25         # a pts step this far (relative) from the median one marks a variable rate


class ClipError(ValueError):
    """A clip that cannot be probed or read (undecodable, empty, too short); names the path."""


@dataclass(frozen=True)
class ClipInfo:
    """What a clip's header and packets say; sha256 is its identity in a latent cache."""

    path: Path
    width: int
    height: int
    fps: Fraction
    frame_count: int
    duration_s: float
    variable_frame_rate: bool
    sha256: str


@dataclass(frozen=True)
class ClipItem:
    """One usable clip of a folder scan: its probe, its caption file (or None), its frame bucket."""

    info: ClipInfo
    caption_path: Path | None
    num_frames: int


def _sha256_file(path: Path, h=None):
    h = h or hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h


def _frame_number(path: Path) -> int | None:
    m = re.search(r"(\d+)$", path.stem)
    return int(m.group(1)) if m else None


def sequence_frames(folder: Path) -> list[Path]:
    """The numbered frames of an image-sequence folder, in frame-number order."""
    frames = [p for p in Path(folder).iterdir()
              if p.is_file() and p.suffix.lower() in FRAME_EXTENSIONS and _frame_number(p) is not None]
    return sorted(frames, key=lambda p: (_frame_number(p), p.name))


def _as_fraction(fps) -> Fraction:
    if fps is None or fps <= 0:
        raise ValueError(f"fps must be positive, got {fps!r}")
    return Fraction(fps).limit_denominator(1_000_000)


def _probe_sequence(folder: Path, fps) -> ClipInfo:
    frames = sequence_frames(folder)
    if not frames:
        raise ClipError(f"{folder}: an image-sequence folder with no numbered png/jpg/webp frames")
    try:
        with Image.open(frames[0]) as img:
            width, height = img.size
    except Exception as e:  # PIL raises many kinds for a bad file
        raise ClipError(f"{frames[0]}: unreadable frame ({e})") from e
    h = hashlib.sha256()
    for p in frames:
        _sha256_file(p, h)
    rate = _as_fraction(fps)
    return ClipInfo(Path(folder), width, height, rate, len(frames), float(len(frames) / rate), False, h.hexdigest())


def probe_clip(path, *, sequence_fps=SEQUENCE_FPS) -> ClipInfo:
    """Probe a clip from its header and packets (demuxed, not decoded).

    The frame count is the number of video packets with a timestamp; a variable frame rate shows as
    pts steps (sorted: B-frames arrive out of order) that differ from the median step by more than
    VFR_TOLERANCE. Raises ClipError naming the file when the container cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        return _probe_sequence(path, sequence_fps)
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise ClipError(f"{path}: no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            pts = sorted(p.pts for p in container.demux(stream) if p.pts is not None and p.size > 0)
            rate = stream.average_rate or stream.guessed_rate
            time_base = stream.time_base
    except ClipError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise ClipError(f"{path}: cannot be read as a video ({e})") from e
    if not pts or not width or not height:
        raise ClipError(f"{path}: no video frames")
    steps = np.diff(np.asarray(pts, dtype=np.int64))
    vfr = False
    if len(steps):
        median = float(np.median(steps))
        vfr = median <= 0 or bool(np.any(np.abs(steps - median) > VFR_TOLERANCE * median))
        if not rate and median > 0:
            rate = 1 / (Fraction(int(round(median))) * time_base)
    if not rate:
        raise ClipError(f"{path}: the container states no frame rate")
    fps = Fraction(rate)
    return ClipInfo(path, width, height, fps, len(pts), float(len(pts) / fps), vfr, _sha256_file(path).hexdigest())


def valid_frame_count(n: int, max_frames: int | None = None) -> int:
    """The largest 4k+1 <= n (and <= max_frames): the lengths Wan's VAE encodes. 0 when n < 1."""
    if max_frames is not None:
        n = min(n, max_frames)
    return 0 if n < 1 else (n - 1) // 4 * 4 + 1


def frames_at(info: ClipInfo, target_fps, start_s: float = 0.0) -> int:
    """How many frames a clip yields resampled to target_fps from start_s (output k at start + k/fps)."""
    span = Fraction(info.frame_count) / info.fps - Fraction(start_s).limit_denominator(1_000_000)
    if span <= 0:
        return 0
    n = span * _as_fraction(target_fps)
    return int(n) + (0 if n.denominator == 1 else 1)      # ceil: output times strictly before the end


def frame_bucket(info: ClipInfo, target_fps, max_frames: int | None = None) -> int:
    """The frame bucket a clip trains in: the longest valid 4k+1 window it holds at target_fps."""
    return valid_frame_count(frames_at(info, target_fps), max_frames)


def _resize_crop(img: Image.Image, size) -> Image.Image:
    """Cover size (w, h) and center-crop, in one resample: the image path's bucket treatment."""
    return img if size is None else fit_to_bucket(img, tuple(size))


def _decoded(container, stream) -> Iterator:
    """PyAV's decode generator for one stream (a seam the tests count frames through)."""
    return container.decode(stream)


def _file_frames(container, stream, start_s: float) -> Iterator[tuple[Fraction, object]]:
    """(time since the stream's start, frame) in presentation order, from just before start_s."""
    tb = stream.time_base
    origin = stream.start_time or 0
    if start_s > 0:
        container.seek(origin + int(Fraction(start_s).limit_denominator(1_000_000) / tb),
                       stream=stream, backward=True, any_frame=False)
    for frame in _decoded(container, stream):
        if frame.pts is None:
            continue
        yield Fraction(frame.pts - origin) * tb, frame


def _pick(timed: Iterator[tuple[Fraction, object]], frame_dur: Fraction, target: Fraction,
          start: Fraction, num_frames: int, to_img, size) -> list[torch.Tensor]:
    """Nearest source frame for each output time start + k/target, stopping at num_frames."""
    out: list[torch.Tensor] = []
    prev = None                                  # (time, frame) of the latest frame at or before t
    k = 0
    t = start
    for tc, frame in timed:
        while len(out) < num_frames and tc >= t:
            chosen = prev[1] if prev is not None and t - prev[0] <= tc - t else frame   # ties: earlier
            out.append(_to_tensor(_resize_crop(to_img(chosen), size)))
            k += 1
            t = start + k / target
        if len(out) >= num_frames:
            return out
        prev = (tc, frame)
    while prev is not None and len(out) < num_frames and t < prev[0] + frame_dur:   # the last frame's span
        out.append(_to_tensor(_resize_crop(to_img(prev[1]), size)))
        k += 1
        t = start + k / target
    return out


def _to_tensor(img: Image.Image) -> torch.Tensor:
    arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)


def read_clip_frames(path, *, target_fps, num_frames: int, start_s: float = 0.0, size=None,
                     sequence_fps=SEQUENCE_FPS) -> torch.Tensor:
    """Decode num_frames of a clip at target_fps from start_s -> (F, 3, H, W) float32 in [-1, 1].

    Output frame k is the source frame nearest in time to start_s + k/target_fps. Frames stream
    from the decoder one by one, each resized/center-cropped to size=(w, h) when chosen, and decoding
    stops once num_frames are collected. Raises ClipError naming the file if it runs out first.
    """
    path = Path(path)
    target, start = _as_fraction(target_fps), Fraction(start_s).limit_denominator(1_000_000)
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    if path.is_dir():
        rate = _as_fraction(sequence_fps)
        frames = sequence_frames(path)
        timed = ((i / rate, p) for i, p in enumerate(frames))
        out = _pick(timed, 1 / rate, target, start, num_frames, load_rgb, size)
    else:
        try:
            with av.open(str(path)) as container:
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                rate = Fraction(stream.average_rate or stream.guessed_rate or SEQUENCE_FPS)
                out = _pick(_file_frames(container, stream, start_s), 1 / rate, target, start, num_frames,
                            lambda f: f.to_image(), size)
        except (av.FFmpegError, OSError, IndexError) as e:
            raise ClipError(f"{path}: cannot be decoded ({e})") from e
    if len(out) < num_frames:
        raise ClipError(f"{path}: holds {len(out)} frame(s) at {float(target):g} fps from {start_s:g} s, "
                        f"{num_frames} asked")
    return torch.stack(out).float() / 127.5 - 1.0


def first_frame(path, *, start_s: float = 0.0, size=None, sequence_fps=SEQUENCE_FPS) -> torch.Tensor:
    """The clip's frame at start_s as (3, H, W) float in [-1, 1]: an i2v model's conditioning image."""
    return read_clip_frames(path, target_fps=1, num_frames=1, start_s=start_s, size=size,
                            sequence_fps=sequence_fps)[0]


def _clip_paths(folder: Path) -> list[Path]:
    clips = []
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS:
            clips.append(p)
        elif p.is_dir() and sequence_frames(p):
            clips.append(p)
    return clips


def _caption_for(clip: Path, extension: str) -> Path | None:
    cap = clip.parent / (clip.name + extension if clip.is_dir() else clip.stem + extension)
    return cap if cap.is_file() else None


def scan_clips(folder, *, target_fps, max_frames: int | None = None, caption_extension: str = ".txt",
               sequence_fps=SEQUENCE_FPS) -> list[ClipItem]:
    """Probe every clip of a folder; skip (with one DataWarning per kind) the unusable ones.

    Skipped: clips that cannot be read, clips too short for MIN_FRAMES at target_fps, and clips with
    a variable frame rate (timestamps would not map to evenly spaced training frames).
    """
    folder = Path(folder)
    items: list[ClipItem] = []
    bad: list[Path] = []
    short: list[Path] = []
    vfr: list[Path] = []
    for clip in _clip_paths(folder):
        try:
            info = probe_clip(clip, sequence_fps=sequence_fps)
        except ClipError:
            bad.append(clip)
            continue
        if info.variable_frame_rate:
            vfr.append(clip)
            continue
        n = frame_bucket(info, target_fps, max_frames)
        if n < MIN_FRAMES:
            short.append(clip)
            continue
        items.append(ClipItem(info, _caption_for(clip, caption_extension), n))
    if bad:
        warnings.warn(f"skipped {len(bad)} clip(s) that cannot be decoded: {listing(bad)}",
                      DataWarning, stacklevel=2)
    if short:
        warnings.warn(f"skipped {len(short)} clip(s) shorter than {MIN_FRAMES} frames at "
                      f"{float(target_fps):g} fps: {listing(short)}", DataWarning, stacklevel=2)
    if vfr:
        warnings.warn(f"skipped {len(vfr)} clip(s) with a variable frame rate (re-encode at a constant "
                      f"rate to use them): {listing(vfr)}", DataWarning, stacklevel=2)
    return items
