"""A full disk, said plainly: which path, how much was needed, how much is free, what is intact.

Every save in leantune is atomic (io.atomic_write, train/state.save_checkpoint), so running out of
space loses nothing already saved; the user needs to know where space ran out and how much to
free, not a traceback from deep inside a writer.
"""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable


class DiskFullError(OSError):
    """No space left while writing; the message names the path and the bytes needed."""


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def human(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def disk_full_guard(path: str | Path, needed: int | Callable[[], int | None] | None, intact: str):
    """Turn ENOSPC / EDQUOT inside the block into a `DiskFullError` naming `path`, the bytes
    `needed` (a number or a function computing it lazily), the free bytes, and `intact` (what the
    user still has, e.g. "the last save (step 200) is intact")."""
    try:
        yield
    except OSError as e:
        if not is_disk_full(e) or isinstance(e, DiskFullError):
            raise
        where = Path(e.filename) if e.filename else Path(path)
        amount = needed() if callable(needed) else needed
        free = _free_bytes(Path(path))
        need = f"about {human(amount)} needed, " if amount else ""
        raise DiskFullError(f"disk full writing {where}: {need}{human(free)} free on that disk; "
                                     f"{intact}. Free some space and run again") from None
