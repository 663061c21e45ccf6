"""Per-tensor loading of safetensors checkpoints into models built on the meta device.

Why not `from_pretrained` / `from_single_file`: those load whole state dicts (or whole shards) and
know only their own key layouts; Flux checkpoints in the wild come as diffusers folders, BFL files,
ComfyUI fp8 and "scaled fp8" files and all-in-one files. Here every layout is reduced to a list of
`KeyOp`s (file key -> model key(s), with an optional split / half swap / reshape), checked against
the meta model's names and shapes from the file headers alone, and only then read tensor by tensor:
each tensor is read, dequantised if it is scaled fp8, cast to the target dtype, moved to the target
device and assigned. Host RAM therefore holds the finished model plus one tensor in flight, never a
second copy of the model, and a wrong file fails before a single weight is read.
"""

from __future__ import annotations

import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..io import refuse_pickle


class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the component/key."""


# safetensors header dtype names -> torch dtypes (the ones torch can hold).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Keys ComfyUI fp8 files carry next to the weights: scales (used to dequantise) and markers/input
# scales (only meaningful to fp8 matmul kernels). None of them is a model parameter.
_WEIGHT_SCALE_SUFFIXES = ("scale_weight", "weight_scale")
_AUX_SUFFIXES = (".scale_weight", ".weight_scale", ".scale_input", ".input_scale", ".comfy_quant")
_AUX_KEYS = ("scaled_fp8",)

_MAX_HEADER = 100 * 2**20   # a safetensors header larger than this is certainly not one


def is_auxiliary_key(key: str) -> bool:
    """True for fp8 scale/marker keys that accompany weights but are not parameters themselves."""
    return key in _AUX_KEYS or key.endswith(_AUX_SUFFIXES) or key.rsplit(".", 1)[-1] in _AUX_KEYS


def read_header(path: Path) -> tuple[dict, int]:
    """The parsed JSON header of a safetensors file and its size in bytes (8-byte length prefix excluded)."""
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


_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str                 # safetensors dtype name: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    start: int                 # absolute byte offsets of the data in the file
    end: int


class CheckpointFiles:
    """One key space over one or more safetensors files (the shards of a checkpoint), from headers only.

    `read(key, dtype, device)` returns one tensor, dequantised when the file stores it as scaled
    fp8 (ComfyUI `*.scale_weight` / `*.weight_scale`), in `dtype`, on `device`.
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
                item = _ITEM_BYTES.get(entry.dtype)
                if stop > size or (item is not None and stop - begin != item * _numel(entry.shape)):
                    raise LoadError(f"{path}: key {key!r}: data does not fit its header (truncated or corrupt file)")
                if key in self.tensors:
                    raise LoadError(f"{path}: key {key!r} is also in {self.tensors[key].file}")
                self.tensors[key] = entry
        self._handles: dict[Path, object] = {}
        self._stack: ExitStack | None = None

    @property
    def name(self) -> str:
        """The file (or first shard and count) for error messages."""
        return str(self.paths[0]) if len(self.paths) == 1 else f"{self.paths[0].parent} ({len(self.paths)} shards)"

    def keys(self) -> list[str]:
        """Parameter keys: every key except fp8 scale/marker keys."""
        return [k for k in self.tensors if not is_auxiliary_key(k)]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].shape

    def shapes(self, prefix: str = "") -> dict[str, tuple[int, ...]]:
        """Shapes of the parameter keys under `prefix`, with the prefix removed."""
        return {k[len(prefix):]: self.tensors[k].shape for k in self.keys() if k.startswith(prefix)}

    def has(self, key: str) -> bool:
        return key in self.tensors

    # -- reading --------------------------------------------------------------------------------
    def __enter__(self) -> "CheckpointFiles":
        self._stack = ExitStack()
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def _handle(self, path: Path):
        if path not in self._handles:
            f = open(path, "rb")
            if self._stack is not None:
                self._stack.enter_context(f)
            self._handles[path] = f
        return self._handles[path]

    def scale_key(self, key: str) -> str | None:
        """The ComfyUI scale key that dequantises `key` ("x.weight" -> "x.scale_weight"), if present."""
        if not key.endswith(".weight"):
            return None
        stem = key[: -len("weight")]
        for suffix in _WEIGHT_SCALE_SUFFIXES:
            if stem + suffix in self.tensors:
                return stem + suffix
        return None

    def read_raw(self, key: str) -> torch.Tensor:
        """The tensor as stored, read with plain file reads into fresh memory.

        Not mmap: mapped file pages count as resident memory while a file is open, which would
        make a load look like it holds the model twice; read() keeps one tensor in flight.
        """
        info = self.tensors[key]
        if info.dtype not in _DTYPES:
            raise LoadError(f"{info.file}: key {key!r} has dtype {info.dtype}, which leantune cannot load "
                            f"(packed quantisation formats such as nf4/fp4/gguf are not supported)")
        buf = torch.empty(info.end - info.start, dtype=torch.uint8)
        if self._stack is None:          # a one-off read outside `with files:`
            with open(info.file, "rb") as f:
                got = _read_into(f, info.start, buf)
        else:
            got = _read_into(self._handle(info.file), info.start, buf)
        if got != buf.numel():
            raise LoadError(f"{info.file}: key {key!r}: file ends early (truncated)")
        return buf.view(_DTYPES[info.dtype]).reshape(info.shape)

    def read(self, key: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor in `dtype` on `device`; floating tensors only are cast, scaled fp8 is dequantised."""
        t = self.read_raw(key)
        scale_key = self.scale_key(key)
        if scale_key is not None:
            t = dequantize(t, self.read_raw(scale_key), f"{self.tensors[key].file}: key {key!r}")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device)


def _read_into(f, offset: int, buf: torch.Tensor) -> int:
    f.seek(offset)
    return f.readinto(memoryview(buf.numpy())) if buf.numel() else 0


def dequantize(weight: torch.Tensor, scale: torch.Tensor, where: str) -> torch.Tensor:
    """fp8 weight * scale in fp32: a per-tensor scalar, or one scale per output row."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if w.dim() >= 1 and s.numel() == w.shape[0]:
        return w * s.reshape(-1, *([1] * (w.dim() - 1)))
    if s.shape == w.shape:
        return w * s
    raise LoadError(f"{where}: scale of shape {tuple(s.shape)} does not fit a weight of shape {tuple(w.shape)}")


@dataclass(frozen=True)
class KeyOp:
    """How one file tensor becomes one or more model tensors.

    split: sizes along dim 0 (a fused qkv or BFL `linear1`), one per target; swap_halves: the two
    halves along dim 0 are exchanged (BFL's final adaLN stores shift before scale; diffusers scale
    before shift); reshape: the target shape when the file stores a conv-shaped weight of a linear.
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
        if self.swap_halves:
            a, b = t.chunk(2, dim=0)
            t = torch.cat([b, a], dim=0)
        if self.split is not None:
            # Views of `t`: the loader copies each into its own storage (see load_into_empty).
            return list(torch.split(t, list(self.split), dim=0))
        if self.reshape is not None:
            return [t.reshape(self.reshape)]
        return [t]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def copy_ops(keys: Iterable[str], strip: str = "", rename: Callable[[str], str] | None = None) -> list[KeyOp]:
    """One-to-one ops for files already in the model's layout (optionally minus a prefix / renamed)."""
    ops = []
    for k in keys:
        name = k[len(strip):] if strip and k.startswith(strip) else k
        ops.append(KeyOp(k, ((rename(name) if rename else name),)))
    return ops


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
) -> torch.nn.Module:
    """Validate `ops` against the meta-built `model` from headers only, then load tensor by tensor.

    `what` names the component in messages ("the Flux transformer"); `unexpected_ok(file_key)`
    lets a family ignore known extra keys (a T5 decoder in a full T5 file); `source_name(model_key)`
    gives the file key a missing model key would have had, for the message.
    """
    expected = model.state_dict(keep_vars=True)
    groups = _tie_groups(model)

    # -- validate names and shapes before reading anything --------------------------------------
    provided: dict[str, tuple[KeyOp, tuple[int, ...]]] = {}
    unexpected = []
    for op in ops:
        shape = files.shape(op.source)
        problem = op.check(shape)
        if problem:
            raise LoadError(f"{files.tensors[op.source].file}: key {op.source!r}: {problem}; it is not {what}")
        for target, tshape in zip(op.targets, op.target_shapes(shape)):
            if target not in expected:
                if not unexpected_ok(op.source):
                    unexpected.append(op.source if len(op.targets) == 1 else f"{op.source} -> {target}")
                continue
            if target in provided:
                raise LoadError(f"{files.name}: {target!r} is given twice (by {provided[target][0].source!r} "
                                f"and {op.source!r}) for {what}")
            provided[target] = (op, tshape)
    if unexpected:
        shown = ", ".join(repr(k) for k in unexpected[:5])
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise LoadError(f"{files.name}: unexpected key(s) {shown}{more}: not part of {what}")
    missing = [n for n in expected if not any(m in provided for m in groups.get(n, [n]))]
    if missing:
        shown = ", ".join(repr(source_name(n)) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LoadError(f"{files.name}: missing key(s) {shown}{more} of {what}")
    for target, (op, tshape) in provided.items():
        want = tuple(expected[target].shape)
        if tshape != want:
            src = op.source if len(op.targets) == 1 else f"{op.source} (as {target})"
            raise LoadError(f"{files.tensors[op.source].file}: key {src!r} has shape {tshape}, but {what} "
                            f"expects {want} for {target!r}: the file does not match this architecture")

    # -- load, one file tensor at a time --------------------------------------------------------
    done: set[str] = set()
    with files:
        for op in ops:
            wanted = [t for t in op.targets if t in provided and t not in done]
            if not wanted:
                continue
            t = files.read(op.source)                         # file dtype (fp32 if dequantised)
            for target, piece in zip(op.targets, op.apply(t)):
                if target not in provided or target in done:
                    continue
                to_dtype = _target_dtype(model, target, dtype) if piece.is_floating_point() else piece.dtype
                # A split piece is copied (cast and move in one step) so that each parameter owns
                # its storage: streaming and fp8 re-point parameters one by one, and a view would
                # keep the whole fused tensor alive.
                piece = piece.to(device=device, dtype=to_dtype, copy=op.split is not None)
                names = groups.get(target, [target])
                _assign_group(model, names, piece)
                done.update(names)
            del t

    leftovers = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftovers:  # only reachable if a model has tensors outside its state dict
        raise LoadError(f"{files.name}: {what} still has unloaded tensors {leftovers[:5]}")
    model.to(device)    # buffers built in __init__ (CLIP's position ids)
    return model.eval()
