"""`leantune check --gpus 2` on the tiny Flux, one test per strategy leantune trains with on several
processes: after the one-process variants the whole plan runs on 2 processes (torchrun, gloo,
CPU) at batch 1 each and is compared with one process at batch 2. LoRA on DDP (3 blocks streamed
in poison mode): the line holds; with rank 1's gradient share scaled by 1.5 before the all-reduce
(tests/check_fault_worker.py) it differs and the check exits 1. A full fine-tune on FSDP2 and on
DeepSpeed ZeRO-2: the losses and the update of the steps hold against the one-process full mode;
with rank 1's AdamW update scaled by 1.5 (tests/check_update_fault_worker.py) each differs, naming
the strategy. And the flags: `check --gpus N` and `train --check --gpus N` hand N to the check; a
full fine-tune with streaming (which `train --gpus N` refuses) is said not to be checked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_lora_rest, tiny_run_toml

from test_check import FULL

from leantune import cli
from leantune.check import processes
from leantune.check.run import run_check
from leantune.config import load_config
from leantune.demo import draw_shapes

# The launches run two processes each: these tests share the worker of the other multi-process tests.
pytestmark = pytest.mark.xdist_group("multiprocess")

TESTS = Path(__file__).resolve().parent
PLAN = "[memory]\nstreamed_blocks = 3\n"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("check_processes_shapes") / "images"
    draw_shapes(folder, count=4, size=64, seed=5)
    return folder


def _cfg(tmp_path, tiny_flux_dir, images):
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(tiny_flux_dir, images, tiny_lora_rest(tmp_path / "out", "t", PLAN)))
    return load_config(p, [f'data.cache_dir="{images.parent / "cache"}"', "data.batch_size=1",
                           'train.device="cpu"'])


def _line(result) -> str:
    found = [line for line in result.lines if line.startswith("several processes (2, ddp")]
    assert len(found) == 1, result.lines
    return found[0]


@pytest.fixture
def one_thread_each(monkeypatch):
    # torchrun gives each of several processes one thread; the launching process's setting is theirs.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.slow
def test_two_processes_hold_against_one_process_with_the_doubled_batch(tmp_path, tiny_flux_dir, images,
                                                                        one_thread_each):
    result = run_check(_cfg(tmp_path, tiny_flux_dir, images), steps=2, emit=print, gpus=2)
    line = _line(result)
    assert result.rc == 0, result.lines
    assert line.startswith("several processes (2, ddp; the whole plan at batch 1 per process, against one "
                           "process at batch 2): held — "), line
    assert result.verdicts["processes"].held and result.verdicts["streaming"].held
    ranks, one = result.records["processes"], result.records["one process"]
    assert len(ranks.losses) == 2 and ranks.grads and all(g is not None for g in ranks.grads[-1].values())
    assert ranks.losses != result.records["reference"].losses       # batch 2 of the ranks, not batch 1
    measured = result.verdicts["processes"].measured
    print("measured", measured)                                      # the numbers docs/check.md states
    assert measured["grad_rel"] <= processes.PROCESSES_TOLERANCE.grad_rel
    assert one.weights.keys() == ranks.weights.keys()


@pytest.mark.slow
def test_a_rank_whose_gradient_share_is_scaled_makes_it_differ(tmp_path, tiny_flux_dir, images, one_thread_each,
                                                              monkeypatch):
    monkeypatch.setattr(processes, "WORKER_MODULE", "check_fault_worker")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    result = run_check(_cfg(tmp_path, tiny_flux_dir, images), steps=2, emit=print, gpus=2)
    line = _line(result)
    assert result.rc == 1, result.lines
    assert ": differs: " in line and "gradients" in line.split("outside")[-1], line
    assert result.verdicts["streaming"].held                       # the one-process variants still hold
    assert result.lines[-1].startswith("check: a technique differs")


# -- full fine-tunes: FSDP2 and DeepSpeed ZeRO-2 --------------------------------------------------------

def _full_cfg(tmp_path, tiny_flux_dir, images, strategy: str, clip: float = 0.0, bf16: bool = False):
    rest = (f'\n[train]\nmode = "full"\nsteps = 2\nlearning_rate = 2e-4\nmixed_precision = "no"\nseed = 3\n'
            f'max_grad_norm = {clip}\n\n[full]\nexclude = ["*norm*"]\n\n[distributed]\nstrategy = "{strategy}"\n\n'
            f'[output]\ndir = "{tmp_path / "out"}"\nname = "t"\n')
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = tmp_path / f"{strategy}.toml"
    p.write_text(tiny_run_toml(tiny_flux_dir, images, rest))
    precision = ['model.dtype="bf16"', 'train.mixed_precision="bf16"'] if bf16 else []
    return load_config(p, [f'data.cache_dir="{images.parent / "cache"}"', "data.batch_size=1",
                           'train.device="cpu"', *precision])


def _strategy_line(result, strategy: str) -> str:
    found = [line for line in result.lines if line.startswith(f"several processes (2, {strategy}; ")]
    assert len(found) == 1, result.lines
    return found[0]


def _full_holds(result, strategy: str) -> str:
    line = _strategy_line(result, strategy)
    assert result.rc == 0, result.lines
    assert ": held — " in line and "updates" in line, line
    ranks, one = result.records["processes"], result.records["one process"]
    assert len(ranks.losses) == 2 and ranks.grads == [{}, {}]          # no rank holds a whole gradient
    assert ranks.weights.keys() == one.weights.keys() == one.before.keys()
    moved = [n for n in one.before if not torch.equal(ranks.weights[n], one.before[n])]
    assert len(moved) == len(one.before)                               # every trained weight was stepped
    measured = result.verdicts["processes"].measured
    print(strategy, "measured", measured)                              # the numbers docs/check.md states
    assert measured["update_rel"] <= processes.FULL_TOLERANCE.update_rel
    return line


@pytest.mark.slow
def test_a_full_fine_tune_on_fsdp2_holds_against_one_process_with_the_doubled_batch(tmp_path, tiny_flux_dir,
                                                                                    images, one_thread_each):
    result = run_check(_full_cfg(tmp_path, tiny_flux_dir, images, "fsdp2"), steps=2, emit=print, gpus=2)
    line = _full_holds(result, "fsdp2")
    assert "max_grad_norm off" not in line, line


@pytest.mark.slow
def test_a_bf16_full_fine_tune_on_zero2_holds_compared_in_fp32_with_clipping_off_in_both(tmp_path, tiny_flux_dir,
                                                                                         images, one_thread_each):
    """A bf16 model under bf16 autocast, clipped, as a real run is: compared in fp32 without
    clipping (in bf16 the same runs differ by 0.65 on the updates without any fault)."""
    pytest.importorskip("deepspeed")
    result = run_check(_full_cfg(tmp_path, tiny_flux_dir, images, "deepspeed", clip=1.0, bf16=True), steps=2,
                       emit=print, gpus=2)
    line = _full_holds(result, "deepspeed ZeRO-2")
    assert "; in fp32 (the run: [model] dtype bf16, [train] mixed_precision bf16;" in line, line
    assert "[train] max_grad_norm off in both: one process clips each parameter" in line, line
    assert result.records["reference"].weights["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert result.records["processes"].weights["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float32


@pytest.mark.slow
def test_a_rank_whose_update_is_scaled_makes_fsdp2_and_zero2_differ(tmp_path, tiny_flux_dir, images,
                                                                    one_thread_each, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setattr(processes, "WORKER_MODULE", "check_update_fault_worker")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    for strategy, named in (("fsdp2", "fsdp2"), ("deepspeed", "deepspeed ZeRO-2")):
        result = run_check(_full_cfg(tmp_path / strategy, tiny_flux_dir, images, strategy), steps=2, emit=print,
                           gpus=2)
        line = _strategy_line(result, named)
        assert result.rc == 1, result.lines
        assert ": differs: " in line and "updates" in line.split("outside")[0].split(";")[-1], line
        assert result.verdicts["processes"].measured["update_rel"] > 100 * processes.FULL_TOLERANCE.update_rel
        assert result.lines[-1].startswith("check: a technique differs")


# -- the flags (no launch) ---------------------------------------------------------------------------

def _faked_check(monkeypatch) -> list:
    """run_check replaced by one that records its process count and fails (so train stops there)."""
    import types

    from leantune.check import run as run_mod

    seen = []
    monkeypatch.setattr(run_mod, "run_check", lambda cfg, *a, gpus=None, **k: seen.append(gpus) or
                        types.SimpleNamespace(rc=1))
    return seen


def test_check_and_train_check_hand_the_process_count_to_the_check(tmp_path, tiny_flux_dir, images, monkeypatch):
    seen = _faked_check(monkeypatch)
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(tiny_flux_dir, images, tiny_lora_rest(tmp_path / "out", "t", PLAN)))
    cpu = ["--set", 'train.device="cpu"']
    assert cli.main(["check", str(p), "--gpus", "2", *cpu]) == 1
    assert cli.main(["train", str(p), "--check", "--gpus", "2", *cpu]) == 1     # not launched: the check failed
    assert cli.main(["check", str(p)]) == 1
    assert seen == [2, 2, None]
    assert cli.main(["check", str(p), "--gpus", "0", *cpu]) == 2                 # refused as train refuses it
    assert seen == [2, 2, None]


def test_a_full_fine_tune_that_train_refuses_on_several_processes_is_said_not_checked(tmp_path, tiny_flux_dir,
                                                                                       images):
    p = tmp_path / "full.toml"
    p.write_text(tiny_run_toml(tiny_flux_dir, images, FULL))            # streams 2 blocks
    why = processes.covered(load_config(p))
    assert why is not None and "(fsdp2)" in why and "`train --gpus N` refuses this config" in why
    assert processes.covered(_cfg(tmp_path, tiny_flux_dir, images)) is None
    (tmp_path / "s").mkdir()
    for strategy in ("fsdp2", "deepspeed"):
        cfg = _full_cfg(tmp_path / "s", tiny_flux_dir, images, strategy)
        assert processes.covered(cfg) is None
    assert processes.strategy_of(cfg) == "deepspeed ZeRO-2"
