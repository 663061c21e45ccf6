"""bench/gpu_checks.sh's part runner on the CPU: a part that hangs, with a child of its own, is
stopped at its budget with its whole process tree (a child that outlived the part would load the
GPU machine through the next parts' measurements), and the next part still runs."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_hanging_shell_function_part_is_stopped_with_its_child(tmp_path):
    parts = tmp_path / "parts"
    parts.write_text("1|hang|3|a part whose child outlives it|hang\n1|after|10|the next part|echo next-ran\n")
    out = tmp_path / "out"
    script = ("hang() { sleep 300 & echo $! > \"$OUT/child.pid\"; sleep 300; }; export -f hang; "
              f"bash {ROOT / 'bench' / 'gpu_checks.sh'} --window 1")
    env = {**os.environ, "OUT": str(out), "GPU_CHECKS_PARTS_FILE": str(parts), "TOTAL_S": "60"}
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    child = int((out / "child.pid").read_text())
    try:
        assert not _alive(child), "the hanging part's child outlived the watchdog"
    finally:
        if _alive(child):
            os.kill(child, 9)
    summary = (out / "summary.txt").read_text()
    assert "hang: rc=" in summary and "after: rc=0" in summary, run.stdout + run.stderr
    assert "next-ran" in (out / "after.log").read_text()
