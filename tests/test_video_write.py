"""leantune.data.video_write: mp4 read back with PyAV, animated webp read back with Pillow."""
import os
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from PIL import Image

from leantune.data import video_write

W, H, T = 48, 32, 17
COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40)]


def clip() -> np.ndarray:
    """T frames, each a flat colour cycling through COLOURS with a bright square moving across."""
    frames = np.empty((T, H, W, 3), np.uint8)
    for i in range(T):
        frames[i] = COLOURS[i % len(COLOURS)]
        frames[i, 8:16, 2 * i:2 * i + 8] = 255
    return frames


def read_mp4(path):
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)])
        return frames, s.average_rate, s.codec_context.name


def read_webp(path):
    with Image.open(path) as im:
        frames, durations = [], []
        for i in range(im.n_frames):
            im.seek(i)
            frames.append(np.asarray(im.convert("RGB")))
            durations.append(im.info["duration"])
        return np.stack(frames), durations, im.is_animated


@pytest.mark.parametrize("encoder", [None, "mpeg4"], ids=["default", "mpeg4-fallback"])
def test_mp4_round_trip(tmp_path, encoder):
    frames = clip()
    path = tmp_path / "out.mp4"
    used = video_write.write_mp4(path, frames, 16, encoder=encoder)
    assert used == (encoder or video_write.mp4_encoder())
    back, rate, codec = read_mp4(path)
    assert codec == ("h264" if used == "libx264" else "mpeg4")
    assert back.shape == (T, H, W, 3)
    assert rate == 16
    # flat colour regions (away from the moving square's edges): codec loss only
    diff = np.abs(back[:, 20:, :].astype(int) - frames[:, 20:, :].astype(int))
    assert diff.mean() < 4 and diff.max() < 40, (diff.mean(), diff.max())
    assert np.abs(back[:4, 28, 4].astype(int) - np.array(COLOURS)).max() <= 12     # colours in frame order


def test_default_encoder_is_h264_in_this_build():
    assert "libx264" in av.codecs_available            # PyAV's wheels ship x264
    assert video_write.mp4_encoder() == "libx264"


def test_mp4_streams_an_iterator_of_tensors_and_a_fractional_rate(tmp_path):
    path = tmp_path / "stream.mp4"
    video_write.write_mp4(path, (torch.from_numpy(f) for f in clip()), Fraction(24000, 1001))
    back, rate, _ = read_mp4(path)
    assert len(back) == T and rate == Fraction(24000, 1001)


def test_webp_round_trip(tmp_path):
    frames = clip()
    path = tmp_path / "out.webp"
    video_write.write_webp(path, iter(frames), 16, quality=95)
    back, durations, animated = read_webp(path)
    assert animated and back.shape == (T, H, W, 3)
    assert set(durations) <= {62, 63}                       # 1000/16 = 62.5 ms, rounded as it accumulates
    assert sum(durations) == pytest.approx(1000 * T / 16, abs=1)
    diff = np.abs(back[:, 20:, :].astype(int) - frames[:, 20:, :].astype(int))
    assert diff.mean() < 6, diff.mean()


def test_writes_are_atomic_and_errors_name_the_file(tmp_path):
    path = tmp_path / "keep.mp4"
    video_write.write_mp4(path, clip(), 16)
    before = path.read_bytes()
    bad = clip().astype(np.float32)
    with pytest.raises(video_write.VideoWriteError, match="keep.mp4.*frame 0 is float32"):
        video_write.write_mp4(path, bad, 16)

    def fails_midway():
        yield from clip()[:5]
        raise RuntimeError("decoder failed")

    with pytest.raises(RuntimeError, match="decoder failed"):
        video_write.write_mp4(path, fails_midway(), 16)
    assert path.read_bytes() == before                      # the earlier video is intact
    assert sorted(os.listdir(tmp_path)) == ["keep.mp4"]     # and no temp file is left beside it
    with pytest.raises(video_write.VideoWriteError, match="odd.mp4.*even"):
        video_write.write_mp4(tmp_path / "odd.mp4", np.zeros((5, 31, 32, 3), np.uint8), 16)
    with pytest.raises(video_write.VideoWriteError, match="mixed.webp.*frame 1"):
        video_write.write_webp(tmp_path / "mixed.webp",
                               [np.zeros((8, 8, 3), np.uint8), np.zeros((8, 6, 3), np.uint8)], 8)
    with pytest.raises(video_write.VideoWriteError, match="empty.webp.*no frames"):
        video_write.write_webp(tmp_path / "empty.webp", [], 8)
    with pytest.raises(video_write.VideoWriteError, match="zero.mp4.*fps"):
        video_write.write_mp4(tmp_path / "zero.mp4", clip(), 0)
    assert sorted(os.listdir(tmp_path)) == ["keep.mp4"]


def test_write_video_by_suffix(tmp_path):
    assert video_write.write_video(tmp_path / "a.webp", clip(), 8) == "webp"
    assert video_write.write_video(tmp_path / "a.mp4", clip(), 8) == video_write.mp4_encoder()
    with pytest.raises(video_write.VideoWriteError, match="a.gif"):
        video_write.write_video(tmp_path / "a.gif", clip(), 8)
