"""Start, stop and resume `leantune train` as its own process.

A run is a separate process in its own session, so closing the page, or the page's server
crashing, never stops it. Stop sends SIGINT, which the trainer treats as Ctrl-C: it finishes the
step, saves a resumable state and exits. Resume starts `leantune train --resume` on the same
config. The process id, its start time and exit code are kept in the run's folder (process.json),
so a restarted page still knows which runs are alive.

A bare pid is not an identity: pids are reused, and process.json is a file anyone could edit. A
process counts as the run's only when its start time in /proc (clock ticks since boot) matches the
one recorded at launch, so Stop never signals an unrelated process. Start, stop and resume of one
run hold an exclusive lock on the run folder (flock, so it holds across threads and across two
pages on the same folder): two Resume clicks at once start one trainer, and the other is told it
runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PROCESS_FILE = "process.json"
CONSOLE_FILE = "console.log"
LOCK_FILE = ".launch.lock"


class LaunchError(ValueError):
    """A run cannot be started or stopped as asked; the message says why."""


def read_process(folder: Path) -> dict | None:
    try:
        return json.loads((folder / PROCESS_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_process(folder: Path, info: dict) -> None:
    from ..io import atomic_write_json

    atomic_write_json(folder / PROCESS_FILE, info)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22): with the
    pid, an identity no later process can share."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def is_alive(info: dict | None) -> bool:
    """Whether the process `info` names still runs, is the one launched (same start time), and is
    not a zombie of ours. A record without a start time is not trusted."""
    if not info or info.get("exit_code") is not None or info.get("proc_start") is None:
        return False
    fields = _proc_stat(info.get("pid"))
    if fields is None or fields[0] == "Z":
        return False
    return start_time(info["pid"]) == info["proc_start"]


@contextlib.contextmanager
def run_lock(folder: Path):
    """Exclusive hold on a run folder while its process is checked and started or signalled."""
    with open(folder / LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def train_command(config: Path, resume: bool = False) -> list[str]:
    """`leantune train config [--resume]` with this Python (the same leantune as the page)."""
    return [sys.executable, "-m", "leantune", "train", str(config)] + (["--resume"] if resume else [])


def start(folder: Path, config: Path | None, resume: bool = False, command: list[str] | None = None) -> dict:
    """Start `leantune train config [--resume]` (or `command`) with its output in folder/console.log."""
    with run_lock(folder):
        if is_alive(read_process(folder)):
            raise LaunchError(f"{folder.name}: already running")
        cmd = command or train_command(config, resume)
        with open(folder / CONSOLE_FILE, "ab") as console:
            console.write(f"$ {' '.join(cmd)}\n".encode())
            console.flush()
            proc = subprocess.Popen(cmd, cwd=folder, stdout=console, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        info = {"pid": proc.pid, "proc_start": start_time(proc.pid), "command": cmd, "started": time.time(),
                "resume": resume, "exit_code": None}
        _write_process(folder, info)
    threading.Thread(target=_reap, args=(proc, folder, info), daemon=True).start()
    return info


def _reap(proc: subprocess.Popen, folder: Path, info: dict) -> None:
    """Record the exit code when the run ends while this page is up (else the folder tells)."""
    code = proc.wait()
    current = read_process(folder)
    if current is not None and current.get("pid") == info["pid"]:      # not replaced by a later start
        _write_process(folder, {**info, "exit_code": code, "ended": time.time()})


def stop(folder: Path) -> dict:
    """Ask the run to stop after its step and save (SIGINT, as Ctrl-C)."""
    with run_lock(folder):
        info = read_process(folder)
        if not is_alive(info):
            raise LaunchError(f"{folder.name}: not running")
        os.kill(info["pid"], signal.SIGINT)
    return info
