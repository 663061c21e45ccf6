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


@dataclass(frozen=True)
class Int8TensorInfo(TensorInfo):
    """A ComfyUI int8 ConvRot weight: `dtype` "I8" (its codes), `qtype` the ConvRot group size,
    `row_bytes` the stored row (codes then the fp32 scale, memory/int8_storage.py)."""

    qtype: int = 0
    row_bytes: int = 0

    @property
    def floating(self) -> bool:
        return True            # decodes to floating values (read_rows_into)


class ComfyInt8Files(CheckpointFiles):
    """A safetensors single file with ComfyUI's int8 ConvRot layers (`*_int8_convrot.safetensors`:
    per layer `weight` int8, `weight_scale`, `comfy_quant` {"format": "int8_tensorwise", "convrot":
    true, "convrot_groupsize": g}). Each such Linear weight is handed to the loader as blocks
    (load_into_empty's GGUF path): its rows read as stored, codes and scale side by side, and made
    computable by memory/int8_storage.use_int8_weight, so it stays int8 in memory and streams as
    stored. Read elsewhere (a tensor that is no Linear's weight) it is dequantized as ComfyUI does.
    A layer of another int8 format, or with a missing or ill-shaped tensor, is refused naming the
    file and the key; fp8 layers (their comfy_quant says so) load as in any ComfyUI fp8 file."""

    def __init__(self, path: str | Path):
        from ..memory import int8_storage

        super().__init__([path])
        self._int8_scales: dict[str, str] = {}
        for key in [k for k in self.tensors if k.endswith(".comfy_quant")]:
            marker = self.read(key)
            if _comfy_format(marker) != int8_storage.COMFY_FORMAT:
                continue                                 # an fp8 layer's marker: CheckpointFiles reads those
            where = f"{self.name}: {key}"
            try:
                group = int8_storage.parse_comfy_quant(marker, where)
            except ValueError as e:
                raise LoadError(str(e)) from None
            stem = key[: -len("comfy_quant")]
            weight, scale = stem + "weight", stem + "weight_scale"
            for k in (weight, scale):
                if k not in self.tensors:
                    raise LoadError(f"{self.name}: {k} is missing; an int8 ConvRot layer ({key}) has weight, "
                                    f"weight_scale and comfy_quant")
            w, sc = self.tensors[weight], self.tensors[scale]
            if w.dtype != "I8" or len(w.shape) != 2:
                raise LoadError(f"{self.name}: {weight} is {w.dtype} {w.shape}, not the 2-D int8 weight its {key} names")
            if _numel_of(sc.shape) != w.shape[0] or sc.dtype not in ("F32", "F16", "BF16"):
                raise LoadError(f"{self.name}: {scale} has shape {sc.shape} ({sc.dtype}), not one float scale per "
                                f"row of {weight} {w.shape}")
            if w.shape[1] % group:
                raise LoadError(f"{self.name}: {weight} has {w.shape[1]} inputs, which do not split into the ConvRot "
                                f"groups of {group} its {key} names")
            self.tensors[weight] = Int8TensorInfo(w.file, w.dtype, w.shape, w.start, w.end, qtype=group,
                                                  row_bytes=int8_storage.row_bytes(w.shape[1]))
            self._int8_scales[weight] = scale

    def scale_key(self, key: str) -> str | None:
        return None if key in self._int8_scales else super().scale_key(key)

    def is_blocks(self, key: str) -> bool:
        return key in self._int8_scales

    def use_blocks(self, linear, qtype: int) -> None:
        from ..memory.int8_storage import use_int8_weight

        use_int8_weight(linear, qtype)

    def read_blocks(self, key: str, segments: list[tuple[int, int]]) -> torch.Tensor:
        """The stored rows (memory/int8_storage.pack) of the rows `segments` of an int8 ConvRot weight."""
        from ..memory.int8_storage import pack

        info = self.tensors[key]
        width = info.shape[1]
        scale = self.read(self._int8_scales[key], torch.float32).reshape(-1, 1)
        rows = sum(b - a for a, b in segments)
        codes = torch.empty(rows * width, dtype=torch.int8)
        pos = 0
        for a, b in segments:
            super().read_rows_into(key, a, b, codes[pos * width:(pos + b - a) * width], dequantize=False)
            pos += b - a
        return pack(codes.view(rows, width), torch.cat([scale[a:b] for a, b in segments]))

    def read_rows_into(self, key: str, row_start: int, row_end: int, out: torch.Tensor,
                       dequantize: bool = True) -> None:
        """Rows of an int8 ConvRot weight dequantized as ComfyUI does (memory/int8_storage), cast into `out`."""
        if key not in self._int8_scales:
            return super().read_rows_into(key, row_start, row_end, out, dequantize)
        from ..memory.int8_storage import dequantize as int8_dequantize

        info = self.tensors[key]
        raw = self.read_blocks(key, [(row_start, row_end)])
        out.copy_(int8_dequantize(raw, info.shape[1], info.qtype, torch.float32).reshape(-1))

    def fill_rows_into(self, key: str, row_start: int, row_end: int, out: torch.Tensor,
                       dequantize: bool = True) -> None:
        if key in self._int8_scales:
            self.read_rows_into(key, row_start, row_end, out, dequantize)
            return
        super().fill_rows_into(key, row_start, row_end, out, dequantize)

    def quantize_rows_into(self, key, segments, dtype, q_out, scale_out) -> None:
        if key in self._int8_scales:                  # the loader keeps these as stored instead
            raise LoadError(f"{self.name}: tensor {key!r} is int8 ConvRot; it stays as stored and is not "
                            f"converted to fp8")
        super().quantize_rows_into(key, segments, dtype, q_out, scale_out)


def _comfy_format(marker: torch.Tensor) -> str | None:
    """The "format" of a comfy_quant tensor's JSON, or None when it is not readable JSON."""
    import json

    try:
        conf = json.loads(bytes(marker.to(torch.uint8).reshape(-1).tolist()).rstrip(b"\0").decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return conf.get("format") if isinstance(conf, dict) else None


def _numel_of(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def _has_int8_layers(path: Path) -> bool:
    """True for a safetensors file with int8 tensors and comfy_quant markers (header only)."""
    from .weights import read_header

    header, _ = read_header(path)
    return (any(k.endswith(".comfy_quant") for k in header)
            and any(isinstance(v, dict) and v.get("dtype") == "I8" for v in header.values()))


def open_single_file(path: str | Path) -> CheckpointFiles:
    """A single transformer file's key space: GgufFiles for a .gguf file, ComfyInt8Files for a
    ComfyUI file with int8 ConvRot layers, else its safetensors header. The families' single-file
    readers open files through this, so a GGUF or int8 ConvRot file of any family whose names are
    its single files' loads the same way (quantized Linears kept as stored)."""
    if is_gguf_path(Path(path)):
        return GgufFiles(path)
    if Path(path).is_file() and _has_int8_layers(Path(path)):
        return ComfyInt8Files(path)
    return CheckpointFiles([path])


def tensor_names(path: str | Path) -> list[str]:
    """The tensor names of a GGUF file (header only), for telling its family."""
    return list(GgufFiles(path).tensors)
