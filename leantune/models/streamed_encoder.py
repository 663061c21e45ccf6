"""Text encoders that live in their files: built on meta, each decoder layer read just before its forward.

FLUX.2-dev's text encoder is Mistral Small 3.x, 24B parameters: 48 GB in bf16. Loading it into host
RAM to stream its layers onto the GPU (memory/blockwise.py's `blockwise_offload`, as Qwen-Image's 7B
encoder does) would need those 48 GB on top of everything else, more than a 64 GB machine has to
spare. A file-backed encoder holds nothing: `file_backed` builds the model with its parameters on
the meta device and checks from the file headers alone that every tensor the text model needs is
there with its shape; `placement` then runs it with `blockwise_from_source`, which reads the
resident parts (embedding table, final norm) once and each layer's tensors when that layer runs.
Host RAM holds one tensor in flight (read with plain reads through `CheckpointFiles`: no mapped
pages counted against the process), the device the resident parts and one layer.

fp8 files (e4m3, plain or ComfyUI-scaled) are read as stored and dequantised on the device, so the
host moves one byte per weight. Which module is streamed (`module_path`, e.g. Mistral3's
`model.language_model`, Qwen3's `model`, a T5EncoderModel itself) and its layer list is the
caller's; the key prefix the files use for it (`model.language_model.` or the older
`language_model.model.`, `model.`, none) is found from the headers.

The choice between loading and streaming from the files is `stream_from_files`: when the encoder's
bytes do not fit the host-RAM budget. The cost is one read of the encoder's files per caching pass
(the pass runs its batches of captions layer-major, memory/lockstep.py; page cache or disk), paid
only on cache misses; sampling reads them once per encode.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import nn

from ..memory import lockstep
from ..memory.blockwise import blockwise_from_source, blockwise_offload
from .weights import CheckpointFiles, LoadError, _DTYPES, _target_dtype, _tie_groups, build_empty

SOURCE_ATTR = "_leantune_file_source"
HOST_MARGIN = 0.8      # stream from the files when the encoder needs more than this share of the budget


def encoder_files(path: str | Path) -> list[Path]:
    """The safetensors files of a text encoder: a single file, or a folder's shards (its
    `*.safetensors.index.json` names them; else every `*.safetensors` in it)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise LoadError(f"{path}: no such file or folder")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LoadError(f"{indexes[0]}: not a safetensors index (a 'weight_map' object): {e}") from None
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{path}: no *.safetensors file in the folder")
    return files


def file_bytes(paths: list[Path]) -> int:
    """Bytes of the tensors in the files (headers read only)."""
    files = CheckpointFiles(paths)
    return sum(info.end - info.start for info in files.tensors.values())


def stream_from_files(weight_bytes: int, ram_budget: int | None = None) -> bool:
    """True when an encoder of `weight_bytes` does not fit the host-RAM budget (`ram_budget`, else
    the RAM available now) with a margin: then it is read from its files layer by layer."""
    if ram_budget is None:
        from ..host import host_ram

        ram_budget = host_ram()[1]
    return weight_bytes > HOST_MARGIN * ram_budget


class FileSource:
    """Where a file-backed module's tensors are: the files, the key prefix, the compute dtype."""

    def __init__(self, files: CheckpointFiles, prefix: str, dtype: torch.dtype, owner: nn.Module,
                 aliases: dict[str, str]):
        self.files, self.prefix, self.dtype, self.owner = files, prefix, dtype, owner
        self.aliases = aliases      # a tied tensor's name -> the name the files store it under

    def reader(self, device: torch.device) -> Callable[[str, torch.Tensor], torch.Tensor]:
        """`read(name, placeholder)` for blockwise_from_source: the tensor `name` on `device`."""
        def read(name: str, like: torch.Tensor) -> torch.Tensor:
            key = self.prefix + self.aliases.get(name, name)
            info = self.files.tensors[key]
            stored = _DTYPES[info.dtype]
            if not info.floating:
                return self.files.read(key).to(device)
            target = _target_dtype(self.owner, name, self.dtype)
            if stored.itemsize == 1 and target.itemsize > 1:
                # e4m3 / e5m2: move the stored bytes, dequantise on the device
                raw = torch.empty(info.shape, dtype=stored)
                self.files.read_rows_into(key, 0, info.rows, raw.view(-1), dequantize=False)
                on_device = raw.to(device)
                del raw
                scale = self.files.row_scales(key, [(0, info.rows)]).to(device, torch.float32)  # (rows, 1)
                # Formed in the output: e4m3/e5m2 -> bf16/fp16 is exact and bf16 x fp32 rounds
                # once, the fp32 product's bits without its temporary (issue 40, finding 10:
                # ~9 bytes moved per element on the device became ~5)
                out = torch.empty(info.shape, dtype=target, device=device)
                out.copy_(on_device)
                out.view(info.rows, -1).mul_(scale)
                return out
            return self.files.read(key, target).to(device)
        return read


def file_backed(factory: Callable[[], nn.Module], paths: list[Path], module_path: str, blocks_path: str,
                dtype: torch.dtype, label: str) -> nn.Module:
    """The model `factory` builds, on meta, with its text module (`module_path`, "" for the model
    itself) bound to the safetensors `paths`: no tensor is read until `placement` runs it.

    Every parameter of the text module must be in the files under one prefix with its shape,
    checked now from the headers; a missing or misshapen tensor is a LoadError naming the file
    and key (`label` names the component)."""
    model = build_empty(factory)
    for name, p in model.named_parameters():      # meta placeholders in the dtypes the model computes in
        if p.is_floating_point():
            owner, _, leaf = name.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            mod._parameters[leaf] = nn.Parameter(p.to(_target_dtype(model, name, dtype)), requires_grad=False)
    module = model.get_submodule(module_path) if module_path else model
    blocks = module.get_submodule(blocks_path)
    files = CheckpointFiles(paths)
    names = {n: tuple(p.shape) for n, p in module.named_parameters()}
    names.update({n: tuple(b.shape) for n, b in module.named_buffers() if b.device.type == "meta"})
    # tied tensors (T5's encoder.embed_tokens and shared) are stored under one of their names
    inside = f"{module_path}." if module_path else ""
    ties = {n[len(inside):]: [m[len(inside):] for m in group if m.startswith(inside)]
            for n, group in _tie_groups(model).items() if n.startswith(inside)}
    first_block = next(n for n in names if n.startswith(f"{blocks_path}.0."))
    prefixes = sorted({k[: -len(first_block)] for k in files.tensors if k.endswith(first_block)}, key=len)

    def stored(p: str, n: str) -> str | None:
        return next((m for m in [n, *ties.get(n, [])] if p + m in files.tensors), None)

    prefix = next((p for p in prefixes if all(stored(p, n) for n in names)), None)
    if prefix is None:
        where = prefixes[0] if prefixes else ""
        missing = [where + n for n in names if stored(where, n) is None]
        raise LoadError(f"[model] {label}: {files.name}: missing key {missing[0]!r} of the {label}"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; is it the right file?")
    aliases = {n: stored(prefix, n) for n in names if stored(prefix, n) != n}
    for n, shape in names.items():
        key = prefix + aliases.get(n, n)
        if files.shape(key) != shape:
            raise LoadError(f"[model] {label}: {files.name}: key {key!r} has shape "
                            f"{files.shape(key)}, the {label} expects {shape}")
    setattr(module, SOURCE_ATTR, FileSource(files, prefix, dtype, module, aliases))
    return model


_RAM_BUDGET: ContextVar[int | None] = ContextVar("text_encoder_ram_budget", default=None)


@contextmanager
def text_encoder_ram_budget(ram_budget: int | None) -> Iterator[None]:
    """The host-RAM budget `load_text_model` decides against while a caching pass loads the
    encoders (the run's [memory] ram_budget; None: the RAM available then). A context rather than
    an argument so that every family's `load_text_encoders(sources, dtype, device)` keeps its
    signature."""
    token = _RAM_BUDGET.set(ram_budget)
    try:
        yield
    finally:
        _RAM_BUDGET.reset(token)


def load_text_model(model_cls, folder: Path, dtype: torch.dtype, *, module_path: str, blocks_path: str,
                    label: str) -> nn.Module:
    """A transformers text encoder from its folder: loaded into host RAM when its weights fit the
    host-RAM budget (`text_encoder_ram_budget`), else file-backed (read layer by layer when it runs)."""
    folder = Path(folder)
    paths = encoder_files(folder)
    if not stream_from_files(file_bytes(paths) * _scale_to(dtype, paths), _RAM_BUDGET.get()):
        return model_cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True).eval()
    config = model_cls.config_class.from_pretrained(str(folder), local_files_only=True)
    return file_backed(lambda: model_cls(config), paths, module_path, blocks_path, dtype, label).eval()


def fits_host(paths: list[Path], dtype: torch.dtype) -> bool:
    """Whether an encoder stored in `paths` is loaded into host RAM in `dtype` (else read from its
    files layer by layer), as load_text_model decides: for loaders of single-file encoders."""
    return not stream_from_files(file_bytes(paths) * _scale_to(dtype, paths), _RAM_BUDGET.get())


def _scale_to(dtype: torch.dtype, paths: list[Path]) -> float:
    """Bytes in `dtype` per stored byte (the files' first floating tensor decides: bf16 files
    loaded in bf16 -> 1, fp8 files loaded in bf16 -> 2)."""
    files = CheckpointFiles(paths)
    stored = next((_DTYPES[i.dtype] for i in files.tensors.values() if i.floating), dtype)
    return torch.empty(0, dtype=dtype).element_size() / stored.itemsize


def is_file_backed(module: nn.Module) -> bool:
    return getattr(module, SOURCE_ATTR, None) is not None


def placement(module: nn.Module, blocks: nn.ModuleList, device) -> "contextmanager":
    """How the text module runs on `device`: read from its files layer by layer when file-backed;
    streamed from host RAM layer by layer when it is on the host and `device` is not; as it is
    otherwise (already on `device`, or a host encode).

    Inside a lock-step pass (memory/lockstep.py, the cache's text pass) the placement is entered
    once for the pass and the pass's batches go through each layer together: one read or copy of
    each layer per pass."""
    device = torch.device(device)
    source = getattr(module, SOURCE_ATTR, None)
    if source is not None:
        return lockstep.shared(("from_files", id(module), id(blocks), str(device)),
                               lambda: _from_files(module, blocks, source, device))
    home = next(module.parameters()).device
    if device.type == "cpu" or home == device:
        return nullcontext()
    return blockwise_offload(module, blocks, device)


def moved_whole(module: nn.Module, device) -> "contextmanager":
    """`module` moved whole to `device` for the duration and back home after (a vision tower the
    language model's streaming leaves alone); once per pass inside a lock-step pass, not once per
    prompt. A no-op when it is already there."""
    device = torch.device(device)
    return lockstep.shared(("moved_whole", id(module), str(device)), lambda: _moved_whole(module, device))


@contextmanager
def _moved_whole(module: nn.Module, device: torch.device) -> Iterator[None]:
    home = next(module.parameters()).device
    if home == device:
        yield
        return
    module.to(device)
    try:
        yield
    finally:
        module.to(home)


@contextmanager
def _from_files(module, blocks, source: FileSource, device) -> Iterator[None]:
    with source.files, blockwise_from_source(module, blocks, device, source.reader(device)):
        yield
