"""End-to-end training on the tiny Flux: golden loss curve, Ctrl-C, outputs (exact resume of a LoRA
run, for every family: tests/families/test_conformance.py)."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import tiny_run_toml

from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune import trainer as trainer_mod
from leantune.trainer import train

GOLDEN = Path(__file__).parent / "golden" / "tiny_flux_lora_20_steps.json"

RUN_REST = """trigger_word = "lnt"
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
    p.write_text(tiny_run_toml(tiny_flux_dir, images, RUN_REST.format(out=out)))
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
    log = p.log_file.read_text()
    assert "step 20 loss" in log
    # the first step says which attention kernel its calls took (memory/attention_report.py): the
    # tiny Flux passes no mask; once, not every step
    assert log.count("attention on cpu") == 1 and "on the flash kernel (no mask)" in log
    from PIL import Image

    assert Image.open(p.loss_plot).size[0] > 100
    assert json.loads(p.loss_history.read_text())["loss"] == result.losses


def _sigint_during_step(monkeypatch, step: int, times: int):
    """Deliver `times` real SIGINTs while optimizer step `step` runs (before its work)."""
    real_step = trainer_mod.train_step
    calls = {"n": 0}

    def step_with_ctrl_c(t, c):
        calls["n"] += 1
        if calls["n"] == step:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return real_step(t, c)

    monkeypatch.setattr(trainer_mod, "train_step", step_with_ctrl_c)


def test_ctrl_c_finishes_the_step_then_saves_a_resumable_state(tmp_path, tiny_flux_dir, images, reference_run,
                                                                monkeypatch):
    _, full = reference_run
    cfg = make_config(tmp_path, tiny_flux_dir, images)
    _sigint_during_step(monkeypatch, 7, times=1)
    before = signal.getsignal(signal.SIGINT)     # Python's handler, or SIG_IGN in a background job
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    assert signal.getsignal(signal.SIGINT) is before                         # handler restored
    monkeypatch.setattr(trainer_mod, "train_step", _REAL_STEP)
    ckpts = sorted((cfg.resolve("out") / "checkpoints").glob("step-*"))
    assert ckpts[-1].name == "step-000007"                                    # the interrupted step completed
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6, abs=1e-8)


def test_second_ctrl_c_aborts_at_once_and_saves_nothing_half_done(tmp_path, tiny_flux_dir, images, monkeypatch):
    cfg = make_config(tmp_path, tiny_flux_dir, images)
    _sigint_during_step(monkeypatch, 13, times=2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False)
    ckpts = sorted((cfg.resolve("out") / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-000010"]                         # only the periodic save
    assert "aborted inside step 13" in (cfg.resolve("out") / "train.log").read_text()


def test_resume_without_checkpoint_is_a_clear_error(tmp_path, tiny_flux_dir, images):
    cfg = make_config(tmp_path, tiny_flux_dir, images, out="empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(cfg, resume=True, progress=False)


def _oom_on_call(monkeypatch, n):
    """Make the n-th forward_backward call fail as the CUDA allocator does."""
    real_forward = trainer_mod.forward_backward
    calls = {"n": 0}

    def failing_once(t, c, batch, scale=1.0):
        calls["n"] += 1
        if calls["n"] == n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real_forward(t, c, batch, scale)

    monkeypatch.setattr(trainer_mod, "forward_backward", failing_once)


def test_simulated_oom_replans_and_redoes_the_step_without_losing_a_sample(tmp_path, tiny_flux_dir, images,
                                                                            reference_run, monkeypatch):
    """An allocator failure mid-run is caught: a new plan is applied and the same batch redone.

    On the tiny model every plan's predicted peak is within the planner's safety margin, so the
    planner is made to answer the re-plan with a streaming + checkpointing plan (exact math on
    CPU): the whole run must then reproduce the uninterrupted loss curve and data position.
    """
    from dataclasses import replace

    from leantune.planner import search as planner_mod
    from leantune.train.state import latest_checkpoint, load_checkpoint

    _, full = reference_run
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "calibration"))
    real_plan = planner_mod.Planner.plan
    calls = {"n": 0}

    def plan(self, budget):
        calls["n"] += 1
        first = real_plan(self, replace(budget, vram=8 * 2**30))
        if calls["n"] == 1:
            return first
        return replace(first, checkpointing="blocks", debug_poison=True,
                       streamed_blocks=("transformer_blocks.1", "single_transformer_blocks.0"))

    monkeypatch.setattr(planner_mod.Planner, "plan", plan)
    _oom_on_call(monkeypatch, 9)                 # inside optimizer step 5 (2 micro-batches per step)
    cfg = make_config(tmp_path, tiny_flux_dir, images, extra=["memory.vram_budget=8GiB"])
    result = train(cfg, progress=False)
    assert result.final_step == 20
    log_text = result.paths.log_file.read_text()
    assert "out of memory at step 5" in log_text and "re-planned" in log_text
    assert "memory plan now: stream 2 blocks" in log_text
    assert result.losses == pytest.approx(full.losses, rel=1e-5, abs=1e-7)
    _, state = load_checkpoint(latest_checkpoint(result.paths.checkpoints))
    _, ref_state = load_checkpoint(latest_checkpoint(full.paths.checkpoints))
    assert state["data"] == ref_state["data"]


def test_oom_with_no_plan_left_stops_with_a_resumable_state(tmp_path, tiny_flux_dir, images, reference_run,
                                                             monkeypatch):
    from leantune.planner.feedback.oom import NoPlanFits

    _, full = reference_run
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "calibration"))
    _oom_on_call(monkeypatch, 9)
    cfg = make_config(tmp_path, tiny_flux_dir, images, extra=["memory.vram_budget=1GiB"])
    with pytest.raises(NoPlanFits, match="out of memory at step 5.*resumable"):
        train(cfg, progress=False)
    assert latest_checkpoint_name(cfg) == "step-000004"
    monkeypatch.setattr(trainer_mod, "forward_backward", _REAL_FORWARD)
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6, abs=1e-8)


_REAL_FORWARD = trainer_mod.forward_backward
_REAL_STEP = trainer_mod.train_step


def latest_checkpoint_name(cfg):
    from leantune.train.state import latest_checkpoint

    return latest_checkpoint(cfg.resolve("out") / "checkpoints").name


def test_training_under_the_memory_engine_reproduces_the_plain_run(tmp_path, tiny_flux_dir, images, reference_run):
    """Streaming (poisoned slots) + offloaded checkpointing through the trainer: same loss curve as
    the plain run, and the per-step streaming report reaches the log and TensorBoard."""
    _, full = reference_run
    cfg = make_config(tmp_path, tiny_flux_dir, images,
                      extra=["memory.streamed_blocks=3", "memory.checkpointing=offload", "memory.debug_poison=true"])
    result = train(cfg, progress=False, stop_after=6)
    assert result.losses == pytest.approx(full.losses[:6], rel=1e-5, abs=1e-7)
    log_text = result.paths.log_file.read_text()
    assert "memory plan: stream 3 blocks" in log_text and "streamed 0.00 GB in" in log_text
