"""File I/O shared by every saver and loader: atomic writes, safetensors only, pickle refused.

A save writes to a temporary file in the destination folder, fsyncs it, renames it over the
target and fsyncs the folder, so a crash or a full disk never leaves a half-written file under
the real name: the previous version stays intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

PICKLE_SUFFIXES = {".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"}


class UnsafeFileError(ValueError):
    """A file format that can run code when loaded (pickle) was given."""


class UnreadableFileError(ValueError):
    """A file that should be safetensors is truncated, garbled or something else entirely."""


def refuse_pickle(path: str | Path, what: str = "file") -> Path:
    """Raise a clear error for pickle-based checkpoint formats; return the path otherwise."""
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnsafeFileError(
            f"{path}: {what} is a pickle-based {path.suffix} file, which can run arbitrary code when loaded; "
            f"leantune reads only .safetensors. Convert it to safetensors with a tool you trust first."
        )
    return path


def _target_mode(path: Path) -> int:
    """The permissions the file would get from a plain open(): the existing file's when it is
    replaced, else 0o666 less the umask. mkstemp creates 0o600, which would leave LoRAs, samples
    and caches unreadable to the other users of a shared machine."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # Linux reports it without changing it; os.umask() can only read it by setting it, which
    # briefly affects files other threads (TensorBoard's writer) create.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)`, then fsync and rename tmp over `path`. On any error the tmp is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, _target_mode(path))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        try:
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=True).encode())


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Atomic safetensors save. Tensors are made contiguous and moved to CPU first."""
    from safetensors.torch import save_file

    clean = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}

    def write(tmp: Path) -> None:
        try:
            save_file(clean, str(tmp), metadata=meta)
        except Exception as e:
            raise _as_os_error(e, path) from None

    return atomic_write(path, write)


def _as_os_error(e: Exception, path: Path) -> Exception:
    """safetensors reports a failed write (a full disk: "... (os error 28)") as its own
    SafetensorError, not an OSError; give it back its errno so disk.disk_full_guard and callers
    see what it is. Anything else is returned unchanged."""
    import re

    found = re.search(r"\(os error (\d+)\)", str(e))
    if type(e).__name__ != "SafetensorError" or not found:
        return e
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def save_safetensors_streamed(path: str | Path, layout: list[tuple[str, tuple[int, ...], torch.dtype]],
                              chunks, metadata: dict[str, str] | None = None, digest=None) -> Path:
    """Atomic safetensors save without holding the tensors in memory at once.

    `layout` lists (key, shape, dtype) in file order, so the header can be written first; `chunks`
    then yields {key: tensor} dicts (a block at a time) covering the layout in that order. `digest`
    (a hashlib object) is fed every byte written, a checksum with no second read of the file. Each
    tensor is written from its own memory (moved to CPU alone if it lives elsewhere), so host RAM
    holds at most one chunk beyond what the caller already has: safetensors' own `save_file`
    serializes every tensor to bytes first, a second copy of a whole model.
    """
    import struct

    header: dict = {"__metadata__": {k: str(v) for k, v in (metadata or {}).items()}} if metadata else {}
    offset = 0
    for key, shape, dtype in layout:
        n = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    expected = iter(layout)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            def put(data) -> None:
                f.write(data)
                if digest is not None:
                    digest.update(data)

            put(struct.pack("<Q", len(raw)))
            put(raw)
            for chunk in chunks:
                for key, t in chunk.items():
                    want, shape, dtype = next(expected)
                    if key != want or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                        raise ValueError(f"{path}: tensor {key!r} {tuple(t.shape)} {t.dtype} does not match the "
                                         f"header entry {want!r} {tuple(shape)} {dtype}")
                    put(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if next(expected, None) is not None:
                raise ValueError(f"{path}: fewer tensors were written than the header lists")

    return atomic_write(path, write)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def file_sha256(path: str | Path, chunk: int = 1 << 24) -> str:
    """The sha256 of a file's bytes, read in chunks (a checkpoint can be larger than RAM)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def load_safetensors(path: str | Path, device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Load tensors and the header metadata. Refuses pickle files; names the file on a corrupt header."""
    from safetensors import safe_open

    path = refuse_pickle(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise UnreadableFileError(f"{path}: not a readable safetensors file ({e})") from None
    return tensors, meta
