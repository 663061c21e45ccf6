"""The page's fields for the recipe options (issue 37): masks, priors, EMA and validation reach the
TOML `leantune train` loads, a bad value names its field, and an imported TOML comes back as the
same fields with no key lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantune.config import load_config
from leantune.ui.form import FormError, RunForm

FIELDS = {"name": "dog", "model_path": "/models/flux", "dataset": "/data/dog", "trigger_word": "ohwx"}
RECIPE = {"mask_folder": "/data/dog-masks", "mask_floor": "0.1", "prior_folder": "/data/dogs",
          "prior_caption": "a photo of a dog", "prior_loss": "dop", "prior_ratio": "0.3", "ema": "on",
          "ema_decay": "0.99", "validation_fraction": "0.2", "validation_every": "50"}


def test_the_recipe_fields_reach_the_config_train_loads(tmp_path):
    cfg = load_config(RunForm.from_fields({**FIELDS, **RECIPE}).write(tmp_path / "c.toml"))
    train, prior = cfg.data.datasets
    assert (train.role, Path(train.mask_path), train.mask_floor, train.trigger_word) == \
        ("train", Path("/data/dog-masks"), 0.1, "ohwx")
    assert (prior.role, Path(prior.path), prior.default_caption, prior.trigger_word) == \
        ("prior", Path("/data/dogs"), "a photo of a dog", "")
    assert (cfg.data.prior_loss, cfg.data.prior_ratio) == ("dop", 0.3)
    assert (cfg.ema.enabled, cfg.ema.decay) == (True, 0.99)
    assert (cfg.validation.fraction, cfg.validation.every, cfg.validation.path) == (0.2, 50, None)


def test_the_fields_at_their_defaults_write_no_recipe_key():
    doc = RunForm.from_fields(FIELDS).to_dict()
    assert "ema" not in doc and "validation" not in doc
    assert len(doc["data"]["datasets"]) == 1 and "prior_loss" not in doc["data"]
    assert not {"mask_path", "mask_floor"} & set(doc["data"]["datasets"][0])


@pytest.mark.parametrize("fields, words", [
    ({"mask_floor": "0.2"}, "mask_floor: set, but no mask_folder"),
    ({"mask_folder": "/m", "mask_floor": "1"}, "mask_floor: at least 0 and below 1"),
    ({"prior_loss": "dop"}, 'prior_loss "dop": needs a prior_folder'),
    ({"prior_caption": "a dog"}, "prior_caption: set, but no prior_folder"),
    ({"prior_folder": "/p", "prior_ratio": "1"}, "prior_ratio: between 0 and 1"),
    ({"prior_loss": "kl"}, "prior_loss 'kl': one of plain, dop"),
    ({"ema": "yes"}, "ema 'yes': one of off, on"),
    ({"ema_decay": "1.5"}, "ema_decay: between 0 and 1"),
    ({"validation_fraction": "0.9"}, "validation_fraction: from 0"),
    ({"validation_every": "0"}, "validation_every: must be >= 1")])
def test_a_bad_recipe_field_is_named(fields, words):
    with pytest.raises(FormError, match=words.replace("(", r"\(")):
        RunForm.from_fields({**FIELDS, **fields})


def test_an_imported_toml_comes_back_as_the_recipe_fields_and_saves_the_same_config(tmp_path):
    form = RunForm.from_fields({**FIELDS, **RECIPE})
    again, notes = RunForm.from_toml(form.to_toml())
    assert notes == [] and again.extra_toml == ""
    for key, value in RECIPE.items():
        assert str(getattr(again, key)) == value, key
    assert again.to_dict() == form.to_dict()


def test_recipe_keys_the_fields_cannot_hold_stay_in_the_extra_toml(tmp_path):
    """A prior dataset with more keys, [ema] off with a decay, a validation folder: kept as written."""
    text = """[model]
path = "/m"
[data]
prior_loss = "dop"
[[data.datasets]]
path = "/d"
[[data.datasets]]
path = "/p"
role = "prior"
repeats = 2
[ema]
enabled = false
decay = 0.9
[validation]
path = "/held"
every = 20
"""
    form, _ = RunForm.from_toml(text)
    assert (form.prior_folder, form.ema, form.validation_fraction) == ("", "off", 0.0)
    doc = form.to_dict()
    assert doc["data"]["datasets"][1] == {"path": "/p", "role": "prior", "repeats": 2}
    assert doc["data"]["prior_loss"] == "dop"
    assert doc["ema"] == {"enabled": False, "decay": 0.9}
    assert doc["validation"] == {"path": "/held", "every": 20}
