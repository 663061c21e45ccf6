"""Guards around a run's output folder: one run per folder, one process at a time, no leftovers.

A folder that holds another run (checkpoints, loss history, exported files) is refused unless
`--resume` continues it or `--overwrite` replaces it: re-running a finished config would otherwise
overwrite its final files and leave old checkpoints that a later `--resume` would pick up.

A lock file `.leantune.lock` names the process that holds the folder (pid, host, command, start
time); a second run writing the same folder is refused with that name. A lock left by a killed
process (its pid no longer runs on this host) is taken over, with a line saying so.

Once the lock is held, leftovers of a killed save are cleaned: `.tmp-step-*` folders and the
hidden temporary files of atomic writes. A `.old-step-*` folder whose `step-*` is missing is the
only copy of that step (the kill fell between the two renames of a replacing save): it is put back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path

log = logging.getLogger("leantune")

LOCK_NAME = ".leantune.lock"
CHECKPOINT_PREFIX = "step-"


class RunFolderError(ValueError):
    """The output folder cannot be used as asked (another run, held by a process); names the folder."""


# -- lock ------------------------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True          # it exists, owned by someone else
    return True


def _holder(lock: Path) -> dict | None:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return None


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"process {holder.get('pid')} on {holder.get('host')} ({holder.get('command', '?')}, since {started})"


def acquire_lock(root: Path) -> Path:
    """Create root/.leantune.lock for this process, or raise `RunFolderError` naming its holder."""
    root.mkdir(parents=True, exist_ok=True)
    lock = root / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv) or "python",
          "started": time.time()}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if holder is None:
                # Being written by its creator right now, or a kill mid-write left it empty.
                time.sleep(0.2)
                holder = _holder(lock)
            if holder and holder.get("pid") == os.getpid() and holder.get("host") == me["host"]:
                raise RunFolderError(f"{root}: this process already trains into this folder")
            if holder and (holder.get("host") != me["host"] or _pid_alive(int(holder.get("pid", -1)))):
                raise RunFolderError(f"{root}: the output folder is in use by {_describe(holder)}; wait for it to "
                                     f"finish or give this run another [output] dir (lock file {lock})")
            what = _describe(holder) if holder else "an unreadable lock"
            log.warning("%s: taking over the lock left by %s, which is no longer running", root, what)
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
            f.flush()
            os.fsync(f.fileno())
        return lock
    raise RunFolderError(f"{root}: could not take the lock file {lock}")


def release_lock(lock: Path) -> None:
    holder = _holder(lock)
    if holder and holder.get("pid") == os.getpid():
        lock.unlink(missing_ok=True)


# -- what a run leaves ------------------------------------------------------------------------------

def run_entries(root: Path, name: str) -> list[Path]:
    """What a run named `name` wrote into `root` (the paths of trainer.RunPaths, the exports)."""
    if not root.is_dir():
        return []
    fixed = [root / n for n in ("checkpoints", "loss.json", "loss.png", "memory.png", "memory.json", "train.log",
                                "samples", "tensorboard")]
    found = [p for p in fixed if p.exists()]
    exports = [p for p in root.iterdir() if p.name.startswith((f"{name}_", f"{name}-step"))]
    return found + sorted(exports)


def _holds_run(entries: list[Path]) -> bool:
    """A folder holds a run when it has a checkpoint, a loss history or an exported file; an empty
    checkpoints folder or a lone log of a run that failed at once does not count."""
    for p in entries:
        if p.name == "checkpoints":
            if any(c.name.startswith(CHECKPOINT_PREFIX) for c in p.iterdir()):
                return True
        elif p.name not in ("train.log", "tensorboard", "memory.json", "memory.png"):
            return True
    return False


def check_folder(root: Path, name: str, resume: bool, overwrite: bool) -> None:
    """Refuse a folder that holds another run unless `resume` or `overwrite`; `overwrite` clears it."""
    if resume and overwrite:
        raise RunFolderError("--resume and --overwrite contradict each other: --resume continues the run in "
                             f"{root}, --overwrite deletes it; give one")
    entries = run_entries(root, name)
    if resume or not _holds_run(entries):
        return
    if not overwrite:
        shown = ", ".join(p.name for p in entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise RunFolderError(f"{root}: the output folder holds another run ({shown}); pass --resume to continue "
                             f"it, or --overwrite to delete it and start again (nothing was changed)")
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    log.info("--overwrite: removed the earlier run in %s (%d entries)", root, len(entries))


def clean_leftovers(root: Path) -> list[Path]:
    """Remove what a killed save left (see the module doc); returns what was removed or restored."""
    touched: list[Path] = []
    ckpts = root / "checkpoints"
    if ckpts.is_dir():
        for p in ckpts.iterdir():
            if p.name.startswith(f".tmp-{CHECKPOINT_PREFIX}"):
                shutil.rmtree(p, ignore_errors=True)
                touched.append(p)
            elif p.name.startswith(f".old-{CHECKPOINT_PREFIX}"):
                final = ckpts / p.name[len(".old-"):].rsplit("-", 1)[0]
                if final.exists():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.replace(p, final)
                    log.warning("restored %s from %s (a save was killed while replacing it)", final, p.name)
                touched.append(p)
    for folder in (root, root / "samples"):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):          # io.atomic_write's temporary files
                if p.is_file():
                    p.unlink(missing_ok=True)
                    touched.append(p)
    if touched:
        log.info("removed %d leftover temporary file(s) of an interrupted save in %s", len(touched), root)
    return touched


class RunFolder:
    """`with RunFolder(root, name, resume, overwrite):` — lock, check, clean; the lock goes at exit."""

    def __init__(self, root: Path, name: str, resume: bool = False, overwrite: bool = False, enabled: bool = True):
        self.root, self.name, self.resume, self.overwrite, self.enabled = Path(root), name, resume, overwrite, enabled
        self.lock: Path | None = None

    def __enter__(self) -> "RunFolder":
        if not self.enabled:
            return self
        if self.resume and self.overwrite:
            check_folder(self.root, self.name, True, True)
        self.lock = acquire_lock(self.root)
        try:
            check_folder(self.root, self.name, self.resume, self.overwrite)
            clean_leftovers(self.root)
        except BaseException:
            release_lock(self.lock)
            raise
        return self

    def __exit__(self, *exc) -> bool:
        if self.lock is not None:
            release_lock(self.lock)
        return False


def restore_exports(t, paths, step: int, last_step: int, formats: list[str]) -> list[Path]:
    """On resume: a kill between a step's state save and its LoRA export leaves the step without its
    files; write them from the resumed state (LoRA mode, intermediate steps; the final files are
    written at the end of every run anyway)."""
    if getattr(t.mode, "name", None) != "lora" or step >= last_step or not t.dist.is_main:
        return []
    if all(paths.lora_file(fmt, step).exists() for fmt in formats):
        return []
    files = t.mode.export(t, paths, step, True)
    log.info("rewrote the LoRA files of step %d from its saved state: %s", step, ", ".join(str(f) for f in files))
    return files
