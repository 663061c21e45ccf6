"""The recipe fields the CLI added and the page's Check button (issue 42): [memory] base_format as a
field that reaches the TOML and comes back on import; Check runs `leantune check` on the form's
config (ui/check_job.py, the command the route starts, run here in-process) and the page reads its
per-technique lines; a check never runs beside a run."""

from __future__ import annotations

import pytest
from PIL import Image
from test_ui_labels import _names_the_field, _refused, _route

from leantune.config import load_config
from leantune.ui import check_job, launcher, queue
from leantune.ui.app import create_app
from leantune.ui.form import RunForm, choices

FIELDS = {"name": "dog", "model_path": "/models/flux", "dataset": "/data/dog"}


@pytest.mark.parametrize("value", ["bf16", "fp8", "nf4", "int8"])
def test_the_base_format_field_reaches_the_config_and_comes_back(tmp_path, value):
    form = RunForm.from_fields({**FIELDS, "base_format": value})
    assert load_config(form.write(tmp_path / "c.toml")).memory.base_format == value
    back, notes = RunForm.from_toml(form.to_toml())
    assert back.base_format == value and back.extra_toml == "" and notes == []


def test_base_format_auto_writes_no_key_and_the_choices_are_the_configs(tmp_path):
    assert "base_format" not in RunForm.from_fields(FIELDS).to_dict().get("memory", {})
    app = create_app(tmp_path / "runs", "t", [tmp_path])
    offered = _route(app, "/api/choices", "GET")()["base_format"]
    assert offered[0] == "auto" and sorted(offered) == sorted(choices("memory", "base_format"))
    _names_the_field(_refused(app, "/api/toml", "POST", {**FIELDS, "base_format": "fp4"}), "base_format")


def _images(folder):
    folder.mkdir()
    for i, color in enumerate([(200, 0, 0), (0, 200, 0), (0, 0, 200), (200, 200, 0)]):
        Image.new("RGB", (64, 64), color).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"a square of colour {i}\n")
    return folder


def test_check_runs_leantune_check_on_the_form_and_the_page_reads_its_lines(tmp_path, tiny_flux_dir, monkeypatch):
    """The route writes the form's config, confined as a run's, and starts `python -m
    leantune.ui.check_job`; run in-process here, its lines are the check's: streaming held."""
    images = _images(tmp_path / "images")
    started = []
    monkeypatch.setattr(launcher, "start", lambda folder, config, resume=False, command=None:
                        started.append((folder, command)) or {"pid": 0})
    app = create_app(tmp_path / "runs", "t", [tmp_path, tiny_flux_dir.parent])
    form = {**FIELDS, "model_path": str(tiny_flux_dir), "dataset": str(images), "dtype": "fp32",
            "mixed_precision": "no", "resolutions": "64", "max_text_length": "16", "rank": "4", "steps": "4",
            "extra_toml": "[memory]\nstreamed_blocks = 2\npin_memory = false\n"}
    assert _route(app, "/api/check", "POST")(form) == {"started": True}
    (folder, command), = started
    assert folder == tmp_path / "runs" / check_job.FOLDER
    assert command[1:3] == ["-m", "leantune.ui.check_job"] and command[3] == str(folder / check_job.CONFIG)
    cfg = load_config(folder / check_job.CONFIG)
    assert cfg.memory.streamed_blocks == 2 and cfg.model.path == str(tiny_flux_dir)
    assert not (folder / "config.toml").exists()                  # the check's folder is no run
    assert command[5] == str(check_job.STEPS)
    assert check_job.main([*command[3:5], "1"]) == 0                 # one step per variant: enough here
    said = _route(app, "/api/check", "GET")()
    assert said["done"] and said["rc"] == 0 and said["verdict"] == "every technique held", said
    assert said["lines"][0].startswith("check: ")
    streaming = [line for line in said["lines"] if line.startswith("streaming")]
    assert len(streaming) == 1 and ": held" in streaming[0], said["lines"]
    assert said["lines"][-1].startswith("check: every technique held")

    # a bad form is refused before anything starts, named by the page's label
    started.clear()
    _names_the_field(_refused(app, "/api/check", "POST", {**form, "model_path": ""}), "model_path")
    _names_the_field(_refused(app, "/api/check", "POST", {**form, "model_path": "flux-dev"}), "model_path")
    assert started == []


def test_a_check_waits_for_no_run_and_runs_wait_for_the_check(tmp_path, monkeypatch):
    runs_dir = tmp_path / "runs"
    (runs_dir / "busy").mkdir(parents=True)
    (runs_dir / "busy" / "config.toml").write_text("")
    alive = {runs_dir / "busy"}
    monkeypatch.setattr(launcher, "alive", lambda folder: folder in alive)
    monkeypatch.setattr(launcher, "start", lambda *a, **k: {"pid": 0})
    job = check_job.folder(runs_dir)
    job.mkdir()
    with pytest.raises(launcher.LaunchError, match="busy is running or waiting"):
        queue.start_alone(runs_dir, job, ["true"])
    alive = {job}
    assert queue.alive(runs_dir) == ["the check"]
    assert queue.submit(runs_dir, runs_dir / "busy", resume=False)["queued"]      # Start waits in line
    assert queue.advance(runs_dir) is None
