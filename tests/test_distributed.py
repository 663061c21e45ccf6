"""Several processes: row sharding, the [distributed] checks, and real 2-process runs (torchrun,
gloo, tiny Flux) against the one-process run with the doubled batch.

Tolerance. Two processes sum their weighted gradients where one process averages a batch, so
results differ only in the order of float additions: losses within rel 1e-4 and LoRA weights
within 1e-4 (fp32, 20 AdamW steps at lr 1e-3) are required; the measured gaps are far below.
"""

import json
import math
import re
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_run_toml
from progress_wait import logged_steps, wait_until
from test_train import RUN_REST as TRAIN_RUN_REST

from leantune.config import ConfigError, load_config
from leantune.data.buckets import BatchOrder
from leantune.demo import draw_shapes
from leantune.distributed import DistContext, ShardedBatches, split_rows, torchrun_command
from leantune.train.state import CheckpointError

ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist these tests share one worker: their launches run two processes each (the cores
# are the other worker's meanwhile) and `accelerate launch` takes its default rendezvous port.
pytestmark = pytest.mark.xdist_group("multiprocess")

# test_train's run (rank-4 LoRA, 20 steps, accumulation 2, caption dropout), saving every 5 steps.
RUN_REST = TRAIN_RUN_REST.split("[output]")[0].replace("save_every = 10", "save_every = 5")


def write_config(folder: Path, model, images, name: str, batch_size: int, out: str, extra: str = "") -> Path:
    """A run config; 5 images at one bucket, so each epoch ends in a one-sample global batch."""
    text = tiny_run_toml(model, images, RUN_REST).replace("batch_size = 2", f"batch_size = {batch_size}")
    text = text.replace('cache_dir = "cache"', f'cache_dir = "{folder}/cache-{name}"')
    text = text.replace("[train]", extra + "\n[train]") if extra.startswith("[memory]") else text + extra
    text += f'\n[output]\ndir = "{out}"\nname = "t"\nformats = ["diffusers"]\n'
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=5, size=64, seed=5)
    return folder


# -- sharding, checks (one process) ------------------------------------------------------------------

@pytest.mark.parametrize("n,world", [(4, 2), (5, 2), (1, 2), (3, 4), (7, 3)])
def test_rows_cover_the_global_batch_once_with_weights_summing_to_one(n, world):
    shards = [split_rows(n, r, world) for r in range(world)]
    real = [s for s in shards if s.weight > 0]
    rows = [i for s in real for i in range(s.start, s.stop)]
    assert rows == list(range(n))
    assert sum(s.weight for s in shards) == pytest.approx(1.0)
    assert all(s.stop - s.start == 1 and s.stop == n for s in shards if s.weight == 0)   # stand-in row


class _Iterator:
    """The part of leantune.data.cache.BatchIterator that ShardedBatches uses."""

    def __init__(self, order):
        self.order = order

    @property
    def epoch(self):
        return self.order.epoch

    def __next__(self):
        slot = next(self.order)
        return type("B", (), {"samples": slot.samples, "bucket": slot.bucket, "dropped": slot.dropped})()

    def state_dict(self):
        return self.order.state_dict()

    def load_state_dict(self, state, strict=True):
        self.order.load_state_dict(state, strict=strict)


def test_ranks_see_disjoint_rows_of_the_one_process_order_with_the_doubled_batch():
    buckets = [(64, 64)] * 5 + [(48, 80)] * 4
    single = BatchOrder(buckets, 4, seed=1, dropout=[0.3] * 9)
    ranks = [ShardedBatches(_Iterator(BatchOrder(buckets, 4, seed=1, dropout=[0.3] * 9)), r, 2) for r in range(2)]
    for _ in range(12):                                   # several epochs
        slot = next(single)
        got = [next(it) for it in ranks]
        assert got[0].bucket == got[1].bucket == slot.bucket
        real = [(b.samples, b.dropped) for b in got if b.shard.weight > 0]
        assert tuple(i for s, _ in real for i in s) == slot.samples
        assert tuple(d for _, d in real for d in d) == slot.dropped
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_distributed_config_combinations_are_refused_by_key():
    from leantune.config import validate

    def check(**sections):
        return validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}, **sections}, "run.toml")

    full = {"mode": "full"}
    with pytest.raises(ConfigError, match=r"run.toml: \[distributed\] strategy = \"fsdp2\" with \[memory\] streamed_blocks"):
        check(train=full, distributed={"strategy": "fsdp2"}, memory={"streamed_blocks": 2})
    with pytest.raises(ConfigError, match=r"zero_stage = 3 with \[memory\] streamed_blocks / stream_non_blocks"):
        check(train=full, distributed={"strategy": "deepspeed", "zero_stage": 3}, memory={"stream_non_blocks": True})
    with pytest.raises(ConfigError, match=r"strategy = \"ddp\" with \[train\] mode = \"full\""):
        check(train=full, distributed={"strategy": "ddp"})
    with pytest.raises(ConfigError, match=r"strategy = 'deepspeed' shards a full fine-tune"):
        check(distributed={"strategy": "deepspeed"})
    with pytest.raises(ConfigError, match="zero_stag.*did you mean 'zero_stage'"):
        check(distributed={"zero_stag": 2})
    assert check(train=full, distributed={"zero_stage": 2}, memory={"streamed_blocks": 2}).distributed.zero_stage == 2



def test_full_mode_on_several_processes_picks_fsdp2_and_refuses_streaming_by_key(monkeypatch):
    from leantune.config import validate
    from leantune.train.modes import make_mode
    from leantune.train.sharded_full import ShardedFullMode

    def cfg(**sections):
        return validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}, "train": {"mode": "full"},
                         **sections}, "run.toml")

    assert type(make_mode(cfg())).__name__ == "FullMode"                   # one process: the fused full mode
    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("LOCAL_RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "2")
    assert isinstance(make_mode(cfg()), ShardedFullMode)                   # auto = fsdp2
    with pytest.raises(ValueError, match=r"\[memory\] streamed_blocks / stream_non_blocks / vram_budget"):
        make_mode(cfg(memory={"streamed_blocks": 2}))
    with pytest.raises(ValueError, match=r"zero_stage = 3: leantune runs DeepSpeed ZeRO-2 only"):
        make_mode(cfg(distributed={"strategy": "deepspeed", "zero_stage": 3}))
    sampled = {"every": 5, "prompts": ["a red square"]}
    with pytest.raises(ValueError, match=r"\[sample\] every = 5 with \[train\] mode = \"full\" sharded by FSDP2"):
        make_mode(cfg(sample=sampled))                                       # rank 0 alone would all-gather
    assert type(make_mode(cfg(sample=sampled, distributed={"strategy": "deepspeed"}))).__name__ == "ZeroFullMode"


def test_one_process_context_is_trivial_and_world_size_change_is_explained():
    ctx = DistContext()
    assert ctx.is_main and not ctx.distributed and ctx.sum(2.5) == 2.5 and ctx.vote(False) is False
    assert ctx.main_first(lambda: 7) == 7 and ctx.agreed_step(lambda: 1.5) == 1.5
    assert ctx.agree_observation(5, 1.0, None) == (5, 1.0, None) and ctx.rank_memory(None) == ""
    with pytest.raises(CheckpointError, match=r"saved by a run on 2 process\(es\); this run has 1.*"
                                               r"allow_world_size_change = true"):
        ctx.check_resume({"world_size": 2}, Path("ckpt/step-000010"), allow_change=False)
    assert ctx.check_resume({"world_size": 2}, Path("x"), allow_change=True) is False
    assert ctx.check_resume({}, Path("x"), allow_change=False) is True        # saved before [distributed]
    cmd = torchrun_command(2, ["train", "a.toml", "--resume"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "leantune",
                       "train", "a.toml", "--resume"]


def test_accelerator_is_made_per_run_and_released_so_runs_of_other_configurations_follow(monkeypatch):
    """One process: the run's Accelerator says rank 0 of 1 on the CPU with the run's mixed
    precision; after close() a second run with another mixed precision gets its own (accelerate's
    singleton would refuse it otherwise) and accelerate's variables are as before."""
    import os

    from accelerate.state import AcceleratorState

    from leantune.config import validate

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    seen = []
    for precision in ("bf16", "no"):
        cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]},
                        "train": {"mixed_precision": precision}}, "run.toml")
        ctx = DistContext.from_config(cfg, torch.device("cpu"))
        acc = ctx.accelerator
        seen.append((ctx.rank, ctx.world_size, ctx.device, acc.mixed_precision, acc.num_processes))
        ctx.close()
        assert ctx.accelerator is None and not AcceleratorState._shared_state
    assert seen == [(0, 1, torch.device("cpu"), "bf16", 1), (0, 1, torch.device("cpu"), "no", 1)]
    assert {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")} == before


SEED_LAUNCH_ENV = {   # what `accelerate launch --config_file` sets for x-flux's DeepSpeed config
    "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
    "ACCELERATE_GRADIENT_CLIPPING": "1.0", "ACCELERATE_MIXED_PRECISION": "bf16",
    "ACCELERATE_CONFIG_DS_FIELDS": "gradient_accumulation_steps,gradient_clipping,offload_optimizer_device,"
                                   "offload_param_device,zero3_init_flag,zero_stage,mixed_precision",
}


def test_accelerate_launch_settings_fill_the_keys_the_toml_leaves_unset(monkeypatch):
    from leantune.accelerate_setup import apply_launch_settings
    from leantune.config import validate

    def cfg(mode="full", **train):
        return validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]},
                         "train": {"mode": mode, "mixed_precision": "no", **train}}, "run.toml")

    plain = cfg()
    assert apply_launch_settings(plain) == (plain, [])                # not launched by accelerate
    for k, v in SEED_LAUNCH_ENV.items():
        monkeypatch.setenv(k, v)
    full, notes = apply_launch_settings(cfg())
    assert full.distributed.strategy == "deepspeed" and full.distributed.zero_stage == 2
    assert not full.distributed.offload_optimizer
    assert (full.train.gradient_accumulation, full.train.max_grad_norm) == (2, 1.0)
    assert full.train.mixed_precision == "no"                     # set in the TOML: the TOML wins, and says so
    text = "\n".join(n for _, n in notes)
    # max_grad_norm 1.0 is leantune's default already: nothing to take over.
    assert 'from the accelerate launch config: [distributed] strategy = "deepspeed", [train] gradient_accumulation = 2\n' \
        in text + "\n"
    assert "[train] mixed_precision = 'no' in the run's TOML overrides accelerate launch's mixed_precision = 'bf16'" in text
    mine, _ = apply_launch_settings(cfg(gradient_accumulation=4))
    assert mine.train.gradient_accumulation == 4 and mine.train.max_grad_norm == 1.0
    lora, notes = apply_launch_settings(cfg(mode="lora"))            # LoRA keeps its own all-reduce
    assert lora.distributed.strategy == "auto" and lora.train.gradient_accumulation == 2
    assert any("a LoRA run reduces its adapter gradients itself" in n for _, n in notes)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "nvme")
    with pytest.raises(ConfigError, match="offload_optimizer_device = 'nvme'"):
        apply_launch_settings(cfg())
    for k in SEED_LAUNCH_ENV:                                      # plain `accelerate launch`: its default
        monkeypatch.delenv(k)                                      # "no" is not a choice
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    bf16 = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}}, "run.toml")
    assert apply_launch_settings(bf16)[0].train.mixed_precision == "bf16"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true"), monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    fsdp, _ = apply_launch_settings(cfg())
    assert fsdp.distributed.strategy == "fsdp2" and fsdp.distributed.fsdp_cpu_offload


def test_deepspeed_finds_the_venvs_ninja_without_an_activated_environment(monkeypatch, tmp_path):
    """DeepSpeed compiles its CPU comm op with `ninja` from PATH; pip puts ninja beside this Python,
    which a plain `.venv/bin/python` (CI, `.venv/bin/leantune`) does not have on PATH."""
    import shutil

    from leantune.accelerate_setup import _ninja_on_path

    beside = Path(sys.executable).parent / "ninja"
    if not beside.exists():
        pytest.skip("no ninja installed beside this Python (pip install ninja)")
    monkeypatch.setenv("PATH", str(tmp_path))                        # no ninja anywhere on PATH
    assert shutil.which("ninja") is None
    _ninja_on_path()
    assert Path(shutil.which("ninja")) == beside
    out = subprocess.run(["ninja", "--version"], capture_output=True, text=True)   # as torch's builder runs it
    assert out.returncode == 0 and out.stdout.strip()


# -- real two-process runs -----------------------------------------------------------------------------

def _env(tmp_path):
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "LEANTUNE_CACHE": str(tmp_path / "calibration")}


def _lora(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "t_diffusers.safetensors"))


def _assert_same_lora(a: dict, b: dict, atol=1e-4, what=""):
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"{what}: largest LoRA weight difference {worst:.2e}")        # the measured gap (pytest -s)
    assert worst <= atol, f"largest LoRA weight difference {worst}"


def _loss_gap(a: list[float], b: list[float], what: str) -> None:
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    print(f"{what}: largest relative loss difference {rel:.2e}")


def test_every_collective_of_the_run_works_under_nccls_device_restriction(tmp_path):
    """Two processes on a group whose device map has no CPU backend (tests/nccl_like.py: NCCL's
    restriction, NCCL's error): every collective the trainer calls (the step's loss sum, the
    gradient vote, gather, the calibration's observation, barrier, the gradient all-reduce, an OOM
    announced by rank 1) works and gives the agreed values on both ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_collectives_worker.py"), str(tmp_path)]
    run = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    errors = {k: v["error"] for r in ranks for k, v in r.items() if isinstance(v, dict) and "error" in v}
    assert not errors, errors
    for r in ranks:
        assert r["sum"] == 4.0 and r["vote"] == [True, False] and r["gather"] == [0.0, 10.0]
        assert r["observation"] == [101, 2.0, {"r": 0}] and r["barrier"] == "ok"
        assert r["sync_gradients"] == [[3.0, 3.0, 3.0], [0.0, 0.0]] and r["step_total"] == 2.0
    assert ranks[0]["main_first"] == 0 and ranks[1]["main_first"] == 1
    assert ranks[0]["agreed_step"] == "RankOutOfMemory" and ranks[1]["agreed_step"] == "OutOfMemoryError"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_flux_dir, images):
    """One process, batch_size 2: what two processes with batch_size 1 must reproduce."""
    from leantune.trainer import train

    tmp = tmp_path_factory.mktemp("reference")
    cfg = load_config(write_config(tmp, tiny_flux_dir, images, "ref", 2, str(tmp / "out")))
    result = train(cfg, progress=False)
    return SimpleNamespace(losses=result.losses, lora=_lora(tmp / "out"), cache=tmp / "cache-ref")


def _use_cache(config: Path, cache: Path) -> None:
    """Point a config at a cache another run filled (the entries are keyed by their inputs, so a
    run whose claim is not about caching skips the encoders' loading: seconds in each launch)."""
    text, n = re.subn(r'^cache_dir = ".*"$', f'cache_dir = "{cache}"', config.read_text(), flags=re.M)
    assert n == 1
    config.write_text(text)


def _tail(run) -> str:
    return run.stdout[-3000:] + run.stderr[-6000:]


def _once_per_run(tmp_path_factory, name: str, make) -> tuple[Path, dict]:
    """(folder, result): `make(folder)` run once per test run and its JSON result shared by every
    pytest-xdist worker that asks (one that finds it being made waits for it), so a launch several
    tests read is made once even when those tests land on different workers."""
    import fcntl

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    folder, result = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            folder.mkdir(exist_ok=True)
            result.write_text(json.dumps(make(folder)))
    return folder, json.loads(result.read_text())


def _ran(run) -> dict:
    return {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr}


def _free_port() -> int:
    """A port for `accelerate launch` (its default, 29500, would collide with another launch)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lora_launch(tmp_path_factory, tiny_flux_dir, images):
    """One torchrun launch (2 ranks, gloo with NCCL's device restriction) of tests/dist_worker.py
    whose outputs three tests read, in turn: the LoRA runs "plain", "streamed" (2 streamed blocks per
    rank) and "oom" (rank 1 out of memory in step 3), 20 steps each; "probe" (the ranks' GPUs
    report different free VRAM, 2 steps); and "optstep" (rank 1's first optimizer step out of
    memory, after the gradient vote), which ends the processes and so comes last. One launch pays
    the processes' start, imports and caches once instead of three times; dist_worker undoes each
    config's patches before the next, and records each config's results when it ends."""
    tmp, got = _once_per_run(tmp_path_factory, "lora_launch", lambda tmp: _lora_launch(tmp, tiny_flux_dir, images))
    return SimpleNamespace(folder=tmp, run=SimpleNamespace(**got["run"]), ranks=got["ranks"])


def _lora_launch(tmp: Path, tiny_flux_dir, images) -> dict:
    plain = write_config(tmp, tiny_flux_dir, images, "plain", 1, str(tmp / "plain"))
    streamed = write_config(tmp, tiny_flux_dir, images, "streamed", 1, str(tmp / "streamed"),
                            "[memory]\nstreamed_blocks = 2\ndebug_poison = true\n")
    oom = write_config(tmp, tiny_flux_dir, images, "oom", 1, str(tmp / "oom"), "[memory]\nvram_budget = \"8GiB\"\n")
    probe = write_config(tmp, tiny_flux_dir, images, "probe", 1, str(tmp / "probe"),
                         "[memory]\nvram_budget = \"auto\"\n")
    optstep = write_config(tmp, tiny_flux_dir, images, "optstep", 1, str(tmp / "optstep"),
                           "[memory]\nvram_budget = \"8GiB\"\n")
    for p, steps in ((probe, 2), (optstep, 3)):
        p.write_text(p.read_text().replace("steps = 20", f"steps = {steps}"))
    for p in (streamed, oom, probe, optstep):           # share the cache filled by the first run
        p.write_text(p.read_text().replace(f"cache-{p.stem}", "cache-plain"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_worker.py"), str(tmp), *map(str, (plain, streamed, oom, probe, optstep))]
    run = subprocess.run(cmd, env=_env(tmp), capture_output=True, text=True, timeout=900)
    files = [tmp / f"rank{r}.json" for r in range(2)]
    return {"run": _ran(run), "ranks": [json.loads(f.read_text()) if f.exists() else {} for f in files]}


@pytest.mark.slow
def test_two_processes_match_one_with_the_doubled_batch_plain_streamed_and_after_an_oom(lora_launch, reference):
    """torchrun, 2 ranks, gloo: plain DDP LoRA, the same with 2 streamed blocks per rank, and a run
    where rank 1 runs out of memory in step 3: all equal the one-process run; the caches are filled
    by rank 0 alone; after the OOM both ranks re-plan and redo the step. (The launch's last config,
    test_an_oom_after_the_gradient_vote..., ends it non-zero: these runs and the probe's finished on
    both ranks when each rank wrote its results.)"""
    ref_losses, ref_lora = reference.losses, reference.lora
    run, ranks, tmp = lora_launch.run, lora_launch.ranks, lora_launch.folder
    for r in ranks:
        assert {"plain", "streamed", "oom", "probe"} <= set(r), _tail(run)
    for name in ("plain", "streamed", "oom"):
        for r in ranks:
            assert r[name]["losses"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), name
        _loss_gap(ranks[0][name]["losses"], ref_losses, name)
        _assert_same_lora(_lora(tmp / name), ref_lora, what=name)
    # Counters are cumulative over the three runs: rank 0 encoded once, rank 1 never loaded an encoder.
    assert ranks[0]["oom"]["vae"] == 1 and ranks[0]["oom"]["text_encoders"] == 1
    assert ranks[1]["oom"]["vae"] == 0 and ranks[1]["oom"]["text_encoders"] == 0
    assert ranks[0]["plain"]["files"] and not ranks[1]["plain"]["files"]      # rank 0 saves
    assert ranks[0]["oom"]["replans"] == ranks[1]["oom"]["replans"] == 1
    assert "out of memory at step 3" in run.stderr and "[rank 1]" in run.stderr
    log = (tmp / "oom" / "train.log").read_text()
    assert "memory plan now: stream 1" in log and "per rank: rss" in log


@pytest.mark.slow
def test_an_oom_after_the_gradient_vote_ends_the_run_on_every_rank_without_a_hang(lora_launch):
    """Rank 1's first optimizer step runs out of memory (AdamW allocating its state), after both
    ranks agreed on the step's gradients: rank 0 has stepped already, so redoing the step on rank 1
    alone would diverge the weights, and its vote would meet rank 0's loss sum. Both ranks end
    (no hang, no garbage vote) naming the step and the reason. (The last config of lora_launch: the
    configs before it finished on both ranks; this one on neither.)"""
    run, ranks = lora_launch.run, lora_launch.ranks
    assert run.returncode != 0, _tail(run)
    for r in (0, 1):
        assert f"rank {r}: step 1 failed after the ranks agreed on its gradients" in run.stderr, run.stderr[-6000:]
    assert "rank 1 failed after the gradient vote" in run.stderr
    assert all("probe" in r and "optstep" not in r for r in ranks), [sorted(r) for r in ranks]


@pytest.mark.slow
def test_ranks_whose_gpus_report_different_free_vram_plan_once_and_alike(lora_launch):
    """[memory] vram_budget = "auto" with rank 0's GPU showing 10 GiB free and rank 1's 3 GiB:
    different plans would break the shared host copy and the ranks' common re-plans, so the run
    decides one plan, for the tightest GPU, and every rank uses it. (A config of lora_launch.)"""
    assert all("probe" in r for r in lora_launch.ranks), _tail(lora_launch.run)
    ranks = [r["probe"] for r in lora_launch.ranks]
    assert ranks[0]["budgets"] and ranks[0]["budgets"] == ranks[1]["budgets"], [r["budgets"] for r in ranks]
    assert ranks[0]["plans"] == ranks[1]["plans"]
    assert max(ranks[0]["budgets"]) <= 3 * 2**30                   # the tightest GPU's free VRAM


def _cpu_unless_two_gpus() -> list[str]:
    """`--gpus 2` runs two CPU processes only when asked (commands/train.py check_gpus)."""
    return [] if torch.cuda.device_count() >= 2 else ["--set", "train.device=cpu"]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and _state(pid) not in ("Z", "gone")


def _until_saved(launcher, ckpts: Path, step: int) -> None:
    wait_until((ckpts / f"step-{step:06d}" / "state.json").exists,
               lambda: logged_steps(ckpts.parent / "train.log"), what=f"the save at step {step}",
               alive=lambda: launcher.poll() is None,
               detail=lambda: launcher.stderr.read()[-4000:] if launcher.poll() is not None else "")


@pytest.fixture(scope="module")
def gpus_launches(tmp_path_factory, tiny_flux_dir, images, reference):
    """The reference's run (20 steps, saves every 5) on 2 processes, stopped twice and finished by
    a third launch; three tests read what each launch did:
      1. `leantune train --gpus 2` (torchrun), rank 1 killed (kill -9) after the step-5 save;
      2. `--gpus 2 --resume`, the launcher killed (kill -9) after its first save (step 10 where launch 1 saved last at 5);
      3. `accelerate launch --multi_gpu --num_processes 2 -m leantune train --resume` to step 20.
    Three launches where the tests had four (and a fifth that only ran 2 steps): each stop is the
    end of a launch, and every resume continues the run the reference must equal. The reference's
    cache serves them (rank 0 filling the cache for the other ranks is lora_launch's check)."""
    tmp, got = _once_per_run(tmp_path_factory, "gpus", lambda tmp: _gpus_launches(tmp, tiny_flux_dir, images,
                                                                               reference.cache))
    return SimpleNamespace(**{**got, "resumed": SimpleNamespace(**got["resumed"]), "cfg": tmp / "run.toml",
                              "out": tmp / "out"})


def _gpus_launches(tmp: Path, tiny_flux_dir, images, cache: Path) -> dict:
    from leantune.train.state import latest_checkpoint, load_checkpoint

    cfg = write_config(tmp, tiny_flux_dir, images, "run", 1, str(tmp / "out"))
    _use_cache(cfg, cache)
    env, ckpts, log = _env(tmp), tmp / "out" / "checkpoints", tmp / "out" / "train.log"
    base = [sys.executable, "-m", "leantune", "train", str(cfg), "--gpus", "2", "--no-progress", *_cpu_unless_two_gpus()]
    got = {"calibration": env["LEANTUNE_CACHE"]}
    launcher = None
    try:
        # 1. kill -9 of rank 1 mid-run
        launcher = subprocess.Popen(base, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _until_saved(launcher, ckpts, 5)
        got["died_workers"] = workers = sorted(_children(launcher.pid))
        got["rank1"] = rank1 = next(p for p in workers if "RANK=1\0" in Path(f"/proc/{p}/environ").read_text())
        os.kill(rank1, signal.SIGKILL)
        got["died_err"] = launcher.communicate(timeout=120)[1]
        got["died_rc"] = launcher.returncode
        step, state = load_checkpoint(latest_checkpoint(ckpts))
        got["died_last_save"] = [step, state["world_size"]]
        # 2. `--resume` on `--gpus 2`, then kill -9 of the launcher
        launcher = subprocess.Popen(base + ["--resume"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
        # this launch's own next save: on a busy machine launch 1's rank 0 may have saved step 10
        # before rank 1's kill reached it, and waiting for that file would kill a launcher that has
        # no workers yet
        _until_saved(launcher, ckpts, step + 5)
        got["killed_workers"] = workers = _children(launcher.pid)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        try:                                            # the workers die with their launcher
            wait_until(lambda: not any(_alive(p) for p in workers), what="the workers' end", limit_s=30, poll_s=0.1)
            got["outlived"] = []
        except AssertionError:
            got["outlived"] = [p for p in workers if _alive(p)]
            for p in got["outlived"]:
                os.kill(p, signal.SIGKILL)
        got["final_after_kill"] = (tmp / "out" / "t_diffusers.safetensors").exists()
        # 3. `accelerate launch` resumes to the end
        before = len(log.read_text()) if log.exists() else 0
        accelerate = Path(sys.executable).with_name("accelerate")
        got["resumed"] = _ran(subprocess.run(
            [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(_free_port()),
             "-m", "leantune", "train", str(cfg), "--resume", "--no-progress", *_cpu_unless_two_gpus()],
            env=env, capture_output=True, text=True, timeout=900))
        got["accelerate_log"] = log.read_text()[before:]
    finally:
        if launcher is not None and launcher.poll() is None:
            for p in _children(launcher.pid):
                os.kill(p, signal.SIGKILL)
            launcher.kill()
            launcher.wait()
    return got


@pytest.mark.slow
def test_gpus_shortcut_resumes_exactly_after_kill_9_of_the_launcher(gpus_launches, reference, monkeypatch, capsys):
    """`leantune train --gpus 2` becomes torchrun; kill -9 of it ends the workers too; `--resume`
    on 2 processes finishes with the uninterrupted result; 1 process is refused with the reason.
    (gpus_launches 2 and 3: the `--gpus 2 --resume` launch that is killed continues from the save
    left by launch 1, the `accelerate launch` resume from its step-10 save: the result at step 20
    shows both resumed exactly.)"""
    from leantune.cli import main

    ref_losses, ref_lora = reference.losses, reference.lora
    got = gpus_launches
    assert len(got.killed_workers) == 2
    assert not got.outlived, f"workers {got.outlived} outlived their launcher"
    assert not got.final_after_kill
    assert got.resumed.returncode == 0, got.resumed.stderr[-4000:]
    history = json.loads((got.out / "loss.json").read_text())
    assert history["step"] == 20 and history["loss"] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
    _loss_gap(history["loss"], ref_losses, "killed and resumed")
    _assert_same_lora(_lora(got.out), ref_lora, what="killed and resumed")
    # One process: `python -m leantune` is `sys.exit(main())`, and its launches are the ones above.
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LEANTUNE_CACHE", got.calibration)
    capsys.readouterr()
    assert main(["train", str(got.cfg), "--resume", "--no-progress"]) == 1
    assert "saved by a run on 2 process(es); this run has 1" in capsys.readouterr().err


@pytest.mark.slow
def test_accelerate_launch_runs_two_processes(gpus_launches):
    """`accelerate launch --multi_gpu --num_processes 2 -m leantune train` (gloo on this CPU machine):
    two ranks train, rank 0 writes the log with both ranks' memory and the LoRA files. (gpus_launches
    3: it resumes steps 11-20; its part of the log is read.)"""
    run = gpus_launches.resumed
    assert run.returncode == 0, run.stderr[-4000:]
    log = gpus_launches.accelerate_log
    assert "step 20 loss" in log and re.search(r"per rank: rss \d+\.\d+ \d+\.\d+ GiB", log)
    assert run.stdout.count("LoRA files:") == 1 and (gpus_launches.out / "t_diffusers.safetensors").exists()


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_run_and_leaves_the_last_save_intact(gpus_launches):
    """kill -9 of rank 1 mid-run: the launcher stops rank 0 too (no hang), exits non-zero naming the
    rank, the signal and the intact last save, without torchrun's raw report; that save loads.
    (gpus_launches 1.)"""
    got = gpus_launches
    assert len(got.died_workers) == 2
    err = got.died_err
    assert got.died_rc != 0
    assert f"rank 1 (pid {got.rank1}) was killed by SIGKILL" in err and "is intact" in err and "--resume" in err
    assert "ChildFailedError" not in err and "Traceback" not in err, err
    step, world_size = got.died_last_save
    assert step >= 5 and world_size == 2


# -- one host copy of the streamed weights -------------------------------------------------------------

def test_streamed_weights_shared_between_a_leader_and_a_follower_compute_the_plain_outputs(tmp_path):
    """Two models (as two processes would hold): the leader packs its streamed blocks into files,
    the follower points its weights at the same pages without copying; both compute the plain
    model's outputs, a byte the leader's buffer changes is seen by the follower, and the files'
    names are gone after unlink."""
    import copy

    from test_memory_helpers import lora_flux, make_batch

    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.memory.shared_host import SharedHostBuffers
    from leantune.models.flux import FLUX_SPEC, predict

    base = lora_flux(seed=0)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=7)
    with torch.no_grad():
        want = predict(copy.deepcopy(base), x, sigma, embeds, hw, guidance=3.5)
    plan = Plan(streamed_blocks=("transformer_blocks.0", "single_transformer_blocks.1"), ring_slots=2)
    leader, follower = (SharedHostBuffers("t1", leader=True, folder=tmp_path),
                        SharedHostBuffers("t1", leader=False, folder=tmp_path))
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ha = apply_memory(a, FLUX_SPEC, plan, "cpu", host_buffers=leader)
    hb = apply_memory(b, FLUX_SPEC, plan, "cpu", host_buffers=follower)
    assert len(list(tmp_path.iterdir())) == 2 and follower.mapped_bytes == leader.mapped_bytes > 0
    ua, ub = ha.streaming.units[0], hb.streaming.units[0]
    assert ua.host.data_ptr() != ub.host.data_ptr() and torch.equal(ua.host, ub.host)
    with torch.no_grad():
        for model in (a, b):
            assert torch.equal(predict(model, x, sigma, embeds, hw, guidance=3.5), want)
        saved = ua.host[100].item()
        ua.host[100] = (saved + 1) % 256               # one mapping, two processes' views of it
        assert ub.host[100].item() == (saved + 1) % 256
        ua.host[100] = saved
    leader.unlink()
    assert not list(tmp_path.iterdir())
    with torch.no_grad():
        assert torch.equal(predict(b, x, sigma, embeds, hw, guidance=3.5), want)   # mappings outlive the names
    ha.remove(), hb.remove()


def test_shared_buffers_fall_back_to_private_copies_without_room(tmp_path, monkeypatch):
    from leantune.memory import shared_host

    monkeypatch.setattr(shared_host, "_free_bytes", lambda folder: 1000)
    leader = shared_host.SharedHostBuffers("t2", leader=True, folder=tmp_path)
    assert leader.buffer("transformer_blocks.0", 4096) is None
    assert shared_host.SharedHostBuffers("t2", leader=False, folder=tmp_path).buffer("transformer_blocks.0", 4096) is None
    assert "1 block(s) private" in leader.describe()


# -- full fine-tune, FSDP2 --------------------------------------------------------------------------------

FULL_REST = """
[train]
mode = "full"
steps = 6
learning_rate = 1e-4
mixed_precision = "no"
max_grad_norm = 0
save_every = 3
seed = 3
gradient_accumulation = 2

[full]
exclude = ["*norm*"]
"""


def write_full_config(folder: Path, model, images, name: str, batch_size: int, out: str, extra: str = "") -> Path:
    text = tiny_run_toml(model, images, FULL_REST + extra).replace("batch_size = 2", f"batch_size = {batch_size}")
    text = text.replace('cache_dir = "cache"', f'cache_dir = "{folder}/cache-{name}"')
    text += f'\n[output]\ndir = "{out}"\nname = "m"\n'
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_fsdp2_and_zero2_full_fine_tunes_on_two_processes_match_one_process_and_an_oom_ends_the_run(
        tmp_path, tiny_flux_dir, images):
    """[train] mode = "full" on 2 processes against the one-process full mode (per-parameter AdamW
    inside backward) with the doubled batch: FSDP2 (every block and the root sharded, torch AdamW on
    the shards), and DeepSpeed ZeRO-2 through the run's Accelerator (gradients and AdamW states
    partitioned) stopped after 3 steps and resumed, and ZeRO-2 with the optimizer offloaded to host
    RAM (the run's AdamW steps the fp32 partitions on the CPU). Same losses and the same exported
    model, within 1e-4. Then an FSDP2 run where rank 1 runs out of memory in step 5: both processes end (no hang)
    with the reason, and the step-3 save is intact."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from leantune.train.state import latest_checkpoint, load_checkpoint
    from leantune.trainer import train

    ref_cfg = load_config(write_full_config(tmp_path, tiny_flux_dir, images, "fullref", 2, str(tmp_path / "ref")))
    ref = train(ref_cfg, progress=False)
    fsdp = write_full_config(tmp_path, tiny_flux_dir, images, "fsdp", 1, str(tmp_path / "fsdp"))
    zero = write_full_config(tmp_path, tiny_flux_dir, images, "zero2_resume", 1, str(tmp_path / "zero2_resume"),
                             '\n[distributed]\nstrategy = "deepspeed"\n')
    offload = write_full_config(tmp_path, tiny_flux_dir, images, "zero2offload", 1, str(tmp_path / "zero2offload"),
                                '\n[distributed]\nstrategy = "deepspeed"\noffload_optimizer = true\n')
    oom = write_full_config(tmp_path, tiny_flux_dir, images, "oomfull", 1, str(tmp_path / "oomfull"))
    for p in (fsdp, zero, offload, oom):          # the cache the one-process run filled
        _use_cache(p, tmp_path / "cache-fullref")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_worker.py"), str(tmp_path), "--plain-gloo", str(fsdp), str(zero), str(offload),
           str(oom)]
    run = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert run.returncode != 0, "rank 1's out-of-memory error must end the run"
    assert "rank 1: out of memory in step 5 of a full fine-tune on 2 processes (fsdp2)" in run.stderr, \
        run.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    a = load_file(str(tmp_path / "ref" / "m_comfyui.safetensors"))
    for name, marker in (("fsdp", "full (fsdp2)"), ("zero2_resume", "full (deepspeed ZeRO-2)"),
                         ("zero2offload", "optimizer offload cpu")):
        for r in ranks:
            assert r[name]["losses"] == pytest.approx(ref.losses, rel=1e-4, abs=1e-6), name
        b = load_file(str(tmp_path / name / "m_comfyui.safetensors"))
        assert a.keys() == b.keys()
        worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        _loss_gap(ranks[0][name]["losses"], ref.losses, name)
        print(f"{name}: largest weight difference {worst:.2e}")
        assert worst <= 1e-4, (name, worst)
        assert (tmp_path / name / "checkpoints" / "step-000006" / "state.json").exists()
        assert marker in (tmp_path / name / "train.log").read_text()
    assert all("oomfull" not in r for r in ranks)
    step, state = load_checkpoint(latest_checkpoint(tmp_path / "oomfull" / "checkpoints"))
    assert step == 3 and state["world_size"] == 2 and state["losses"] == pytest.approx(ref.losses[:3], rel=1e-4)


SEED_ACCELERATE_CONFIG = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


@pytest.mark.slow
def test_zero2_full_fine_tune_from_the_seed_accelerate_config_as_written(tmp_path, tiny_flux_dir, images):
    """The x-flux accelerate config file (DEEPSPEED, zero_stage 2, offload_optimizer_device none,
    bf16, gradient_accumulation_steps 2, gradient_clipping 1.0; 8 processes, overridden to 2 on the
    command line) with `accelerate launch --config_file ... -m leantune train` and a bf16 full-mode
    TOML that leaves those keys unset: the run takes them over, DeepSpeed's engine (made by the
    run's Accelerator) reports them, and it trains on 2 CPU processes (finite losses, every trained
    weight of the saved state moved off the base)."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from leantune.cli import main
    from leantune.train.state import latest_checkpoint, load_checkpoint

    seed = tmp_path / "accelerate_config.yaml"
    seed.write_text(SEED_ACCELERATE_CONFIG)
    rest = '\n[train]\nmode = "full"\nsteps = 3\nlearning_rate = 1e-3\nseed = 3\n\n[full]\nexclude = ["*norm*"]\n'
    text = tiny_run_toml(tiny_flux_dir, images, rest).replace('dtype = "fp32"', 'dtype = "bf16"')
    text = text.replace('cache_dir = "cache"', f'cache_dir = "{tmp_path}/cache"')
    cfg = tmp_path / "seed.toml"
    cfg.write_text(text + f'\n[output]\ndir = "{tmp_path / "out"}"\nname = "m"\n')
    assert main(["cache", str(cfg)]) == 0          # filled here: the launch's rank 0 loads no encoder
    accelerate = Path(sys.executable).with_name("accelerate")
    run = subprocess.run([str(accelerate), "launch", "--config_file", str(seed), "--num_processes", "2",
                          "--main_process_port", str(_free_port()), "-m", "leantune", "train", str(cfg), "--no-progress"],
                         env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    log = (tmp_path / "out" / "train.log").read_text()
    assert 'from the accelerate launch config: [distributed] strategy = "deepspeed", [train] gradient_accumulation = 2' \
        in log
    assert ("full (deepspeed ZeRO-2)" in log and "over 2 processes; bf16 on, gradient accumulation 2, clipping 1, "
            "optimizer offload none") in log
    history = json.loads((tmp_path / "out" / "loss.json").read_text())
    assert history["step"] == 3 and all(math.isfinite(x) for x in history["loss"])
    step, state = load_checkpoint(latest_checkpoint(tmp_path / "out" / "checkpoints"))
    base = load_file(str(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    trained = state["trainable"]
    assert step == 3 and trained and set(trained) <= set(base)
    unmoved = [k for k, v in trained.items() if torch.equal(v.to(base[k].dtype), base[k])]
    assert all(torch.isfinite(v).all() for v in trained.values()) and not unmoved, unmoved[:5]


# -- planner: per process and machine ----------------------------------------------------------------------

def test_per_rank_numbers_count_the_shared_streamed_blocks_once():
    from leantune.memory.plan import Plan
    from leantune.planner.ranks import per_rank

    g = 2**30
    host = {"process baseline": 2 * g, "transformer while loading": 22 * g,
            "transformer while converting to fp8": 0, "stored transformer + one unit while packing": 23 * g,
            "streamed blocks (pinned)": 18 * g, "staging buffers": 0, "offloaded activations": 2 * g, "caches": 0}
    plan = Plan(notes={"predicted_peak_vram": 7 * g, "host_breakdown": host})
    shared, private = per_rank(plan, 4, 100, shared=True), per_rank(plan, 4, 100, shared=False)
    assert shared["vram per process"] == 7 * g + 100
    assert shared["host per process"] == 22 * g
    assert shared["host machine steady"] == 4 * 4 * g + 18 * g
    assert private["host machine steady"] == 4 * 22 * g
    # In turns (default): while the 4th process loads (2 + 23), 3 are steady (2 + 2 own each) and the
    # streamed blocks exist once (shared) or 3 times (private). At once: 4 loading peaks.
    assert shared["host machine loading"] == 3 * 4 * g + 18 * g + 25 * g == shared["host machine peak"]
    assert private["host machine loading"] == 3 * 4 * g + 3 * 18 * g + 25 * g == private["host machine peak"]
    at_once = per_rank(plan, 4, 100, shared=True, turns=False)
    assert at_once["host machine loading"] == 4 * 25 * g == at_once["host machine peak"]
    assert per_rank(plan, 1, 100)["vram per process"] == 7 * g


def test_plan_gpus_prints_per_process_and_machine_numbers(capsys):
    from leantune.cli import main

    assert main(["plan", "--model", "flux-dev", "--rank", "16", "--resolution", "512", "--vram", "8GiB",
                 "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 processes (ddp, one shared host copy of the streamed blocks, loading in turns)" in out
    assert "VRAM per process (predicted peak)" in out and "host RAM, machine, during steps" in out
    assert main(["plan", "--model", "flux-dev", "--vram", "8GiB", "--gpus", "2", "--strategy", "fsdp2"]) == 2
    assert "--strategy fsdp2: shards a full fine-tune; LoRA training uses ddp" in capsys.readouterr().err


def test_deepspeed_config_from_the_run_matches_the_seed_report_setup(tmp_path):
    """x-flux's accelerate config (zero_stage 2, offload_optimizer_device none, bf16, gradient
    accumulation 2, clipping 1.0) in leantune's keys gives that DeepSpeed config; a JSON file
    named by [distributed] deepspeed_config is used as written."""
    from leantune.config import validate
    from leantune.accelerate_setup import deepspeed_config

    cfg = validate({"model": {"path": "m", "dtype": "bf16"}, "data": {"datasets": [{"path": "d"}], "batch_size": 1},
                    "train": {"mode": "full", "gradient_accumulation": 2, "max_grad_norm": 1.0,
                              "mixed_precision": "bf16"},
                    "distributed": {"strategy": "deepspeed", "zero_stage": 2, "offload_optimizer": False}},
                   "run.toml", base_dir=tmp_path)
    ds = deepspeed_config(cfg, 2)
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    assert ds["bf16"] == {"enabled": True}
    assert ds["gradient_accumulation_steps"] == 2 and ds["gradient_clipping"] == 1.0
    assert ds["train_micro_batch_size_per_gpu"] == 1 and ds["train_batch_size"] == 4
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 2}, "train_batch_size": 8}')
    own = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"deepspeed_config": "ds.json"})})
    assert deepspeed_config(own, 2) == {"zero_optimization": {"stage": 2}, "train_batch_size": 8}
