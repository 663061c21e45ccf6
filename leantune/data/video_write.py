"""Frames out to files: an mp4 (H.264 when this PyAV build can encode it, else MPEG-4 part 2) and an
animated webp preview, each written atomically (a temp name beside the target, then renamed).

Why these two. mp4/H.264 in yuv420p plays in every browser and player, which is where training
samples are looked at; PyAV's wheels ship libx264, and a build without it still writes a playable
mp4 with FFmpeg's own mpeg4 encoder (`write_mp4` returns which one it used). The animated webp is
the small preview a page or a file browser shows without a video player (Pillow encodes it).

Frames are uint8 (H, W, 3) RGB: a whole (T, H, W, 3) array or any iterable of frames, so a decoder
that yields chunks (data/video_vae.py) can write a long video while holding one chunk. The webp
encoder of Pillow takes its frames as one list, so a preview holds its frames (uint8) until written.
"""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator

import av
import numpy as np
from PIL import Image

from leantune.io import atomic_write

# In order of preference: H.264 by x264, by OpenH264; MPEG-4 part 2 (always in FFmpeg) last.
H264_ENCODERS = ("libx264", "libopenh264")
FALLBACK_ENCODER = "mpeg4"
X264_CRF = 18                 # visually lossless for previews of generated video, still small


class VideoWriteError(ValueError):
    """Frames that cannot be written as a video (wrong dtype or shape, no frames, odd size); names the file."""


def mp4_encoder() -> str:
    """The encoder `write_mp4` uses with this PyAV build: the first H.264 one present, else mpeg4."""
    available = av.codecs_available
    return next((name for name in H264_ENCODERS if name in available), FALLBACK_ENCODER)


def _frames(frames, path: Path) -> Iterator[np.ndarray]:
    """Each frame as a C-contiguous uint8 (H, W, 3) array, checked against the first one's size."""
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = iter(frames)
    size = None
    for i, frame in enumerate(frames):
        if hasattr(frame, "numpy"):               # a torch tensor from a decoder
            frame = frame.detach().cpu().numpy()
        frame = np.asarray(frame)
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
            raise VideoWriteError(f"{path}: frame {i} is {frame.dtype} {frame.shape}, expected uint8 (H, W, 3) RGB")
        if size is None:
            size = frame.shape[:2]
        elif frame.shape[:2] != size:
            raise VideoWriteError(f"{path}: frame {i} is {frame.shape[1]}x{frame.shape[0]}, the first frame "
                                  f"{size[1]}x{size[0]}; a video has one size")
        yield np.ascontiguousarray(frame)
    if size is None:
        raise VideoWriteError(f"{path}: no frames to write")


def _rate(fps, path: Path) -> Fraction:
    try:
        rate = Fraction(fps).limit_denominator(1001 * 1000)
    except (TypeError, ValueError):
        rate = Fraction(0)
    if rate <= 0:
        raise VideoWriteError(f"{path}: fps must be a positive number, got {fps!r}")
    return rate


def write_mp4(path, frames, fps, *, encoder: str | None = None) -> str:
    """Write uint8 RGB frames to an mp4 at `fps`, streaming frame by frame; returns the encoder used.

    yuv420p (what browsers play) halves the chroma resolution, so width and height must be even.
    The moov atom is moved to the front (faststart) so a page can play the file while it loads.
    """
    path = Path(path)
    rate = _rate(fps, path)
    codec = encoder or mp4_encoder()
    it = _frames(frames, path)
    first = next(it)
    h, w = first.shape[:2]
    if h % 2 or w % 2:
        raise VideoWriteError(f"{path}: {w}x{h} frames; an mp4 in yuv420p needs an even width and height")

    def write(tmp: Path) -> None:
        with av.open(str(tmp), "w", format="mp4", options={"movflags": "faststart"}) as out:
            stream = out.add_stream(codec, rate=rate)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            stream.codec_context.time_base = 1 / rate
            if codec == "libx264":
                stream.options = {"crf": str(X264_CRF)}
            else:                                  # a bit rate that keeps small previews clean
                stream.bit_rate = max(1_000_000, int(w * h * float(rate) * 0.4))
            for i, frame in enumerate(_chain(first, it)):
                vf = av.VideoFrame.from_ndarray(frame, format="rgb24")
                vf.pts = i
                for packet in stream.encode(vf):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)

    atomic_write(path, write)
    return codec


def _chain(first, rest):
    yield first
    yield from rest


def write_webp(path, frames, fps, *, quality: int = 85, loop: int = 0) -> Path:
    """Write uint8 RGB frames to an animated webp at `fps` (frame times rounded to the millisecond as
    they accumulate, so 16 fps alternates 62 and 63 ms and keeps the clip's length); loop 0 = forever."""
    path = Path(path)
    rate = _rate(fps, path)
    images = [Image.fromarray(f) for f in _frames(frames, path)]

    def write(tmp: Path) -> None:
        images[0].save(tmp, format="WEBP", save_all=True, append_images=images[1:], duration=1000 / float(rate),
                       loop=loop, quality=quality)

    return atomic_write(path, write)


def write_video(path, frames: Iterable, fps) -> str:
    """By the file's suffix: .mp4 (returns the encoder) or .webp (returns "webp")."""
    suffix = Path(path).suffix.lower()
    if suffix == ".mp4":
        return write_mp4(path, frames, fps)
    if suffix == ".webp":
        write_webp(path, frames, fps)
        return "webp"
    raise VideoWriteError(f"{path}: writes .mp4 or .webp, not {suffix or 'a file without a suffix'}")
