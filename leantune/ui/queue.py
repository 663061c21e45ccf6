"""One job at a time: the page's runs wait in line for the machine.

A GPU (or this CPU) runs one training run well; two at once fight for its memory, and the plan of
each assumed it had the machine. So Start and Resume while another run is alive put the run in
line (queued.json in its folder, with the time it was queued and whether it resumes), and the
page's server starts the oldest one as soon as no run is alive. The line is files, so a restarted
page keeps it; a run can leave the line by being deleted. Decisions hold one lock, so two clicks
cannot both find the machine free: a file lock on the runs folder (flock on LOCK_FILE), not a lock
of this process, because two page servers started on one runs folder share its line too, and each
would otherwise start a trainer in the moment between the other's check and its process record.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from . import launcher, runs

LOCK_FILE = ".queue.lock"


@contextlib.contextmanager
def _line(runs_dir: Path):
    """The runs folder's line, held by this thread against every other thread and process."""
    Path(runs_dir).mkdir(parents=True, exist_ok=True)
    with launcher.run_lock(Path(runs_dir), LOCK_FILE):
        yield


def alive(runs_dir: Path) -> list[str]:
    """The jobs alive: runs, and the page's check (check_job.py), which holds the machine as a run does."""
    from . import check_job

    check = ["the check"] if launcher.alive(check_job.folder(runs_dir)) else []
    return [f.name for f in runs.run_folders(runs_dir) if launcher.alive(f)] + check


def start_alone(runs_dir: Path, folder: Path, command: list[str]) -> dict:
    """Start `command` in `folder` now if no job is alive and no run waits, else refuse (the check)."""
    with _line(runs_dir):
        busy, line = alive(runs_dir), waiting(runs_dir)
        if busy or line:
            names = ", ".join(busy + [f.name for f in line])
            raise launcher.LaunchError(f"{names} {'is' if len(busy + line) == 1 else 'are'} running or waiting: "
                                       f"check when the machine is free")
        return launcher.start(folder, None, command=command)


def waiting(runs_dir: Path) -> list[Path]:
    """Queued run folders, oldest first."""
    def queued_at(folder: Path) -> float:
        try:
            return float(json.loads((folder / runs.QUEUED_FILE).read_text())["queued_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0.0
    return sorted((f for f in runs.run_folders(runs_dir) if (f / runs.QUEUED_FILE).is_file()), key=queued_at)


def submit(runs_dir: Path, folder: Path, resume: bool) -> dict:
    """Start the run now when the machine is free and nobody waits, else put it in line."""
    from ..io import atomic_write_json

    with _line(runs_dir):
        if launcher.alive(folder):
            raise launcher.LaunchError(f"{folder.name}: already running")
        busy = alive(runs_dir)
        ahead = [f.name for f in waiting(runs_dir) if f != folder]
        if not busy and not ahead:
            info = launcher.start(folder, folder / runs.CONFIG_FILE, resume=resume)
            return {**info, "started": True}          # (info.started, the launch time, is in process.json)
        atomic_write_json(folder / runs.QUEUED_FILE, {"queued_at": time.time(), "resume": resume})
        return {"started": False, "queued": True, "position": len(ahead) + 1, "running": busy}


def leave(folder: Path) -> bool:
    """Take a queued run out of the line (Stop on a run that waits); False if it was not queued."""
    with _line(folder.parent):
        try:
            (folder / runs.QUEUED_FILE).unlink()
            return True
        except FileNotFoundError:
            return False


def advance(runs_dir: Path) -> str | None:
    """Start the oldest queued run if no run is alive; returns its name."""
    with _line(runs_dir):
        if alive(runs_dir):
            return None
        line = waiting(runs_dir)
        if not line:
            return None
        folder = line[0]
        try:
            resume = bool(json.loads((folder / runs.QUEUED_FILE).read_text()).get("resume"))
        except (OSError, ValueError):
            resume = False
        (folder / runs.QUEUED_FILE).unlink()
        launcher.start(folder, folder / runs.CONFIG_FILE, resume=resume)
        return folder.name


def keep_moving(runs_dir: Path, every_s: float = 1.0) -> threading.Thread:
    """A daemon thread that advances the line while the page's server is up."""
    def loop():
        while True:
            try:
                advance(runs_dir)
            except Exception:          # a broken run folder must not stop the line for the others
                pass
            time.sleep(every_s)
    thread = threading.Thread(target=loop, name="leantune-ui-queue", daemon=True)
    thread.start()
    return thread
