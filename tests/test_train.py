"""End-to-end training on the tiny Flux: golden loss curve, exact resume, Ctrl-C, outputs."""

import json
import os
from pathlib import Path

import pytest
import torch

from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune.train import trainer as trainer_mod
from leantune.train.trainer import train

GOLDEN = Path(__file__).parent / "golden" / "tiny_flux_lora_20_steps.json"

RUN = """
[model]
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "cache"
max_text_length = 32

[[data.datasets]]
path = "{images}"
trigger_word = "lnt"
caption_dropout = 0.2

[lora]
rank = 4
alpha = 8
targets = "all"

[train]
steps = 20
learning_rate = 1e-3
lr_scheduler = "cosine"
warmup_steps = 3
mixed_precision = "no"
save_every = 10
keep_last = 5
seed = 3
gradient_accumulation = 2

[output]
dir = "{out}"
name = "t"
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=6, size=64, seed=5)
    return folder


def make_config(tmp_path, tiny_flux_dir, images, out="out", extra=()):
    p = tmp_path / "run.toml"
    p.write_text(RUN.format(model=tiny_flux_dir, images=images, out=out))
    return load_config(p, list(extra))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_flux_dir, images):
    tmp = tmp_path_factory.mktemp("reference")
    cfg = make_config(tmp, tiny_flux_dir, images)
    return cfg, train(cfg, progress=False)


def test_golden_loss_curve(reference_run):
    """A deterministic 20-step run must reproduce the stored loss curve (fp32, CPU)."""
    _, result = reference_run
    assert len(result.losses) == 20
    if os.environ.get("LEANTUNE_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"losses": result.losses}, indent=1))
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert result.losses == pytest.approx(golden, rel=2e-3, abs=1e-5)


def test_run_writes_lora_files_logs_and_plots(reference_run):
    cfg, result = reference_run
    p = result.paths
    assert {f.name for f in result.lora_files} == {"t_comfyui.safetensors", "t_diffusers.safetensors"}
    assert all(f.stat().st_size > 0 for f in result.lora_files)
    assert list(p.tensorboard.glob("events.out.tfevents.*"))
    assert "step 20 loss" in p.log_file.read_text()
    from PIL import Image

    assert Image.open(p.loss_plot).size[0] > 100
    assert json.loads(p.loss_history.read_text())["loss"] == result.losses


def test_resume_reproduces_the_uninterrupted_run(tmp_path, tiny_flux_dir, images, reference_run):
    _, full = reference_run
    cfg = make_config(tmp_path, tiny_flux_dir, images)
    first = train(cfg, stop_after=10, progress=False)
    assert first.final_step == 10
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.final_step == 20
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6, abs=1e-8)
    from safetensors.torch import load_file

    a = load_file(str(full.paths.lora_file("diffusers")))
    b = load_file(str(resumed.paths.lora_file("diffusers")))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_ctrl_c_saves_a_resumable_state(tmp_path, tiny_flux_dir, images, reference_run, monkeypatch):
    _, full = reference_run
    cfg = make_config(tmp_path, tiny_flux_dir, images)
    real_step = trainer_mod.train_step
    calls = {"n": 0}

    def interrupting_step(t, c):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt
        return real_step(t, c)

    monkeypatch.setattr(trainer_mod, "train_step", interrupting_step)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    monkeypatch.setattr(trainer_mod, "train_step", real_step)
    ckpts = sorted((cfg.resolve("out") / "checkpoints").glob("step-*"))
    assert ckpts[-1].name == "step-000006"
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6, abs=1e-8)


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, tiny_flux_dir, images):
    cfg = make_config(tmp_path, tiny_flux_dir, images, out="empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(cfg, resume=True, progress=False)
