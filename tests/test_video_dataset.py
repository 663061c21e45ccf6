"""Clips as a dataset: [data] target_fps / max_frames, clip items beside images, frame buckets, and
the clip latent cache (keys, entries, a tiny real AutoencoderKLWan), on real files written with PyAV."""
import re
import warnings
from fractions import Fraction

import av
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from PIL import Image

from leantune.config import ConfigError, load_config
from leantune.data import cache, video, video_vae
from leantune.data.buckets import BatchOrder
from leantune.data.dataset import DataError, DataWarning, ImageItem, VideoItem, scan_datasets, scan_media

W, H = 80, 48                      # the 64 px resolution has an 80x48 bucket: no crop, no upscale
Z = 4

MINIMAL = """
[model]
path = "model"
[[data.datasets]]
path = "data"
trigger_word = "sks"
"""


def config(tmp_path, data_keys: str = "", dataset_keys: str = ""):
    text = MINIMAL.replace("[[data.datasets]]", f"[data]\nresolutions = [64]\n{data_keys}\n[[data.datasets]]")
    (tmp_path / "run.toml").write_text(text + dataset_keys)
    return load_config(tmp_path / "run.toml")


def frame(i: int, shift: int = 0) -> np.ndarray:
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([(x * 3 + i * 9 + shift) % 256, (y * 5 + i * 4) % 256, np.full_like(x, 40 + shift)],
                    -1).astype(np.uint8)


def write_clip(path, n, fps=30, shift=0):
    with av.open(str(path), "w") as out:
        s = out.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        s.codec_context.time_base = Fraction(1, fps)
        for i in range(n):
            f = av.VideoFrame.from_ndarray(frame(i, shift), format="rgb24")
            f.pts, f.time_base = i, Fraction(1, fps)
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return path


@pytest.fixture
def folder(tmp_path):
    """data/: a captioned clip, an image-sequence clip, a still image, a too-short clip, a clip in a
    sub-folder without a caption."""
    d = tmp_path / "data"
    d.mkdir()
    write_clip(d / "walk.mp4", 30)                       # 1 s at 30 fps: 16 frames at 16 fps -> 13
    (d / "walk.txt").write_text("a person walking\n")
    seq = d / "turn"
    seq.mkdir()
    for i in range(24):
        Image.fromarray(frame(i)).save(seq / f"frame_{i:03d}.png")
    (d / "turn.txt").write_text("a turning head")
    Image.fromarray(frame(0)).save(d / "still.png")
    (d / "still.txt").write_text("a still image")
    write_clip(d / "blink.mp4", 6)                        # 0.2 s: 4 frames at 16 fps, under 5
    (d / "more").mkdir()
    write_clip(d / "more" / "run.mp4", 60)
    return d


# -- [data] target_fps / max_frames ----------------------------------------------------------

def test_video_keys_default_and_validate(tmp_path):
    cfg = config(tmp_path)
    assert (cfg.data.target_fps, cfg.data.max_frames) == (16.0, 81)
    cfg = config(tmp_path, "target_fps = 24\nmax_frames = 121")
    assert (cfg.data.target_fps, cfg.data.max_frames) == (24.0, 121)
    for keys, message in [
        ("target_fps = 0", r"\[data\]: key 'target_fps'.*target_fps = 0 is not a frame rate"),
        ("target_fps = -16", r"\[data\]: key 'target_fps'.*above 0"),
        ("target_fps = 1000", r"\[data\]: key 'target_fps'.*at most 240"),
        ("max_frames = 80", r"\[data\]: key 'max_frames'.*max_frames = 80 is not a clip length.*4k\+1.*use 77 or 81"),
        ("max_frames = 3", r"\[data\]: key 'max_frames'.*the shortest clip is 5 frames"),
        ("max_frames = 100001", r"\[data\]: key 'max_frames'.*too long"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, keys)


# -- clip items ----------------------------------------------------------------------------------

def test_scan_media_finds_clips_beside_images_with_their_captions(tmp_path, folder):
    cfg = config(tmp_path)
    with pytest.warns(DataWarning) as record:
        images, clips = scan_media(cfg.data, tmp_path)
    said = [str(w.message) for w in record]
    assert any(m.startswith("skipped 1 clip(s) shorter than 5 frames at 16 fps") and "blink.mp4" in m for m in said)
    assert any(m.startswith("1 clip(s) have no caption file") and "run.mp4" in m for m in said)
    assert [it.path.name for it in images] == ["still.png"]        # the sequence's frames are not images
    assert all(isinstance(it, ImageItem) for it in images)
    by_name = {c.path.name: c for c in clips}
    assert sorted(by_name) == ["run.mp4", "turn", "walk.mp4"]
    walk, turn, run = by_name["walk.mp4"], by_name["turn"], by_name["run.mp4"]
    assert isinstance(walk, VideoItem)
    assert walk.caption == "sks, a person walking" and turn.caption == "sks, a turning head"
    assert run.caption == "sks"                                    # no caption file: the trigger alone
    assert (walk.width, walk.height, walk.fps, walk.frame_count) == (W, H, 30, 30)
    assert walk.num_frames == video.frame_bucket(video.probe_clip(walk.path), 16, 81) == 13
    assert turn.fps == video.SEQUENCE_FPS and turn.num_frames == 21   # 24 frames at 16 fps -> 21
    assert run.num_frames == 29                                    # 2 s at 16 fps = 32 -> 29
    assert walk.sha256 == video.probe_clip(walk.path).sha256


def test_image_scans_are_unchanged_and_a_clip_only_dataset_is_not_empty(tmp_path, folder):
    cfg = config(tmp_path)
    # an image family's scan still sees every image file (it knows nothing of clips)
    with pytest.warns(DataWarning, match="24 image"):               # the frames have no captions
        assert len(scan_datasets(cfg.data, tmp_path)) == 1 + 24
    only = tmp_path / "only"
    only.mkdir()
    write_clip(only / "a.mp4", 30)
    (only / "a.txt").write_text("a clip")
    text = (tmp_path / "run.toml").read_text()
    (tmp_path / "run.toml").write_text(text.replace('path = "data"', 'path = "only"'))
    cfg = load_config(tmp_path / "run.toml")
    images, clips = scan_media(cfg.data, tmp_path)
    assert images == [] and [c.path.name for c in clips] == ["a.mp4"]
    with pytest.raises(DataError, match=r"#1: no usable image \(.png.*\) in .*only"):
        scan_datasets(cfg.data, tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "run.toml").write_text(text.replace('path = "data"', 'path = "empty"'))
    with pytest.raises(DataError, match=r"#1: no usable image \(.*\) or clip in .*empty"):
        scan_media(load_config(tmp_path / "run.toml").data, tmp_path)


def test_clips_without_captions_are_named_as_clips(tmp_path, folder):
    (folder / "walk.txt").unlink()
    cfg = config(tmp_path, dataset_keys="require_captions = true\n")
    with pytest.warns(DataWarning), pytest.raises(DataError, match=r"2 clip\(s\) have no caption file.*walk.mp4"):
        scan_media(cfg.data, tmp_path)


def test_a_too_short_sequence_is_skipped_as_a_clip_and_its_frames_are_not_images(tmp_path, folder):
    short = folder / "more" / "nod"
    short.mkdir()
    for i in range(3):                                              # 3 frames at 16 fps: under 5
        Image.fromarray(frame(i)).save(short / f"f_{i}.png")
    with pytest.warns(DataWarning) as record:
        images, clips = scan_media(config(tmp_path).data, tmp_path)
    assert any("shorter than 5 frames" in str(w.message) and "nod" in str(w.message) for w in record)
    assert [it.path.name for it in images] == ["still.png"]
    assert "nod" not in {c.path.name for c in clips}


def test_a_damaged_sequence_frame_is_a_clip_error_naming_it(tmp_path, folder):
    (folder / "turn" / "frame_003.png").write_bytes(b"not a png")
    with pytest.raises(video.ClipError, match=r"turn: frame frame_003.png cannot be read"):
        list(video_vae.iter_clip_frames(folder / "turn", target_fps=16, num_frames=9))


def test_a_caption_that_does_not_decode_skips_its_clip_by_name(tmp_path, folder):
    (folder / "walk.txt").write_bytes(b"\xff\xfe\x00\xd8")          # a UTF-16 BOM then a lone surrogate
    with pytest.warns(DataWarning) as record:
        _, clips = scan_media(config(tmp_path).data, tmp_path)
    assert any(re.search(r"unreadable image\(s\) or clip\(s\):\n.*walk.mp4: caption file walk.txt is not valid utf-16",
                         str(w.message)) for w in record), [str(w.message) for w in record]
    assert "walk.mp4" not in {c.path.name for c in clips}


# -- frame buckets ---------------------------------------------------------------------------

def test_frame_buckets_follow_target_fps_and_max_frames(tmp_path, folder):
    def buckets(keys):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DataWarning)
            _, clips = scan_media(config(tmp_path, keys).data, tmp_path)
        return {c.path.name: cache.clip_bucket(c, 64) for c in clips}

    assert buckets("") == {"walk.mp4": (W, H, 13), "turn": (W, H, 21), "run.mp4": (W, H, 29)}
    assert buckets("max_frames = 17") == {"walk.mp4": (W, H, 13), "turn": (W, H, 17), "run.mp4": (W, H, 17)}
    # at 24 fps: walk 24 -> 21, the 16 fps sequence 1.5 s = 36 -> 33, run 48 -> 45, and blink's
    # 0.2 s now hold 5 frames (4.8 output times before its end)
    assert buckets("target_fps = 24") == {"walk.mp4": (W, H, 21), "turn": (W, H, 33), "run.mp4": (W, H, 45),
                                          "blink.mp4": (W, H, 5)}


def test_a_batch_never_mixes_frame_buckets(tmp_path, folder):
    (folder / "walk2.mp4").write_bytes((folder / "walk.mp4").read_bytes())
    (folder / "more" / "run2.mp4").write_bytes((folder / "more" / "run.mp4").read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        cfg = config(tmp_path)
        _, clips = scan_media(cfg.data, tmp_path)
    samples, jobs = cache.clip_samples(clips, cfg.data, "vae", torch.bfloat16)
    assert len(samples) == 5 and len(jobs) == 3                    # the copies hash to one entry each
    order = BatchOrder([s.bucket for s in samples], 2, seed=0)
    for _ in range(10):
        slot = next(order)
        assert {samples[i].bucket for i in slot.samples} == {slot.bucket}
        assert {samples[i].item.num_frames for i in slot.samples} == {slot.bucket[2]}


# -- clip cache keys -------------------------------------------------------------------------

def test_clip_key_changes_with_content_fps_frames_and_resolution(tmp_path, folder):
    def key_of(name, keys=""):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DataWarning)
            data = config(tmp_path, keys).data
            _, clips = scan_media(data, tmp_path)
        clip = next(c for c in clips if c.path.name == name)
        return cache.clip_latent_key(clip.sha256, clip.fps, cache.clip_bucket(clip, 64), data.target_fps, 0.0,
                                     "vae", torch.bfloat16)

    base = key_of("run.mp4")
    assert key_of("run.mp4") == base                                       # deterministic
    assert key_of("run.mp4", "target_fps = 24") != base                    # other frames picked
    assert key_of("run.mp4", "max_frames = 17") != base                    # a shorter window
    # a max_frames change that leaves the window as it was (run trains 29 frames under both) keeps
    # the entry: the latents are the same
    assert key_of("run.mp4", "max_frames = 33") == base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        clip = next(c for c in scan_media(config(tmp_path).data, tmp_path)[1] if c.path.name == "run.mp4")
    bigger = cache.clip_bucket(clip, 128)
    assert bigger[:2] != (W, H) and bigger[2] == 29
    k = lambda **kw: cache.clip_latent_key(**{"clip_sha256": clip.sha256, "source_fps": clip.fps,   # noqa: E731
                                              "bucket": cache.clip_bucket(clip, 64), "target_fps": 16.0,
                                              "start_s": 0.0, "vae_id": "vae", "dtype": torch.bfloat16, **kw})
    assert k() == base and k(target_fps=16) == base                        # 16 and 16.0 key alike
    assert k(bucket=bigger) != base                                        # resolution
    assert k(bucket=(W, H, 25)) != base                                    # frame bucket
    assert k(source_fps=24) != base                                        # a sequence read at another rate
    assert k(vae_id="other") != base and k(dtype=torch.float32) != base and k(start_s=0.5) != base
    write_clip(folder / "more" / "run.mp4", 60, shift=1)                   # the file's content changed
    assert key_of("run.mp4") != base


# -- the clip latent cache pass --------------------------------------------------------------

def tiny_vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=4, z_dim=Z, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0],
                            scale_factor_spatial=4).eval()


def test_fill_clip_latents_encodes_once_and_reuses(tmp_path, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        cfg = config(tmp_path, "max_frames = 5")              # short windows: little work for the VAE
        _, clips = scan_media(cfg.data, tmp_path)
    _, jobs = cache.clip_samples(clips, cfg.data, "vae", torch.float32)
    jobs = {k: v for k, v in jobs.items() if v[0].path.name in ("walk.mp4", "turn")}   # a file and a sequence
    loads = []

    def load_vae(sources, dtype, device):
        loads.append(dtype)
        return tiny_vae()

    shape = lambda b: cache.clip_latent_shape(b, Z, 4)              # noqa: E731
    out = tmp_path / "cache" / "latents"
    stats, failed = cache.fill_clip_latents(jobs, out, None, torch.float32, "cpu", load_vae, 16.0, shape)
    assert (stats.misses, stats.hits, failed, len(loads)) == (2, 0, set(), 1)
    for key, (item, bucket) in jobs.items():
        tensors, meta = cache.load_safetensors(out / f"{key}.safetensors")
        lat = tensors["latent"]
        assert lat.dtype == cache.STORE_DTYPE and tuple(lat.shape) == shape(bucket)
        assert meta["key"] == key and meta["bucket"] == "x".join(map(str, bucket))
        expected = video_vae.encode_clip(tiny_vae(), item.path, target_fps=16.0, num_frames=bucket[2],
                                         size=bucket[:2], sequence_fps=item.fps)
        assert torch.equal(lat, expected.to(cache.STORE_DTYPE))
    stats, _ = cache.fill_clip_latents(jobs, out, None, torch.float32, "cpu", load_vae, 16.0, shape)
    assert (stats.hits, stats.misses, len(loads)) == (2, 0, 1)     # all reused, the VAE not loaded again
    bad_key = next(iter(jobs))
    (out / f"{bad_key}.safetensors").write_bytes(b"not a safetensors file")
    with pytest.warns(cache.CacheWarning, match=f"recomputing 1 corrupt clip latent cache entry:\n.*{bad_key}"):
        stats, _ = cache.fill_clip_latents(jobs, out, None, torch.float32, "cpu", load_vae, 16.0, shape)
    assert (stats.hits, stats.recomputed, len(loads)) == (1, 1, 2)
    assert cache.check_clip_latent_entry(out / f"{bad_key}.safetensors", bad_key, shape(jobs[bad_key][1])) is None


def test_a_clip_that_fails_while_decoding_is_skipped_by_name(tmp_path, folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        cfg = config(tmp_path, "max_frames = 5")
        _, clips = scan_media(cfg.data, tmp_path)
    _, jobs = cache.clip_samples(clips, cfg.data, "vae", torch.float32)
    jobs = {k: v for k, v in jobs.items() if v[0].path.name in ("walk.mp4", "run.mp4")}
    write_clip(folder / "more" / "run.mp4", 6)           # shorter than its probe said, after the scan
    shape = lambda b: cache.clip_latent_shape(b, Z, 4)   # noqa: E731
    with pytest.warns(DataWarning, match=r"skipped 1 clip\(s\) that failed while their frames were decoded: "
                                         r".*run.mp4: holds 4 frame\(s\)"):
        stats, failed = cache.fill_clip_latents(jobs, tmp_path / "c", None, torch.float32, "cpu",
                                                lambda *a: tiny_vae(), 16.0, shape)
    assert [jobs[k][0].path.name for k in failed] == ["run.mp4"]
    assert len(list((tmp_path / "c").iterdir())) == 1    # the other one was written
