"""`leantune sample --frames N` on the tiny Wan: one .mp4, its animated .webp preview and a .json of
the parameters per prompt and seed, whose frames are WanPipeline's for that prompt and seed (bit for
bit before encoding; the mp4 and webp within their codecs' loss); a length the VAE cannot decode, or
frames for an image family, is refused naming the key before any model is read."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from leantune.tiny.wan import save_wan_folder

SIDE, HEIGHT, FRAMES, SEED = 64, 48, 5, 7
PROMPTS = ["a square moving right", "a red square"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A one-transformer tiny Wan (Wan 2.1's layout), as WanPipeline.from_pretrained loads it."""
    return save_wan_folder(tmp_path_factory.mktemp("wan") / "folder", experts=1)


def _sample(folder, out, *flags) -> int:
    from leantune.cli import main

    return main(["sample", "--model", str(folder), "--family", "wan2.2", "--prompt", PROMPTS[0], "--prompt",
                 PROMPTS[1], "--width", str(SIDE), "--height", str(HEIGHT), "--steps", "3", "--guidance", "5.0",
                 "--seed", str(SEED), "--device", "cpu", "--out", str(out), "--set", "model.dtype=fp32",
                 "--set", "max_text_length=32", *flags])


def _aligned(pipe) -> None:
    """Every weight of the pipeline copied to fresh (aligned) memory: from_pretrained leaves them in
    the safetensors mmap at offsets that are not 64-byte aligned, and the CPU's matmul kernels round
    such operands differently (1 uint8 level on a pixel here); leantune's loader copies them."""
    with torch.no_grad():
        for name in ("transformer", "vae", "text_encoder"):
            for p in getattr(pipe, name).parameters():
                p.data = p.data.clone()


def test_sample_frames_writes_wanpipelines_videos_with_their_parameters(folder, tmp_path, monkeypatch, capsys):
    import av
    from diffusers import WanPipeline
    from PIL import Image

    from leantune.infer import run, video

    written = {}                     # the frames handed to the writer, before the codecs' loss
    save_video = video.save_video

    def spy(frames, path, fps):
        written[path.name] = frames.copy()
        return save_video(frames, path, fps)

    monkeypatch.setattr(video, "save_video", spy)
    plans = []
    transformer_plan = run.transformer_plan
    monkeypatch.setattr(run, "transformer_plan", lambda *a, **k: plans.append((a[4], k["frames"])) or
                        transformer_plan(*a, **k))
    assert _sample(folder, tmp_path / "out", "--frames", str(FRAMES), "--vram", "8GiB") == 0
    assert plans == [(1, 2)]           # priced: one video per forward, 5 frames = 2 latent frames
    files = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[-1] for p in files] == [f"00000-{SEED}.mp4", f"00001-{SEED + 1}.mp4"]

    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    _aligned(pipe)
    for i, (prompt, name) in enumerate(zip(PROMPTS, written)):
        out = pipe(prompt=prompt, negative_prompt="", height=HEIGHT, width=SIDE, num_frames=FRAMES,
                   num_inference_steps=3, guidance_scale=5.0, max_sequence_length=32,
                   generator=torch.Generator().manual_seed(SEED + i), output_type="np").frames[0]
        want = (out * 255).round().astype(np.uint8)            # diffusers' numpy_to_pil rounding
        got = written[name]
        assert got.shape == want.shape == (FRAMES, HEIGHT, SIDE, 3)
        assert np.array_equal(got, want), np.abs(got.astype(int) - want.astype(int)).max()
        assert not np.array_equal(got[0], got[-1])             # a video, not a still

        mp4 = tmp_path / "out" / name
        with av.open(str(mp4)) as c:
            back = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
        assert back.shape == want.shape and np.abs(back.astype(int) - want.astype(int)).mean() < 12
        with Image.open(mp4.with_suffix(".webp")) as im:
            assert im.n_frames == FRAMES and im.size == (SIDE, HEIGHT)
        meta = json.loads(mp4.with_suffix(".json").read_text())
        assert meta["prompt"] == prompt and meta["seed"] == str(SEED + i) and meta["frames"] == str(FRAMES)
        assert (meta["steps"], meta["guidance"], meta["width"], meta["height"], meta["fps"]) == \
            ("3", "5", str(SIDE), str(HEIGHT), "16")
        assert meta["negative_prompt"] == "" and meta["video"] == mp4.name and meta["preview"] == f"{mp4.stem}.webp"
    assert not np.array_equal(*written.values())             # two prompts and seeds, two videos

    # a second run numbers its files after the first's, never overwriting them
    monkeypatch.setattr(video, "save_video", save_video)
    assert _sample(folder, tmp_path / "out", "--frames", "1", "--set", "prompts=['a red square']") == 0
    assert capsys.readouterr().out.split()[0].endswith(f"00002-{SEED}.png")


def test_a_bad_frames_value_is_refused_naming_the_key(folder, tmp_path, capsys):
    """6 frames (not 4k+1) on Wan and 5 frames on an image family: errors naming `frames`, no files."""
    from leantune.config import ConfigError
    from leantune.infer.request import validate_request

    assert _sample(folder, tmp_path / "bad", "--frames", "6") == 2
    assert re.search(r"command line: top level: key 'frames'.*frames = 6: 6 frames is not a length this VAE "
                     r"encodes: 1 \+ 4k \(e\.g\. 5\)", capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"req\.toml: top level: key 'frames'.*family \"flux\" samples images"):
        validate_request({"model": {"path": str(folder), "family": "flux"}, "prompts": ["a"], "frames": 5},
                         "req.toml")
    assert not (tmp_path / "bad").exists()


def test_the_plan_prices_a_videos_latent_frames(folder):
    """Under a VRAM budget the denoising plan's activations grow with the latent frames of one
    video (1, 5 and 9 frames: 1, 2 and 3 latent frames of the same 48x64 bucket)."""
    from leantune.infer.request import validate_request
    from leantune.infer.run import FolderComponents, transformer_plan

    acts = []
    for frames in (1, 5, 9):
        req = validate_request({"model": {"path": str(folder), "family": "wan2.2", "dtype": "fp32"}, "prompts": ["a"],
                                "width": SIDE, "height": HEIGHT, "frames": frames,
                                "memory": {"vram_budget": "8GiB"}}, "req.toml")
        transformer = FolderComponents(req).transformer(torch.float32)
        plan, _ = transformer_plan(req, transformer, torch.device("cpu"), 8 * 2**30, 1, 32, cfg=True,
                                   frames=1 + (frames - 1) // 4)
        acts.append(plan.notes["per_bucket"][f"{HEIGHT}x{SIDE}"]["activations"])
    assert acts[0] < acts[1] < acts[2], acts
