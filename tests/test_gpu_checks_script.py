"""bench/gpu_checks.sh, the one command for a GPU window: its parts, their budgets, its runner.
The GPU parts themselves need a GPU; here the listing and the runner (budget, log per part,
summary) are checked on the CPU."""

import os
import re
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_checks.sh"
WINDOWS = {1: ["setup", "nccl-collectives", "fp32-stream", "oom-step1", "gpu-tests"],
           2: ["setup", "flux2-klein4b", "text-encoder-read", "load-gpu-host", "bench-planner"],
           3: ["setup", "bench-engine", "bench-sampler", "dequant-rate", "host-step", "encoder-pass"],
           4: ["setup", "offload-nccl", "cudnn-attention", "rng-device", "round2-tests"],
           5: ["setup", "strategies", "two-gpu-guard"]}


def _listing(out: str) -> dict:
    """window -> [(part, budget)] and its stated total, from --dry-run's output."""
    windows, current = {}, None
    for line in out.splitlines():
        if m := re.match(r"^window (\S+)$", line):
            current = windows.setdefault(m.group(1), {"parts": [], "total": None})
        elif m := re.match(r"^(\S+)\s+(\d+)s\s", line):
            if m.group(1) == "total":
                current["total"] = int(m.group(2))
            else:
                current["parts"].append((m.group(1), int(m.group(2))))
    return windows


def test_every_window_fits_one_device_session():
    """A session is lent 15 minutes of device time, a machine's start (1-2 minutes) included, and
    one command runs at most 10 minutes: each window's parts fit 510 s, set-up included, and every
    check belongs to exactly one window."""
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    windows = _listing(out.stdout)
    assert {int(w): [p for p, _ in v["parts"]] for w, v in windows.items()} == WINDOWS
    for w, v in windows.items():
        assert v["total"] == sum(b for _, b in v["parts"]) <= 510, w
    only = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", "oom-step1,flux2-klein4b"], capture_output=True,
                          text=True, timeout=30).stdout
    assert [p for p, _ in _listing(only)["only"]["parts"]] == ["oom-step1", "flux2-klein4b"]


def test_budgets_over_the_window_fail_the_dry_run():
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=30,
                         env={"PATH": "/usr/bin:/bin", "TOTAL_S": "400"})
    assert out.returncode == 1 and "the parts' budgets exceed TOTAL_S" in out.stderr


def test_a_part_runs_under_its_budget_with_its_own_log_and_a_summary_line(tmp_path):
    """The runner on a part that needs no GPU here (two-gpu-guard skips itself with fewer than two).

    Its output goes to a file, not a pipe: the part's watchdog (`sleep <budget>`, left behind when
    the part ends first) would hold a pipe open for the whole budget; it is ended with the runner's
    process group. A machine too busy to run the part's Python within its 45 s budget shows the
    runner's other promise instead: the part is stopped at its budget and its summary line says so
    (rc 124 from `timeout`, 143 from the watchdog's SIGTERM, whichever comes first, 137 after
    timeout's --kill-after); the part's own output is then read from a run of its command without
    the runner."""
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "OUT": str(tmp_path), "HOME": str(tmp_path)}
    with open(tmp_path / "runner.out", "w") as out:
        runner = subprocess.Popen(["bash", str(SCRIPT), "--only", "two-gpu-guard"], stdout=out,
                                  stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = runner.wait(timeout=300)
        finally:
            try:
                os.killpg(runner.pid, signal.SIGKILL)        # the watchdog's sleep, and anything left
            except ProcessLookupError:
                pass
            runner.wait()
    said = (tmp_path / "runner.out").read_text()
    assert rc == 0, said
    summary = (tmp_path / "summary.txt").read_text()
    line = re.fullmatch(r"two-gpu-guard: rc=(\d+) (\d+)s \(budget 45s\)\n", summary)
    assert line, summary
    log = (tmp_path / "two-gpu-guard.log").read_text()
    if line.group(1) == "0":
        assert '"skipped": "needs 2 GPUs' in log
    else:                                   # stopped at its budget on a busy machine
        assert line.group(1) in ("124", "137", "143") and int(line.group(2)) >= 45, (summary, log)
        alone = subprocess.run([str(ROOT / ".venv" / "bin" / "python3"), "bench/gpu_findings.py", "two-gpu-guard"],
                               capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert alone.returncode == 0 and '"skipped": "needs 2 GPUs' in alone.stdout, alone.stdout + alone.stderr
