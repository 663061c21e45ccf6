"""The page's video fields (issue 42): clip frame rate, longest clip and sample frames reach the
TOML `leantune train` loads (and only when set), come back from an imported TOML, the dataset view
counts a clip's trained frames at the form's values, and the Sample form asks `leantune sample` for
frames and lists the videos it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from asgi_get import asgi_get
from test_ui_dataset_view import _mp4

from leantune.config import load_config
from leantune.ui import sample_job
from leantune.ui.form import FormError, RunForm

FIELDS = {"name": "walk", "model_path": "/models/wan", "family": "wan2.2", "dataset": "/data/clips",
          "sample_prompts": "a dog walking", "sample_every": "50"}
VIDEO = {"target_fps": "24", "max_frames": "49", "sample_frames": "33"}


def test_the_video_fields_reach_the_config_and_come_back(tmp_path):
    cfg = load_config(RunForm.from_fields({**FIELDS, **VIDEO}).write(tmp_path / "c.toml"))
    assert (cfg.data.target_fps, cfg.data.max_frames, cfg.sample.frames) == (24.0, 49, 33)
    again, notes = RunForm.from_toml(RunForm.from_fields({**FIELDS, **VIDEO}).to_toml())
    assert notes == [] and again.extra_toml == ""
    assert (again.target_fps, again.max_frames, again.sample_frames) == ("24", 49, 33)


def test_at_their_defaults_the_video_fields_write_nothing():
    doc = RunForm.from_fields(FIELDS).to_dict()
    assert not {"target_fps", "max_frames"} & set(doc["data"]) and "frames" not in doc["sample"]
    # a rate typed is written even where it is A14B's 16: empty is what leaves the model's own
    assert RunForm.from_fields({**FIELDS, "target_fps": "16"}).to_dict()["data"]["target_fps"] == 16.0


@pytest.mark.parametrize("fields, words", [
    ({"target_fps": "0"}, "target_fps: a frame rate above 0"),
    ({"target_fps": "fast"}, "target_fps: a frame rate above 0"),
    ({"max_frames": "0"}, "max_frames: at least 1 frame"),
    ({"sample_frames": "-1"}, "sample_frames: 0"),
])
def test_a_bad_video_field_is_named(fields, words):
    with pytest.raises(FormError, match=words):
        RunForm.from_fields({**FIELDS, **fields})


def test_a_frame_count_the_vae_cannot_encode_is_refused_naming_the_key(tmp_path):
    """4k+1 is the config's rule; the page shows it on the field through labels.RUN_FIELDS."""
    from leantune.config import ConfigError
    from leantune.ui.labels import RUN_FIELDS

    with pytest.raises(ConfigError, match="max_frames = 48"):
        RunForm.from_fields({**FIELDS, "max_frames": "48"}).write(tmp_path / "c.toml")
    assert (RUN_FIELDS["data.max_frames"], RUN_FIELDS["sample.frames"]) == ("max_frames", "sample_frames")


def test_the_dataset_view_counts_a_clips_frames_at_the_forms_rate(tmp_path):
    from leantune.ui.app import create_app

    data = tmp_path / "clips"
    data.mkdir()
    _mp4(data / "walk.mp4", frames=40, fps=16)                 # 2.5 s
    app = create_app(tmp_path / "runs", "t", [tmp_path])

    def trained(**query) -> int:
        status, body, _ = asgi_get(app, "/api/dataset", {"path": str(data), **query}, "t")
        assert status == 200, body
        return json.loads(body)["images"][0]["train_frames"]
    assert trained() == 37                                     # 16 fps, up to 81: the longest 4k+1 in 40
    assert trained(target_fps="8") == 17                       # 20 frames at 8 fps
    assert trained(max_frames="21") == 21
    assert trained(family="wan2.2-ti2v") == 57                 # no rate given: TI2V-5B's own 24 fps (60 frames)
    assert trained(family="wan2.2") == 37 and trained(family="flux") == 37     # A14B's 16; an image family: the default
    status, body, _ = asgi_get(app, "/api/dataset", {"path": str(data), "target_fps": "0"}, "t")
    assert status == 400 and b"target_fps" in body


def test_the_sample_form_asks_for_frames_and_lists_the_videos(tmp_path):
    cmd = sample_job.command({"model_path": "/models/wan", "prompts": "a dog", "frames": "33"}, tmp_path / "o")
    assert cmd[cmd.index("--frames") + 1] == "33"
    with pytest.raises(FormError, match="frames: 'many' is not a number"):
        sample_job.command({"model_path": "/m", "prompts": "a dog", "frames": "many"}, tmp_path / "o")
    job = tmp_path / sample_job.SAMPLES_DIR / "1"
    job.mkdir(parents=True)
    for name in ("00000-0.mp4", "00000-0.webp", "00000-0.json"):
        (job / name).write_bytes(b"x")
    listed = sample_job.result(tmp_path, 1)
    assert listed["videos"] == ["00000-0.mp4"] and listed["images"] == []


def _sequence(folder: Path, frames: int, color=(30, 200, 30), size=(48, 32)) -> Path:
    """An image-sequence clip: `folder` of numbered PNG frames, as the trainer takes one."""
    from PIL import Image

    folder.mkdir()
    for i in range(frames):
        Image.new("RGB", size, color).save(folder / f"{i + 1:04d}.png")
    return folder


def test_an_image_sequence_folder_is_a_clip_of_the_dataset_view(tmp_path):
    """The trainer takes `walk/` of numbered frames (with `walk.txt` beside it) as a clip: the view
    lists it once as a clip with its frames at the sequence rate, not its frames as images; its
    thumbnail and enlarged view are its first frame; its caption is written beside the folder; a
    folder without numbered frames is not listed."""
    import io

    from PIL import Image

    from leantune.data.video import SEQUENCE_FPS
    from leantune.ui import dataset_view
    from leantune.ui.app import create_app

    data = tmp_path / "clips"
    data.mkdir()
    _sequence(data / "walk", frames=21)
    (data / "notes").mkdir()
    (data / "notes" / "readme.txt").write_text("not frames")
    entries = {e["name"]: e for e in dataset_view.scan(str(data), None, [tmp_path])}
    assert sorted(entries) == ["walk"]
    walk = entries["walk"]
    assert (walk["kind"], walk["sequence"], walk["frames"], walk["fps"]) == ("clip", True, 21, float(SEQUENCE_FPS))
    assert walk["train_frames"] == 21 and (walk["width"], walk["height"]) == (48, 32)
    assert "no caption (.txt): trains with the trigger word only" in walk["warnings"]

    dataset_view.write_caption(str(data), "walk", "a green  field", roots=[tmp_path])
    assert (data / "walk.txt").read_text() == "a green field\n"
    assert dataset_view.scan(str(data), None, [tmp_path])[0]["caption"] == "a green field"
    app = create_app(tmp_path / "runs", "t", [tmp_path])
    status, body, _ = asgi_get(app, "/api/dataset/thumb", {"path": str(data), "name": "walk"}, "t")
    assert status == 200
    r, g, b = Image.open(io.BytesIO(body)).getpixel((24, 16))
    assert g > 150 and r < 80 and b < 80, (r, g, b)
    status, body, _ = asgi_get(app, "/api/dataset/image", {"path": str(data), "name": "walk"}, "t")
    assert status == 200 and body == (data / "walk" / "0001.png").read_bytes()
    status, _, _ = asgi_get(app, "/api/dataset/image", {"path": str(data), "name": "notes"}, "t")
    assert status == 400


def test_a_sequence_whose_frame_links_outside_the_roots_is_not_shown(tmp_path):
    from leantune.ui import dataset_view

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    _sequence(outside, frames=5)
    data = root / "clips"
    data.mkdir()
    seq = _sequence(data / "walk", frames=4)
    (seq / "0005.png").symlink_to(outside / "0005.png")
    with pytest.raises(dataset_view.DatasetViewError, match="no such image"):
        dataset_view.preview_path(str(data), "walk", [root])
    assert dataset_view.sequence_folder(data / "walk", [root]) is None
    assert dataset_view.sequence_folder(data / "walk", [tmp_path]) == seq.resolve()


def test_the_captioner_captions_clips_from_their_first_frame(tmp_path):
    """A video file and an image sequence get captions as images do (before, a clip stopped the
    captioner: PIL cannot open an mp4)."""
    from tiny_captioner import WORDS, save_tiny_blip

    from leantune.ui import captioner

    model = save_tiny_blip(tmp_path / "blip")
    data = tmp_path / "clips"
    data.mkdir()
    _mp4(data / "run.mp4", frames=8, fps=8)
    _sequence(data / "walk", frames=5)
    assert captioner.caption_folder(str(model), str(data), tmp_path / "status.json") == 0
    for caption in (data / "run.txt", data / "walk.txt"):
        words = caption.read_text().split()
        assert words and set(words) <= set(WORDS), (caption, words)


def test_the_wan_expert_fields_and_sample_references_reach_the_config(tmp_path):
    fields = {**FIELDS, "expert": "both", "lora_experts": "shared",
              "sample_references": "/data/clips/first.png\n/data/clips/second.png"}
    form = RunForm.from_fields(fields)
    cfg = load_config(form.write(tmp_path / "c.toml"))
    assert (cfg.model.expert, cfg.lora.experts) == ("both", "shared")
    assert cfg.sample.references == ["/data/clips/first.png", "/data/clips/second.png"]
    again, notes = RunForm.from_toml(form.to_toml())
    assert notes == [] and again.extra_toml == "" and again.as_fields() == form.as_fields()
    doc = RunForm.from_fields(FIELDS).to_dict()              # at their defaults: nothing written
    assert "expert" not in doc["model"] and "experts" not in doc["lora"] and "references" not in doc["sample"]
    with pytest.raises(FormError, match="expert 'middle': one of auto"):
        RunForm.from_fields({**FIELDS, "expert": "middle"})


def test_an_expert_on_a_one_transformer_family_is_refused_on_its_field(tmp_path):
    from leantune.config import ConfigError
    from leantune.ui.labels import on_field

    with pytest.raises(ConfigError) as e:
        RunForm.from_fields({**FIELDS, "family": "flux", "expert": "both"}).write(tmp_path / "c.toml")
    said = on_field(str(e.value))
    assert said["field"] == "expert", said


def test_ti2v_image_to_video_and_the_base_error_bound_reach_the_config(tmp_path):
    fields = {**FIELDS, "family": "wan2.2-ti2v", "image_to_video": "on", "max_base_error": "10",
              "sample_references": "/data/clips/first.png"}
    form = RunForm.from_fields(fields)
    cfg = load_config(form.write(tmp_path / "c.toml"))
    assert (cfg.model.image_to_video, cfg.memory.max_base_error) == (True, 10.0)
    again, notes = RunForm.from_toml(form.to_toml())
    assert notes == [] and again.extra_toml == "" and again.as_fields() == form.as_fields()
    doc = RunForm.from_fields(FIELDS).to_dict()
    assert "image_to_video" not in doc["model"] and "max_base_error" not in doc.get("memory", {})
    with pytest.raises(FormError, match="max_base_error: a percentage above 0"):
        RunForm.from_fields({**FIELDS, "max_base_error": "-1"})
    with pytest.raises(FormError, match="image_to_video 'yes': one of off, on"):
        RunForm.from_fields({**FIELDS, "image_to_video": "yes"})
