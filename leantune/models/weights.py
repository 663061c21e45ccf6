"""Per-tensor loading of safetensors checkpoints into models built on the meta device.

Why not `from_pretrained` / `from_single_file`: those load whole state dicts (or whole shards) and
know only their own key layouts; Flux checkpoints in the wild come as diffusers folders, BFL files,
ComfyUI fp8 and "scaled fp8" files and all-in-one files. Here every layout is reduced to a list of
`KeyOp`s (file key -> model key(s)), checked against the meta model's names and shapes from the
file headers alone, and only then read.

Every model tensor is a run of rows of one file tensor (a fused qkv splits into row ranges, BFL's
final adaLN swaps two halves, a conv-shaped linear weight is the same bytes), so the loader
allocates each parameter once, in its target dtype, and fills it from the file's mapping, casting
and dequantising (ComfyUI scaled fp8) chunk by chunk. Host RAM therefore holds the finished model
plus a few MiB, never a second copy of the model nor a full-precision copy of a tensor, and a
wrong file fails before a single weight is read. A caller may keep chosen e4m3 tensors in e4m3
(`keep_fp8`): their bytes are copied as stored, never converted, and their scales are handed to
the caller instead of being multiplied in. A run that stores block Linears in fp8 has them
quantized as they are read (`quantize_fp8`): chunks of rows go from the file through the load
dtype to block-scaled e4m3, so a bf16 or fp32 file never exists in host RAM in full precision,
only what is kept.

Files are mapped (mmap), not read: bytes come from the page cache without a copy into a staging
buffer (the kernel's copy of every byte was most of a load's system time), and each tensor's pages
are unmapped from the process once it is filled (`release`), so mapped pages never add more than a
tensor to the resident memory. A file changed on disk while it loads can end the process (SIGBUS),
as with any mmap-based loader; one truncated before is refused from its header.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from contextlib import ExitStack, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterable

import torch

from ..io import refuse_pickle


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the component/key."""


# safetensors header dtype names -> torch dtypes (the ones torch can hold) and their sizes.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}

# Keys ComfyUI fp8 files carry next to the weights: scales (used to dequantise) and markers/input
# scales (only meaningful to fp8 matmul kernels). None of them is a model parameter.
_WEIGHT_SCALE_SUFFIXES = ("scale_weight", "weight_scale")
_AUX_SUFFIXES = (".scale_weight", ".weight_scale", ".scale_input", ".input_scale", ".comfy_quant")
_AUX_KEYS = ("scaled_fp8",)

_MAX_HEADER = 100 * 2**20      # a safetensors header larger than this is certainly not one
STAGING_BYTES = 8 * 2**20      # file bytes read per chunk while filling a parameter
_FOLIO_GAP = 2 * 2**20         # tensors closer than this share a dropped range (drop_cached)
MAX_WORKERS = 8                # quantizing workers at most (each holds a few chunks of STAGING_BYTES)
# Host bytes a quantizing load holds beyond what it keeps (the planner prices its loading phase with
# it): each worker's chunk in the load dtype, its fp32 work buffer and a dequantised source chunk,
# each at most STAGING_BYTES, plus one chunk in flight.
QUANTIZING_WORK_BYTES = MAX_WORKERS * 4 * STAGING_BYTES


def is_auxiliary_key(key: str) -> bool:
    """True for fp8 scale/marker keys that accompany weights but are not parameters themselves."""
    return key.rsplit(".", 1)[-1] in _AUX_KEYS or key.endswith(_AUX_SUFFIXES)


def read_header(path: Path) -> tuple[dict, int]:
    """The parsed JSON header of a safetensors file and its length in bytes (the 8-byte prefix excluded)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise LoadError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw_len)
            if n > _MAX_HEADER or n > path.stat().st_size - 8:
                raise LoadError(f"{path}: not a safetensors file (header length {n} is implausible)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise LoadError(f"{path}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoadError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise LoadError(f"{path}: not a safetensors file (header is not a JSON object)")
    return header, n


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str                 # safetensors dtype name: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    start: int                 # absolute byte offsets of the data in the file
    end: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return _numel(self.shape[1:]) if self.shape else 1

    @property
    def floating(self) -> bool:
        return self.dtype in _FLOATING


class CheckpointFiles:
    """One key space over one or more safetensors files (the shards of a checkpoint), from headers only.

    Use as a context manager around reads to keep the files open; `read_rows_into` fills part of
    a tensor, `read` returns a whole one.
    """

    def __init__(self, paths: Iterable[str | Path]):
        self.paths = [refuse_pickle(Path(p)) for p in paths]
        if not self.paths:
            raise LoadError("no safetensors file to load")
        self.tensors: dict[str, TensorInfo] = {}
        self.metadata: dict[str, str] = {}
        for path in self.paths:
            if not path.is_file():
                raise LoadError(f"{path}: no such file")
            header, n = read_header(path)
            size = path.stat().st_size
            self.metadata.update(header.pop("__metadata__", None) or {})
            for key, info in header.items():
                try:
                    begin, stop = (int(o) + 8 + n for o in info["data_offsets"])
                    entry = TensorInfo(path, info["dtype"], tuple(int(s) for s in info["shape"]), begin, stop)
                except (KeyError, TypeError, ValueError):
                    raise LoadError(f"{path}: corrupt safetensors header entry for key {key!r}") from None
                if entry.dtype not in _DTYPES:
                    raise LoadError(f"{path}: key {key!r} has dtype {entry.dtype}, which leantune cannot load "
                                    f"(packed quantisation formats such as nf4/fp4 are not supported)")
                if stop > size or stop - begin != _DTYPES[entry.dtype].itemsize * _numel(entry.shape):
                    raise LoadError(f"{path}: key {key!r}: data does not fit its header (truncated or corrupt file)")
                if key in self.tensors:
                    raise LoadError(f"{path}: key {key!r} is also in {self.tensors[key].file}")
                self.tensors[key] = entry
        self._stamps = {path: _file_stamp(path) for path in self.paths}
        self._handles: dict[Path, object] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self._stack: ExitStack | None = None
        self._local = threading.local()                 # per-thread staging and quantize buffers
        self._pool = None                               # quantizing workers, while the files are open
        self._scales: dict[str, torch.Tensor] = {}

    @property
    def name(self) -> str:
        """The file (or folder and shard count) for error messages."""
        return str(self.paths[0]) if len(self.paths) == 1 else f"{self.paths[0].parent} ({len(self.paths)} shards)"

    def keys(self) -> list[str]:
        """Parameter keys: every key except fp8 scale/marker keys."""
        return [k for k in self.tensors if not is_auxiliary_key(k)]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].shape

    def shapes(self, prefix: str = "") -> dict[str, tuple[int, ...]]:
        """Shapes of the parameter keys under `prefix`, with the prefix removed."""
        return {k[len(prefix):]: self.tensors[k].shape for k in self.keys() if k.startswith(prefix)}

    # -- reading --------------------------------------------------------------------------------
    def __enter__(self) -> "CheckpointFiles":
        self._stack = ExitStack()
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()
        self._maps.clear()
        self._local = threading.local()
        self._scales.clear()
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        self._pool = None

    def _handle(self, path: Path):
        if self._stack is None:
            raise RuntimeError("CheckpointFiles reads need `with files:`")
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(open(path, "rb"))
        return self._handles[path]

    def _mapping(self, path: Path) -> mmap.mmap:
        """The file mapped (private, never written: pages come from the page cache, uncopied)."""
        if path not in self._maps:
            self._maps[path] = self._stack.enter_context(mmap.mmap(self._handle(path).fileno(), 0,
                                                                   access=mmap.ACCESS_COPY))
        return self._maps[path]

    def _source(self, info: TensorInfo, offset: int, nbytes: int, staging: str = "staging") -> torch.Tensor:
        """`nbytes` of `info`'s data from `offset` as a flat tensor of its dtype: a view of the
        mapped file (no copy; `release` drops its pages from this process afterwards), or, where
        the offset does not suit the dtype's alignment, a read into this thread's staging buffer."""
        dtype = _DTYPES[info.dtype]
        at = info.start + offset
        if nbytes and at % dtype.itemsize == 0:
            return torch.frombuffer(self._mapping(info.file), dtype=torch.uint8, count=nbytes, offset=at).view(dtype)
        return self._read_bytes(info, offset, nbytes, self._buffer(staging, nbytes, torch.uint8)).view(dtype)

    def changed_file(self) -> Path | None:
        """The first of the files whose size, modification time or inode differ from when their
        headers were read, or None: a load that reads for a long time (block by block into the
        disk tier) checks it between blocks."""
        for path, stamp in getattr(self, "_stamps", {}).items():
            try:
                now = _file_stamp(path)
            except OSError:
                return path
            if now != stamp:
                return path
        return None

    def drop_cached(self, keys: list[str], span: bool = False) -> None:
        """Drop the file pages of `keys` from the page cache (posix_fadvise DONTNEED): a block read
        into the disk tier is not read from this file again, and its cached pages would fill the
        host RAM the disk tier saves. One range per run of neighbouring tensors (`span`: one per
        file, from the first to the last of them): the kernel keeps a large folio that is not
        wholly inside the range, and a folio often holds the ends of two tensors. Pages still
        mapped, or on another core's LRU list just after being read, are kept too: the loader
        asks again once the files are closed."""
        advise = getattr(os, "posix_fadvise", None)
        by_file: dict[Path, list[tuple[int, int]]] = {}
        for key in keys:
            info = self.tensors[key]
            if isinstance(info, TensorInfo) and info.end > info.start:
                by_file.setdefault(info.file, []).append((info.start, info.end))
        if advise is None:
            return
        for path, spans in by_file.items():
            spans.sort()
            runs = [list(spans[0])]
            for a, b in spans[1:]:
                if span or a - runs[-1][1] <= _FOLIO_GAP:
                    runs[-1][1] = max(runs[-1][1], b)
                else:
                    runs.append([a, b])
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                for a, b in runs:
                    start = a - a % mmap.PAGESIZE
                    advise(fd, start, b - start, os.POSIX_FADV_DONTNEED)
            except OSError:                                # a filesystem that takes no advice
                pass
            finally:
                os.close(fd)

    def release(self, key: str) -> None:
        """Unmap the pages of `key` from this process (they stay in the page cache), so a file read
        through its mapping never adds more than a tensor to the resident memory."""
        info = self.tensors[key]
        self._release_range(info, info.start, info.end)

    def _release_range(self, info: TensorInfo, begin: int, end: int) -> None:
        """Unmap the file bytes [begin, end) of `info`'s file from this process (whole pages: the
        one holding `begin` too). A page another worker still reads is faulted in again from the
        page cache, unchanged: the mapping is private and never written."""
        m = self._maps.get(info.file)
        if m is None or end <= begin or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = begin - begin % mmap.PAGESIZE
        m.madvise(mmap.MADV_DONTNEED, start, end - start)

    def scale_key(self, key: str) -> str | None:
        """The ComfyUI scale key that dequantises `key` ("x.weight" -> "x.scale_weight"), if present."""
        if not key.endswith(".weight"):
            return None
        stem = key[: -len("weight")]
        for suffix in _WEIGHT_SCALE_SUFFIXES:
            if stem + suffix in self.tensors:
                return stem + suffix
        return None

    def _scale(self, key: str) -> torch.Tensor | None:
        """The fp32 dequantisation scale of `key`, as (1, 1) for a per-tensor scale or (rows, 1) per row."""
        skey = self.scale_key(key)
        if skey is None:
            return None
        if skey not in self._scales:
            info, sinfo = self.tensors[key], self.tensors[skey]
            s = self._read_bytes(sinfo, 0, sinfo.end - sinfo.start).view(_DTYPES[sinfo.dtype]).to(torch.float32)
            if s.numel() == 1:
                s = s.reshape(1, 1)
            elif s.numel() == info.rows:
                s = s.reshape(-1, 1)
            else:
                raise LoadError(f"{info.file}: key {skey!r} has shape {sinfo.shape}, which does not scale "
                                f"{key!r} of shape {info.shape} (per tensor or per row)")
            self._scales[skey] = s
        return self._scales[skey]

    def _read_bytes(self, info: TensorInfo, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """`nbytes` of `info`'s data from `offset`, into `out` (uint8). Positioned reads (pread), so
        the quantizing workers read their own chunks at once from one handle."""
        buf = out if out is not None else torch.empty(nbytes, dtype=torch.uint8)
        fd = self._handle(info.file).fileno()
        view, done = memoryview(buf.numpy()), 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:nbytes]], info.start + offset + done)
            if got <= 0:
                raise LoadError(f"{info.file}: file ends early (truncated)")
            done += got
        return buf

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable buffer of this thread (staging, quantize work), grown when too small."""
        buf = getattr(self._local, name, None)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            setattr(self._local, name, buf)
        return buf[:numel]

    def row_scales(self, key: str, segments: list[tuple[int, int]]) -> torch.Tensor:
        """The fp32 dequantisation scale of the rows `segments` of `key`, one per row: (rows, 1).
        1 where the file has no scale key (plain e4m3)."""
        rows = sum(b - a for a, b in segments)
        scale = self._scale(key)
        if scale is None:
            return torch.ones(rows, 1)
        if scale.shape[0] == 1:
            return scale.expand(rows, 1).clone()
        return torch.cat([scale[a:b] for a, b in segments])

    def read_rows_into(self, key: str, row_start: int, row_end: int, out: torch.Tensor,
                       dequantize: bool = True) -> None:
        """Fill the flat tensor `out` with rows [row_start, row_end) of `key`, cast to out's dtype and
        dequantised (unless not `dequantize`: raw values, the scale left to the caller), reading at
        most STAGING_BYTES at a time."""
        info = self.tensors[key]
        src_dtype = _DTYPES[info.dtype]
        row_bytes = info.row_numel * src_dtype.itemsize
        scale = self._scale(key) if dequantize else None
        rows_per_chunk = max(1, STAGING_BYTES // max(row_bytes, 1))
        if scale is None:                            # the mapped rows, copied once (cast, e.g. fp32 / fp8 -> bf16)
            rows_per_chunk = max(rows_per_chunk, row_end - row_start)
        for r0 in range(row_start, row_end, rows_per_chunk):
            r1 = min(row_end, r0 + rows_per_chunk)
            raw = self._source(info, r0 * row_bytes, (r1 - r0) * row_bytes)
            dst = out[(r0 - row_start) * info.row_numel:(r1 - row_start) * info.row_numel]
            if scale is None:
                dst.copy_(raw)
            else:
                rows = scale if scale.shape[0] == 1 else scale[r0:r1]
                dst.copy_((raw.view(r1 - r0, info.row_numel).to(torch.float32) * rows).view(-1))
            del raw                                  # no view of the mapping outlives its use

    def fill_rows_into(self, key: str, row_start: int, row_end: int, out: torch.Tensor,
                       dequantize: bool = True) -> None:
        """read_rows_into on this load's workers: chunks of about STAGING_BYTES of the file, each
        chunk's pages unmapped as soon as it is copied. Why: a tensor kept as it is read (a bf16
        modulation Linear, 38 % of what an fp8 Flux load keeps) was copied, then unmapped, on the
        calling thread while the workers idled; first-touch page faults make that copy cost a core
        for as long as the quantizing of the fp8 weights."""
        info = self.tensors[key]
        row_bytes = info.row_numel * _DTYPES[info.dtype].itemsize
        rows = max(1, STAGING_BYTES // max(row_bytes, 1))
        if row_end - row_start <= rows or self._stack is None:
            self.read_rows_into(key, row_start, row_end, out, dequantize)
            return
        if dequantize:
            self._scale(key)                              # read once, before the workers share it
        self._mapping(info.file)                          # opened here, not by racing workers
        width = info.row_numel

        def job(span: tuple[int, int]) -> None:
            r0, r1 = span
            self.read_rows_into(key, r0, r1, out[(r0 - row_start) * width:(r1 - row_start) * width], dequantize)
            self._release_range(info, info.start + r0 * row_bytes, info.start + r1 * row_bytes)

        self._map(job, [(r0, min(row_end, r0 + rows)) for r0 in range(row_start, row_end, rows)])

    def quantize_rows_into(self, key: str, segments: list[tuple[int, int]], dtype: torch.dtype,
                           q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
        """Fill the (rows, in) e4m3 `q_out` and its (rows, nb) fp32 `scale_out` with the rows
        `segments` of `key`, block-scaled as memory/fp8.quantize stores a weight: each chunk of
        rows is read, made exactly what a load in `dtype` holds (cast, dequantised), and quantized
        at once, so no full-precision copy of the tensor ever exists (a few MiB per worker).

        Chunks go to torch.get_num_threads() workers (at most MAX_WORKERS), each quantizing on one
        thread (memory/fp8_kernels.c where it is built, else torch's ops): on a busy machine one
        parallel region per op waits at every barrier for its slowest thread, while independent
        chunks only wait for the CPU."""
        from ..memory.fp8 import quantize_into

        info = self.tensors[key]
        width = info.row_numel
        self._scale(key)                                  # read once, before the workers share it
        self._handle(info.file)                           # opened here, not by racing workers
        rows_per_chunk = max(1, STAGING_BYTES // max(4 * width, 1))     # fp32 temporary <= STAGING_BYTES
        jobs, pos = [], 0
        for a, b in segments:
            for r0 in range(a, b, rows_per_chunk):
                r1 = min(b, r0 + rows_per_chunk)
                jobs.append((r0, r1, pos))
                pos += r1 - r0

        as_stored = _DTYPES[info.dtype] == dtype and self._scale(key) is None
        itemsize = _DTYPES[info.dtype].itemsize

        def job(j: tuple[int, int, int]) -> None:
            r0, r1, p = j
            n = r1 - r0
            if as_stored:                             # the mapped rows themselves: nothing to make first
                chunk = self._source(info, r0 * width * itemsize, n * width * itemsize, "work")
            else:
                chunk = self._buffer("work", n * width, dtype)
                self.read_rows_into(key, r0, r1, chunk)
            quantize_into(chunk.view(n, width), q_out[p:p + n], scale_out[p:p + n],
                          work=self._buffer("fp32", n * width, torch.float32))
            del chunk
            self._release_range(info, info.start + r0 * width * itemsize, info.start + r1 * width * itemsize)

        self._map(job, jobs)

    def _map(self, fn, jobs: list) -> None:
        """fn over jobs on this load's workers (one torch thread each), or here when one would do."""
        workers = min(torch.get_num_threads(), MAX_WORKERS, len(jobs))
        if workers <= 1 or self._stack is None:
            for j in jobs:
                fn(j)
            return
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(min(torch.get_num_threads(), MAX_WORKERS), "leantune-load")
            self._stack.callback(self._pool.shutdown)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for f in [self._pool.submit(fn, j) for j in jobs]:
                f.result()
        finally:
            torch.set_num_threads(threads)

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A whole tensor: in `dtype` if floating (default: as stored; fp32 when it is scaled fp8)."""
        if self._stack is None:
            with self:
                return self.read(key, dtype)
        info = self.tensors[key]
        if not info.floating or dtype is None:
            dtype = torch.float32 if self.scale_key(key) else _DTYPES[info.dtype]
        out = torch.empty(info.shape, dtype=dtype)
        self.read_rows_into(key, 0, info.rows, out.view(-1))
        return out


@dataclass(frozen=True)
class KeyOp:
    """How one file tensor becomes one or more model tensors, each a run of the file tensor's rows.

    split: sizes along dim 0 (a fused qkv, BFL's `linear1`), one per target; swap_halves: the two
    halves along dim 0 are exchanged (BFL's final adaLN stores shift before scale, diffusers scale
    before shift); reshape: the target shape when the file stores a linear weight conv-shaped.
    """

    source: str
    targets: tuple[str, ...]
    split: tuple[int, ...] | None = None
    swap_halves: bool = False
    reshape: tuple[int, ...] | None = None

    def target_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        if self.split is not None:
            return [(n, *shape[1:]) for n in self.split]
        if self.reshape is not None:
            return [tuple(self.reshape)]
        return [tuple(shape)]

    def segments(self, shape: tuple[int, ...]) -> list[list[tuple[int, int]]]:
        """Per target, the row ranges of the file tensor it consists of, in order."""
        rows = shape[0] if shape else 1
        if self.split is not None:
            out, start = [], 0
            for n in self.split:
                out.append([(start, start + n)])
                start += n
            return out
        if self.swap_halves:
            return [[(rows // 2, rows), (0, rows // 2)]]
        return [[(0, rows)]]

    def check(self, shape: tuple[int, ...]) -> str | None:
        """Why this op cannot apply to a tensor of `shape`, or None."""
        if self.split is not None and (not shape or sum(self.split) != shape[0] or min(self.split) <= 0):
            return f"cannot split shape {shape} into {self.split} along dim 0"
        if self.swap_halves and (not shape or shape[0] % 2):
            return f"cannot swap halves of shape {shape}"
        if self.reshape is not None and _numel(self.reshape) != _numel(shape):
            return f"cannot reshape {shape} to {self.reshape}"
        return None

    def apply(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The op on an in-memory tensor (same row semantics the loader streams from files)."""
        rows = t.reshape(t.shape[0] if t.dim() else 1, -1)
        return [torch.cat([rows[a:b] for a, b in segs]).reshape(shape)
                for segs, shape in zip(self.segments(tuple(t.shape)), self.target_shapes(tuple(t.shape)))]


def apply_ops(ops: Iterable[KeyOp], state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole in-memory state dict converted by `ops` (the loaders apply the same ops lazily instead)."""
    out = {}
    for op in ops:
        for target, t in zip(op.targets, op.apply(state_dict[op.source])):
            out[target] = t
    return out


def copy_ops(keys: Iterable[str], strip: str = "", rename: Callable[[str], str] | None = None) -> list[KeyOp]:
    """One-to-one ops for files already in the model's layout (optionally minus a prefix / renamed)."""
    ops = []
    for k in keys:
        name = k[len(strip):] if strip and k.startswith(strip) else k
        ops.append(KeyOp(k, ((rename(name) if rename else name),)))
    return ops


# -- loading straight into the disk tier (memory/disk_load.py) ----------------------------------------

_PARKING: ContextVar = ContextVar("leantune_parking", default=None)


@contextmanager
def parking(spill):
    """Inside: a transformer loaded to the CPU by load_into_empty has the blocks `spill.blocks`
    (memory/disk_load.BlockSpill: the plan's disk-tier blocks) read one at a time and parked in
    the disk tier's loading file as each is filled, so host RAM never holds them together. A
    context rather than an argument: every family's load_transformer ends in load_into_empty, and
    the loaders need not know the disk tier exists. A load whose model has none of those blocks
    (another component) is not affected."""
    token = _PARKING.set(spill)
    try:
        yield spill
    finally:
        _PARKING.reset(token)


def _parked_targets(model, provided: dict, spill) -> dict[str, str]:
    """Model key -> the disk-tier block it belongs to, for the blocks of `spill` that `model` has."""
    names = {n for n, _ in model.named_modules()}
    prefixes = [(b + ".", b) for b in spill.blocks if b in names]
    out = {}
    for target in provided:
        for prefix, block in prefixes:
            if target.startswith(prefix):
                out[target] = block
                break
    return out


def _by_block(parked: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for target, block in parked.items():
        out.setdefault(block, []).append(target)
    return out


def _check_unchanged(files) -> None:
    changed = getattr(files, "changed_file", lambda: None)()
    if changed is not None:
        raise LoadError(f"{changed}: the file was changed on disk while it was being loaded (its size, "
                        f"modification time or inode differ from when its header was read); load it again "
                        f"once nothing writes to it")


def _drop_source_pages(files, keys: list[str], span: bool = False) -> None:
    drop = getattr(files, "drop_cached", None)
    if drop is not None:
        drop(keys, span)


def _file_stamp(path: Path) -> tuple:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def build_empty(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Construct a model with its parameters on the meta device (no memory, no random init).

    Buffers stay real: some are computed in __init__ and never saved (CLIP's position ids).
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return factory()


def _tie_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """name -> all state-dict names that must share that tensor (shared objects + transformers ties)."""
    by_id: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(name)
    groups = {n: names for names in by_id.values() for n in names}
    ties = {}
    if hasattr(model, "get_expanded_tied_weights_keys"):   # transformers ties embeddings after loading
        ties = model.get_expanded_tied_weights_keys(all_submodels=True)
    for target, source in ties.items():
        if target in groups and source in groups and groups[target] is not groups[source]:
            merged = groups[source] + [n for n in groups[target] if n not in groups[source]]
            for n in merged:
                groups[n] = merged
    return groups


def _target_dtype(model: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a floating parameter gets: `dtype`, except modules the model keeps in fp32 (T5's `wo` in fp16)."""
    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if keep and dtype in (torch.float16, torch.bfloat16) and any(k in name.split(".") for k in keep):
        return torch.float32
    return dtype


def _assign_group(model: torch.nn.Module, names: list[str], tensor: torch.Tensor) -> None:
    """Put `tensor` under every name of a tie group: one Parameter object shared by all (as tying does)."""
    shared = None
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if leaf in module._parameters:
            if shared is None:
                shared = torch.nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
            module._parameters[leaf] = shared
        else:
            module._buffers[leaf] = tensor


def _listing(items: list[str]) -> str:
    shown = ", ".join(repr(k) for k in items[:5])
    return shown + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def _fill_quantized(model, files: CheckpointFiles, source: str, target: str, shape: tuple[int, ...],
                    segs: list[tuple[int, int]], names: list[str], dtype: torch.dtype, where: str, device,
                    on_fp8: Callable[[str, torch.Tensor], None]) -> None:
    """One weight quantized to block-scaled e4m3 while it is read (load_into_empty's quantize_fp8)."""
    from ..memory.fp8 import FP8_DTYPE, scale_blocks

    rows, width = shape
    q = torch.empty(rows, width, dtype=FP8_DTYPE, device=where)
    scale = torch.empty(rows, scale_blocks(width), dtype=torch.float32, device=where)
    if where != "meta":
        files.quantize_rows_into(source, segs, dtype, q, scale)
    _assign_group(model, names, q.to(device))
    on_fp8(target, scale.to(device))


def _is_gguf_linear(model, files, source: str, target: str, shape: tuple[int, ...]) -> bool:
    """True for a GGUF file's quantized tensor that is an nn.Linear's 2-D weight: it keeps its blocks."""
    if not (getattr(files, "is_blocks", None) and files.is_blocks(source)) or len(shape) != 2:
        return False
    module_name, _, leaf = target.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf == "weight" and type(module) is torch.nn.Linear


def _fill_gguf(model, files, source: str, target: str, shape: tuple[int, ...], segs: list[tuple[int, int]],
               names: list[str], meta: bool, device) -> None:
    """One Linear weight as its GGUF blocks, (rows, row_bytes) uint8, made computable by
    memory/gguf_storage.use_gguf_weight (models/gguf_file.py)."""
    from ..memory.gguf_storage import use_gguf_weight

    info = files.tensors[source]
    rows = sum(b - a for a, b in segs)
    raw = (torch.empty(rows, info.row_bytes, dtype=torch.uint8, device="meta") if meta
           else files.read_blocks(source, segs))
    for name in names:                                # frozen: integer bytes cannot require gradients
        module_name, _, leaf = name.rpartition(".")
        param = (model.get_submodule(module_name) if module_name else model)._parameters.get(leaf)
        if param is not None:
            param.requires_grad_(False)
    _assign_group(model, names, raw.to(device))
    use = getattr(files, "use_blocks", None) or use_gguf_weight      # int8 ConvRot files (gguf_file.ComfyInt8Files)
    use(model.get_submodule(target[: -len(".weight")]), info.qtype)


def load_into_empty(
    model: torch.nn.Module,
    files: CheckpointFiles,
    ops: list[KeyOp],
    *,
    what: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    unexpected_ok: Callable[[str], bool] = lambda key: False,
    source_name: Callable[[str], str] = lambda target: target,
    keep_fp8: Callable[[str], bool] | None = None,
    on_fp8: Callable[[str, torch.Tensor], None] | None = None,
    quantize_fp8: Callable[[str], bool] | None = None,
) -> torch.nn.Module:
    """Validate `ops` against the meta-built `model` from headers only, then fill it tensor by tensor.

    `what` names the component in messages ("a Flux transformer"); `unexpected_ok(file_key)` lets
    a family ignore known extra keys (a T5 decoder in a full T5 file); `source_name(model_key)`
    gives the file key a missing model key would have had, for the message.

    `keep_fp8(model_key)`: True for model tensors that stay float8_e4m3fn when the file stores them
    so; they are filled with the stored bytes (no conversion, no scaling) and, once in place,
    `on_fp8(model_key, scale)` receives their fp32 dequantisation scale, one per row: (rows, 1).

    `quantize_fp8(model_key)`: True for 2-D floating weights the run stores in fp8 (memory/fp8.py's
    block-scaled e4m3): they are quantized chunk by chunk as they are read (`dtype` first, exactly
    as a plain load holds them, so the bits equal quantizing that load) and handed to `on_fp8` with
    their (rows, nb) scale; a file's e4m3 tensor that `keep_fp8` keeps is kept instead. Where it
    returns "nf4" the weight becomes NF4 rows as it is read instead (memory/nf4_storage.fill_nf4), where
    "int8" int8 ConvRot rows (memory/int8_storage.fill_int8).

    A GGUF file's quantized Linear weights (models/gguf_file.py) keep their blocks as stored, with
    the GGUF forward (memory/gguf_storage.py); its other quantized tensors are decoded as read.

    On `device="meta"` nothing is read: every tensor gets the dtype and shape loading would give it
    (and fp8 weights their scale), which is what the planner prices a checkpoint by.
    """
    if (keep_fp8 is None and quantize_fp8 is None) != (on_fp8 is None):
        raise ValueError("load_into_empty: keep_fp8 / quantize_fp8 and on_fp8 go together")
    expected = model.state_dict(keep_vars=True)
    groups = _tie_groups(model)

    # -- validate names and shapes before reading anything --------------------------------------
    provided: dict[str, tuple[KeyOp, tuple[int, ...], list[tuple[int, int]]]] = {}
    unexpected = []
    for op in ops:
        shape = files.shape(op.source)
        problem = op.check(shape)
        if problem:
            raise LoadError(f"{files.tensors[op.source].file}: key {op.source!r}: {problem}; it is not {what}")
        for target, tshape, segs in zip(op.targets, op.target_shapes(shape), op.segments(shape)):
            if target not in expected:
                if not unexpected_ok(op.source):
                    unexpected.append(op.source if len(op.targets) == 1 else f"{op.source} -> {target}")
                continue
            if target in provided:
                raise LoadError(f"{files.name}: {target!r} is given twice (by {provided[target][0].source!r} "
                                f"and {op.source!r}) for {what}")
            provided[target] = (op, tshape, segs)
    if unexpected:
        raise LoadError(f"{files.name}: unexpected key(s) {_listing(unexpected)}: not part of {what}")
    missing = [n for n in expected if not any(m in provided for m in groups.get(n, [n]))]
    if missing:
        raise LoadError(f"{files.name}: missing key(s) {_listing([source_name(n) for n in missing])} of {what}")
    for target, (op, tshape, _) in provided.items():
        want = tuple(expected[target].shape)
        if tshape != want:
            src = op.source if len(op.targets) == 1 else f"{op.source} (as {target})"
            raise LoadError(f"{files.tensors[op.source].file}: key {src!r} has shape {tshape}, but {what} "
                            f"expects {want} for {target!r}: the file does not match this architecture")

    # -- fill: each parameter allocated once in its final dtype, streamed from the file ----------
    done: set[str] = set()
    meta = torch.device(device).type == "meta"

    def fill(target: str) -> None:
        op, tshape, segs = provided[target]
        if target in done:
            return                                    # tied to a tensor already loaded
        info = files.tensors[op.source]
        if _is_gguf_linear(model, files, op.source, target, tshape):   # GGUF blocks, kept as stored
            _fill_gguf(model, files, op.source, target, tshape, segs, groups.get(target, [target]), meta, device)
            done.update(groups.get(target, [target]))
            if not meta:
                files.release(op.source)
            return
        keep = keep_fp8 is not None and info.dtype == "F8_E4M3" and keep_fp8(target)
        if (not keep and quantize_fp8 is not None and info.floating and len(tshape) == 2
                and info.row_numel == tshape[1] and quantize_fp8(target)):
            if quantize_fp8(target) == "nf4":        # NF4 rows instead of e4m3 (memory/nf4_storage.py)
                from ..memory.nf4_storage import fill_nf4
                fill_nf4(model, files, op.source, target, segs, _target_dtype(model, target, dtype), meta, device)
            elif quantize_fp8(target) == "int8":     # int8 ConvRot rows instead (memory/int8_storage.py)
                from ..memory.int8_storage import fill_int8, group_size_for
                fill_int8(model, files, op.source, target, segs, _target_dtype(model, target, dtype),
                          group_size_for(tshape[1]), meta, device)
            else:
                _fill_quantized(model, files, op.source, target, tshape, segs, groups.get(target, [target]),
                                _target_dtype(model, target, dtype), "meta" if meta else "cpu", device, on_fp8)
            done.update(groups.get(target, [target]))
            if not meta:
                files.release(op.source)
            return
        if keep:
            to_dtype = torch.float8_e4m3fn
        else:
            to_dtype = _target_dtype(model, target, dtype) if info.floating else _DTYPES[info.dtype]
        out = torch.empty(tshape, dtype=to_dtype, device="meta" if meta else "cpu")
        flat, pos = out.view(-1), 0
        for a, b in segs if not meta else ():
            n = (b - a) * info.row_numel
            files.fill_rows_into(op.source, a, b, flat[pos:pos + n], dequantize=not keep)
            pos += n
        if not meta:
            files.release(op.source)
        names = groups.get(target, [target])
        _assign_group(model, names, out.to(device))
        done.update(names)
        if keep:
            rows = sum(b - a for a, b in segs)
            on_fp8(target, torch.empty(rows, 1, device="meta") if meta else files.row_scales(op.source, segs))

    spill = None if meta or torch.device(device).type != "cpu" else _PARKING.get()
    if spill is not None:
        from ..memory.host_buffers import return_freed_host_memory
    parked = _parked_targets(model, provided, spill) if spill is not None else {}
    with nullcontext() if meta else files:
        for target in provided:
            if target not in parked:
                fill(target)
        for block, targets in _by_block(parked).items():   # one disk-tier block in host RAM at a time
            _check_unchanged(files)
            for target in targets:
                fill(target)
            _check_unchanged(files)                   # what was read is what the headers described
            spill.park(block, model.get_submodule(block))
            return_freed_host_memory()                # the filled block's pages back to the OS
            _drop_source_pages(files, [provided[t][0].source for t in targets])   # not read again

    if parked:     # again with the files closed: pages still mapped or just read were not let go
        _drop_source_pages(files, [provided[t][0].source for t in parked], span=True)

    leftovers = [] if meta else [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftovers:  # only reachable if a model has tensors outside its state dict
        raise LoadError(f"{files.name}: {what} still has unloaded tensors {leftovers[:5]}")
    model.to(device)    # buffers built in __init__ (CLIP's position ids)
    return model.eval()
