"""The tests' progress-following wait (progress_wait.py): a slow worker that keeps moving passes
however long it takes in all; one that stops moving, or dies, fails with the reason."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from progress_wait import logged_steps, wait_until

# A worker that logs a step every `pause` seconds, `steps` times, then (optionally) hangs.
WORKER = ("import sys, time\nlog, steps, pause, hang = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]\n"
          "for i in range(1, steps + 1):\n    time.sleep(pause)\n"
          "    open(log, 'a').write(f'INFO step {i} loss 0.1\\n')\n"
          "if hang == '1':\n    time.sleep(60)\n")


def _worker(tmp_path, steps, pause, hang=False):
    log = tmp_path / "train.log"
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(log), str(steps), str(pause), "1" if hang else "0"])
    return proc, log


def test_a_slow_worker_that_keeps_moving_passes_past_any_fixed_budget(tmp_path):
    """12 steps 0.25 s apart take 3 s in all: more than the 1 s stall window, which the wait
    allows between steps, not for the whole run."""
    proc, log = _worker(tmp_path, 12, 0.25)
    try:
        start = time.monotonic()
        wait_until(lambda: logged_steps(log) >= 12, lambda: logged_steps(log), what="12 steps", stall_s=1.0,
                   limit_s=120, alive=lambda: proc.poll() is None or logged_steps(log) >= 12)
        assert time.monotonic() - start > 1.0 and logged_steps(log) == 12
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_that_stops_moving_fails_after_the_stall_window_naming_where_it_stopped(tmp_path):
    proc, log = _worker(tmp_path, 2, 0.1, hang=True)
    try:
        with pytest.raises(AssertionError, match=r"10 steps: no progress for 1 s \(still at 2\)"):
            wait_until(lambda: logged_steps(log) >= 10, lambda: logged_steps(log), what="10 steps", stall_s=1.0,
                       limit_s=120)
    finally:
        proc.kill()
        proc.wait()


def test_a_worker_that_dies_fails_at_once_with_its_detail(tmp_path):
    proc, log = _worker(tmp_path, 1, 0.0)
    proc.wait()
    with pytest.raises(AssertionError, match="the process ended first. exit 0"):
        wait_until(lambda: logged_steps(log) >= 5, lambda: logged_steps(log), what="5 steps",
                   alive=lambda: proc.poll() is None, detail=lambda: f"exit {proc.returncode}")


def test_the_safety_net_ends_a_wait_that_moves_forever(tmp_path):
    ticks = iter(range(10**9))
    with pytest.raises(AssertionError, match="not done after 1 s"):
        wait_until(lambda: False, lambda: next(ticks), what="forever", stall_s=100, limit_s=1.0, poll_s=0.05)
