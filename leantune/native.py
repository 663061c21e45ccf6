"""Small native libraries built on first use: the build and load machinery the host kernels share.

Why: a few element loops (the host optimizer step, train/host_kernels.py; quantizing a load to
fp8, memory/fp8_kernels.py) run billions of times on the CPU, where torch ops cost several passes
and full-size temporaries. Each is a plain C file (no torch headers) next to its Python module. The
simulated GPU's device guard (memory/simulated.py: C++ against torch's headers) is built and loaded
by the same machinery into its own folder, simulated_device/.

How a library is built: with the system C compiler ($CC, else cc or gcc; -O3 -march=native) into
$LEANTUNE_CACHE_DIR (else ~/.cache/leantune)/host_kernels/ the first time it is needed (about a
second), never at import; the file name carries a hash of the source, the compiler, the flags and
the CPU's feature flags. The build writes the library and, beside it, `<name>.so.sha256` (the
library's sha256, in `sha256sum` format), each under a temporary name and renamed, so concurrent
processes never read a half-written file.

What is loaded, and why so strict: a library's constructor runs with the rights of the process
that loads it, and its file name is computed from public inputs, so anyone who can write into the
folder could plant one for the next run (a team's cache on a shared disk, a folder another local
user created with mode 0777). So:
- the cache root and the library's folder (host_kernels/, simulated_device/) must be owned by this
  user (or root) and not writable by group or others. Where missing they are created with mode
  0700, and so is every missing folder above the root (`make_private_folders`; every cache folder
  leantune makes, the planner's too, is made that way). One of this user's own that is writable by
  group or others (made under a umask of 002, as Ubuntu's default, before leantune made its folders
  0700) is tightened (chmod go-w) and used, said once at info level; one owned by another user, a
  sticky one (1777: /tmp, a folder shared on purpose), a library folder that is a symbolic link, and
  a root that is a link to a folder writable by group or others (never chmod-ed through the link)
  are not used at all: nothing is built or loaded in it.
- the library and its digest file must be regular files (no symlink is followed), owned by this
  user (or root), not writable by group or others; one that breaks this is refused, not replaced.
- only bytes whose sha256 equals the digest the build recorded are loaded. The file is read into
  memory, hashed, and those same bytes are written to a private copy (mkstemp: a random name,
  mode 0600, in the 0700 folder) that is loaded and unlinked at once. Why a copy rather than
  dlopen of /proc/self/fd/N of the checked file: it needs no /proc (absent in some containers and
  sandboxes, and off Linux), and what the loader maps is exactly the bytes that were hashed, not
  an inode that someone with write access could change after the check.
- a file at the library's name that is no library the build recorded (its digest file missing,
  as from a leantune before digests, or not matching; ctypes cannot load it; a function is
  missing) is rebuilt once, in this process; only if the rebuild fails too is it unavailable.

Where no compiler exists, a folder or file is refused, the build fails, or LEANTUNE_HOST_KERNELS=0,
`NativeLibrary.get()` returns None and the caller keeps its torch-op path; `unavailable_reason()`
is one sentence naming the path and the reason. It is logged once per library per process, as a
warning with what the slower path means for results (`note`), or at info level for
LEANTUNE_HOST_KERNELS=0 (the user's own choice, nothing to warn about). `NativeLibrary.load()`
raises that sentence instead (Unavailable), for a caller without a slower path (the simulated GPU).

-ffp-contract=off: no fused multiply-adds the source does not spell, so results are those of the
written IEEE operations (the fp8 quantizer is bitwise torch's; the optimizer's tolerances are
stated against a known operation order). No -ffast-math, for the same reason.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("leantune")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd", "-shared", "-fPIC")
FALLBACK = "the slower torch-op path is used"
COMPILE_TIMEOUT_S = 120


class Unavailable(Exception):
    """Why a library is not used: one sentence naming the path (or source) and the reason."""


class _Stale(Exception):
    """A file at the library's name that is not a library this build recorded: rebuilt once."""


def cache_root() -> Path:
    return Path(os.environ.get("LEANTUNE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "leantune"))


def cache_dir() -> Path:
    return cache_root() / "host_kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_identity() -> str:
    """The CPU's architecture and feature flags (Linux: /proc/cpuinfo), else the platform's name."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return platform.machine() + line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _ownership_problem(st: os.stat_result) -> str | None:
    """What lets another user change what this file or folder holds, as a phrase; None if nothing.

    Root is trusted as an owner (it can replace anything anyway; a cache made under sudo stays
    usable); the sticky bit is not an excuse, since the rule is simpler to state and to check."""
    if not hasattr(os, "geteuid"):
        return None
    if st.st_uid not in (os.geteuid(), 0):
        try:
            import pwd

            who = f"{pwd.getpwuid(st.st_uid).pw_name}, uid {st.st_uid}"
        except (ImportError, KeyError):
            who = f"uid {st.st_uid}"
        return f"is owned by another user ({who})"
    writable = st.st_mode & 0o022
    if writable:
        by = {0o020: "group", 0o002: "others", 0o022: "group and others"}[writable]
        return f"is writable by {by} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private_folders(path: str | os.PathLike) -> Path:
    """Create the folder `path` and every missing folder above it with mode 0700 (a umask can only
    clear bits of it); folders that exist are left as they are. Every cache folder leantune makes
    is made this way (os.makedirs gives the folders above the last the default mode instead)."""
    path = Path(os.path.abspath(path))
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for q in reversed(missing):
        try:
            os.mkdir(q, 0o700)
        except FileExistsError:          # made meanwhile (another process); checked by whoever needs it
            pass
    return path


def _checked_folder(path: Path, link_ok: bool = False) -> None:
    """`path` is a folder only this user (or root) can write, else Unavailable; one of this user's
    own that is only writable by group or others, and not sticky, is tightened (chmod go-w) instead,
    and said so.
    A symbolic link is refused unless `link_ok` (the cache root may be a link the user made to
    another disk); the folder behind a link is checked, never tightened. The checks and the chmod
    are of one descriptor, opened without following a link, so they are of the same folder."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    link = False
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        if not link_ok:
            raise Unavailable(f"{path} is a symbolic link: not loading libraries from it (remove it, and "
                              "leantune makes its own folder)") from None
        link = True
        fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise Unavailable(f"{path} is not a folder: not building libraries in it")
        problem = _ownership_problem(st)
        # Sticky (1777: /tmp, a folder shared on purpose): others' files are meant to be there, and
        # the folder is not leantune's to close; refused below.
        if (problem and not link and st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX
                and hasattr(os, "fchmod")):
            mode = stat.S_IMODE(st.st_mode)
            try:
                os.fchmod(fd, mode & ~0o022)
            except OSError:              # a read-only file system: refused below, with the fix to apply
                pass
            else:
                log.info("%s %s: made it %04o (chmod go-w), since leantune loads libraries only from folders "
                         "only you can write", path, problem.replace("is writable", "was writable"), mode & ~0o022)
                return
    finally:
        os.close(fd)
    if problem:
        fix = ("set LEANTUNE_CACHE_DIR to a folder of your own" if problem.startswith("is owned")
               else f"chmod go-w {path}, or set LEANTUNE_CACHE_DIR to a folder only you can write")
        raise Unavailable(f"{path} {problem}: not loading libraries from it ({fix})")


def private_folder(name: str = "host_kernels") -> Path:
    """The library folder `name` of the cache, checked (module docstring), created with mode 0700
    where missing, as the cache root and every missing folder above it are."""
    root = cache_root()
    folder = root / name
    try:
        make_private_folders(root)
        _checked_folder(root, link_ok=True)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        _checked_folder(folder)
    except OSError as e:
        raise Unavailable(f"{folder} cannot be made or read ({e.strerror or e})") from None
    return folder


def _read_private(path: Path) -> bytes:
    """The bytes of a regular file only this user (or root) can write, read through one descriptor
    that follows no symlink, so the checks and the bytes are of the same file. FileNotFoundError
    if absent; Unavailable if another user could have written it; _Stale if it is no regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _Stale(f"{path} is a symbolic link" if e.errno == errno.ELOOP
                     else f"{path} cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _Stale(f"{path} is not a regular file")
        problem = _ownership_problem(st)
        if problem:
            raise Unavailable(f"{path} {problem}: not loading it (remove it, and leantune builds its own)")
        return f.read()


def _write_private(path: Path, data: bytes) -> None:
    """`data` at `path`, atomically: a mode-0600 temporary beside it, synced, then renamed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _load_bytes(data: bytes, folder: Path, name: str, opener: Callable[[str], object] = ctypes.CDLL):
    """`opener`'s library of exactly these bytes (ctypes' by default), through a private copy loaded
    and unlinked at once (module docstring: why a copy)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".load.so")
    except OSError as e:
        raise Unavailable(f"{folder} is not writable ({e.strerror or e}): the private copy a library is loaded "
                          "from cannot be made there") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return opener(tmp)
    finally:
        os.unlink(tmp)


def _digest_path(out: Path) -> Path:
    return out.with_name(out.name + ".sha256")


class NativeLibrary:
    """One C file's library, built and loaded once per process on the first `get()`.

    `declare(lib)` sets the functions' ctypes signatures (a missing function raises AttributeError
    there). `extra_flags` follow FLAGS on the compiler's command line. `note` says what the torch-op
    path means for results, for the one warning given when the library is not used.

    Another kind of library (memory/simulated.py: C++ against torch's headers, loaded by torch)
    overrides `folder` and the methods between `flags` and `open`; the checks, the digest, the
    private copy and the one rebuild stay these."""

    folder = "host_kernels"          # the cache's folder this library is kept in

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], extra_flags: tuple[str, ...] = (),
                 note: str = ""):
        self.source, self.declare, self.extra_flags, self.note = source, declare, tuple(extra_flags), note
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._reason = ""

    def flags(self) -> tuple[str, ...]:
        return (*FLAGS, *self.extra_flags)

    def find_compiler(self) -> str | None:
        return compiler()

    def no_compiler(self) -> str:
        """Why nothing can be built without a compiler: one sentence."""
        return f"{self.source.name} cannot be built: no C compiler on PATH ($CC, cc, gcc)"

    def key(self, cc: str) -> bytes:
        """What the library's file name is a hash of."""
        # -march=native: the library is for this CPU, so its instruction sets are part of the key (a
        # home directory shared with another machine never hands it a library it cannot run).
        return self.source.read_bytes() + cc.encode() + " ".join(self.flags()).encode() + cpu_identity().encode()

    def command(self, cc: str, out: str) -> list[str]:
        """The compiler's command line that writes the library to `out`."""
        return [cc, *self.flags(), str(self.source), "-o", out, "-lm"]

    def check_buildable(self) -> None:
        """Unavailable where the build cannot work (before the compiler is run)."""

    def open(self, path: str):
        """The library at `path` loaded (ctypes'); OSError if it does not load."""
        return ctypes.CDLL(path)

    def library_path(self, cc: str | None = None) -> Path | None:
        """Where the build keeps this library on this machine (None without a compiler)."""
        cc = cc or self.find_compiler()
        if cc is None:
            return None
        return cache_root() / self.folder / f"{self.source.stem}-{hashlib.sha256(self.key(cc)).hexdigest()[:16]}.so"

    def get(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            if os.environ.get("LEANTUNE_HOST_KERNELS", "1") == "0":
                self._reason = f"LEANTUNE_HOST_KERNELS=0: {self.source.name} is not used; {FALLBACK}"
                log.info("%s", self._reason)
            else:
                try:
                    self._lib = self.load()
                except Unavailable as e:
                    self._reason = f"{e}; {FALLBACK}"
                if self._reason:
                    log.warning("%s%s", self._reason, f" ({self.note})" if self.note else "")
            self._tried = True
        return self._lib

    def unavailable_reason(self) -> str:
        self.get()
        return self._reason

    def load(self):
        """The library, loaded from a verified private copy, built or rebuilt (once) first where
        missing or stale; Unavailable, one sentence naming the path, where it cannot be had. Each
        call loads anew (get() keeps the first)."""
        try:
            folder, cc, out = self._where()
            stale = ""
            try:
                return self._load_recorded(out)
            except FileNotFoundError:
                pass
            except _Stale as e:
                stale = str(e)
                log.info("%s; rebuilding it", stale)
            data = self._compile(cc, out)
            try:
                return self._declared(_load_bytes(data, folder, out.name, self.open))
            except (OSError, AttributeError) as e:
                raise Unavailable(f"{out} was just {'rebuilt' if stale else 'built'} and does not load ({e})") from None
        except OSError as e:        # anything the steps above did not name (the source unreadable, ...)
            raise Unavailable(f"{self.source.name} could not be built or loaded ({e})") from None

    def build(self) -> Path:
        """The library's path once it holds a library this user built and recorded, building or
        rebuilding it (once) where missing or stale by its digest; not loaded (`load` also rebuilds
        a recorded one that does not load). Unavailable as for `load`."""
        try:
            _, cc, out = self._where()
            try:
                self._recorded(out)
                return out
            except FileNotFoundError:
                pass
            except _Stale as e:
                log.info("%s; rebuilding it", e)
            self._compile(cc, out)
            return out
        except OSError as e:
            raise Unavailable(f"{self.source.name} could not be built ({e})") from None

    def _where(self) -> tuple[Path, str, Path]:
        folder = private_folder(self.folder)
        cc = self.find_compiler()
        if cc is None:
            raise Unavailable(self.no_compiler())
        return folder, cc, self.library_path(cc)

    def _declared(self, lib: ctypes.CDLL) -> ctypes.CDLL:
        self.declare(lib)
        return lib

    def _recorded(self, out: Path) -> bytes:
        """The bytes at `out` if they are the library its build recorded; _Stale if they are not."""
        data = _read_private(out)
        digest = _digest_path(out)
        try:
            recorded = _read_private(digest).split()[0].decode("ascii")
        except FileNotFoundError:
            raise _Stale(f"{out} has no recorded digest ({digest.name} is missing)") from None
        except (IndexError, UnicodeDecodeError):
            raise _Stale(f"{digest} holds no digest") from None
        if hashlib.sha256(data).hexdigest() != recorded:
            raise _Stale(f"{out} does not match the digest its build recorded in {digest.name}")
        return data

    def _load_recorded(self, out: Path) -> ctypes.CDLL:
        """The library at `out` if it is the one its build recorded; _Stale if it is not."""
        data = self._recorded(out)
        try:
            lib = _load_bytes(data, out.parent, out.name, self.open)
        except OSError as e:
            raise _Stale(f"{out} does not load ({e})") from None
        try:
            return self._declared(lib)
        except AttributeError as e:
            raise _Stale(f"{out} lacks a function ({e})") from None

    def _compile(self, cc: str, out: Path) -> bytes:
        """Compile the source, record the library and its digest in the cache, return its bytes."""
        self.check_buildable()
        tmp = ""
        try:
            fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".build")
            os.close(fd)
            cmd = self.command(cc, tmp)
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise Unavailable(f"{self.source.name} did not compile within {COMPILE_TIMEOUT_S} s ({cc})") from None
            if done.returncode != 0:
                log.info("%s failed:\n%s", " ".join(cmd), done.stderr[-1500:])
                lines = [line.strip() for line in done.stderr.splitlines() if line.strip()] or ["no message"]
                first = next((line for line in lines if "error" in line), lines[-1])
                raise Unavailable(f"{self.source.name} did not compile with {cc} (exit {done.returncode}: {first})")
            with open(tmp, "rb") as f:
                data = f.read()
        except OSError as e:
            raise Unavailable(f"{self.source.name} could not be compiled with {cc} ({e.strerror or e})") from None
        finally:
            if tmp and os.path.lexists(tmp):
                os.unlink(tmp)
        try:
            _write_private(_digest_path(out), f"{hashlib.sha256(data).hexdigest()}  {out.name}\n".encode())
            _write_private(out, data)
        except OSError as e:
            raise Unavailable(f"{out} cannot be written ({e.strerror or e})") from None
        return data


_reserved = threading.local()


def leave_a_core() -> None:
    """On the calling thread, split the kernels' work over one thread fewer than torch's count (the
    host-step worker: the autograd thread running the device's backward beside it launches kernels
    and must not wait for a core)."""
    _reserved.cores = 1


def kernel_threads() -> int:
    """The ranges a tensor is split into on this thread, at most (torch's intra-op thread count,
    less a core the thread left to another, leave_a_core)."""
    import torch

    return max(1, torch.get_num_threads() - getattr(_reserved, "cores", 0))


def parallel(fn, ranges: list[tuple[int, int]]) -> list:
    """fn(lo, hi) over the ranges: the first on this thread, the rest on a shared pool (a C call
    through ctypes drops the GIL, so the ranges run at once)."""
    global _pool
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="leantune-host-kernel")
    futs = [_pool.submit(fn, lo, hi) for lo, hi in ranges[1:]]
    first = fn(*ranges[0])
    return [first] + [f.result() for f in futs]
