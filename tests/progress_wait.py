"""Waits that follow progress, not a wall-clock budget tuned on an idle machine.

A fixed deadline ("finished within 180 s") passes on an idle machine and fails on a shared one
that runs the same steps three times slower. These waits instead fail when nothing moves: the
thing waited for is not done and its progress (steps logged, a file's size, a process alive) has
not changed for `stall_s`, or the process doing the work ended. A generous outer `limit_s` stays
as a safety net against a loop that keeps "progressing" forever.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

STALL_S = 600.0       # no progress for this long: the work is stuck, not slow
LIMIT_S = 3600.0      # the safety net


def wait_until(done: Callable[[], bool], progress: Callable[[], object] = lambda: None, *, what: str,
               alive: Callable[[], bool] = lambda: True, stall_s: float = STALL_S, limit_s: float = LIMIT_S,
               poll_s: float = 0.2, detail: Callable[[], str] = lambda: "") -> None:
    """Return once `done()`; fail (AssertionError naming `what`) if `alive()` turns false first, if
    `progress()` keeps one value for `stall_s`, or after `limit_s` in all."""
    start = moved = time.monotonic()
    last = progress()
    while not done():
        now = time.monotonic()
        if not alive():
            if done():
                return
            raise AssertionError(f"{what}: the process ended first. {detail()}")
        current = progress()
        if current != last:
            last, moved = current, now
        if now - moved > stall_s:
            raise AssertionError(f"{what}: no progress for {stall_s:.0f} s (still at {last!r}). {detail()}")
        if now - start > limit_s:
            raise AssertionError(f"{what}: not done after {limit_s:.0f} s (at {last!r}). {detail()}")
        time.sleep(poll_s)


def logged_steps(log: Path) -> int:
    """The last step a trainer's log (train.log or a console) reports, 0 before the first."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    steps = re.findall(r"\bstep (\d+)", text)
    return int(steps[-1]) if steps else 0


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1
