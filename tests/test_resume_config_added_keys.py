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


def test_schedule_free_warmup_is_refused_on_resume_as_its_state_holds_it(tmp_path):
    """AdamWScheduleFree saves warmup_steps in its param groups: load_state_dict brings the saved
    value back, so a changed [train] warmup_steps would be silently ignored. With AdamW (the
    LambdaLR warmup, recomputed from the config) the change applies."""
    import torch
    from schedulefree import AdamWScheduleFree

    from leantune.errors import CheckpointError

    param = torch.nn.Parameter(torch.zeros(2))
    saved_opt = AdamWScheduleFree([param], lr=1e-3, warmup_steps=10)
    resumed = AdamWScheduleFree([param], lr=1e-3, warmup_steps=50)
    resumed.load_state_dict(saved_opt.state_dict())
    assert resumed.param_groups[0]["warmup_steps"] == 10          # the saved value wins

    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(tmp_path / "m", tmp_path / "i", '[train]\noptimizer = "schedulefree_adamw"\n'
                                                              'warmup_steps = 10\n'))
    saved = resolved_config(load_config(p))
    with pytest.raises(CheckpointError, match=r"train.warmup_steps: 10 -> 50"):
        check_resume(saved, load_config(p, ["train.warmup_steps=50"]), tmp_path / "ckpt")
    adamw = resolved_config(load_config(p, ['train.optimizer="adamw"']))
    changes = check_resume(adamw, load_config(p, ['train.optimizer="adamw"', "train.warmup_steps=50"]), tmp_path / "c")
    assert changes.changed == {"train.warmup_steps": (10, 50)} and changes.refused == []
