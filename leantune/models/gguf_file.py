"""Reading GGUF transformer files (ComfyUI-GGUF's Flux.1 and the like) as one more checkpoint layout.

What the community publishes: city96's `tools/convert.py` writes a single BFL/ComfyUI-layout
transformer (`double_blocks.0.img_attn.qkv.weight`, no `model.diffusion_model.` prefix; the
architecture string "flux") into GGUF, keeping 1-D tensors and the embedders / final layer in F32
and quantizing the rest (Q8_0, Q4_0, ... and, through llama.cpp's quantizer, the K types Q5_K,
Q4_K). So the tensor names are those of the safetensors single files, and everything downstream of
the names (which family, the key conversion of models/<family>/keys.py, the architecture from the
shapes) is the safetensors path's own.

How: `GgufFiles` is a CheckpointFiles (weights.py) whose key space is read from the GGUF header by
the `gguf` package's GGUFReader (numpy memmap; nothing is loaded, and a file it cannot parse is
refused with the file's name). F32 / F16 / BF16 tensors are plain tensors at their file offsets,
read through the same mapped-file machinery as safetensors (cast to the load dtype as always). A
quantized tensor is kept as its stored blocks when it is an nn.Linear weight (load_into_empty hands
the (rows, row_bytes) uint8 rows to memory/gguf_storage.use_gguf_weight; a fused qkv splits by
rows, which GGUF rows allow), and is otherwise decoded with gguf.quants.dequantize while it is read.
GGUF stores shapes innermost first; here shapes are torch's (rows first).

Refused, naming the file (and the tensor): not a GGUF file (bad magic, unparsable header), a tensor
whose data runs past the end of the file, a block type leantune does not keep (gguf_storage's
taken types), a quantized tensor whose byte count does not match its shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .weights import STAGING_BYTES, CheckpointFiles, LoadError, TensorInfo

_PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16"}     # GGUF type name -> safetensors dtype name


@dataclass(frozen=True)
class GgufTensorInfo(TensorInfo):
    """A quantized GGUF tensor: `dtype` is the block type's name ("Q8_0"), `qtype` its number."""

    qtype: int = 0
    row_bytes: int = 0         # stored bytes of one row (of row_numel values)

    @property
    def floating(self) -> bool:
        return True            # decodes to floating values (read_rows_into)


def _reader_class():
    """gguf.GGUFReader that reads a truncated file's header to its end: a tensor's data slice that
    runs past the end of the file comes back zero-padded instead of failing in a reshape that names
    no tensor, so GgufFiles can say which tensor the file lost (its data is never read from there)."""
    import gguf

    class _Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            if "data_offset" in self.__dict__ and offset + itemsize * int(count) > len(self.data):
                return np.zeros(int(count), dtype=dtype)          # tensor data only (after the header)
            return super()._get(offset, dtype, count, override_order)

    return _Reader


def is_gguf_path(path: Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


class GgufFiles(CheckpointFiles):
    """One GGUF file as a CheckpointFiles key space (from its header only)."""

    def __init__(self, path: str | Path):
        from ..memory.gguf_storage import block_size, taken_types

        path = Path(path)
        if not path.is_file():
            raise LoadError(f"{path}: no such file")
        import gguf

        try:
            reader = _reader_class()(path, "r")
        except (ValueError, KeyError, IndexError, TypeError, OverflowError) as e:
            raise LoadError(f"{path}: not a readable GGUF file ({e})") from None
        except OSError as e:
            raise LoadError(f"{path}: cannot read ({e.strerror or e})") from None
        size = path.stat().st_size
        taken = taken_types()
        self.paths = [path]
        self.tensors = {}
        self.metadata = {}
        for key, field in reader.fields.items():          # string fields, as safetensors' __metadata__
            if field.types == [gguf.GGUFValueType.STRING]:   # (general.architecture; a leantune.config)
                try:
                    self.metadata[key] = bytes(field.parts[field.data[0]]).decode("utf-8")
                except (IndexError, TypeError, UnicodeDecodeError):
                    raise LoadError(f"{path}: metadata field {key!r} is not a readable string (corrupt file)") from None
        for t in reader.tensors:
            name, kind = t.name, t.tensor_type.name
            shape = tuple(int(s) for s in reversed(list(t.shape)))      # torch order: rows first
            start, stop = int(t.data_offset), int(t.data_offset) + int(t.n_bytes)
            if stop > size:
                raise LoadError(f"{path}: tensor {name!r}: its data ends at byte {stop}, past the end of the "
                                f"file ({size} bytes): truncated or corrupt file")
            if kind in _PLAIN:
                entry = TensorInfo(path, _PLAIN[kind], shape, start, stop)
                itemsize = 2 if kind != "F32" else 4
                if stop - start != itemsize * int(np.prod(shape, dtype=np.int64)):
                    raise LoadError(f"{path}: tensor {name!r}: data does not fit its shape {shape} (corrupt file)")
            elif kind in taken:
                values, nbytes = block_size(int(t.tensor_type))
                width = shape[-1] if shape else 1
                rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
                if width % values or stop - start != rows * (width // values) * nbytes:
                    raise LoadError(f"{path}: tensor {name!r}: {kind} data of {stop - start} bytes does not hold "
                                    f"shape {shape} (whole blocks of {values} values, {nbytes} bytes each): corrupt file")
                entry = GgufTensorInfo(path, kind, shape, start, stop, qtype=int(t.tensor_type),
                                       row_bytes=width // values * nbytes)
            else:
                raise LoadError(f"{path}: tensor {name!r} is stored as {kind}, which leantune does not read "
                                f"(it reads F32, F16, BF16 and {', '.join(sorted(taken))})")
            if name in self.tensors:
                raise LoadError(f"{path}: tensor {name!r} appears twice")
            self.tensors[name] = entry
        del reader                                       # its memmap; reads map the file again
        self._handles, self._maps = {}, {}
        self._stack = None
        import threading

        self._local = threading.local()
        self._pool = None
        self._scales = {}

    def scale_key(self, key: str) -> str | None:
        return None                                      # GGUF blocks carry their own scales

    # -- quantized tensors ------------------------------------------------------------------------
    def is_blocks(self, key: str) -> bool:
        return isinstance(self.tensors[key], GgufTensorInfo)

    def read_blocks(self, key: str, segments: list[tuple[int, int]]) -> torch.Tensor:
        """The stored bytes of the rows `segments` of a quantized tensor: (rows, row_bytes) uint8,
        copied out of the mapped file (so nothing refers to the mapping afterwards)."""
        info = self.tensors[key]
        rows = sum(b - a for a, b in segments)
        out = torch.empty(rows, info.row_bytes, dtype=torch.uint8)
        mapping, pos = self._mapping(info.file), 0
        for a, b in segments:
            n = (b - a) * info.row_bytes
            src = torch.frombuffer(mapping, dtype=torch.uint8, count=n, offset=info.start + a * info.row_bytes)
            out.view(-1)[pos:pos + n].copy_(src)
            pos += n
            del src
        return out

    def read_rows_into(self, key: str, row_start: int, row_end: int, out: torch.Tensor,
                       dequantize: bool = True) -> None:
        """Rows of a quantized tensor decoded by gguf.quants.dequantize (fp32) and cast into `out`,
        STAGING_BYTES of fp32 at a time; plain tensors as in CheckpointFiles."""
        info = self.tensors[key]
        if not isinstance(info, GgufTensorInfo):
            return super().read_rows_into(key, row_start, row_end, out, dequantize)
        import gguf

        qtype = gguf.GGMLQuantizationType(info.qtype)
        step = max(1, STAGING_BYTES // max(4 * info.row_numel, 1))
        for r0 in range(row_start, row_end, step):
            r1 = min(row_end, r0 + step)
            raw = self.read_blocks(key, [(r0, r1)]).numpy()
            w = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
            out[(r0 - row_start) * info.row_numel:(r1 - row_start) * info.row_numel].copy_(w.reshape(-1))

    def fill_rows_into(self, key: str, row_start: int, row_end: int, out: torch.Tensor,
                       dequantize: bool = True) -> None:
        if isinstance(self.tensors[key], GgufTensorInfo):
            self.read_rows_into(key, row_start, row_end, out, dequantize)
            return
        super().fill_rows_into(key, row_start, row_end, out, dequantize)

    def quantize_rows_into(self, key, segments, dtype, q_out, scale_out) -> None:
        if isinstance(self.tensors[key], GgufTensorInfo):      # the loader keeps these as blocks instead
            raise LoadError(f"{self.name}: tensor {key!r} is {self.tensors[key].dtype}; it stays in its GGUF "
                            f"blocks and is not converted to fp8")
        super().quantize_rows_into(key, segments, dtype, q_out, scale_out)


def open_single_file(path: str | Path) -> CheckpointFiles:
    """A single transformer file's key space: GgufFiles for a .gguf file, else its safetensors
    header. The families' single-file readers open files through this, so a GGUF file of any
    family whose names are its single files' loads the same way (quantized Linears kept)."""
    return GgufFiles(path) if is_gguf_path(Path(path)) else CheckpointFiles([path])


def tensor_names(path: str | Path) -> list[str]:
    """The tensor names of a GGUF file (header only), for telling its family."""
    return list(GgufFiles(path).tensors)
