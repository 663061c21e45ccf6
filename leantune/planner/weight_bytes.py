"""Weight bytes, exactly: per block, for the non-block group, and for the adapters a workload adds.

The weight terms of the memory model are counted, never estimated: every tensor of every block is
listed once (from a meta-device model, which costs no memory), with what it would cost in the
compute dtype, in fp8 storage (1 byte per element plus one fp32 scale per output row and block of
64 inputs, for the Linears fp8 storage converts; the modulation Linears only with fp8 modulation),
and packed by the streaming engine (each tensor 512-byte aligned). Block Linears that are already
e4m3 (an fp8 checkpoint, loaded as it is stored, modulation included) cost 1 byte per element plus
their own scales in every plan: the engine keeps them in fp8 whatever the plan says. Linear
weights of a GGUF base (memory/gguf_storage.py), of an NF4 base (memory/nf4_storage.py: packed
codes and absmax in one uint8 row) and of an int8 ConvRot base (memory/int8_storage.py) cost their stored bytes, exactly, in every plan and in or out of
the blocks (an entry "stored" with no fp8 scales: its element count is bytes). A bf16 block Linear that
int8 or NF4 storage could take also carries what it would store in each (`ModuleWeights.formats`:
int8 ConvRot's codes and row scale, out x (in + 4); NF4's packed nibbles, absmax codes and nested
statistics, out x nf4_storage.row_bytes(in)), so the search can price "auto"'s choice of base format exactly (base_formats.py). Tests hold these numbers to what fp8 storage, the streaming engine and peft really
allocate, so the planner prices exactly what the engine builds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..memory.fp8 import SCALE_ATTR
from ..memory.gguf_storage import is_gguf
from ..memory.int8_storage import group_size_for, is_int8, row_bytes as int8_row_bytes
from ..memory.nf4_storage import BLOCK as NF4_BLOCK, is_nf4, row_bytes as nf4_row_bytes
from ..memory.fp8 import SCALE_BLOCK as FP8_GROUP
from ..memory.streaming_units import ALIGN as STREAM_ALIGN
from ..train.adapter_types import adafactor_numel, adapter_numel
from ..train.fused_optim import STATE_SUFFIX
from .workload import Workload


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The formats besides fp8 a block Linear's entry in ModuleWeights.formats prices, in its order.
STORED_FORMATS = ("int8", "nf4")


def format_bytes(out_features: int, in_features: int) -> tuple[int, int]:
    """(int8 ConvRot, NF4) stored bytes of an (out, in) Linear weight, 0 where that format does not
    take it (int8: no ConvRot group divides the inputs; NF4: the inputs are not whole 64-value
    blocks), as memory/int8_storage.int8_block_weights and nf4_storage.nf4_block_weights choose."""
    int8 = out_features * int8_row_bytes(in_features) if group_size_for(in_features) else 0
    nf4 = out_features * nf4_row_bytes(in_features) if in_features % NF4_BLOCK == 0 else 0
    return int8, nf4


def align(n: int) -> int:
    """`n` rounded up to the streaming engine's per-tensor alignment."""
    return -(-n // STREAM_ALIGN) * STREAM_ALIGN


def fp8_scale_count(out_features: int, in_features: int) -> int:
    """fp32 scales of one fp8 weight: per output row and block of 64 inputs (per row if not divisible)."""
    blocks = in_features // FP8_GROUP if in_features % FP8_GROUP == 0 else 1
    return out_features * blocks


@dataclass(frozen=True)
class ModuleWeights:
    """The frozen tensors of one block (or of the non-block group): enough to price any storage.

    `tensors` holds (numel, fp8 scale count, stored in fp8, modulation) per tensor. The scale
    count is 0 for tensors fp8 storage leaves alone (norms, biases, anything outside blocks);
    "stored in fp8" marks e4m3 weights of an fp8 checkpoint, whose scale count is that of their own
    scale; "modulation" marks the modulation Linears (spec.modulation), converted only with fp8
    modulation. Weights a full fine-tune trains have scale count 0 (fp8 storage holds frozen
    weights only). `trained` holds the shapes of the tensors a full fine-tune trains (empty
    otherwise): their optimizer state is priced from them (full_model.py).
    """

    name: str                     # "transformer_blocks.3", or "non_blocks"
    kind: str                     # "double", "single", "joint", "joint_dual" (spec.block_kinds), "non_block"
    tensors: tuple[tuple[int, int, bool, bool], ...]
    native_bytes: int             # as the model holds them now
    trained: tuple[tuple[int, ...], ...] = ()
    # Per tensor (as `tensors`), its (int8, NF4) stored bytes where that storage could take it, else
    # (0, 0); empty for a measurement from before the base formats (priced as fp8 only)
    formats: tuple[tuple[int, int], ...] = ()

    @property
    def numel(self) -> int:
        return sum(t[0] for t in self.tensors)

    def e4m3_numel(self, fp8: bool = True, modulation: bool = False) -> int:
        """Elements held in e4m3 with fp8 storage of the block Linears (`fp8`) and of the
        modulation Linears (`modulation`), those already e4m3 included."""
        return sum(n for n, s, stored, mod in self.tensors if self._e4m3(s, stored, mod, fp8, modulation))

    @property
    def prequantized(self) -> bool:
        return any(stored and s for _, s, stored, _ in self.tensors)

    @property
    def prequantized_modulation(self) -> bool:
        return any(stored and s and mod for _, s, stored, mod in self.tensors)

    @staticmethod
    def _e4m3(scales: int, stored: bool, mod: bool, fp8: bool, modulation: bool) -> bool:
        """Priced as stored (1 byte per element plus 4 per scale): e4m3 weights, and GGUF blocks
        (stored, no scales: bytes as elements)."""
        return (bool(scales) or stored) and (stored or (modulation if mod else fp8))

    def _parts(self, i: int, dtype_bytes: int, fp8: bool, modulation: bool, fmt: str) -> tuple[int, ...]:
        """The bytes of tensor `i` as separate tensors (the engine aligns each): in the load dtype,
        or as the plan stores it: e4m3 and its fp32 scales ("fp8", and whatever a file stores
        already), or one row tensor of int8 / NF4 (`fmt`) where that format takes it (else the
        load dtype, as the loader leaves it)."""
        n, s, stored, mod = self.tensors[i]
        if not self._e4m3(s, stored, mod, fp8, modulation):
            return (n * dtype_bytes,)
        if stored or fmt == "fp8":
            return (n, 4 * s)
        q = self.formats[i][STORED_FORMATS.index(fmt)] if self.formats else 0
        return (q,) if q else (n * dtype_bytes,)

    def bytes(self, dtype_bytes: int, fp8: bool = False, modulation: bool = False, fmt: str = "fp8") -> int:
        """Bytes in `dtype_bytes` per element, or with fp8 storage (1 byte + fp32 scales) of the
        block Linears (`fp8`) and of the modulation Linears (`modulation`); `fmt` "int8" / "nf4":
        those Linears in that format instead (formats)."""
        return sum(sum(self._parts(i, dtype_bytes, fp8, modulation, fmt)) for i in range(len(self.tensors)))

    def unit_bytes(self, dtype_bytes: int, fp8: bool = False, modulation: bool = False, fmt: str = "fp8") -> int:
        """The streaming engine's packed host buffer: every tensor (and fp8 scale) 512-byte aligned."""
        return sum(align(p) for i in range(len(self.tensors)) for p in self._parts(i, dtype_bytes, fp8, modulation, fmt))

    def largest_conversion(self, fp8: bool = True, modulation: bool = False, fmt: str = "fp8") -> int:
        """Bytes of the largest weight fp8 storage converts (its e4m3 copy and scales; its int8 /
        NF4 rows with `fmt`), which exist beside the original while it converts; 0 when nothing
        here is converted."""
        return max((sum(self._parts(i, 1, fp8, modulation, fmt)) for i, (n, s, stored, mod) in enumerate(self.tensors)
                    if not stored and self._e4m3(s, stored, mod, fp8, modulation)
                    and (fmt == "fp8" or self._parts(i, 0, fp8, modulation, fmt)[0])), default=0)

    def quantized(self, fp8: bool, modulation: bool, fmt: str) -> tuple[int, int]:
        """(weights `fmt` storage converts here, the largest one's elements): what dequantizes in
        each use (base_formats.dequant_extra_s) and the largest dequantization's temporaries."""
        sizes = [n for i, (n, s, stored, mod) in enumerate(self.tensors)
                 if not stored and self._e4m3(s, stored, mod, fp8, modulation)
                 and (fmt == "fp8" or self._parts(i, 0, fp8, modulation, fmt)[0])]
        return sum(sizes), max(sizes, default=0)


@dataclass(frozen=True)
class AdapterShape:
    """One targeted Linear: LoRA adds down (rank, in) and up (out, rank)."""

    name: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ModelWeights:
    blocks: tuple[ModuleWeights, ...]        # execution order
    non_blocks: ModuleWeights
    adapters: tuple[AdapterShape, ...]       # for the workload's rank/targets/blocks
    # Tensors the model keeps as plain attributes (no parameter, no buffer) and moves to the device
    # itself at its first forward, keeping the copy: Qwen-Image's rotary tables (device_tables).
    device_tables: int = 0
    # Elements of the parameters and buffers the model holds itself, in no child module (Z-Image's
    # x_pad_token / cap_pad_token): no block or non-block unit holds them, so the engine leaves them
    # on the device in every plan, streamed or not; priced with the resident weights.
    own_numel: int = 0

    def total(self, dtype_bytes: int, fp8: bool = False, modulation: bool = False, fmt: str = "fp8") -> int:
        return (sum(b.bytes(dtype_bytes, fp8, modulation, fmt) for b in self.blocks) + self.non_blocks.bytes(dtype_bytes)
                + self.own_numel * dtype_bytes)

    @property
    def native_bytes(self) -> int:
        return sum(b.native_bytes for b in self.blocks) + self.non_blocks.native_bytes

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.blocks) + self.non_blocks.numel + self.own_numel

    @property
    def prequantized(self) -> bool:
        """Some block weights are already e4m3 (an fp8 checkpoint): every plan stores them in fp8."""
        return any(b.prequantized for b in self.blocks)

    @property
    def prequantized_modulation(self) -> bool:
        """The checkpoint stores modulation Linears in e4m3 (and the loader kept them so)."""
        return any(b.prequantized_modulation for b in self.blocks)

    def stores_as(self, fmt: str) -> bool:
        """Some block Linear that `fmt` storage ("int8", "nf4") could take (measured with formats)."""
        k = STORED_FORMATS.index(fmt)
        return any(f[k] for b in self.blocks for f in b.formats)

    def fp8_convertible(self, modulation: bool = False) -> bool:
        """Some block weight fp8 storage would convert (of the block Linears, or of the modulation
        Linears with `modulation`); none when a full fine-tune trains them all."""
        return any(s and not stored and mod == modulation for b in self.blocks for _, s, stored, mod in b.tensors)

    def adapter_params(self, rank: int, kind: str = "lora", factor: int = -1, decompose_both: bool = False) -> int:
        """Trainable elements of the adapters, from the shapes peft creates for the adapter type
        (train/adapter_types.py: LoRA's two matrices, DoRA's magnitude besides, LoKr's factors of
        the Linear's split sides, LoHa's two pairs)."""
        return sum(adapter_numel(kind, a.in_features, a.out_features, rank, factor, decompose_both)
                   for a in self.adapters)

    def adafactor_state(self, rank: int, kind: str = "lora", factor: int = -1, decompose_both: bool = False) -> int:
        """Elements Adafactor keeps for the adapters: one per row and per column of each matrix."""
        return sum(adafactor_numel(kind, a.in_features, a.out_features, rank, factor, decompose_both)
                   for a in self.adapters)


def _is_adapter(name: str) -> bool:
    return bool(re.search(r"\.(lora_|lokr_|hada_)", f".{name}")) or "lora_magnitude" in name


def _base_name(name: str) -> str:
    """A Linear's name with peft's wrapper level removed: 'attn.to_q.base_layer' -> 'attn.to_q'."""
    return name.replace(".base_layer", "")


def _module_weights(name: str, kind: str, module: torch.nn.Module, spec, in_block: bool,
                    trains=None) -> ModuleWeights:
    """`trains(qualified name)`: whether a full fine-tune trains that tensor (None: nothing trains).
    Trained weights keep their dtype under fp8 storage (it holds frozen weights only)."""
    prefix = f"{name}." if in_block else ""
    fp8_of: dict[int, tuple[int, bool, bool]] = {}      # id(weight) -> (scale count, already e4m3, modulation)
    formats_of: dict[int, tuple[int, int]] = {}          # id(weight) -> (int8, NF4) stored bytes
    for mname, m in module.named_modules():             # GGUF / NF4 / int8 rows: their bytes, in or out of blocks
        if type(m) is torch.nn.Linear and (is_gguf(m) or is_nf4(m) or is_int8(m)):
            fp8_of[id(m.weight)] = (0, True, in_block and spec.is_modulation(_base_name(mname)))
    if in_block:
        for mname, m in module.named_modules():
            rel = _base_name(mname)
            if (type(m) is not torch.nn.Linear or _is_adapter(mname) or is_gguf(m) or is_nf4(m) or is_int8(m)
                    or spec.keeps_compute_dtype(rel, fp8_modulation=True)):
                continue
            if trains is not None and m.weight.dtype not in FP8_DTYPES and trains(f"{prefix}{mname}.weight"):
                continue
            mod = spec.is_modulation(rel)
            if m.weight.dtype in FP8_DTYPES:            # kept as the checkpoint stores it, with its own scale
                scale = getattr(m, SCALE_ATTR, None)
                fp8_of[id(m.weight)] = (scale.numel() if scale is not None else m.out_features, True, mod)
            else:
                fp8_of[id(m.weight)] = (fp8_scale_count(m.out_features, m.in_features), False, mod)
                formats_of[id(m.weight)] = format_bytes(m.out_features, m.in_features)
    seen: set[int] = set()
    tensors, native, trained, formats = [], 0, [], []
    params = {id(p) for p in module.parameters()}
    for pname, t in list(module.named_parameters()) + list(module.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        native += t.numel() * t.element_size() if not _is_adapter(pname) else 0
        if _is_adapter(pname) or pname.endswith(SCALE_ATTR) or f"{STATE_SUFFIX}." in pname:
            continue            # scales are priced with their weight, optimizer state from `trained`
        tensors.append((t.numel(), *fp8_of.get(id(t), (0, False, False))))
        formats.append(formats_of.get(id(t), (0, 0)))
        if trains is not None and id(t) in params and t.dtype not in FP8_DTYPES and trains(f"{prefix}{pname}"):
            trained.append(tuple(t.shape))
    return ModuleWeights(name, kind, tuple(tensors), native, tuple(trained),
                         tuple(formats) if any(any(f) for f in formats) else ())


def measure_weights(spec, model: torch.nn.Module, workload: Workload | None = None) -> ModelWeights:
    """Exact parameter counts per block and for the non-block group, from any device (meta included).

    LoRA adapters already attached to `model` are excluded; the workload's adapters are priced from
    the shapes of the Linears its rank/targets/blocks select, with the same regex peft is given. A
    full fine-tune's trained tensors (the workload's [full] train / exclude patterns, matched on the
    diffusers names as the trainer matches them) are listed by shape per block; optimizer state a
    model already carries (the trainer's `*_optstate` modules) is not counted as weights.
    """
    trains = None
    if workload is not None and workload.mode == "full":
        from ..train.trainable import trains_name

        def trains(qname: str) -> bool:
            return trains_name(qname, workload.full_train, workload.full_exclude)
    blocks = []
    for kind, (name, block) in zip(spec.block_kinds(model), spec.blocks(model)):
        blocks.append(_module_weights(name, kind, block, spec, in_block=True, trains=trains))
    tensors, native, trained = [], 0, []
    for name in spec.non_block_modules:
        mod = getattr(model, name, None)
        if mod is not None:
            w = _module_weights(name, "non_block", mod, spec, in_block=False,
                                trains=(lambda q, name=name: trains(f"{name}.{q}")) if trains else None)
            tensors.extend(w.tensors)
            trained.extend(w.trained)
            native += w.native_bytes
    non_blocks = ModuleWeights("non_blocks", "non_block", tuple(tensors), native, tuple(trained))
    adapters: list[AdapterShape] = []
    if workload is not None and workload.mode == "lora":
        regex = re.compile(spec.lora_target_regex(workload.targets, workload.lora_blocks))
        for mname, m in model.named_modules():
            if type(m) is torch.nn.Linear and not _is_adapter(mname):
                base = _base_name(mname)
                if regex.fullmatch(base):
                    adapters.append(AdapterShape(base, m.in_features, m.out_features))
    own = sum(t.numel() for t in list(model.parameters(recurse=False)) + list(model.buffers(recurse=False)))
    return ModelWeights(tuple(blocks), non_blocks, tuple(adapters), device_tables(model), own)


def device_tables(model: torch.nn.Module) -> int:
    """Bytes of the tensors `model`'s modules hold as plain attributes, neither parameters nor
    buffers: Qwen-Image's rotary tables (QwenEmbedRope's pos_freqs / neg_freqs, complex64, 4 MB;
    diffusers keeps them out of the buffers so that a dtype cast cannot drop their imaginary part).
    `named_buffers` does not list them and `model.to(device)` (the engine's placement) leaves them
    on the host, but the module's forward copies them to the device (`_get_device_freqs`, an
    lru_cache per device) and that copy stays there for the run: device bytes in every plan.
    Any device: a meta build may hold them on meta or on the CPU."""
    seen: dict[int, int] = {}
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                seen[id(v)] = v.numel() * v.element_size()
    return sum(seen.values())
