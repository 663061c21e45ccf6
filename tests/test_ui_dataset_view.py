"""The dataset view for real datasets (issue 42): video clips with their frame count and duration
as the trainer's probe reads them, each caption's token count against Text tokens with the model's
own tokenizer, and a 1000-image view that moves at most 5 MB (its listing and every thumbnail,
through the app as a browser asks for them)."""

from __future__ import annotations

import io
import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from asgi_get import asgi_get, asgi_get_many
from PIL import Image

from leantune.ui import clips, dataset_view, tokens


def _mp4(path: Path, frames: int, fps: int, color=(200, 30, 30), size=(48, 32)) -> Path:
    """A constant-rate H.264 clip of `frames` solid frames of `color`."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), color, np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return path


def test_clips_are_listed_with_frames_duration_and_the_frames_the_trainer_takes(tmp_path):
    from leantune.data.video import frame_bucket, probe_clip
    from leantune.ui.app import create_app

    data = tmp_path / "data"
    data.mkdir()
    _mp4(data / "walk.mp4", frames=20, fps=8)
    (data / "walk.txt").write_text("a person walking\n")
    _mp4(data / "blink.mp4", frames=2, fps=8, color=(0, 0, 200))           # 0.25 s: too short to train
    (data / "broken.mov").write_bytes(b"not a video at all")
    Image.new("RGB", (64, 64), (0, 200, 0)).save(data / "still.png")
    entries = {e["name"]: e for e in dataset_view.scan(str(data), roots=[tmp_path])}
    assert sorted(entries) == ["blink.mp4", "broken.mov", "still.png", "walk.mp4"]
    walk = entries["walk.mp4"]
    info = probe_clip(data / "walk.mp4")
    assert (walk["kind"], walk["frames"], walk["duration_s"], walk["fps"]) == ("clip", 20, 2.5, 8.0)
    # 2.5 s at the config's 16 fps are 40 frames: the longest 4k+1 window is 37 (data/video.frame_bucket)
    assert walk["train_frames"] == frame_bucket(info, Fraction(16), 81) == 37
    assert (walk["width"], walk["height"], walk["caption"], walk["warnings"]) == (48, 32, "a person walking", [])
    assert entries["blink.mp4"]["train_frames"] is None
    assert any("shorter than 5 frames" in w for w in entries["blink.mp4"]["warnings"])
    assert any(w.startswith("unreadable") for w in entries["broken.mov"]["warnings"])
    assert entries["still.png"]["kind"] == "image"
    # max_frames as the config caps it
    assert clips.describe((data / "walk.mp4").resolve(), 16, 17)["train_frames"] == 17

    # a clip's caption is written as an image's, its thumbnail is its first frame, the file plays
    dataset_view.write_caption(str(data), "blink.mp4", "an eye  blinking", roots=[tmp_path])
    assert (data / "blink.txt").read_text() == "an eye blinking\n"
    app = create_app(tmp_path / "runs", "t", [tmp_path])
    status, body, _ = asgi_get(app, "/api/dataset/thumb", {"path": str(data), "name": "walk.mp4"}, "t")
    assert status == 200
    thumb = Image.open(io.BytesIO(body))
    assert thumb.format == "JPEG" and thumb.size == (48, 32)
    r, g, b = thumb.getpixel((24, 16))
    assert r > 150 and g < 80 and b < 80, (r, g, b)
    status, body, _ = asgi_get(app, "/api/dataset/image", {"path": str(data), "name": "walk.mp4"}, "t")
    assert status == 200 and body == (data / "walk.mp4").read_bytes()
    status, _, _ = asgi_get(app, "/api/dataset/image", {"path": str(data), "name": "walk.txt"}, "t")
    assert status == 400


def test_token_counts_are_the_trainers_and_a_caption_past_the_limit_is_marked(tmp_path, tiny_flux_dir):
    """Flux cuts captions with its T5 tokenizer (tokenizer_2/): the count is that tokenizer's, the
    trigger word and the end token included; a stock name or a file has none to count with."""
    from test_ui_labels import _names_the_field, _refused, _route
    from transformers import AutoTokenizer

    from leantune.ui.app import create_app

    t5 = AutoTokenizer.from_pretrained(str(tiny_flux_dir / "tokenizer_2"), local_files_only=True)
    short, long = "a red box", " ".join(["a red box on a white table"] * 30)
    answer = tokens.count([short, long], str(tiny_flux_dir), "flux", 16, trigger_word="ohwx")
    want = [len(t5(f"ohwx, {c}")["input_ids"]) for c in (short, long)]
    assert answer["counts"] == want and want[0] <= 16 < want[1]
    assert t5(f"ohwx, {short}")["input_ids"][-1] == t5.eos_token_id          # the end token counted
    assert answer["tokenizer"].endswith("tokenizer_2") and "tokenizer_2/" in answer["note"]
    clip_count = tokens.count([long], str(tiny_flux_dir), "sd3", 10)         # another family, another folder
    assert clip_count["counts"] is None and "give the Model" in clip_count["note"]
    for model in ("flux-dev", "", str(tmp_path / "model.safetensors")):
        answer = tokens.count([short], model, "flux", 10)
        assert answer["counts"] is None and "model's folder" in answer["note"]
    app = create_app(tmp_path / "runs", "t", [tmp_path])
    route = _route(app, "/api/tokens", "POST")
    assert route({"texts": [short], "model_path": str(tiny_flux_dir), "family": "flux",
                  "max_text_length": "10", "trigger_word": "ohwx"})["counts"] == want[:1]
    _names_the_field(_refused(app, "/api/tokens", "POST", {"texts": [short], "max_text_length": "ten"}),
                     "max_text_length")


def test_a_dataset_view_of_1000_images_moves_at_most_5_mb(tmp_path, monkeypatch):
    """The listing and every one of the 1000 thumbnails, as the page's grid asks for them (more
    than the grid loads at first: it loads lazily), weigh under 5 MB with the response headers; the
    second open reads the kept sizes and thumbnails (no decoding). Photo-like 200x150 images: a
    gradient with grain. Time: docs/benchmarks.md (bench/ui_dataset_view.py)."""
    from leantune.ui import thumbs
    from leantune.ui.app import create_app

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:150, 0:200]
    grains = [rng.integers(-20, 21, (150, 200, 3)) for _ in range(7)]
    for i in range(1000):
        base = np.stack([x * 255 // 200, y * 255 // 150, np.full_like(x, (i * 37) % 256)], -1)
        Image.fromarray(np.clip(base + grains[i % 7], 0, 255).astype(np.uint8)).save(data / f"img{i:04d}.jpg", quality=85)
        if i % 2:
            (data / f"img{i:04d}.txt").write_text(f"photo {i} of a gradient\n")
    app = create_app(tmp_path / "runs", "t", [data])
    status, listing, moved = asgi_get(app, "/api/dataset", {"path": str(data)}, "t")
    assert status == 200
    images = json.loads(listing)["images"]
    assert len(images) == 1000 and images[1]["caption"] == "photo 1 of a gradient"
    answers = asgi_get_many(app, [("/api/dataset/thumb", {"path": str(data), "name": e["name"]}) for e in images], "t")
    for status, body, size in answers:
        assert status == 200 and body[:2] == b"\xff\xd8"                   # a JPEG
        moved += size
    print(f"1000-image dataset view: {moved / 1e6:.2f} MB moved")
    assert moved <= 5_000_000, moved
    assert len(list((tmp_path / "runs" / thumbs.FOLDER).iterdir())) == 1000
    import leantune.data.dataset as ds

    decoded, original = [], ds.inspect_image
    monkeypatch.setattr(ds, "inspect_image", lambda p: decoded.append(p) or original(p))
    assert dataset_view.scan(str(data), roots=[data]) == images and decoded == []     # kept: nothing decoded
    (data / "img0003.jpg").write_bytes((data / "img0004.jpg").read_bytes())            # changed: decoded again
    assert dataset_view.scan(str(data), roots=[data]) == images and decoded == [data / "img0003.jpg"]


def test_removing_ticked_images_moves_them_and_their_captions_aside(tmp_path):
    """Nothing is deleted: the images and their captions move into the dataset's hidden .removed/
    folder, which neither this view nor the trainer's scan reads; a name that is not an image of the
    folder is refused before anything moves."""
    from leantune.data.dataset import _image_files
    from leantune.ui.app import create_app

    data = tmp_path / "data"
    data.mkdir()
    for name, colour in (("a", (200, 0, 0)), ("b", (0, 200, 0)), ("c", (0, 0, 200))):
        Image.new("RGB", (32, 32), colour).save(data / f"{name}.png")
    (data / "a.txt").write_text("a red square\n")
    before = (data / "a.png").read_bytes()
    with pytest.raises(dataset_view.DatasetViewError):
        dataset_view.remove_images(str(data), ["b.png", "../outside.png"], [tmp_path])
    with pytest.raises(dataset_view.DatasetViewError, match="no such image"):
        dataset_view.remove_images(str(data), ["b.png", "missing.png"], [tmp_path])
    assert sorted(p.name for p in data.iterdir()) == ["a.png", "a.txt", "b.png", "c.png"]     # nothing moved
    app = create_app(tmp_path / "runs", "t", [tmp_path])
    from test_ui_labels import _route

    done = _route(app, "/api/dataset/remove", "POST")({"path": str(data), "names": ["a.png", "b.png"]})
    moved = Path(done["to"])
    assert sorted(done["moved"]) == ["a.png", "a.txt", "b.png"] and moved.parent == data / ".removed"
    assert (moved / "a.png").read_bytes() == before and (moved / "a.txt").read_text() == "a red square\n"
    assert [e["name"] for e in dataset_view.scan(str(data), None, [tmp_path])] == ["c.png"]
    assert [p.name for p in getattr(_image_files(data, True), "files", _image_files(data, True))] == ["c.png"]
