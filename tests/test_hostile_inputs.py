"""Inputs and events that used to lose work or end in a raw traceback: `convert` onto an existing
file, `--gpus` beyond the machine, SIGTERM, `--overwrite` in a shared folder, non-finite weights
and bit rot in checkpoints, a changed dataset on resume, full and read-only disks, oversized
captions, an SD3.5 folder given as Flux, and the warnings for settings that train without effect."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_toml
from progress_wait import file_size, logged_steps, wait_until

from leantune.cli import main
from leantune.demo import draw_shapes

REST = """
[lora]
rank = 2
targets = "attention"

[train]
steps = 4
learning_rate = 1e-3
mixed_precision = "no"
save_every = 2
seed = 3

[output]
dir = "out"
name = "t"
formats = ["comfyui"]
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile_shapes") / "images"
    draw_shapes(folder, count=2, size=64, seed=4)
    return folder


def _config(tmp_path, model, images, rest: str = REST) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(model, images, rest))
    return p


# -- convert -------------------------------------------------------------------------------------------

def _lora_file(path, value=1.0):
    from leantune.io import save_safetensors

    save_safetensors({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.full((2, 32), value),
                      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 2)}, path)
    return path


def test_convert_refuses_to_replace_an_existing_file_without_overwrite(tmp_path, capsys):
    src = _lora_file(tmp_path / "in.safetensors")
    other = _lora_file(tmp_path / "other.safetensors", value=2.0)
    before = other.read_bytes()
    assert main(["convert", str(src), str(other), "--to", "comfyui"]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and "already exists" in err and "--overwrite" in err
    assert other.read_bytes() == before
    assert main(["convert", str(src), str(other), "--to", "comfyui", "--overwrite"]) == 0
    assert other.read_bytes() != before


# -- --gpus ------------------------------------------------------------------------------------------

def test_gpus_is_checked_against_the_machine(tmp_path, images, monkeypatch, capsys):
    config = str(_config(tmp_path, "no-such-model", images))
    assert main(["train", config, "--gpus", "-3"]) == 2
    assert "--gpus must be at least 1" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["train", config, "--gpus", "64"]) == 2
    err = capsys.readouterr().err
    assert "--gpus 64" in err and "no GPU" in err and 'device = "cpu"' in err
    # Processes on the CPU (gloo) only when asked, and no more than it has cores.
    many = (os.cpu_count() or 1) + 1
    assert main(["train", config, "--gpus", str(many), "--set", "train.device=cpu"]) == 2
    assert f"{os.cpu_count()} CPU core" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert main(["train", config, "--gpus", "3"]) == 2
    assert "this machine has 2 GPU(s)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- non-finite weights ----------------------------------------------------------------------------------

def test_a_run_whose_weights_turn_nan_saves_nothing_and_keeps_the_last_save(tmp_path, tiny_flux_dir, images,
                                                                           monkeypatch, capsys):
    """Before: the final save wrote a LoRA whose every value was NaN and called the state intact
    (the loss of the last step is computed before its update, so it is still finite)."""
    from leantune import trainer
    from leantune.train.state import list_checkpoints, load_checkpoint

    real_step = trainer.train_step
    calls = {"n": 0}

    def diverging_step(t, cfg):
        loss = real_step(t, cfg)
        calls["n"] += 1
        if calls["n"] == 4:                    # the update of the last step blows up
            with torch.no_grad():
                for p in t.params:
                    p.fill_(float("nan"))
        return loss

    monkeypatch.setattr(trainer, "train_step", diverging_step)
    config = _config(tmp_path, tiny_flux_dir, images)
    assert main(["train", str(config), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "non-finite" in err and "nothing was saved" in err and "step-000002" in err and "Traceback" not in err
    out = tmp_path / "out"
    assert [c.name for c in list_checkpoints(out / "checkpoints")] == ["step-000002"]
    assert not (out / "t_comfyui.safetensors").exists()          # no final LoRA of NaN
    _, state = load_checkpoint(out / "checkpoints" / "step-000002")
    assert all(torch.isfinite(v).all() for v in state["trainable"].values())


# -- SIGTERM -------------------------------------------------------------------------------------------

def _env():
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1"}


def test_sigterm_finishes_the_step_saves_a_resumable_state_and_releases_the_lock(tmp_path, tiny_flux_dir, images):
    """docker stop, systemd, Slurm and `timeout` send SIGTERM first. Before: the process died at
    once, with no log line, a stale lock and everything since the last save lost."""
    from leantune.train.run_folder import LOCK_NAME
    from leantune.train.state import latest_checkpoint, load_checkpoint

    config = _config(tmp_path, tiny_flux_dir, images, REST.replace("steps = 4", "steps = 100000")
                     .replace("save_every = 2", "save_every = 0"))
    # The cache filled here first: the process signalled loads no encoder (seconds of imports).
    assert main(["cache", str(config)]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "leantune", "train", str(config), "--no-progress"],
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "out" / "train.log"
    try:
        wait_until(lambda: log.exists() and "step 3 loss" in log.read_text(), lambda: (logged_steps(log), file_size(log)),
                   what="step 3's log line",
                   alive=lambda: proc.poll() is None,
                   detail=lambda: proc.stderr.read()[-3000:] if proc.poll() is not None else "")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    text = log.read_text()
    # Inside a step it finishes the step first; between steps (logging) it stops at once.
    assert "SIGTERM: stopping" in text and "saving a resumable state" in text
    step, state = load_checkpoint(latest_checkpoint(tmp_path / "out" / "checkpoints"))
    assert step >= 3 and len(state["losses"]) == step
    assert not (tmp_path / "out" / LOCK_NAME).exists()
    assert "Traceback" not in err and "stopped by SIGTERM" in err


def test_a_second_signal_during_a_step_aborts_it():
    from leantune.trainer import StopRequest

    stop = StopRequest()
    with pytest.raises(KeyboardInterrupt):
        with stop:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.time() + 10
            while not stop.requested and time.time() < deadline:
                time.sleep(0.01)
            assert stop.requested                      # the first one only asks
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert stop.aborted_mid_step
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL      # the handler is put back


# -- --overwrite ----------------------------------------------------------------------------------------

def test_overwrite_deletes_only_what_the_run_wrote_and_refuses_foreign_files(tmp_path, tiny_flux_dir, images,
                                                                               capsys):
    """Before: with [output] dir = ".", --overwrite deleted the user's own samples/, checkpoints/
    and a `<name>_*` document."""
    project = tmp_path
    (project / "samples").mkdir()
    (project / "samples" / "mine.png").write_bytes(b"user's picture")
    (project / "checkpoints").mkdir()
    (project / "checkpoints" / "notes.txt").write_text("user's notes")
    (project / "t_plan.docx").write_text("user's document")
    config = _config(project, tiny_flux_dir, images, REST.replace('dir = "out"', 'dir = "."'))
    assert main(["train", str(config), "--no-progress", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "not written by leantune" in err and "samples" in err and "t_plan.docx" in err
    assert "checkpoints/" in err and "nothing was deleted" in err
    assert (project / "samples" / "mine.png").exists() and (project / "checkpoints" / "notes.txt").exists()
    assert (project / "t_plan.docx").exists()

    # A run of its own: --overwrite replaces it; a file the user adds to it blocks that, named.
    out_cfg = _config(project, tiny_flux_dir, images, REST.replace("steps = 4", "steps = 2"))
    assert main(["train", str(out_cfg), "--no-progress"]) == 0
    out = project / "out"
    (out / "checkpoints" / "keep-me.txt").write_text("added by the user")
    (out / "t_readme.txt").write_text("added by the user")
    assert main(["train", str(out_cfg), "--no-progress", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "checkpoints/keep-me.txt" in err and "t_readme.txt" in err
    assert (out / "t_comfyui.safetensors").exists()
    (out / "checkpoints" / "keep-me.txt").unlink()
    (out / "t_readme.txt").unlink()
    assert main(["train", str(out_cfg), "--no-progress", "--overwrite", "--set", "train.steps=1"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]


# -- resume after the dataset changed ---------------------------------------------------------------------

def test_resume_after_images_were_added_offers_to_restart_the_epoch(tmp_path, tiny_flux_dir, images, capsys):
    """Before: BatchOrder.load_state_dict raised a bare ValueError (a traceback)."""
    import shutil

    own = tmp_path / "images"
    shutil.copytree(images, own)
    config = _config(tmp_path, tiny_flux_dir, own, REST.replace("steps = 4", "steps = 2"))
    assert main(["train", str(config), "--no-progress"]) == 0
    draw_shapes(tmp_path / "more", count=1, size=64, seed=9)
    for p in (tmp_path / "more").iterdir():
        shutil.copy(p, own / f"added_{p.name}")
    assert main(["train", str(config), "--no-progress", "--resume", "--set", "train.steps=3"]) == 1
    err = capsys.readouterr().err
    assert "step-000002" in err and "images were added or removed" in err
    assert "allow_dataset_change = true" in err and "Traceback" not in err
    with pytest.warns(UserWarning, match="continuing at the start of epoch"):
        assert main(["train", str(config), "--no-progress", "--resume", "--set", "train.steps=3",
                     "--set", "data.allow_dataset_change=true"]) == 0


# -- full and read-only disks -----------------------------------------------------------------------------

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_taking_the_lock_on_a_full_or_read_only_disk_is_a_clear_error_leaving_no_lock(tmp_path, monkeypatch, code):
    """Before: an OSError traceback, and on a full disk a 0-byte lock file left behind."""
    from leantune.disk import DiskFullError
    from leantune.train.run_folder import LOCK_NAME, RunFolderError, acquire_lock

    root = tmp_path / "out"
    root.mkdir()
    real_open, real_fsync = os.open, os.fsync
    if code == errno.ENOSPC:                   # the lock file is created, its contents do not fit
        def fsync(fd):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(os, "fsync", fsync)
    else:                                      # the folder cannot take a new file
        def open_(path, flags, *a, **k):
            if str(path).endswith(LOCK_NAME):
                raise OSError(code, os.strerror(code), str(path))
            return real_open(path, flags, *a, **k)
        monkeypatch.setattr(os, "open", open_)
    with pytest.raises((DiskFullError, RunFolderError)) as e:
        acquire_lock(root)
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "fsync", real_fsync)
    msg = str(e.value)
    assert str(root / LOCK_NAME) in msg
    assert ("disk full" in msg) if code == errno.ENOSPC else ("cannot create" in msg and "[output] dir" in msg)
    assert not (root / LOCK_NAME).exists()


def test_cache_folder_on_a_full_disk_is_a_clear_error(tmp_path, tiny_flux_dir, images, monkeypatch, capsys):
    """safetensors reports ENOSPC as its own SafetensorError, not an OSError, so it escaped the
    disk-full message as a traceback. The error here is the one safetensors raises (its class and
    message format, as it reports any OS error while writing)."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    config = _config(tmp_path, tiny_flux_dir, images)
    assert main(["cache", str(config)]) == 1
    err = capsys.readouterr().err
    assert "disk full writing" in err and str(tmp_path / "cache" / "latents") in err and "Traceback" not in err


# -- the wrong family -------------------------------------------------------------------------------------

def test_an_sd35_folder_given_as_flux_says_it_is_sd35(tmp_path, tiny_sd3_dir, images, capsys):
    """Before: "cannot load the T5 tokenizer" (the Flux loader read SD3's CLIP-G tokenizer_2)."""
    config = _config(tmp_path, tiny_sd3_dir, images)
    for verb in ("cache", "train"):
        assert main([verb, str(config), *(["--no-progress"] if verb == "train" else [])]) == 1
        err = capsys.readouterr().err
        assert "Stable Diffusion 3" in err and 'family = "sd3"' in err and str(tiny_sd3_dir) in err, err
        assert "tokenizer" not in err


def test_a_flux_folder_given_as_sd3_says_it_is_flux(tmp_path, tiny_flux_dir, images, capsys):
    config = _config(tmp_path, tiny_flux_dir, images)
    config.write_text(config.read_text().replace('[model]\n', '[model]\nfamily = "sd3"\n', 1))
    assert main(["cache", str(config)]) == 1
    err = capsys.readouterr().err
    assert "Flux.1" in err and 'family = "flux"' in err


# -- limits ---------------------------------------------------------------------------------------------

def test_dataset_scan_is_capped_and_says_how_many_files_it_found(tmp_path, monkeypatch):
    """Before: a dataset path of / scanned (and decoded) the whole disk."""
    from leantune.config import DatasetConfig
    from leantune.data import dataset as dataset_mod

    folder = tmp_path / "everything"
    for i in range(6):
        (folder / f"sub{i}").mkdir(parents=True)
        for j in range(3):
            (folder / f"sub{i}" / f"f{j}.txt").write_text("x")
    draw_shapes(folder / "sub0", count=1, size=64, seed=1)
    monkeypatch.setattr(dataset_mod, "MAX_SCAN_FILES", 10)
    decoded = []
    monkeypatch.setattr(dataset_mod, "inspect_image", lambda p: decoded.append(p) or ("0" * 64, 64, 64))
    with pytest.raises(dataset_mod.DataError, match=r"#1: .*everything.*more than 10 files.*point"):
        dataset_mod.scan_dataset(DatasetConfig(path=str(folder)), 0)
    assert not decoded                               # refused before decoding anything
    monkeypatch.setattr(dataset_mod, "MAX_SCAN_FILES", 100)
    items, _ = dataset_mod.scan_dataset(DatasetConfig(path=str(folder)), 0)
    assert len(items) == 1


def test_huge_caption_with_control_characters_is_cut_cleaned_and_cached_with_a_small_header(
        tmp_path, tiny_flux_dir, capsys):
    """Before: a 10 MB caption was tokenized whole (80 s in T5) and written into the cache file's
    header; NUL and escape characters went to the text encoders without a word."""
    import json as json_mod

    from leantune.config import load_config
    from leantune.data.dataset import DataWarning, scan_datasets

    folder = tmp_path / "imgs"
    draw_shapes(folder, count=2, size=64, seed=3)
    first, second = sorted(folder.glob("*.png"))
    first.with_suffix(".txt").write_text("a red\x00 circle \x1b[31mbright " + "word " * 400_000)   # 2 MB
    second.with_suffix(".txt").write_text("a blue square")
    config = _config(tmp_path, tiny_flux_dir, folder)
    cfg = load_config(config)
    with pytest.warns(DataWarning) as caught:
        items = scan_datasets(cfg.data, cfg.base_dir)
    messages = " ".join(str(w.message) for w in caught)
    assert "control character" in messages and first.name in messages
    assert "longer than the text encoders read" in messages
    caption = next(it.caption for it in items if it.path == first)
    assert "\x00" not in caption and "\x1b" not in caption and caption.startswith("a red circle [31mbright word")
    assert len(caption) <= 64 * cfg.data.max_text_length

    assert main(["cache", str(config)]) == 0
    assert "text: 0 hits, 3 misses, 0 recomputed" in capsys.readouterr().out     # 2 captions and the empty one
    for entry in (tmp_path / "cache" / "text").glob("*.safetensors"):
        with open(entry, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json_mod.loads(f.read(size))
        assert size < 4096, (entry, size)
        assert len(header["__metadata__"].get("caption", "")) <= 256
    assert main(["cache", str(config)]) == 0           # the small headers still identify the entries
    assert "text: 3 hits, 0 misses, 0 recomputed" in capsys.readouterr().out


# -- settings that train without effect -------------------------------------------------------------------

def test_lora_rank_larger_than_the_layers_it_adapts_warns():
    from leantune.config import LoraConfig
    from leantune import tiny
    from leantune.models.flux import FLUX_SPEC
    from leantune.train.lora import LoraRankWarning, add_lora

    with pytest.warns(LoraRankWarning, match=r"rank 48 .* larger than .* of \d+ adapted layer.*32"):
        add_lora(tiny.flux_transformer(seed=0), FLUX_SPEC, LoraConfig(rank=48, targets="attention"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoraRankWarning)
        add_lora(tiny.flux_transformer(seed=0), FLUX_SPEC, LoraConfig(rank=32, targets="attention"))


def test_batch_size_larger_than_the_dataset_warns(tmp_path, tiny_flux_dir, images, capsys):
    from leantune.data.dataset import DataWarning

    config = _config(tmp_path, tiny_flux_dir, images)
    with pytest.warns(DataWarning, match=r"batch_size 8 is larger than the dataset \(2 samples"):
        assert main(["cache", str(config), "--set", "data.batch_size=8"]) == 0


# -- a process of a multi-process run dies ------------------------------------------------------------------

def test_a_dead_rank_is_named_with_the_intact_save(tmp_path, images, monkeypatch, capsys):
    """Before: torchrun's raw ChildFailedError report. The failure is torchrun's own exception,
    as its launcher raises it when rank 1 is killed by SIGKILL (the real run is
    test_distributed.py::test_a_rank_that_dies_ends_the_run_and_leaves_the_last_save_intact)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from leantune.train.state import save_checkpoint

    def rank_1_killed(args):
        assert args.nproc_per_node == "2" and args.module and args.training_script == "leantune"
        raise ChildFailedError("leantune", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=-9,
                                                              error_file=str(tmp_path / "none.json"))})

    monkeypatch.setattr(torchrun, "run", rank_1_killed)
    config = _config(tmp_path, "unused-model", images, REST.replace("seed = 3", 'seed = 3\ndevice = "cpu"'))
    save_checkpoint(tmp_path / "out" / "checkpoints", 6, {"w": torch.ones(1)})
    assert main(["train", str(config), "--gpus", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "rank 1 (pid 4242) was killed by SIGKILL" in err
    assert "the last save" in err and "step-000006" in err and "is intact" in err and "--resume" in err
    assert "Traceback" not in err and "ChildFailedError" not in err


def test_a_worker_that_loses_its_peer_says_so_without_a_traceback(monkeypatch, capsys):
    """Rank 0 blocked in a collective when rank 1 is killed gets gloo's error; it says it lost
    contact (the launcher names the dead rank) instead of printing a traceback."""
    from leantune.commands import cache as cache_cmd

    def collective_fails(args):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                           "[127.0.0.1]:41236")

    monkeypatch.setattr(cache_cmd, "run", collective_fails)
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    assert main(["cache", "unused.toml"]) == 1
    err = capsys.readouterr().err
    assert "[rank 0]: lost contact with another process of this run (" in err and "Connection closed by peer" in err
    monkeypatch.setenv("WORLD_SIZE", "1")                 # one process: a real fault keeps its traceback
    with pytest.raises(RuntimeError):
        main(["cache", "unused.toml"])


def test_sigterm_to_the_launcher_of_a_multi_process_run_ends_it_with_a_line(tmp_path, images, monkeypatch, capsys):
    """torchrun's agent turns SIGTERM into a SignalException after stopping its workers (which
    save their state, as above); the launcher says so instead of printing a traceback."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def terminated(args):
        raise SignalException(f"Process {os.getpid()} got signal: {signal.SIGTERM}", sigval=signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", terminated)
    config = _config(tmp_path, "unused-model", images, REST.replace("seed = 3", 'seed = 3\ndevice = "cpu"'))
    assert main(["train", str(config), "--gpus", "2", "--no-progress"]) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
