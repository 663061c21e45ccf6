"""ui/labels.py: a config key or form field in an error becomes the label the page shows (issue 42).

The labels are read from the shipped index.html, so each case checks against the page itself."""

from __future__ import annotations

from leantune.ui.labels import FIELDS, labels, on_field


def test_every_mapped_field_is_a_control_on_the_page():
    page = labels()
    missing = sorted({f for f in FIELDS.values() if f not in page})
    assert not missing, missing


def test_form_config_and_extra_toml_errors_name_the_label():
    page = labels()
    for message, field in [
        ("model_path: give the model folder", "model_path"),
        ("invalid config:\n  the config: [memory] vram_budget: bad size", "vram_budget"),
        ("extra_toml: Expected '=' after a key", "extra_toml"),
    ]:
        got = on_field(message)
        assert got["field"] == field
        assert got["message"].startswith(page[field]), got
        assert "model_path:" not in got["message"] and "[memory]" not in got["message"]
