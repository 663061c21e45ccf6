"""bench/gpu_checks.sh, the one command for a GPU window: its parts, their budgets, its runner.
The GPU parts themselves need a GPU; here the listing and the runner (budget, log per part,
summary) are checked on the CPU."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_checks.sh"
PARTS = ["setup", "nccl-collectives", "gpu-tests", "fp32-stream", "oom-step1", "strategies", "two-gpu-guard",
         "bench-planner", "bench-engine", "bench-sampler"]


def test_dry_run_lists_every_part_in_order_within_25_minutes():
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    names = [r[0] for r in rows[:-1]]
    assert names == PARTS
    budgets = [int(r[1].rstrip("s")) for r in rows[:-1]]
    total = int(rows[-1][1].rstrip("s"))
    assert rows[-1][0] == "total" and total == sum(budgets) <= 25 * 60
    only = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", "oom-step1,fp32-stream"], capture_output=True,
                          text=True, timeout=30).stdout
    assert re.findall(r"^(\S+)\s+\d+s", only, re.M) == ["fp32-stream", "oom-step1", "total"]


def test_a_part_runs_under_its_budget_with_its_own_log_and_a_summary_line(tmp_path):
    """The runner on a part that needs no GPU here (two-gpu-guard skips itself with fewer than two)."""
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "OUT": str(tmp_path), "HOME": str(tmp_path)}
    out = subprocess.run(["bash", str(SCRIPT), "--only", "two-gpu-guard"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    log = (tmp_path / "two-gpu-guard.log").read_text()
    assert '"skipped": "needs 2 GPUs' in log
    assert re.fullmatch(r"two-gpu-guard: rc=0 \d+s \(budget 45s\)\n", (tmp_path / "summary.txt").read_text())
