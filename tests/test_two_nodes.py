"""Two machines: `leantune train --nodes 2 --node-rank R --master HOST:PORT` (issue 40, "two nodes").

Each "machine" is a Linux network namespace with its own address on a veth pair (10.77.x.1 and
10.77.x.2); loopback never carries traffic between them (gloo is bound to the veth interface,
GLOO_SOCKET_IFNAME, and the rendezvous is machine 0's veth address). The two share this
machine's filesystem, as nodes share a network filesystem. One process per machine, on the CPU:
  1. a LoRA run of the tiny Flux equals the one-process run with the doubled batch (the same
     reference and tolerances as tests/test_distributed.py's two-process runs);
  2. a second launch, resuming from that run's step-15 save, has machine 1's processes killed
     after its first step (kill -9 of its launcher and worker, as a machine that dies takes every
     process with it): machine 0 ends too, non-zero, without a hang, and the last save is intact
     and loads;
  3. a full fine-tune with DeepSpeed ZeRO-2 (`[distributed] strategy = "deepspeed"`) equals the
     one-process full fine-tune with the doubled batch (tests/test_distributed.py's tolerance).
DeepSpeed needs no launcher of its own here (no ssh, no hostfile): each machine's torchrun sets
RANK / WORLD_SIZE / MASTER_ADDR (machine 0's veth address), from which DeepSpeed's
init_distributed makes the process group (env://). Its shared-memory collective serves ranks of
one machine only and stays off (DeepSpeed's LOCAL_SIZE is unset).
Needs root (network namespaces); the machines CI runs on have it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_distributed import (_assert_same_lora, _children, _env, _lora, _loss_gap, _use_cache, images,  # noqa: F401
                              reference, write_config, write_full_config)

pytestmark = [pytest.mark.xdist_group("multiprocess"), pytest.mark.slow]


class Machines:
    """Two network namespaces joined by a veth pair; removed on close."""

    def __init__(self, tag: str):
        self.names = [f"lt{tag}a", f"lt{tag}b"]
        self.links = [f"lt{tag}va", f"lt{tag}vb"]
        self.addrs = [f"10.77.{int(tag) % 250}.1", f"10.77.{int(tag) % 250}.2"]
        self._ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1], host=True)
        for ns, link, addr in zip(self.names, self.links, self.addrs):
            self._ip("netns", "add", ns, host=True)
            self._ip("link", "set", link, "netns", ns, host=True)
            self._ip("-n", ns, "addr", "add", f"{addr}/24", "dev", link, host=True)
            self._ip("-n", ns, "link", "set", link, "up", host=True)
            self._ip("-n", ns, "link", "set", "lo", "up", host=True)

    @staticmethod
    def _ip(*args, host=False):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def popen(self, machine: int, cmd: list[str], env: dict) -> subprocess.Popen:
        env = {**env, "GLOO_SOCKET_IFNAME": self.links[machine], "PYTHONFAULTHANDLER": "1"}
        return subprocess.Popen(["ip", "netns", "exec", self.names[machine], *cmd], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def close(self) -> None:
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def machines():
    if os.geteuid() != 0:
        pytest.fail("the two-machine tests need root for network namespaces (ip netns); CI runs as root")
    m = Machines(str(os.getpid() % 200 + 20))
    yield m
    m.close()


def _launch(machines: Machines, cfg: Path, env: dict, port: int, *extra: str) -> list[subprocess.Popen]:
    base = [sys.executable, "-m", "leantune", "train", str(cfg), "--nodes", "2", "--master",
            f"{machines.addrs[0]}:{port}", "--no-progress", "--set", "train.device=cpu", *extra]
    return [machines.popen(r, base + ["--node-rank", str(r)], env) for r in range(2)]


def _finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each; a process still running after `timeout` is killed with
    its children and reported with exit code None (a hang)."""
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
        except subprocess.TimeoutExpired:
            ps = subprocess.run(["ps", "-o", "pid,stat,wchan:20,args", "-p", ",".join(map(str, _tree(p.pid)))],
                                capture_output=True, text=True).stdout
            for pid in _tree(p.pid):                  # every process's stacks (faulthandler) into stderr
                try:
                    os.kill(pid, signal.SIGABRT)
                except ProcessLookupError:
                    pass
            time.sleep(3)
            for pid in reversed(_tree(p.pid)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            stdout, stderr = p.communicate()
            out.append((None, stdout, ps + stderr))
    return out


def _tree(pid: int) -> list[int]:
    kids = _children(pid)
    return [pid] + [q for k in kids for q in _tree(k)]


def test_a_run_on_two_machines_equals_one_process_and_a_dead_machine_ends_both(machines, tmp_path, tiny_flux_dir,
                                                                               images, reference):
    from leantune.train.state import latest_checkpoint, load_checkpoint

    cfg = write_config(tmp_path, tiny_flux_dir, images, "run", 1, str(tmp_path / "out"))
    _use_cache(cfg, reference.cache)
    env, out = _env(tmp_path), tmp_path / "out"

    # 1. the whole run on two machines
    ran = _finish(_launch(machines, cfg, env, 29611))
    for rc, stdout, stderr in ran:
        assert rc == 0, stderr[-4000:]
    assert "per rank: rss" in (out / "train.log").read_text()                 # both ranks report
    history = __import__("json").loads((out / "loss.json").read_text())
    assert history["step"] == 20
    assert history["loss"] == pytest.approx(reference.losses, rel=1e-4, abs=1e-6)
    _loss_gap(history["loss"], reference.losses, "two machines")
    _assert_same_lora(_lora(out), reference.lora, what="two machines")
    assert sum(stdout.count("LoRA files:") for _, stdout, _ in ran) == 1          # rank 0 writes them

    # 2. resume from step 15 on two machines, then machine 1 dies whole after a step
    ckpts = out / "checkpoints"
    for d in sorted(ckpts.iterdir()):
        if d.name > "step-000015":                    # back to the step-15 save, as if the run stopped there
            __import__("shutil").rmtree(d)
    (out / "t_diffusers.safetensors").unlink()
    log, before = out / "train.log", len((out / "train.log").read_text())

    def resumed_step() -> int:                        # the last step this launch logged (0: none yet)
        steps = re.findall(r"\bstep (\d+) loss", log.read_text()[before:])
        return int(steps[-1]) if steps else 0

    procs = _launch(machines, cfg, env, 29612, "--resume")
    deadline = time.monotonic() + 300
    while resumed_step() < 16:
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
        assert time.monotonic() < deadline, "no step 16"
        time.sleep(0.1)
    for pid in reversed(_tree(procs[1].pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t0 = time.monotonic()
    rc0, _, err0 = _finish(procs[:1], timeout=90)[0]
    procs[1].wait()
    assert rc0 is not None, f"machine 0 hung after machine 1 died: {err0[-4000:]}"
    assert rc0 != 0 and time.monotonic() - t0 < 180
    assert "is intact" in err0 and "--resume" in err0 and "Traceback" not in err0, err0[-4000:]
    step, state = load_checkpoint(latest_checkpoint(ckpts))
    assert step == 15 and state["world_size"] == 2
    assert not (out / "t_diffusers.safetensors").exists()                          # the run never finished



def test_a_zero2_full_fine_tune_on_two_machines_equals_one_process(machines, tmp_path, tiny_flux_dir, images):
    """[train] mode = "full", [distributed] strategy = "deepspeed", launched with `leantune train
    --nodes 2` on each machine: DeepSpeed ZeRO-2 (gradients and AdamW states partitioned between the
    machines, its collectives over gloo on the veth) gives the one-process full fine-tune's losses,
    fp32 trained weights (the step-6 checkpoints) and exported model with the doubled batch, within
    tests/test_distributed.py's 1e-4; the weights moved further than that from the base."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from leantune.config import load_config
    from leantune.train.state import load_checkpoint
    from leantune.trainer import train

    ref_cfg = load_config(write_full_config(tmp_path, tiny_flux_dir, images, "fullref", 2, str(tmp_path / "ref")))
    ref = train(ref_cfg, progress=False)
    cfg = write_full_config(tmp_path, tiny_flux_dir, images, "zero2", 1, str(tmp_path / "zero2"),
                            '\n[distributed]\nstrategy = "deepspeed"\n')
    _use_cache(cfg, tmp_path / "cache-fullref")
    for rc, stdout, stderr in _finish(_launch(machines, cfg, _env(tmp_path), 29613)):
        assert rc == 0, stderr[-4000:]
    out = tmp_path / "zero2"
    assert ("full (deepspeed ZeRO-2): 86 tensors, 0.10M parameters, optimizer states over 2 processes"
            in (out / "train.log").read_text())
    history = __import__("json").loads((out / "loss.json").read_text())
    assert history["step"] == 6
    assert history["loss"] == pytest.approx(ref.losses, rel=1e-4, abs=1e-6)
    _loss_gap(history["loss"], ref.losses, "ZeRO-2 on two machines")

    def trained(run: str) -> dict:
        step, state = load_checkpoint(tmp_path / run / "checkpoints" / "step-000006")
        assert step == 6
        return state["trainable"]

    a, b = trained("ref"), trained("zero2")
    base = load_file(str(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 86
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"ZeRO-2 on two machines: largest fp32 weight difference {worst:.2e}")
    assert worst <= 1e-4, worst
    assert max(float((a[k] - base[k].float()).abs().max()) for k in a) > 1e-4       # the check can fail
    a, b = load_file(str(tmp_path / "ref" / "m_comfyui.safetensors")), load_file(str(out / "m_comfyui.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) <= 1e-4


# -- `leantune check --nodes 2`: the whole plan on both machines against one process ---------------------

_CHECK_MAIN = ("import sys; from leantune.check import processes; processes.WORKER_MODULE = sys.argv.pop(1); "
               "from leantune import cli; sys.exit(cli.main(sys.argv[1:]))")


def _check_on_two_machines(machines: Machines, cfg: Path, tmp: Path, port: int, worker: str) -> list[tuple]:
    """`leantune check CFG --nodes 2 --node-rank R --master A:PORT` on each machine (each with its own
    cache folder, as machines have their own disks), the ranks running `worker`."""
    env = {**_env(tmp), "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), _env(tmp)["PYTHONPATH"]])}
    procs = [machines.popen(r, [sys.executable, "-c", _CHECK_MAIN, worker, "check", str(cfg), "--nodes", "2",
                                "--node-rank", str(r), "--master", f"{machines.addrs[0]}:{port}",
                                "--set", 'train.device="cpu"', "--set", f'data.cache_dir="{tmp / f"cache-{r}"}"'],
                            env) for r in range(2)]
    return _finish(procs)


def test_check_on_two_machines_holds_and_catches_a_rank_whose_gradient_is_scaled(machines, tmp_path, tiny_flux_dir,
                                                                                  images):
    """`leantune check --nodes 2` on two machines, one process each: machine 0 launches its rank
    before any one-process run, machine 1's rank gets the job through the rendezvous store, the
    whole plan (3 blocks streamed in poison mode) at batch 2 per machine holds against one process
    at batch 4 started from rank 0's adapters, and both machines exit 0; with machine 1's rank
    scaling its gradient share by 1.5 (tests/check_fault_worker.py) machine 0's line differs and
    both machines exit 1."""
    from conftest import tiny_lora_rest, tiny_run_toml

    cfg = tmp_path / "run.toml"
    cfg.write_text(tiny_run_toml(tiny_flux_dir, images, tiny_lora_rest(tmp_path / "out", "t",
                                                                      "[memory]\nstreamed_blocks = 3\n")))
    (rc0, out0, err0), (rc1, out1, err1) = _check_on_two_machines(machines, cfg, tmp_path / "held", 29614,
                                                                  "leantune.check.processes")
    assert rc0 == 0, out0 + err0[-4000:]
    assert rc1 == 0, out1 + err1[-4000:]
    lines = out0.splitlines()
    line = next(ln for ln in lines if ln.startswith("several machines ("))
    assert line.startswith("several machines (2 x 1 process, ddp; the whole plan at batch 2 per process, against one "
                           "process at batch 4): held — "), line
    assert lines.index(line) == 1, lines          # first, before the one-process variants
    assert any(ln.startswith("streaming") and ": held" in ln for ln in lines), lines
    assert "the whole plan on every machine held" in out1
    assert not (tmp_path / "out").exists()        # nothing written to the run's folder

    (rc0, out0, err0), (rc1, out1, err1) = _check_on_two_machines(machines, cfg, tmp_path / "fault", 29615,
                                                                  "check_fault_worker")
    line = next(ln for ln in out0.splitlines() if ln.startswith("several machines ("))
    assert ": differs: " in line and "gradients" in line.split("outside")[-1], line
    assert rc0 == 1 and rc1 == 1, (out0 + err0[-3000:], out1 + err1[-3000:])
    assert "the check did not hold" in out1
