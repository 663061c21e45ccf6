"""Issue 40: what a GPU and NCCL would break that plain CPU runs do not show, emulated on the CPU
(a default group with no CPU backend, a device with fewer GPUs than the save saw, ...). What only a
GPU can show is in bench/gpu_checks.sh."""

from __future__ import annotations

import datetime
import os
import types

import pytest
import torch
import torch.distributed as dist

from leantune import distributed as ltd


@pytest.fixture
def one_rank_gloo(tmp_path):
    """A one-process gloo default group (destroyed after the test)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- finding 2: the host-side gloo group gets [distributed] timeout_minutes --------------------------

def test_the_host_group_beside_an_nccl_default_gets_the_runs_timeout(one_rank_gloo, monkeypatch):
    monkeypatch.setattr(ltd, "_serves", lambda group, device_type: False)    # as under NCCL alone
    group = ltd.host_group_for_default(90)
    assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(minutes=90)


def test_from_config_passes_timeout_minutes_to_the_host_group(monkeypatch):
    from leantune import accelerate_setup
    from leantune.config import validate

    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]},
                    "distributed": {"timeout_minutes": 240}}, "run.toml")
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ltd, "die_with_launcher", lambda: None)
    fake = types.SimpleNamespace(state=types.SimpleNamespace(backend="nccl"), num_processes=2, process_index=0,
                                 local_process_index=0, device=torch.device("cpu"))
    monkeypatch.setattr(accelerate_setup, "make_accelerator", lambda *a, **k: (fake, {}))
    asked = []
    monkeypatch.setattr(ltd, "host_group_for_default", lambda *a, **k: asked.append((a, k)))
    ltd.DistContext.from_config(cfg, torch.device("cpu"))
    assert asked == [((240,), {})]


# -- finding 9: CUDA's random state is the run's device's only ----------------------------------------

class _FakeCuda:
    """`count` visible GPUs, each with its own random state; an index past them is refused as CUDA
    refuses it ("invalid device ordinal"), by torch's own `*_all` functions too."""

    def __init__(self, monkeypatch, count: int, current: int = 0):
        self.states = [torch.tensor([10 * i + 1, 10 * i + 2], dtype=torch.uint8) for i in range(count)]
        self.current = current
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: count)
        monkeypatch.setattr(cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(cuda, "get_rng_state", self.get)
        monkeypatch.setattr(cuda, "set_rng_state", self.set)
        monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [self.get(i) for i in range(count)])
        monkeypatch.setattr(cuda, "set_rng_state_all", lambda sts: [self.set(s, i) for i, s in enumerate(sts)])

    def _index(self, device):
        i = self.current if device == "cuda" else (device.index if isinstance(device, torch.device) else int(device))
        if not 0 <= i < len(self.states):
            raise IndexError(f"CUDA error: invalid device ordinal {i}")
        return i

    def get(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def set(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()


def test_a_save_from_more_gpus_than_visible_resumes_on_the_runs_device(monkeypatch):
    from leantune.train.state import rng_state, set_rng_state

    gen = torch.Generator().manual_seed(3)
    four = _FakeCuda(monkeypatch, count=4, current=2)
    saved = rng_state(gen)                                     # a rank on the third of four GPUs
    one = _FakeCuda(monkeypatch, count=1)                      # resumed where one GPU is visible
    set_rng_state(saved, gen)
    assert torch.equal(one.states[0], four.states[2])
    # A save of the earlier layout (every visible GPU's state, a list of four) resumes as well.
    old = {**saved, "cuda": [torch.full((2,), 50 + i, dtype=torch.uint8) for i in range(4)]}
    set_rng_state(old, gen, torch.device("cuda", 0))
    assert one.states[0].tolist() == [50, 50]
    again = _FakeCuda(monkeypatch, count=4, current=3)         # the run's device named: its state, not the current's
    assert torch.equal(rng_state(gen, torch.device("cuda", 1))["cuda"], again.states[1])
    # A CPU run keeps no CUDA state even where CUDA is there.
    assert "cuda" not in rng_state(gen, torch.device("cpu"))


# -- finding 4: cuDNN attention is off for every CUDA command, caching and sampling too ----------------

@pytest.mark.parametrize("cuda_visible", [True, False])
def test_every_command_starts_with_cudnn_attention_off_where_a_gpu_is_visible(monkeypatch, cuda_visible):
    from leantune import cli
    from leantune.commands import cache
    from leantune.memory import attention_kernels

    monkeypatch.setattr(attention_kernels, "_done", False)
    monkeypatch.delenv("LEANTUNE_CUDNN_SDP", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_visible)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    seen = []
    monkeypatch.setattr(cache, "run", lambda args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        assert cli.main(["cache", "run.toml"]) == 0           # `leantune cache` encodes before any plan
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    assert seen == [not cuda_visible]


# -- finding 7: a rank's loading turn uses the machine's cores, not torchrun's one thread -------------

def test_a_loading_turn_runs_on_every_core_and_then_gives_them_back(monkeypatch):
    ctx = ltd.DistContext(rank=1, world_size=2, local_rank=1, local_world_size=2, strategy="ddp")
    monkeypatch.setattr(ctx, "gather", lambda value: [value, value])
    monkeypatch.setattr(ctx, "barrier", lambda: None)
    monkeypatch.setattr(ltd, "machine_cores", lambda: 4, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)                                  # torchrun's OMP_NUM_THREADS=1
    try:
        seen = ctx.local_turns(lambda: torch.get_num_threads())
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert (seen, after) == (4, 1)


# -- finding 1: FSDP2 with fsdp_cpu_offload under NCCL: CPU shards need a CPU backend in the group ----

def _make_accelerator_backend(monkeypatch, **distributed) -> str:
    import accelerate

    from leantune import accelerate_setup
    from leantune.config import validate

    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}, "train": {"mode": "full"},
                    "distributed": distributed}, "run.toml")
    asked = {}

    def fake(**kwargs):
        asked.update(kwargs)
        return "accelerator"

    monkeypatch.setattr(accelerate, "Accelerator", fake)
    _, saved = accelerate_setup.make_accelerator(cfg, torch.device("cuda", 0), "fsdp2", 2)
    accelerate_setup.release_accelerator(saved)
    return asked["kwargs_handlers"][0].backend


def test_fsdp2_with_cpu_offload_starts_its_group_with_a_cpu_backend_beside_nccl(monkeypatch):
    assert _make_accelerator_backend(monkeypatch, strategy="fsdp2", fsdp_cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert _make_accelerator_backend(monkeypatch, strategy="fsdp2") == "nccl"


@pytest.mark.xdist_group("multiprocess")
def test_offloaded_shards_clip_and_gather_over_the_group_an_nccl_run_starts(tmp_path):
    """torchrun, 2 ranks: the group `group_backend` starts for FSDP2 + fsdp_cpu_offload under NCCL
    (NCCL emulated without a CPU backend, tests/nccl_like.py) carries the clipping norm and the
    save's full_tensor() of CPU DTensor shards."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "tests" / "dist_offload_worker.py"), str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in seen, seen
        assert seen["norm"] == pytest.approx(3.0 * 8 ** 0.5)
        assert seen["full"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


# -- finding 8: the one-boundary ordering needs every node of a step on one device queue -------------

def test_a_streamed_output_off_the_engines_device_is_refused():
    """A block returning its output on another device (here "meta" beside the CPU engine; on a GPU,
    the host): its backward nodes would run on that device's queue, out of the streaming order."""
    from test_streaming_boundaries import Block, _streamed, _toy

    model = _toy("chain")
    block = model.blocks[1]
    block.forward = lambda h, **kw: tuple(t.to("meta") for t in Block.forward(block, h, **kw))
    _streamed(model)
    with pytest.raises(RuntimeError, match=r"streamed blocks\.1 returned a tensor needing a gradient on meta"):
        model(torch.randn(3, 8, requires_grad=True))


def test_a_boundary_firing_on_another_thread_than_the_first_is_refused():
    """Autograd runs each device's queue on its own thread: a second device's nodes in one backward
    show as a boundary on another thread."""
    import threading

    from test_streaming_boundaries import _streamed, _toy

    model = _toy("chain")
    eng = _streamed(model).engine
    from leantune.memory.streamed_forward import Boundary

    units = {u.name: u for u in eng.units}
    fired, errors = [], []
    eng.backward_boundary = lambda b: (fired.append(b.unit.name), setattr(eng, "callback_queued", True))
    Boundary(eng, units["blocks.3"])(None)                    # this backward's first boundary, here
    other = threading.Thread(target=lambda: _catch(errors, Boundary(eng, units["blocks.2"])))
    other.start()
    other.join()
    Boundary(eng, units["blocks.1"])(None)                    # back on the first thread: fine
    assert fired == ["blocks.3", "blocks.1"]
    assert len(errors) == 1 and "another thread than this backward's first boundary" in errors[0]


def _catch(errors: list, boundary) -> None:
    try:
        boundary(None)
    except RuntimeError as e:
        errors.append(str(e))


# -- finding 3: sharded full fine-tunes price the host RAM of loading, and FSDP2 loads in turns --------

def _sharded_mode(monkeypatch, strategy: str, local: int, load_in_turns: bool = True):
    from leantune.config import validate
    from leantune.train.sharded_full import sharded_full_mode

    for k, v in {"RANK": "0", "WORLD_SIZE": str(local), "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]}, "train": {"mode": "full"},
                    "distributed": {"strategy": strategy, "load_in_turns": load_in_turns}}, "run.toml")
    ctx = ltd.DistContext(rank=0, world_size=local, local_rank=0, local_world_size=local, strategy=strategy)
    return cfg, sharded_full_mode(cfg.train, cfg.full, cfg.memory, cfg.distributed, cfg.output.formats, ctx)


def test_loading_a_sharded_full_fine_tune_is_priced_before_any_weight_is_read(monkeypatch):
    from leantune import host
    from leantune.config import ConfigError

    meta = torch.nn.Linear(1024, 1024, device="meta")                 # 4 MiB + 4 KiB of fp32
    model = sum(p.numel() * 4 for p in meta.parameters())
    # 4 processes: all at once 4x the model; in turns the model and 3 quarter-model shards (1.75x).
    monkeypatch.setattr(host, "host_ram", lambda: (64 * model, int(2.0 * model)))
    _, fsdp = _sharded_mode(monkeypatch, "fsdp2", 4)
    monkeypatch.setattr(fsdp, "_make_mesh", lambda: None)             # the mesh needs a group; not priced
    fsdp.check_before_load(lambda: meta)                              # 1.75x fits in 2x
    _, at_once = _sharded_mode(monkeypatch, "fsdp2", 4, load_in_turns=False)
    monkeypatch.setattr(at_once, "_make_mesh", lambda: None)
    with pytest.raises(ConfigError, match=r"4 processes of this machine \(all at once\).*load_in_turns = true"):
        at_once.check_before_load(lambda: meta)
    _, zero = _sharded_mode(monkeypatch, "deepspeed", 4)                           # ZeRO-2 keeps the whole model on every rank
    with pytest.raises(ConfigError, match=r"all at once"):
        zero.check_before_load(lambda: meta)
    assert fsdp.shards_in_turn and not zero.shards_in_turn


# -- finding 2, second part: main_first waits by polling, not in a barrier with the group's timeout --

def test_main_first_outlasts_the_groups_timeout_where_a_barrier_does_not(tmp_path):
    """torchrun, 2 ranks, a gloo group with a 2 s timeout and rank 0's part of main_first taking
    4 s: rank 1 waits by polling the store (distributed.wait_for_main) and runs its part after
    rank 0's ended, in two contexts of the same group one after the other (the store counts the
    calls, so the second context's key is a new one); the same phase before a plain barrier
    times out there, which is how main_first's barrier ended a long caching phase."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "tests" / "dist_main_first_worker.py"), str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all("error" not in s for s in seen), (seen, run.stderr[-3000:])
    for name in ("first", "second"):
        zero, one = seen[0][name], seen[1][name]
        assert (zero["returned"], one["returned"]) == ("rank 0's result", "rank 1's result")
        assert zero["part"][1] - zero["part"][0] >= 4.0
        assert one["part"][0] >= zero["part"][1] - 0.05      # rank 1 started after rank 0 ended
    assert "timed out" in seen[1]["barrier"].lower()


# -- finding 8, second part: the slots are waited for and released on the forward's stream -----------

class _FakeStream:
    def __init__(self, name: str):
        self.name, self.waited = name, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class _FakeEvent:
    """A CUDA event that remembers the stream it was last recorded on."""

    recorded: list = []

    def __init__(self, enable_timing: bool = False):
        self.stream = None

    def record(self, stream) -> None:
        self.stream = stream
        _FakeEvent.recorded.append((stream.name, torch._C._current_graph_task_id() != -1))

    def query(self) -> bool:
        return self.stream is None or self.stream.name != "copy"    # a copy is still running: waited for

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def test_slots_are_released_and_waited_for_on_the_forwards_stream_in_backward(monkeypatch):
    """The engine on the CPU with CUDA's streams and events emulated: the forward runs on stream
    "forward" and, as on autograd's device thread, code in backward sees another current stream
    ("backward"); a copy is always still running when waited for. Every slot release (free event)
    and every wait for a copy is on the forward's
    stream, in backward too; with the current stream at each use, backward's would be taken and
    the next copy could overwrite a slot a kernel still reads. The gradients are the plain
    model's (poison mode: a weight read outside its hold is NaN)."""
    import contextlib
    import copy

    from test_streaming_boundaries import _streamed, _toy

    plain = _toy("chain")
    model = copy.deepcopy(plain)
    handle = _streamed(model)
    be = handle.engine.backend
    streams = {"forward": _FakeStream("forward"), "backward": _FakeStream("backward")}

    def current_stream(device=None):
        return streams["backward" if torch._C._current_graph_task_id() != -1 else "forward"]

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(be, "cuda", True)
    monkeypatch.setattr(be, "copy_stream", _FakeStream("copy"))
    _FakeEvent.recorded = []

    x = torch.randn(3, 8, requires_grad=True)
    model(x).square().sum().backward()
    x0 = x.detach().clone().requires_grad_(True)
    plain(x0).square().sum().backward()
    monkeypatch.setattr(be, "cuda", False)

    # the releases in backward (the copy stream's own events are the prefetches' ends)
    released = [name for name, backward in _FakeEvent.recorded if backward and name != "copy"]
    assert released and set(released) == {"forward"}, _FakeEvent.recorded
    assert {name for name, _ in _FakeEvent.recorded} <= {"forward", "copy"}
    assert streams["forward"].waited and not streams["backward"].waited      # waits for copies
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    want = [p.grad for p in plain.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(grads, want)) and torch.equal(x.grad, x0.grad)
