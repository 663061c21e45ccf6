"""Start, stop and resume `leantune train` as its own process.

A run is a separate process in its own session, so closing the page, or the page's server
crashing, never stops it. Stop sends SIGINT, which the trainer treats as Ctrl-C: it finishes the
step, saves a resumable state and exits. Resume starts `leantune train --resume` on the same
config. The process id and exit code are kept in the run's folder (process.json), so a restarted
page still knows which runs are alive.
"""

from __future__ import annotations

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


def is_alive(info: dict | None) -> bool:
    """Whether the process `info` names still runs (and is not a zombie of ours)."""
    if not info or info.get("exit_code") is not None:
        return False
    pid = info.get("pid")
    try:
        os.kill(pid, 0)
    except (OSError, TypeError):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def train_command(config: Path, resume: bool = False) -> list[str]:
    """`leantune train config [--resume]` with this Python (the same leantune as the page)."""
    return [sys.executable, "-m", "leantune", "train", str(config)] + (["--resume"] if resume else [])


def start(folder: Path, config: Path | None, resume: bool = False, command: list[str] | None = None) -> dict:
    """Start `leantune train config [--resume]` (or `command`) with its output in folder/console.log."""
    if is_alive(read_process(folder)):
        raise LaunchError(f"{folder.name}: already running")
    cmd = command or train_command(config, resume)
    with open(folder / CONSOLE_FILE, "ab") as console:
        console.write(f"$ {' '.join(cmd)}\n".encode())
        console.flush()
        proc = subprocess.Popen(cmd, cwd=folder, stdout=console, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    info = {"pid": proc.pid, "command": cmd, "started": time.time(), "resume": resume, "exit_code": None}
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
    info = read_process(folder)
    if not is_alive(info):
        raise LaunchError(f"{folder.name}: not running")
    os.kill(info["pid"], signal.SIGINT)
    return info
