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
    assert (again.target_fps, again.max_frames, again.sample_frames) == (24.0, 49, 33)


def test_at_their_defaults_the_video_fields_write_nothing():
    doc = RunForm.from_fields(FIELDS).to_dict()
    assert not {"target_fps", "max_frames"} & set(doc["data"]) and "frames" not in doc["sample"]


@pytest.mark.parametrize("fields, words", [
    ({"target_fps": "0"}, "target_fps: a frame rate above 0"),
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
