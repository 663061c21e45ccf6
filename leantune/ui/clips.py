"""Video clips of a dataset folder as the page shows them: frame count, duration, the frames they train.

A video family (Wan) trains on clips beside stills (data/dataset.py scan_media): .mp4, .webm, .mov
and .mkv files with a same-stem caption. The page lists them in the same grid as the images, with
what the trainer will make of each, read by the trainer's own probe (data/video.py probe_clip,
container packets only, nothing decoded): the source frames and seconds, and the frames it trains
at [data] target_fps up to max_frames (frame_bucket), or why the trainer skips it (undecodable, a
variable frame rate, too short). The probe hashes the whole file, so each clip's answer is kept by
path, size and modification time: opening the view again probes nothing.
"""

from __future__ import annotations

from pathlib import Path

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")     # data/video.py's, without importing PyAV for images
_KEPT: dict[tuple, dict] = {}
_KEEP_AT_MOST = 20_000


def is_clip(path: Path) -> bool:
    return path.suffix.lower() in VIDEO_EXTENSIONS


def sequence_frames(folder: Path) -> list[Path]:
    """The numbered frames of an image-sequence folder as the trainer takes them (data/video.py's
    rule; PyAV is imported only when the dataset has a sub-folder to look into)."""
    from ..data.video import sequence_frames as frames

    return frames(folder)


def is_sequence(path: Path) -> bool:
    """Whether `path` is an image-sequence clip: a non-hidden folder of numbered frames."""
    return path.is_dir() and not path.name.startswith(".") and bool(sequence_frames(path))


def clip_files(folder: Path) -> list[Path]:
    """The clips of `folder` (not recursive, hidden ones left out), sorted by name: video files and
    image-sequence folders (`walk/` of 0001.png, 0002.png, ... with `walk.txt` beside it), which the
    trainer's scan takes as clips too (data/dataset.py scan_media)."""
    return sorted(p for p in folder.iterdir() if not p.name.startswith(".")
                  and ((p.is_file() and is_clip(p)) or is_sequence(p)))


def describe(path: Path, target_fps: float | None = None, max_frames: int | None = None) -> dict:
    """{width, height, frames, duration_s, fps, train_frames, warnings} of the clip at real path
    `path`, as the trainer's scan sees it at [data] target_fps and max_frames (the config's defaults
    when not given)."""
    from ..config import DataConfig

    defaults = DataConfig.model_fields
    target_fps = defaults["target_fps"].default if target_fps is None else target_fps
    max_frames = defaults["max_frames"].default if max_frames is None else max_frames
    if path.is_dir():             # a sequence changes with any of its frames: keyed by each frame's stat
        stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sequence_frames(path)]
        key = (str(path), tuple(stats), float(target_fps), int(max_frames))
    else:
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns, float(target_fps), int(max_frames))
    if key not in _KEPT:
        if len(_KEPT) >= _KEEP_AT_MOST:
            _KEPT.clear()
        _KEPT[key] = _probe(path, target_fps, max_frames)
    out = dict(_KEPT[key])
    out["warnings"] = list(out["warnings"])
    if path.is_dir():
        out["sequence"] = True    # its rate is the trainer's SEQUENCE_FPS: a folder of frames carries none
    return out


def _probe(path: Path, target_fps: float, max_frames: int) -> dict:
    from ..data.video import MIN_FRAMES, ClipError, frame_bucket, probe_clip

    entry = {"width": None, "height": None, "frames": None, "duration_s": None, "fps": None,
             "train_frames": None, "warnings": []}
    try:
        info = probe_clip(path)
    except ClipError:
        entry["warnings"].append("unreadable: the file does not decode as a video (the trainer skips it)")
        return entry
    entry.update(width=info.width, height=info.height, frames=info.frame_count,
                 duration_s=round(info.duration_s, 3), fps=round(float(info.fps), 3))
    if info.variable_frame_rate:
        entry["warnings"].append("variable frame rate: the trainer skips it (re-encode at a constant rate)")
        return entry
    frames = frame_bucket(info, target_fps, max_frames)
    if frames < MIN_FRAMES:
        entry["warnings"].append(f"shorter than {MIN_FRAMES} frames at {float(target_fps):g} fps: the trainer skips it")
    else:
        entry["train_frames"] = frames
    return entry
