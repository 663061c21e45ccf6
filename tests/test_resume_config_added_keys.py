"""A checkpoint saved before this session's keys existed resumes without a changed line, and the
keys the saved optimizer state fixes (Prodigy's) are refused when changed on resume."""

import pytest
from conftest import tiny_run_toml

from leantune.config import load_config
from leantune.train.resume_config import ADDED_DATASET_DEFAULTS, ADDED_DEFAULTS, check_resume, compare, resolved_config


def _older(saved: dict) -> dict:
    """The resolved config as an older leantune wrote it: without the keys added since."""
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for key in ADDED_DEFAULTS:
        section, name = key.split(".")
        old.get(section, {}).pop(name, None)
    for section in ("ema", "validation"):
        if all(f"{section}.{k}" in ADDED_DEFAULTS or v is None for k, v in old.get(section, {}).items()):
            old.pop(section, None)
    old["data"]["datasets"] = [{k: v for k, v in ds.items() if k not in ADDED_DATASET_DEFAULTS}
                               for ds in old["data"]["datasets"]]
    return old


def test_an_older_checkpoints_config_shows_no_change_and_prodigy_keys_are_refused(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(tmp_path / "m", tmp_path / "i", '[train]\noptimizer = "prodigy"\nlearning_rate = 1.0\n'))
    cfg = load_config(p)
    saved = resolved_config(cfg)
    older = _older(saved)
    assert "ema" not in older and "mask_floor" not in older["data"]["datasets"][0]
    assert compare(older, saved).changed == {}
    changed = load_config(p, ["train.prodigy_d_coef=2.0"])
    from leantune.errors import CheckpointError

    with pytest.raises(CheckpointError, match="prodigy_d_coef"):
        check_resume(saved, changed, tmp_path / "ckpt")
