"""ui/labels.py: an error comes back naming the field by the label the page shows, with the id of
the field it is about (issue 42).

The labels are read from the shipped index.html, so each case checks against the page itself: the
field an error names is a control on the page, the message starts with that control's label, and
no config name or CLI flag of the form's fields is left in it. Each route's errors are taken as the
app's own exception handler answers them (the JSON the page reads)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from leantune.ui.form import RunForm
from leantune.ui.labels import FIELDS, labels, on_field, page_ids

FORM = {"name": "cats", "model_path": "/models/flux", "dataset": "/data/cats", "vram_budget": "8GiB"}
# what a message may never say: the form's ids followed by ':', config "[section] key" of a field, flags
INTERNAL = re.compile(r"\b(model_path|extra_toml|vram_budget|ram_budget|sample_prompts|mask_folder|prior_folder)\b|"
                      r"\[(model|memory|data|train|lora|sample)\][: ]+(key )?'?(path|vram_budget|ram_budget|"
                      r"resolutions|rank|steps|every)|--(model|vram|ram|rank|resolution)\b")


def _answer(app, exc: Exception) -> tuple[int, dict]:
    """The status and JSON the app's own handler gives for `exc` (as the page receives it)."""
    for kind in type(exc).__mro__:
        handler = app.exception_handlers.get(kind)
        if handler:
            response = asyncio.run(handler(None, exc))
            return response.status_code, json.loads(response.body)
    raise AssertionError(f"no handler for {type(exc).__name__}")


def _route(app, path: str, method: str):
    for route in app.routes:
        if getattr(route, "path", None) == path and method in getattr(route, "methods", ()):
            return route.endpoint
    raise AssertionError(f"no route {method} {path}")


def _refused(app, path: str, method: str, *args) -> dict:
    with pytest.raises(ValueError) as e:
        _route(app, path, method)(*args)
    status, body = _answer(app, e.value)
    assert status in (400, 403), (status, body)
    return body


def _names_the_field(answer: dict, field: str) -> None:
    assert answer["field"] == field, answer
    assert field in page_ids(), field
    assert answer["error"].startswith((labels()[field], f'"{labels()[field]}"')), answer
    if field != "extra_toml":
        assert not INTERNAL.search(answer["error"]), answer


@pytest.fixture
def app(tmp_path):
    from leantune.ui.app import create_app

    return create_app(tmp_path / "runs", "t", [tmp_path])


def _images(folder: Path) -> Path:
    folder.mkdir()
    Image.new("RGB", (64, 64), (200, 0, 0)).save(folder / "a.png")
    return folder


def test_every_mapped_field_is_a_control_on_the_page():
    page = labels()
    missing = sorted({f for f in FIELDS.values() if f not in page})
    assert not missing, missing
    form_ids = set(RunForm().as_fields())
    assert not form_ids - set(page), form_ids - set(page)          # every field of the run form has a label


def test_form_config_and_extra_toml_messages_name_the_label():
    page = labels()
    for message, field in [
        ("model_path: give the model folder", "model_path"),
        ("invalid configuration:\n  the config: [memory]: key 'vram_budget': Value error, 'lots' is not a size",
         "vram_budget"),
        ("extra_toml: Expected '=' after a key", "extra_toml"),
        ("mask_floor: set, but no mask_folder; give the folder of masks", "mask_floor"),
        ("/runs/x/config.toml: [[data.datasets]] #1: key 'repeats': Input should be greater than or equal to 1",
         "repeats"),
        ("[[data.datasets]] #1 path = '/x': outside the folders this page may use", "dataset"),
    ]:
        got = on_field(message)
        _names_the_field(got, field)
        assert got["error"].startswith(page[field] + ":") or got["error"].startswith(f'"{page[field]}"'), got
    assert on_field("mask_floor: set, but no mask_folder")["error"].count(page["mask_folder"]) == 1


def test_a_key_the_extra_toml_sets_is_its_problem_in_the_tomls_own_words():
    extra = "[memory]\nvram_budget = 'x'\n"
    got = on_field("invalid configuration:\n  the config: [memory]: key 'vram_budget': Value error, 'x' is bad", extra)
    assert got["field"] == "extra_toml" and "[memory] vram_budget" in got["error"], got
    assert got["error"].startswith(labels()["extra_toml"])


def test_every_problem_of_a_config_check_is_named_once_each():
    message = ("invalid configuration:\n  the config: [data]: key 'resolutions': Value error, 7 is not a multiple of 16\n"
               "  the config: [sample]: key 'guidance': Input should be greater than or equal to 0 (got -1.0)")
    got = on_field(message)
    assert got["field"] == "resolutions" and [p["field"] for p in got["problems"]] == ["resolutions", "sample_guidance"]
    for p in got["problems"]:
        _names_the_field(p, p["field"])


@pytest.mark.parametrize("fields, field", [
    ({"rank": "eight"}, "rank"),                                               # the form's own check
    ({"mask_floor": "0.2"}, "mask_floor"),
    ({"prior_loss": "dop"}, "prior_loss"),
    ({"extra_toml": "[train]\nmax_grad_norm = = 1\n"}, "extra_toml"),          # the extra TOML does not parse
])
def test_the_toml_preview_refuses_a_bad_field_naming_its_label(app, fields, field):
    _names_the_field(_refused(app, "/api/toml", "POST", {**FORM, **fields}), field)


@pytest.mark.parametrize("fields, field", [
    ({"vram_budget": "lots"}, "vram_budget"),                                  # the config check (pydantic)
    ({"resolutions": "7"}, "resolutions"),
    ({"warmup_steps": "-1"}, "warmup_steps"),
    ({"extra_toml": "[train]\nbogus = 1\n"}, "extra_toml"),                    # a key only the extra TOML holds
    ({"extra_toml": "[memory]\nram_budget = 'y'\n"}, "extra_toml"),
])
def test_the_toml_preview_says_what_the_config_check_refuses_by_label(app, fields, field):
    answer = _route(app, "/api/toml", "POST")({**FORM, **fields})
    _names_the_field(answer, field)
    assert "/tmp" not in answer["error"] and "the config:" not in answer["error"]


def test_an_empty_form_shows_no_error(app):
    """A first view: the preview and the plan of an untouched form say what they wait for, no error."""
    defaults = RunForm().as_fields()
    assert _route(app, "/api/toml", "POST")(defaults)["error"] is None
    plan = _route(app, "/api/plan", "POST")(defaults)
    assert plan["fits"] is None and "error" not in plan and "model" in plan["message"]
    assert not INTERNAL.search(plan["message"])


def test_the_plan_route_names_the_field(app):
    _names_the_field(_refused(app, "/api/plan", "POST", {**FORM, "vram_budget": "lots"}), "vram_budget")
    missing = _route(app, "/api/plan", "POST")(FORM)          # /models/flux is not there: the planner's answer
    assert missing["planned"] is False and missing["field"] == "model_path"
    assert missing["message"].startswith(f'not planned: "{labels()["model_path"]}"') and not INTERNAL.search(missing["message"])


def test_the_run_route_names_the_field(app, tmp_path):
    images = str(_images(tmp_path / "d"))
    _names_the_field(_refused(app, "/api/runs", "POST", {**FORM, "model_path": "", "dataset": images}), "model_path")
    _names_the_field(_refused(app, "/api/runs", "POST", {**FORM, "dataset": ""}), "dataset")
    _names_the_field(_refused(app, "/api/runs", "POST", {**FORM, "dataset": str(tmp_path / "nope")}), "dataset")
    _names_the_field(_refused(app, "/api/runs", "POST", {**FORM, "model_path": "flux-dev", "dataset": images}),
                     "model_path")
    _names_the_field(_refused(app, "/api/runs", "POST", {**FORM, "dataset": images, "vram_budget": "lots"}),
                     "vram_budget")
    assert not (tmp_path / "runs" / "cats").exists()


def test_the_dataset_caption_and_sample_routes_name_their_fields(app, tmp_path):
    _names_the_field(_refused(app, "/api/dataset", "GET", str(tmp_path / "nope")), "dataset")
    _names_the_field(_refused(app, "/api/caption-job", "POST", {"path": str(_images(tmp_path / "d")), "model": ""}),
                     "caption_model")
    _names_the_field(_refused(app, "/api/sample", "POST", {"model_path": "", "prompts": "a cat"}), "s_model")
    _names_the_field(_refused(app, "/api/sample", "POST", {"model_path": "/m", "prompts": ""}), "s_prompts")
    _names_the_field(_refused(app, "/api/sample", "POST", {"model_path": "/m", "prompts": "a", "steps": "x"}),
                     "s_steps")
