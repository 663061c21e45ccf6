"""Output-folder guards: another run, --resume/--overwrite, config changes on resume, a corrupt
latest checkpoint, leftovers of a killed save, the lock, a full disk."""

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import tiny_run_toml

from leantune.cli import main
from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune.disk import DiskFullError
from leantune.train import state as state_mod
from leantune.train.run_folder import LOCK_NAME, RunFolder, RunFolderError, clean_leftovers
from leantune.train.state import CheckpointError, list_checkpoints
from leantune.trainer import train

REST = """trigger_word = "lnt"

[lora]
rank = 2
targets = "attention"

[train]
steps = 4
learning_rate = 1e-3
mixed_precision = "no"
save_every = 2
keep_last = 3
seed = 3

[output]
dir = "out"
name = "t"
formats = ["comfyui"]
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=2, size=64, seed=5)
    return folder


def _toml(tmp_path, tiny_flux_dir, images, rest=REST):
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(tiny_flux_dir, images, rest))
    return p


@pytest.fixture(scope="module")
def finished_once(tmp_path_factory, tiny_flux_dir, images):
    """The 4-step run, trained once per module: `finished` copies it for each test."""
    folder = tmp_path_factory.mktemp("finished")
    train(load_config(_toml(folder, tiny_flux_dir, images)), progress=False)
    return folder


@pytest.fixture
def finished(tmp_path, finished_once):
    """A config whose 4-step run has finished in tmp_path/out (checkpoints at 2 and 4): a copy of
    the module's one run (config, cache and output folder). Its config names the cache and output
    folders relative to the TOML, and nothing the run saved holds the folder's path (checked), so
    the copy is that run as if it had been made here."""
    for name in ("run.toml", "cache", "out"):
        src = finished_once / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp_path / name)
    saved = [f for f in (tmp_path / "out").rglob("*") if f.suffix in (".json", ".toml")] + [tmp_path / "run.toml"]
    assert not [f for f in saved if str(finished_once) in f.read_text()]
    return tmp_path / "run.toml"


def test_second_run_in_a_finished_folder_is_refused_unless_resume_or_overwrite(finished, capsys):
    out = finished.parent / "out"
    final = (out / "t_comfyui.safetensors").read_bytes()
    # Refused, saying which flags; nothing changed.
    assert main(["train", str(finished), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "holds another run" in err and "--resume" in err and "--overwrite" in err and str(out) in err
    assert (out / "t_comfyui.safetensors").read_bytes() == final
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["step-000002", "step-000004"]
    assert not (out / LOCK_NAME).exists()          # the refused run let go of the lock
    # Both flags contradict each other.
    assert main(["train", str(finished), "--resume", "--overwrite", "--no-progress"]) == 1
    assert "contradict" in capsys.readouterr().err
    # --overwrite starts again from nothing: old checkpoints are gone before the first new save.
    assert main(["train", str(finished), "--overwrite", "--no-progress", "--set", "train.steps=1",
                 "--set", "train.save_every=0"]) == 0
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["step-000001"]
    assert json.loads((out / "loss.json").read_text())["step"] == 1


def test_resume_lists_changes_accepts_more_steps_refuses_rank(finished, caplog):
    caplog.set_level(logging.INFO, logger="leantune")
    cfg = load_config(finished, ["train.steps=6", "train.learning_rate=5e-4", "lora.rank=8"])
    with pytest.raises(CheckpointError) as err:
        train(cfg, resume=True, progress=False)
    assert "lora.rank: 2 -> 8" in str(err.value) and "step-000004" in str(err.value)
    cfg = load_config(finished, ["train.steps=6", "train.learning_rate=5e-4"])
    result = train(cfg, resume=True, progress=False)
    assert result.final_step == 6 and len(result.losses) == 6
    text = caplog.text
    assert "train.steps changed 4 -> 6: training continues to the new step count" in text
    assert "train.learning_rate changed 0.001 -> 0.0005" in text
    # The stored config of the new saves is the new one.
    saved = json.loads((finished.parent / "out" / "checkpoints" / "step-000006" / "config.json").read_text())
    assert saved["train"]["steps"] == 6 and saved["lora"]["rank"] == 2


def test_changed_learning_rate_takes_effect_on_resume(finished):
    """The scheduler's base rate comes back from the state; a changed learning rate must still apply.
    (The finished run resumed from its step 4 with 2 more steps: the same path as resuming a run
    cut short, apply_learning_rate after the scheduler's and optimizer's saved states load.)"""
    from leantune import trainer as trainer_mod

    seen = {}
    real = trainer_mod.train_step

    def spy(t, cfg):
        seen.setdefault("lr", [g["lr"] for g in t.optimizer.param_groups])
        return real(t, cfg)

    trainer_mod.train_step = spy
    try:
        train(load_config(finished, ["train.steps=6", "train.learning_rate=1e-4"]), resume=True, stop_after=1,
              progress=False)
    finally:
        trainer_mod.train_step = real
    assert seen["lr"] and all(lr == pytest.approx(1e-4) for lr in seen["lr"])   # constant schedule


def test_corrupt_latest_checkpoint_falls_back_and_is_kept_aside(finished, caplog):
    ckpts = finished.parent / "out" / "checkpoints"
    (ckpts / "step-000004" / "tensors.safetensors").write_bytes(b"garbage")
    caplog.set_level(logging.INFO, logger="leantune")
    result = train(load_config(finished), resume=True, progress=False)
    assert result.final_step == 4 and len(result.losses) == 4       # steps 3..4 redone from step 2
    assert (ckpts / "corrupt-step-000004" / "tensors.safetensors").read_bytes() == b"garbage"
    assert "does not load" in caplog.text and "corrupt-step-000004" in caplog.text
    assert "resumed from" in caplog.text and "step-000002" in caplog.text


def test_leftovers_of_a_killed_save_are_cleaned_and_a_half_replaced_step_restored(tmp_path):
    root = tmp_path / "out"
    ckpts = root / "checkpoints"
    (ckpts / ".tmp-step-000006-999").mkdir(parents=True)
    (ckpts / ".tmp-step-000006-999" / "tensors.safetensors").write_bytes(b"x" * 10)
    (ckpts / ".old-step-000004-999").mkdir()                 # killed between the two renames
    (ckpts / ".old-step-000004-999" / "state.json").write_text("{}")
    (ckpts / "step-000002").mkdir()
    (ckpts / ".old-step-000002-999").mkdir()                 # its replacement landed: the old copy goes
    (root / ".loss.json.abc123.tmp").write_text("partial")
    (root / "keep.txt").write_text("the user's")
    clean_leftovers(root)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000004"]
    assert (ckpts / "step-000004" / "state.json").exists()
    assert sorted(p.name for p in root.iterdir()) == ["checkpoints", "keep.txt"]


def test_kill_between_state_and_lora_save_rewrites_the_lora_on_resume(tmp_path, tiny_flux_dir, images, monkeypatch,
                                                                      caplog):
    path = _toml(tmp_path, tiny_flux_dir, images, REST.replace("steps = 4", "steps = 6"))
    from leantune.train import lora_mode as modes

    calls = {"n": 0}
    real_export = modes.LoraMode.export

    def killed_export(self, t, paths, step, intermediate):
        calls["n"] += 1
        if step == 4:
            raise KeyboardInterrupt          # stands in for a kill right after the state save
        return real_export(self, t, paths, step, intermediate)

    monkeypatch.setattr(modes.LoraMode, "export", killed_export)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(path), progress=False)
    out = tmp_path / "out"
    assert (out / "checkpoints" / "step-000004").exists() and not (out / "t-step000004_comfyui.safetensors").exists()
    monkeypatch.setattr(modes.LoraMode, "export", real_export)
    caplog.set_level(logging.INFO, logger="leantune")
    train(load_config(path), resume=True, stop_after=1, progress=False)
    assert "rewrote the LoRA files of step 4 from its saved state" in caplog.text
    assert (out / "t-step000004_comfyui.safetensors").stat().st_size > 0


def test_lock_names_the_holding_process_and_a_stale_lock_is_taken_over(tmp_path, caplog):
    root = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        root.mkdir()
        (root / LOCK_NAME).write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename,
                                                  "command": "leantune train other.toml", "started": 0}))
        with pytest.raises(RunFolderError, match=rf"in use by process {holder.pid} .*leantune train other.toml"):
            with RunFolder(root, "t"):
                pass
    finally:
        holder.kill()
        holder.wait()
    caplog.set_level(logging.INFO, logger="leantune")
    with RunFolder(root, "t"):                      # the holder is gone: its lock is taken over
        assert json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert "taking over the lock" in caplog.text
    assert not (root / LOCK_NAME).exists()


def test_disk_full_during_a_save_names_path_bytes_and_the_intact_save(finished, monkeypatch, capsys):
    out = finished.parent / "out"
    before = sorted(p.name for p in (out / "checkpoints").iterdir())

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(state_mod, "save_safetensors_streamed", full)
    assert main(["train", str(finished), "--resume", "--no-progress", "--set", "train.steps=6"]) == 1
    err = capsys.readouterr().err
    assert "disk full writing" in err and ".tmp-step-000006" in err
    assert re.search(r"about [0-9.]+ (KiB|MiB) needed, [0-9.]+ \w+ free", err) and "the last save (step-000004) is intact" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before     # no leftovers, nothing lost
    assert issubclass(DiskFullError, OSError)
