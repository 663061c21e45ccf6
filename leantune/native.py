"""Small C libraries built on first use: the build and load machinery the host kernels share.

Why: a few element loops (the host optimizer step, train/host_kernels.py; quantizing a load to
fp8, memory/fp8_kernels.py) run billions of times on the CPU, where torch ops cost several passes
and full-size temporaries. Each is a plain C file (no torch headers) next to its Python module.

How a library is built: with the system C compiler ($CC, else cc or gcc; -O3 -march=native) into
$LEANTUNE_CACHE_DIR (else ~/.cache/leantune)/host_kernels/ the first time it is needed (about a
second), never at import; the file name carries a hash of the source, the compiler, the flags and
the CPU's feature flags, and it is written under a temporary name and renamed, so concurrent
processes never load a half-written file. Where no compiler exists, or the build fails, or
LEANTUNE_HOST_KERNELS=0, `NativeLibrary.get()` returns None and the caller keeps its torch-op path;
`unavailable_reason()` says why.

-ffp-contract=off: no fused multiply-adds the source does not spell, so results are those of the
written IEEE operations (the fp8 quantizer is bitwise torch's; the optimizer's tolerances are
stated against a known operation order). No -ffast-math, for the same reason.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd", "-shared", "-fPIC")


def cache_dir() -> Path:
    root = os.environ.get("LEANTUNE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "leantune")
    return Path(root) / "host_kernels"


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


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library of `source`, compiled now unless the cache holds this exact build."""
    flags = (*FLAGS, *extra_flags)
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler on PATH ($CC, cc, gcc)")
    # -march=native: the library is for this CPU, so its instruction sets are part of the key (a
    # home directory shared with another machine never hands it a library it cannot run).
    key = hashlib.sha256(source.read_bytes() + cc.encode() + " ".join(flags).encode()
                         + cpu_identity().encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd = [cc, *flags, str(source), "-o", str(tmp), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-1500:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


class NativeLibrary:
    """One C file's library, built and loaded once per process on the first `get()`.

    `declare(lib)` sets the functions' ctypes signatures; a missing symbol or a failed build leaves
    `get()` None with the reason kept. `extra_flags` follow FLAGS on the compiler's command line."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None], extra_flags: tuple[str, ...] = ()):
        self.source, self.declare, self.extra_flags = source, declare, tuple(extra_flags)
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self._reason = ""

    def get(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            if os.environ.get("LEANTUNE_HOST_KERNELS", "1") == "0":
                self._reason = "LEANTUNE_HOST_KERNELS=0"
            else:
                try:
                    lib = ctypes.CDLL(str(build(self.source, self.extra_flags)))
                    self.declare(lib)
                    self._lib = lib
                except (OSError, AttributeError, RuntimeError, subprocess.TimeoutExpired) as e:
                    self._reason = f"{self.source.name} not built: {e}"
            self._tried = True
        return self._lib

    def unavailable_reason(self) -> str:
        self.get()
        return self._reason


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
