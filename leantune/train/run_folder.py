"""Guards around a run's output folder: one run per folder, one process at a time, no leftovers.

A folder that holds another run (checkpoints, loss history, exported files) is refused unless
`--resume` continues it or `--overwrite` replaces it: re-running a finished config would otherwise
overwrite its final files and leave old checkpoints that a later `--resume` would pick up.

A lock file `.leantune.lock` names the process that holds the folder (pid, host, command, start
time); a second run writing the same folder is refused with that name. A lock left by a killed
process (its pid no longer runs on this host) is taken over, with a line saying so.

`--overwrite` deletes only what the run folder's own record says leantune wrote: the manifest
`.leantune-run.json` lists the top-level entries a run created (the folders and files it made, the
exported files), added as they are made. Anything else that looks like a run's output (a `samples/`
or `checkpoints/` folder that was there before, a `<name>_*` document, a file dropped into an owned
folder) is foreign: the overwrite is refused, naming it, and nothing is deleted.

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
MANIFEST_NAME = ".leantune-run.json"
CHECKPOINT_PREFIX = "step-"
FIXED_ENTRIES = ("checkpoints", "loss.json", "loss.png", "memory.png", "memory.json", "train.log", "samples",
                 "tensorboard")
# What leantune writes inside the folders it owns; anything else there is the user's.
_OWNED_CONTENT = {
    "checkpoints": (CHECKPOINT_PREFIX, f"corrupt-{CHECKPOINT_PREFIX}", f".tmp-{CHECKPOINT_PREFIX}",
                    f".old-{CHECKPOINT_PREFIX}"),
    "samples": (CHECKPOINT_PREFIX, "."),          # step-000010.png and atomic writes' .*.tmp
    "tensorboard": ("events.out.tfevents.",),
}


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


def _unwritable(root: Path, what: Path, e: OSError) -> RunFolderError:
    return RunFolderError(f"{root}: cannot create {what} ({e.strerror or e}); the output folder must be writable: "
                          f"check its permissions, or give the run another [output] dir")


def acquire_lock(root: Path) -> Path:
    """Create root/.leantune.lock for this process, or raise `RunFolderError` naming its holder.

    A folder that cannot be written (read-only, no permission) is a `RunFolderError`; a full disk
    a `DiskFullError`; either way no lock file is left behind (an empty one would make the next
    run wait for a holder that never was)."""
    from ..disk import disk_full_guard, is_disk_full

    lock = root / LOCK_NAME
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if is_disk_full(e):
            with disk_full_guard(root, None, "nothing was written"):
                raise
        raise _unwritable(root, root, e) from None
    me = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv) or "python",
          "started": time.time()}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            fd = None
        except OSError as e:
            if is_disk_full(e):
                with disk_full_guard(lock, None, "nothing was written"):
                    raise
            raise _unwritable(root, lock, e) from None
        if fd is None:
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
        try:
            with disk_full_guard(lock, None, "nothing was written"), os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            lock.unlink(missing_ok=True)      # never an empty lock
            raise
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
    fixed = [root / n for n in FIXED_ENTRIES]
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


def _manifest(root: Path) -> set[str]:
    try:
        return set(json.loads((root / MANIFEST_NAME).read_text()).get("entries", []))
    except FileNotFoundError:
        return set()
    except (OSError, ValueError, AttributeError):
        log.warning("%s: unreadable; treating every entry of %s as not written by leantune", root / MANIFEST_NAME, root)
        return set()


def record_written(root: Path, paths) -> None:
    """Add the top-level entries of `paths` (under `root`) to the run's manifest."""
    from ..io import atomic_write_json

    root = Path(root)
    names = set()
    for p in paths:
        try:
            names.add(Path(p).relative_to(root).parts[0])
        except (ValueError, IndexError):
            continue
    known = _manifest(root)
    if names - known:
        atomic_write_json(root / MANIFEST_NAME, {"entries": sorted(known | names)})


def claim_fixed_entries(root: Path) -> None:
    """At the start of a run: the fixed entries that do not exist yet are this run's to make; one
    that is already there and unrecorded stays the user's (the run writes into it, never claims it)."""
    record_written(root, [root / n for n in FIXED_ENTRIES if not (root / n).exists()])


def foreign_entries(root: Path, entries: list[Path]) -> list[str]:
    """Of what a run's overwrite would delete, what the manifest does not say leantune wrote."""
    owned = _manifest(root)
    foreign = []
    for p in entries:
        if p.name not in owned:
            foreign.append(p.name + ("/" if p.is_dir() else ""))
        elif p.is_dir() and not p.is_symlink():
            allowed = _OWNED_CONTENT.get(p.name, ())
            foreign += sorted(f"{p.name}/{c.name}" for c in p.iterdir() if not c.name.startswith(allowed))
    return foreign


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
    foreign = foreign_entries(root, entries)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" (and {len(foreign) - 8} more)" if len(foreign) > 8 else "")
        raise RunFolderError(f"{root}: --overwrite deletes only what leantune wrote, and these entries were not "
                             f"written by leantune (its record {MANIFEST_NAME} does not list them): {shown}; move "
                             f"them away or give the run another [output] dir (nothing was deleted)")
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    (root / MANIFEST_NAME).unlink(missing_ok=True)
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
            claim_fixed_entries(self.root)
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
    written at the end of every run anyway). With [ema], its files too: the live files are written
    first, so a kill between the two leaves only the EMA's missing."""
    if getattr(t.mode, "name", None) != "lora" or step >= last_step or not t.dist.is_main:
        return []
    ema = getattr(t, "ema", None)
    live_missing = not all(paths.lora_file(fmt, step).exists() for fmt in formats)
    ema_missing = False
    if ema is not None:
        from .ema import ema_paths

        ema_missing = not all(ema_paths(paths).lora_file(fmt, step).exists() for fmt in formats)
    if not (live_missing or ema_missing):
        return []
    files = t.mode.export(t, paths, step, True) if live_missing else []
    if ema_missing:
        from .ema import export_ema

        files = files + export_ema(t, paths, step, True)
    record_written(paths.root, files)
    log.info("rewrote the LoRA files of step %d from its saved state: %s", step, ", ".join(str(f) for f in files))
    return files
