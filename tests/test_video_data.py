"""leantune.data.video on real clips written with PyAV: frame i is a solid grey encoding i."""
from fractions import Fraction

import av
import numpy as np
import pytest
from PIL import Image

from leantune.data import video
from leantune.data.dataset import DataWarning

W, H = 32, 24
STEP = 7


def level(i: int) -> int:
    return 16 + (i % 32) * STEP


def index_of(frame) -> int:
    """The source index a decoded frame encodes (float tensor in [-1, 1], (3, H, W))."""
    mean = float(((frame + 1) * 127.5).mean())
    return round((mean - 16) / STEP)


def write_clip(path, n, fps=30, codec="libx264", pts=None):
    with av.open(str(path), "w") as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.codec_context.time_base = Fraction(1, fps)
        for i in range(n):
            arr = np.full((H, W, 3), level(i), np.uint8)
            f = av.VideoFrame.from_ndarray(arr, format="rgb24")
            f.pts = i if pts is None else pts[i]
            f.time_base = Fraction(1, fps)
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return path


@pytest.fixture(scope="session")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    good = {"a.mp4": ("libx264", 12), "b.webm": ("libvpx-vp9", 12), "c.mov": ("mpeg4", 12)}
    for name, (codec, n) in good.items():
        write_clip(d / name, n, codec=codec)
    (d / "a.txt").write_text("a clip")
    seq = d / "seq"
    seq.mkdir()
    for i in range(12):
        Image.fromarray(np.full((H, W, 3), level(i), np.uint8)).save(seq / f"frame_{i:04d}.png")
    (d / "seq.txt").write_text("a sequence")
    long = tmp_path_factory.mktemp("long") / "long.mp4"
    write_clip(long, 90)
    return d, long


def test_probe_values(clips):
    d, _ = clips
    for name in ("a.mp4", "b.webm", "c.mov"):
        info = video.probe_clip(d / name)
        assert (info.width, info.height, info.frame_count) == (W, H, 12), name
        assert info.fps == 30, (name, info.fps)
        assert info.duration_s == pytest.approx(0.4), name
        assert not info.variable_frame_rate, name
        assert len(info.sha256) == 64
    assert video.probe_clip(d / "a.mp4").sha256 != video.probe_clip(d / "c.mov").sha256
    seq = video.probe_clip(d / "seq", sequence_fps=30)
    assert (seq.width, seq.height, seq.frame_count, seq.fps) == (W, H, 12, 30)


def test_valid_frame_count_is_4k_plus_1():
    assert [video.valid_frame_count(n) for n in range(0, 11)] == [0, 1, 1, 1, 1, 5, 5, 5, 5, 9, 9]
    assert video.valid_frame_count(100, max_frames=81) == 81
    assert video.valid_frame_count(100, max_frames=80) == 77


def test_frame_bucket(clips):
    d, long = clips
    info = video.probe_clip(d / "a.mp4")                     # 12 frames at 30 fps = 0.4 s
    assert video.frames_at(info, 15) == 6
    assert video.frame_bucket(info, 15) == 5
    assert video.frame_bucket(info, 30) == 9
    assert video.frame_bucket(video.probe_clip(long), 30, max_frames=33) == 33


@pytest.mark.parametrize("name", ["a.mp4", "b.webm", "c.mov"])
def test_resample_30_to_15_picks_every_other_frame(clips, name):
    d, _ = clips
    frames = video.read_clip_frames(d / name, target_fps=15, num_frames=5)
    assert frames.shape == (5, 3, H, W) and frames.dtype.is_floating_point
    assert frames.min() >= -1 and frames.max() <= 1
    assert [index_of(f) for f in frames] == [0, 2, 4, 6, 8]


def test_resample_to_a_rate_between_frames_is_nearest(clips):
    d, _ = clips
    frames = video.read_clip_frames(d / "a.mp4", target_fps=12, num_frames=5)   # t = k/12 -> 2.5k frames
    assert [index_of(f) for f in frames] == [0, 2, 5, 7, 10]        # 2.5 and 7.5 tie: the earlier frame


def test_start_and_resize(clips):
    _, long = clips
    frames = video.read_clip_frames(long, target_fps=30, num_frames=5, start_s=1.0, size=(16, 16))
    assert frames.shape == (5, 3, 16, 16)
    assert [index_of(f) for f in frames] == [(30 + k) % 32 for k in range(5)]
    first = video.first_frame(long, size=(16, 8))
    assert first.shape == (3, 8, 16) and index_of(first) == 0


def test_decoding_streams_only_a_prefix(clips, monkeypatch):
    _, long = clips
    yielded = []
    real = video._decoded

    def counting(container, stream):
        for f in real(container, stream):
            yielded.append(f.pts)
            yield f

    monkeypatch.setattr(video, "_decoded", counting)
    frames = video.read_clip_frames(long, target_fps=30, num_frames=5)
    assert len(frames) == 5
    assert 5 <= len(yielded) <= 6, yielded                      # of 90 frames in the clip


def test_too_few_frames_is_an_error_naming_the_file(clips):
    d, _ = clips
    with pytest.raises(video.ClipError, match="a.mp4"):
        video.read_clip_frames(d / "a.mp4", target_fps=30, num_frames=13)


def test_image_sequence_equals_the_clip_frames(clips):
    d, _ = clips
    seq = video.read_clip_frames(d / "seq", target_fps=15, num_frames=5, sequence_fps=30)
    clip = video.read_clip_frames(d / "a.mp4", target_fps=15, num_frames=5)
    assert [index_of(f) for f in seq] == [0, 2, 4, 6, 8]
    assert (seq - clip).abs().max() < 0.05                     # codec loss only


def test_scan_skips_bad_short_and_vfr_clips_by_name(clips, tmp_path):
    d, _ = clips
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("a.mp4", "b.webm", "c.mov", "a.txt", "seq.txt"):
        (folder / name).write_bytes((d / name).read_bytes())
    (folder / "seq").mkdir()
    for p in (d / "seq").iterdir():
        (folder / "seq" / p.name).write_bytes(p.read_bytes())
    good = (d / "a.mp4").read_bytes()
    (folder / "truncated.mp4").write_bytes(good[: len(good) // 3])
    (folder / "garbage.mp4").write_bytes(b"\x00junk" * 200)
    write_clip(folder / "short.mp4", 4)
    write_clip(folder / "vfr.mp4", 12, pts=[0, 1, 2, 5, 6, 7, 12, 13, 14, 20, 21, 22])
    with pytest.warns(DataWarning) as rec:
        items = video.scan_clips(folder, target_fps=30, sequence_fps=30)
    names = {it.info.path.name for it in items}
    assert names == {"a.mp4", "b.webm", "c.mov", "seq"}
    caps = {it.info.path.name: it.caption_path and it.caption_path.name for it in items}
    assert caps["a.mp4"] == "a.txt" and caps["seq"] == "seq.txt" and caps["b.webm"] is None
    assert all(it.num_frames == 9 for it in items)
    msgs = [str(w.message) for w in rec if issubclass(w.category, DataWarning)]
    undecodable = [m for m in msgs if "cannot be decoded" in m]
    assert len(undecodable) == 1 and "2 clip" in undecodable[0]
    assert "truncated.mp4" in undecodable[0] and "garbage.mp4" in undecodable[0]
    short = [m for m in msgs if "shorter than 5 frames" in m]
    assert len(short) == 1 and "short.mp4" in short[0] and "1 clip" in short[0]
    vfr = [m for m in msgs if "variable frame rate" in m]
    assert len(vfr) == 1 and "vfr.mp4" in vfr[0] and "1 clip" in vfr[0]
    assert len(msgs) == 3
