"""Start, stop and resume `leantune train` as its own process.

A run is a separate process in its own session, so closing the page, or the page's server
crashing, never stops it. Stop sends SIGINT, which the trainer treats as Ctrl-C: it finishes the
step, saves a resumable state and exits. Resume starts `leantune train --resume` on the same
config. The process id, its start time and exit code are kept in the run's folder (process.json),
so a restarted page still knows which runs are alive.

A bare pid is not an identity: pids are reused, and process.json is a file anyone could edit, even
to name another process with its real start time. A process counts as the run's only when /proc
says it is what the page started there: its start time (clock ticks since boot) is the one
recorded, its command line is the argv recorded, and its working folder is the run's folder (the
page starts every process there, and leantune never changes folder). Stop signals nothing else and
says why. Start, stop and resume of one
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


def _cmdline(pid: int) -> list[str] | None:
    try:
        return [os.fsdecode(a) for a in Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")[:-1]]
    except (OSError, TypeError, ValueError):
        return None


def _cwd(pid: int) -> Path | None:
    try:
        return Path(os.readlink(f"/proc/{int(pid)}/cwd"))
    except (OSError, TypeError, ValueError):     # gone, or another user's process
        return None


def is_alive(info: dict | None, folder: Path) -> bool:
    """Whether the process `info` (the record found in `folder`) still runs and is the one the page
    launched there: same start time, same command line, working folder `folder`; a zombie of ours
    is not alive. A record without a start time or a command is not trusted."""
    if not info or info.get("exit_code") is not None or info.get("proc_start") is None:
        return False
    if not isinstance(info.get("command"), list):
        return False
    fields = _proc_stat(info.get("pid"))
    if fields is None or fields[0] == "Z":
        return False
    return (start_time(info["pid"]) == info["proc_start"] and _cmdline(info["pid"]) == info["command"]
            and _cwd(info["pid"]) == Path(folder).resolve())


def alive(folder: Path) -> bool:
    """Whether the process recorded in `folder` is alive and the one the page launched there."""
    return is_alive(read_process(folder), folder)


@contextlib.contextmanager
def run_lock(folder: Path, name: str = LOCK_FILE):
    """Exclusive hold on a run folder while its process is checked and started or signalled (a
    lock file of another `name`: another decision on the folder, the queue's on the runs folder).
    flock on a file opened here: it holds across threads and processes alike."""
    with open(folder / name, "a") as f:
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
        if alive(folder):
            raise LaunchError(f"{folder.name}: already running")
        cmd = [str(a) for a in (command or train_command(config, resume))]
        before = time_before(read_process(folder)) if resume else 0.0
        with open(folder / CONSOLE_FILE, "ab") as console:
            console.write(f"$ {' '.join(cmd)}\n".encode())
            console.flush()
            proc = subprocess.Popen(cmd, cwd=folder, stdout=console, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        info = {"pid": proc.pid, "proc_start": start_time(proc.pid), "command": cmd, "started": time.time(),
                "resume": resume, "exit_code": None, "before_s": before}
        _write_process(folder, info)
    threading.Thread(target=_reap, args=(proc, folder, info), daemon=True).start()
    return info


def time_before(info: dict | None) -> float:
    """The seconds a run trained before its latest launch ended: the launches before it, carried
    over at each resume, plus the latest one when its end is known. A run's time shown across
    Stop and Resume is this plus the current launch's. A record that says nothing usable is 0."""
    if not info:
        return 0.0
    try:
        before = max(0.0, float(info.get("before_s") or 0.0))
        if info.get("ended") is not None and info.get("started") is not None:
            before += max(0.0, float(info["ended"]) - float(info["started"]))
    except (TypeError, ValueError):
        return 0.0
    return before


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
        handle = _pidfd((info or {}).get("pid"))      # held from before the check: the pid cannot be reused
        try:
            if not is_alive(info, folder):
                pid = (info or {}).get("pid")
                stat = _proc_stat(pid) if info and info.get("exit_code") is None else None
                if stat is not None and stat[0] != "Z":
                    raise LaunchError(f"{folder.name}: {PROCESS_FILE} names process {pid}, which is not the run "
                                      f"this page started in {folder} (its start time, command line or folder "
                                      f"differ); not signalled")
                raise LaunchError(f"{folder.name}: not running")
            if handle is not None:
                signal.pidfd_send_signal(handle, signal.SIGINT)
            else:
                os.kill(info["pid"], signal.SIGINT)
        finally:
            if handle is not None:
                os.close(handle)
    return info


def _pidfd(pid) -> int | None:
    """A pidfd of `pid` (Linux 5.3+), or None (gone, or no pidfds here: then os.kill by pid)."""
    try:
        return os.pidfd_open(int(pid)) if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") else None
    except (OSError, TypeError, ValueError):
        return None
