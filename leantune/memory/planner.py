"""The planner: from a VRAM budget to the fastest memory plan that fits.

Other trainers answer "will it fit?" with fixed tiers (a table of `blocks_to_swap` values per card
size) that users then run out of memory with. Here the answer is computed: a memory model predicts
the peak VRAM and host RAM of every candidate plan, a timing model predicts its step time, and the
search keeps the fastest plan whose peak plus a safety margin is under the budget.

Memory model (all bytes, per component; `Estimate.vram` / `Estimate.host`):
- weights: exact, from the model's parameters (a meta-device model is enough). Stored in the
  compute dtype, or with fp8 storage as 1 byte per Linear weight inside a block (except the spec's
  fp8_skip modules) plus one fp32 scale per output row and block of 64 inputs; norms, modulation,
  biases, embedders and the final layer keep the compute dtype.
- stream slots: a ring of K slots, each the size of the largest streamed block (or non-block group).
- adapters: r * (in + out) fp32 parameters per targeted Linear; gradients the same; AdamW keeps two
  fp32 states per parameter, Adafactor one fp32 value per row and per column of each matrix.
- activations: measured, not guessed. `probe_activations` runs a two-double/two-single-block copy of
  the model on the meta device (no memory, milliseconds) under the workload's batch, tokens, LoRA
  and bf16 autocast, with a dispatch mode that tracks every tensor storage as it is created and
  freed. That gives, per block kind, exactly what the real diffusers/peft code keeps for backward
  (S_k), the block output (O_k), and the transient peaks in forward (Tf_k), backward (Tb_k) and
  no-grad forward (Tn_k). Two things are emulated because they depend on the GPU: bf16 autocast
  (CUDA's op lists: matmuls in bf16, norms/pow/softmax in fp32) and attention (flash/efficient
  kernels keep q, k, v, out and a (B, heads, L) fp32 logsumexp, never the L x L matrix).
  Composition over the n blocks in execution order, with N_pre the embedder outputs:
    none:    peak = N_pre + sum_{j<=i} S_j + O_i + Tb_i                 (max over i; i = last usually)
    blocks:  peak = N_pre + sum_{j<=i} O_j + O_i + S_i + max(Tf_i, Tb_i) (only block inputs are kept)
    offload: as blocks, with sum_{j<=i} O_j replaced by 2 * O_i (inputs wait in pinned host memory)
  For Flux (width D = 3072, bf16 autocast, LoRA r16) the probe finds S_double ~ 25 and
  S_single ~ 23 times B*L*D*2 bytes (~31 without autocast) and O = B*L*D*2, where L is the image
  tokens (height/16 * width/16) plus the text tokens; the probe, not this summary, is the source.
  fp8 plans are probed with the engine's own fp8 storage applied, so its dequantised temporaries
  are in the transients.
- workspace: cuBLAS/cuDNN workspaces (`Machine.workspace`).
- host RAM: a process baseline, the transformer while it loads, the streamed blocks' host copies
  (pinned buffers are rounded up to a power of two by PyTorch's caching host allocator, which is why
  pageable copies can fit where pinned ones do not), offloaded activations and caches.

Timing model: compute time = FLOPs (counted in the same meta run) / sustained FLOP/s; transfers
run on a copy stream at the measured or assumed H2D bandwidth (pageable units at the pageable rate:
the engine stages them through pinned buffers on a worker thread) and are simulated through the
engine's ring over two steps (unit i uses slot i mod K; a copy waits for its slot's last use to end;
a block's compute waits for its copy; units still in their slot are not copied again). Step time =
compute + exposed transfer + overhead, the overhead being fp8 dequantisation (the extra bytes the
probe saw memory-bound ops move, at HBM bandwidth), the copies' own HBM traffic and the optimizer.

Search: every combination of fp8 (where accuracy allows), checkpointing none/blocks/offload, the
number of streamed blocks (blocks with the most FLOPs per byte first: for Flux the single blocks,
spread evenly through their list), ring slots 2-4, pinned or pageable, and streaming the non-block
group when every block streams. The fastest feasible plan wins; exact ties go to the simpler plan.
Because the feasible set only grows with the budget, more budget never gives a slower plan. When
nothing fits, `InfeasibleBudget` says the smallest budget that works and what to change.

Calibration: the first training steps measure the real peak and step time; `PlanCalibrator`
compares them with the prediction and, when off by more than the margin, re-plans once and stores
the correction (JSON, keyed by the architecture and the bucket) so the next run starts right.
`OomGuard` catches a CUDA out-of-memory during a step, re-plans with a tighter budget and redoes
the step; only when no plan fits does it stop with `NoPlanFits`.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .fp8 import SCALE_BLOCK as FP8_GROUP
from .machine import GiB, Machine, assumed_machine, host_ram, probe_machine
from .monitor import host_rss
from .plan import Plan
from .streaming import ALIGN as STREAM_ALIGN
from .streaming import STAGING_CHUNK

log = logging.getLogger("leantune")

MiB = 2**20
Mode = Literal["lora", "full", "inference"]
CHECKPOINTING = ("none", "blocks", "offload")
RING_CHOICES = (2, 3, 4)
HOST_BASELINE = int(2.5 * GiB)  # python + torch + CUDA runtime + diffusers, before any weight
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}

# Config keys holding the length of each block list, per family (the probe builds a 2+2 copy).
BLOCK_COUNT_KEYS = {"flux": {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"}}
TEXT_LENGTH = {"dev": 512, "schnell": 256}


# -- inputs ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """What is trained (or sampled): everything besides the plan that decides memory and time."""

    mode: Mode = "lora"
    rank: int = 16
    targets: str = "attention_mlp"
    lora_blocks: dict[str, list[int]] | None = None
    optimizer: Literal["adamw", "adafactor"] = "adamw"
    batch_size: int = 1
    buckets: tuple[tuple[int, int], ...] = ((1024, 1024),)   # (height, width) in pixels
    text_length: int = 512
    gradient_accumulation: int = 1
    autocast: bool = True           # bf16 autocast, as the trainer's mixed_precision = "bf16"
    lora_dropout: float = 0.0
    dtype: torch.dtype = torch.bfloat16   # storage and compute dtype of the frozen weights
    allow_fp8: bool = True          # fp8 storage of frozen block weights is acceptable
    host_cache_bytes: int = 0       # caches held in host RAM during training

    @staticmethod
    def square(resolutions: list[int] | tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple((int(r), int(r)) for r in resolutions)

    def image_tokens(self, bucket: tuple[int, int]) -> int:
        """Packed latent tokens of a bucket: 8x VAE downsampling then 2x2 patches."""
        return (bucket[0] // 16) * (bucket[1] // 16)

    def describe(self) -> str:
        what = {"lora": f"LoRA r{self.rank} ({self.targets})", "full": "full fine-tune",
                "inference": "inference"}[self.mode]
        sizes = ", ".join(f"{w}x{h}" for h, w in self.buckets)
        opt = "" if self.mode == "inference" else f", {self.optimizer}"
        accum = f", accumulation {self.gradient_accumulation}" if self.gradient_accumulation > 1 else ""
        return f"{what}{opt}, batch {self.batch_size}{accum}, {sizes}, text {self.text_length} tokens"


@dataclass(frozen=True)
class Budget:
    """VRAM and host RAM the run may use. The margin absorbs allocator fragmentation."""

    vram: int
    ram: int | None = None          # None: available host RAM minus a margin
    margin: float = 0.07
    min_margin: int = 256 * MiB

    @property
    def margin_bytes(self) -> int:
        return int(max(self.margin * self.vram, self.min_margin))

    @property
    def usable_vram(self) -> int:
        return self.vram - self.margin_bytes

    def ram_limit(self, machine: Machine) -> int:
        if self.ram is not None:
            return self.ram
        return default_ram_budget(machine)

    def needed_for(self, peak: int) -> int:
        """The smallest budget whose usable part holds `peak`."""
        return max(math.ceil(peak / (1.0 - self.margin)), peak + self.min_margin)


def default_ram_budget(machine: Machine | None = None) -> int:
    """What this process may use in total: its current RSS plus available RAM, minus a margin."""
    total, avail = (machine.host_ram_total, machine.host_ram_available) if machine else host_ram()
    return int(host_rss()[0] + avail - max(2 * GiB, 0.1 * total))


class InfeasibleBudget(ValueError):
    """No plan fits the budget. The message names the smallest budget that works and what to change."""

    def __init__(self, message: str, needed_vram: int | None = None, needed_ram: int | None = None,
                 best: Plan | None = None):
        super().__init__(message)
        self.needed_vram = needed_vram
        self.needed_ram = needed_ram
        self.best = best


class NoPlanFits(RuntimeError):
    """Out of memory and no tighter plan fits: the run must stop (after saving a resumable state)."""


# -- weights ---------------------------------------------------------------------------------------

def _align(n: int) -> int:
    return -(-n // STREAM_ALIGN) * STREAM_ALIGN


def fp8_scale_count(out_features: int, in_features: int) -> int:
    """fp32 scales of one fp8 weight: per output row and block of 64 inputs (per row if not divisible)."""
    blocks = in_features // FP8_GROUP if in_features % FP8_GROUP == 0 else 1
    return out_features * blocks


@dataclass(frozen=True)
class ModuleWeights:
    """The frozen tensors of one block (or of the non-block group): enough to price any storage.

    `tensors` holds (numel, fp8 scale count) per tensor; the scale count is 0 for tensors fp8
    storage leaves alone (norms, modulation, biases, anything outside blocks).
    """

    name: str                     # "transformer_blocks.3", or "non_blocks"
    kind: str                     # "double", "single", "non_block"
    tensors: tuple[tuple[int, int], ...]
    native_bytes: int             # as the model holds them now

    @property
    def numel(self) -> int:
        return sum(n for n, _ in self.tensors)

    @property
    def fp8_numel(self) -> int:
        return sum(n for n, s in self.tensors if s)

    def bytes(self, dtype_bytes: int, fp8: bool = False) -> int:
        """Bytes in `dtype_bytes` per element, or with fp8 storage (1 byte + fp32 scales)."""
        return sum(n + 4 * s if (fp8 and s) else n * dtype_bytes for n, s in self.tensors)

    def unit_bytes(self, dtype_bytes: int, fp8: bool = False) -> int:
        """The streaming engine's packed host buffer: every tensor (and fp8 scale) 512-byte aligned."""
        total = 0
        for n, s in self.tensors:
            total += _align(n) + _align(4 * s) if (fp8 and s) else _align(n * dtype_bytes)
        return total


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

    def total(self, dtype_bytes: int, fp8: bool = False) -> int:
        return sum(b.bytes(dtype_bytes, fp8) for b in self.blocks) + self.non_blocks.bytes(dtype_bytes)

    @property
    def native_bytes(self) -> int:
        return sum(b.native_bytes for b in self.blocks) + self.non_blocks.native_bytes

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.blocks) + self.non_blocks.numel

    def adapter_params(self, rank: int) -> int:
        return sum(rank * (a.in_features + a.out_features) for a in self.adapters)

    def adafactor_state(self, rank: int) -> int:
        """Elements Adafactor keeps for the adapters: one per row and per column of each matrix."""
        return sum((rank + a.in_features) + (a.out_features + rank) for a in self.adapters)


def _is_adapter(name: str) -> bool:
    return ".lora_" in f".{name}" or "lora_magnitude" in name


def _base_name(name: str) -> str:
    """A Linear's name with peft's wrapper level removed: 'attn.to_q.base_layer' -> 'attn.to_q'."""
    return name.replace(".base_layer", "")


def _module_weights(name: str, kind: str, module: torch.nn.Module, spec, in_block: bool) -> ModuleWeights:
    fp8_of: dict[int, int] = {}
    if in_block:
        for mname, m in module.named_modules():
            if type(m) is torch.nn.Linear and not _is_adapter(mname) and not spec.keeps_compute_dtype(_base_name(mname)):
                fp8_of[id(m.weight)] = fp8_scale_count(m.out_features, m.in_features)
    seen: set[int] = set()
    tensors, native = [], 0
    for pname, t in list(module.named_parameters()) + list(module.named_buffers()):
        if _is_adapter(pname) or id(t) in seen or pname.endswith("weight_scale"):
            continue
        seen.add(id(t))
        tensors.append((t.numel(), fp8_of.get(id(t), 0)))
        native += t.numel() * t.element_size()
    return ModuleWeights(name, kind, tuple(tensors), native)


def measure_weights(spec, model: torch.nn.Module, workload: Workload | None = None) -> ModelWeights:
    """Exact parameter counts per block and for the non-block group, from any device (meta included).

    LoRA adapters already attached to `model` are excluded; the workload's adapters are priced from
    the shapes of the Linears its rank/targets/blocks select, with the same regex peft is given.
    """
    import re

    blocks = []
    for bl in spec.block_lists:
        for i, block in enumerate(getattr(model, bl.attr)):
            blocks.append(_module_weights(f"{bl.attr}.{i}", bl.kind, block, spec, in_block=True))
    tensors, native = [], 0
    for name in spec.non_block_modules:
        mod = getattr(model, name, None)
        if mod is not None:
            w = _module_weights(name, "non_block", mod, spec, in_block=False)
            tensors.extend(w.tensors)
            native += w.native_bytes
    non_blocks = ModuleWeights("non_blocks", "non_block", tuple(tensors), native)
    adapters: list[AdapterShape] = []
    if workload is not None and workload.mode == "lora":
        regex = re.compile(spec.lora_target_regex(workload.targets, workload.lora_blocks))
        for mname, m in model.named_modules():
            if type(m) is torch.nn.Linear and not _is_adapter(mname):
                base = _base_name(mname)
                if regex.fullmatch(base):
                    adapters.append(AdapterShape(base, m.in_features, m.out_features))
    return ModelWeights(tuple(blocks), non_blocks, tuple(adapters))


# -- activations: a meta-device probe ------------------------------------------------------------------

class _Tracker(TorchDispatchMode):
    """An allocator simulation: bytes of tensor storages created under it and still alive.

    A storage counts as new when no input of the op shares it (views and in-place results do not
    allocate). Its bytes are released when the storage object dies. Also counts FLOPs of every op
    torch's flop counter knows. Both are attributed to the open "window" (a block's forward, ...).
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self._sizes: dict[int, int] = {}
        self.windows: dict[str, dict] = {}
        self._open: dict | None = None
        from torch.utils.flop_counter import flop_registry

        self._flop_registry = flop_registry

    def open(self, name: str) -> None:
        """Close the current window and start `name` (a window seen again keeps its first record)."""
        self.close()
        self._open = {"name": name, "start": self.live, "peak": self.live, "flops": 0.0, "traffic": 0}

    def close(self) -> None:
        if self._open is not None:
            self._open["end"] = self.live
            self.windows.setdefault(self._open["name"], self._open)
            self._open = None

    def add_flops(self, flops: float) -> None:
        if self._open is not None:
            self._open["flops"] += flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = self._flop_registry.get(func._overloadpacket)
        if counter is not None:
            self.add_flops(float(counter(*args, **kwargs, out_val=out)))
        in_tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = {id(t.untyped_storage()) for t in in_tensors}
        created = 0
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._sizes:
                continue
            n = storage.nbytes()
            created += n
            self._sizes[key] = n
            self.live += n
            if self._open is not None and self.live > self._open["peak"]:
                self._open["peak"] = self.live
            weakref.finalize(storage, self._release, key)
        if created and counter is None and self._open is not None:
            # memory-bound op (cast, dequantisation, norm, activation): bytes read + written
            self._open["traffic"] += created + sum(t.numel() * t.element_size() for t in in_tensors)
        return out

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)


class _FlashAttention(torch.autograd.Function):
    """What a flash/efficient SDPA kernel keeps and allocates, without computing anything."""

    tracker: _Tracker | None = None

    @staticmethod
    def forward(ctx, q, k, v):           # (B, heads, L, d)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)   # (B, heads, L)
        ctx.save_for_backward(q, k, v, out, lse)
        b, h, lq, d = q.shape
        if _FlashAttention.tracker is not None:
            _FlashAttention.tracker.add_flops(4.0 * b * h * lq * k.shape[-2] * d)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _out, _lse = ctx.saved_tensors
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)   # fp32 accumulator
        gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del dq_accum
        b, h, lq, d = q.shape
        if _FlashAttention.tracker is not None:   # QK^T recompute, dV, dP, dQ, dK
            _FlashAttention.tracker.add_flops(10.0 * b * h * lq * k.shape[-2] * d)
        return gq, gk, gv


_LOW_PRECISION_FUNCS = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
                        torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm}
_FP32_FUNCS = {F.layer_norm, F.group_norm, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.rsqrt,
               torch.Tensor.rsqrt, F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.exp,
               torch.Tensor.exp, torch.log, torch.Tensor.log, torch.sum, torch.Tensor.sum, F.mse_loss,
               torch.norm, torch.cumsum, torch.prod}
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


class _GpuSemantics(TorchFunctionMode):
    """On meta tensors, behave as a CUDA training step would: flash attention, and bf16 autocast
    following CUDA's op lists (autocast itself only acts on CUDA tensors)."""

    def __init__(self, autocast: bool):
        super().__init__()
        self.autocast = autocast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value")
            q, k, v = (list(args) + [kwargs.get(n) for n in names][len(args):])[:3]
            if self.autocast:
                q, k, v = (_cast(t, torch.bfloat16) for t in (q, k, v))
            return _FlashAttention.apply(q, k, v)
        if self.autocast:
            if func in _LOW_PRECISION_FUNCS:
                args, kwargs = _cast_all((args, kwargs), torch.bfloat16)
            elif func in _FP32_FUNCS:
                args, kwargs = _cast_all((args, kwargs), torch.float32, only_from=(torch.float16, torch.bfloat16))
        return func(*args, **kwargs)


def _cast(t, dtype, only_from=_CASTABLE):
    if isinstance(t, torch.Tensor) and t.dtype in only_from and t.dtype != dtype:
        return t.to(dtype)
    return t


def _cast_all(tree, dtype, only_from=_CASTABLE):
    args, kwargs = tree
    return (tuple(_cast(a, dtype, only_from) for a in args),
            {k: _cast(v, dtype, only_from) for k, v in kwargs.items()})


@dataclass(frozen=True)
class KindProfile:
    """Per-block activation bytes and FLOPs of one block kind at one bucket (batch included)."""

    saved: int            # S: bytes one more block adds to the live set after its forward (output included)
    out: int              # O: bytes of its output (the next block's input; what checkpointing keeps)
    fwd_transient: int    # Tf: peak above the end state during its forward
    bwd_transient: int    # Tb: peak above the start state during its backward
    nograd_transient: int  # Tn: peak above the start during a no-grad forward (checkpointed/inference)
    fwd_flops: float
    bwd_flops: float
    fwd_traffic: int = 0  # bytes moved by memory-bound ops (casts, fp8 dequantisation, norms)
    bwd_traffic: int = 0


@dataclass(frozen=True)
class ActivationProfile:
    """The probe's result for one bucket: per kind, plus the non-block parts."""

    bucket: tuple[int, int]
    tokens: int                              # image + text tokens per sample
    kinds: dict[str, KindProfile]
    pre: int                                 # embedder outputs, temb, rotary tables (live before block 0)
    post: int                                # final norm/projection and loss tensors after the last block
    post_bwd_transient: int
    nb_fwd_flops: float                      # embedders (before the blocks)
    nb_bwd_flops: float
    nograd_pre: int
    nograd_post_transient: int
    nb_post_flops: float = 0.0               # final norm, projection and loss (after the blocks)


def _probe_model(spec, model: torch.nn.Module, workload: Workload, with_lora: bool, fp8: bool):
    """A copy of `model`'s architecture with two blocks per list, on meta, in the workload's dtype,
    with the run's adapters (the trainer's own add_lora) and fp8 storage (the engine's own)."""
    keys = BLOCK_COUNT_KEYS.get(spec.family)
    if keys is None or not hasattr(model, "config"):
        raise ValueError(f"the planner cannot build a probe copy of a {spec.family} model")
    cfg = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}
    for attr, key in keys.items():
        cfg[key] = min(2, len(getattr(model, attr)))
    with torch.device("meta"):
        probe = type(model).from_config(cfg)
    probe._apply(lambda t: t.to(workload.dtype) if t.is_floating_point() else t)
    probe.requires_grad_(workload.mode == "full")
    if with_lora:
        from ..config import LoraConfig
        from ..train.lora import add_lora

        blocks = None
        if workload.lora_blocks is not None:   # a kind with any LoRA block is probed with LoRA
            blocks = {kind: ([0, 1][:len(getattr(probe, spec.block_list(kind).attr))] if idx else [])
                      for kind, idx in workload.lora_blocks.items()}
        add_lora(probe, spec, LoraConfig(rank=workload.rank, targets=workload.targets, blocks=blocks,
                                         dropout=workload.lora_dropout))
    if fp8:
        from .fp8 import apply_fp8_storage

        apply_fp8_storage(probe, spec, compute_dtype=workload.dtype)
    return probe


def _probe_inputs(model, workload: Workload, bucket: tuple[int, int]) -> dict:
    cfg = model.config
    b, n_img, n_txt = workload.batch_size, workload.image_tokens(bucket), workload.text_length
    dt = workload.dtype

    def meta(*shape, dtype=dt):
        return torch.empty(*shape, device="meta", dtype=dtype)

    inputs = dict(hidden_states=meta(b, n_img, cfg.in_channels),
                  encoder_hidden_states=meta(b, n_txt, cfg.joint_attention_dim),
                  pooled_projections=meta(b, cfg.pooled_projection_dim), timestep=meta(b),
                  img_ids=meta(n_img, 3), txt_ids=meta(n_txt, 3), return_dict=False)
    if getattr(cfg, "guidance_embeds", False):
        inputs["guidance"] = meta(b, dtype=torch.float32)
    return inputs


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


def _run_probe(spec, probe, workload: Workload, bucket, grad: bool) -> tuple[_Tracker, dict, dict]:
    """One forward (and backward when `grad`) of the probe model; returns the tracker's windows,
    the live bytes after each block and the output bytes of each block."""
    tracker = _Tracker()
    after: dict[str, int] = {}
    outs: dict[str, int] = {}
    handles = []
    kinds = {bl.attr: bl.kind for bl in spec.block_lists}

    for attr, kind in kinds.items():
        for i, block in enumerate(getattr(probe, attr)):
            name = f"{kind}.{i}"

            def pre(_m, _a, _k, name=name):
                tracker.open(f"fwd:{name}")

            def post(_m, _a, _k, output, name=name):
                after[name] = tracker.live
                outs[name] = _storage_bytes(tree_leaves(output))
                tracker.open(f"fwd:after:{name}")
                if grad:
                    started = []

                    def on_grad(_g, name=name):
                        if not started:
                            started.append(True)
                            tracker.open(f"bwd:{name}")

                    for t in tree_leaves(output):
                        if isinstance(t, torch.Tensor) and t.requires_grad:
                            t.register_hook(on_grad)

            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
    inputs = _probe_inputs(probe, workload, bucket)
    _FlashAttention.tracker = tracker
    try:
        semantics = _GpuSemantics(workload.autocast)
        with semantics, tracker, torch.set_grad_enabled(grad):
            tracker.open("fwd:pre")
            pred = probe(**inputs)[0]                                      # (B, N_img, 64)
            if grad:
                target = torch.empty(pred.shape, device="meta", dtype=torch.float32)
                loss = ((pred.float() - target) ** 2).mean()
                tracker.open("fwd:post_end")
                tracker.open("bwd:post")
                semantics.autocast = False          # autocast does not reach the backward pass
                loss.backward()
                del loss, target
            tracker.open("end")
            del pred
            tracker.close()
    finally:
        _FlashAttention.tracker = None
        for h in handles:
            h.remove()
    return tracker, after, outs


def probe_activations(spec, model: torch.nn.Module, workload: Workload, bucket: tuple[int, int],
                      fp8: bool = False) -> ActivationProfile:
    """Activation bytes and FLOPs of `model`'s architecture for one bucket, measured on meta.

    Each kind is characterised by its last block in the probe copy, whose input comes from a block
    of the same kind (or the kind before), as almost every block in the full model does.
    """
    with_lora = workload.mode == "lora" and (workload.lora_blocks is None or any(workload.lora_blocks.values()))
    probe = _probe_model(spec, model, workload, with_lora, fp8)
    order = [f"{bl.kind}.{i}" for bl in spec.block_lists for i in range(len(getattr(probe, bl.attr)))]
    last = {name.split(".")[0]: name for name in order}          # kind -> its last block in the probe
    kinds = list(last)
    tokens = workload.image_tokens(bucket) + workload.text_length

    ng, _, ng_outs = _run_probe(spec, probe, workload, bucket, grad=False)
    nograd = {k: ng.windows[f"fwd:{last[k]}"]["peak"] - ng.windows[f"fwd:{last[k]}"]["start"] for k in kinds}
    ng_post = ng.windows[f"fwd:after:{order[-1]}"]
    nograd_pre = ng.windows["fwd:pre"]["end"]
    nograd_post = max(0, ng_post["peak"] - ng_post["start"])
    if workload.mode == "inference":
        profiles = {k: KindProfile(saved=0, out=ng_outs[last[k]], fwd_transient=nograd[k], bwd_transient=0,
                                   nograd_transient=nograd[k], fwd_flops=ng.windows[f"fwd:{last[k]}"]["flops"],
                                   bwd_flops=0.0, fwd_traffic=ng.windows[f"fwd:{last[k]}"]["traffic"])
                    for k in kinds}
        return ActivationProfile(bucket, tokens, profiles, pre=nograd_pre, post=0, post_bwd_transient=0,
                                 nb_fwd_flops=ng.windows["fwd:pre"]["flops"], nb_bwd_flops=0.0,
                                 nograd_pre=nograd_pre, nograd_post_transient=nograd_post,
                                 nb_post_flops=ng_post["flops"])

    tr, after, outs = _run_probe(spec, probe, workload, bucket, grad=True)
    profiles = {}
    for k in kinds:
        name = last[k]
        idx = order.index(name)
        before = after[order[idx - 1]] if idx > 0 else tr.windows[f"fwd:{name}"]["start"]
        fw, bw = tr.windows[f"fwd:{name}"], tr.windows.get(f"bwd:{name}")
        profiles[k] = KindProfile(
            saved=after[name] - before, out=outs[name],
            fwd_transient=max(0, fw["peak"] - fw["end"]),
            bwd_transient=max(0, bw["peak"] - bw["start"]) if bw else 0,
            nograd_transient=nograd[k], fwd_flops=fw["flops"], bwd_flops=bw["flops"] if bw else 0.0,
            fwd_traffic=fw["traffic"], bwd_traffic=bw["traffic"] if bw else 0)
    post_fwd = tr.windows[f"fwd:after:{order[-1]}"]
    post_bwd = tr.windows["bwd:post"]
    return ActivationProfile(
        bucket=bucket, tokens=tokens, kinds=profiles,
        pre=tr.windows[f"fwd:{order[0]}"]["start"], post=tr.windows["fwd:post_end"]["start"] - after[order[-1]],
        post_bwd_transient=max(0, post_bwd["peak"] - post_bwd["start"]),
        nb_fwd_flops=tr.windows["fwd:pre"]["flops"], nb_bwd_flops=post_bwd["flops"],
        nograd_pre=nograd_pre, nograd_post_transient=nograd_post, nb_post_flops=post_fwd["flops"])


# -- estimates ---------------------------------------------------------------------------------------

def _pow2(n: int) -> int:
    """What PyTorch's caching host allocator reserves for a pinned buffer of n bytes."""
    return 1 << (max(int(n), 1) - 1).bit_length()


@dataclass(frozen=True)
class Estimate:
    """Predicted peak VRAM and host RAM (bytes, per component) and step time (seconds) of a plan."""

    vram: dict[str, int]
    peak_vram: int
    host: dict[str, int]
    peak_host: int
    step_s: float
    compute_s: float
    exposed_s: float                 # compute waiting on copies
    overhead_s: float                # fp8 dequantisation and the optimizer step
    h2d_bytes: int                   # weights (and offloaded inputs) copied per step
    per_bucket: dict[str, dict]      # "HxW" -> {"peak_vram", "activations", "step_s"}


@dataclass
class Calibration:
    """Corrections measured on this machine: activation scale per bucket key, compute and copy rates."""

    activation_scale: dict[str, float] = field(default_factory=dict)
    flops_scale: float = 1.0
    h2d_pinned: float | None = None

    def to_dict(self) -> dict:
        return {"activation_scale": dict(self.activation_scale), "flops_scale": self.flops_scale,
                "h2d_pinned": self.h2d_pinned}

    @classmethod
    def from_dict(cls, d: dict | None) -> Calibration:
        d = d or {}
        return cls(dict(d.get("activation_scale", {})), float(d.get("flops_scale", 1.0)), d.get("h2d_pinned"))


def bucket_key(bucket: tuple[int, int]) -> str:
    return f"{bucket[0]}x{bucket[1]}"


_PROBE_CACHE: dict = {}


def architecture_key(model: torch.nn.Module, workload: Workload) -> str:
    """Identity of what decides activation memory: the architecture config and the workload's shape
    (not the weight values, so every checkpoint of one architecture shares a calibration)."""
    cfg = {k: v for k, v in dict(getattr(model, "config", {})).items() if not k.startswith("_")}
    blob = json.dumps({"class": type(model).__name__, "config": cfg, "mode": workload.mode, "rank": workload.rank,
                       "targets": workload.targets, "blocks": workload.lora_blocks, "batch": workload.batch_size,
                       "text": workload.text_length, "autocast": workload.autocast, "dtype": str(workload.dtype),
                       "dropout": workload.lora_dropout}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Planner:
    """The memory model of one (model, workload, machine): estimates any plan, searches the best.

    Construction measures the weights and runs the meta probes once per bucket (about a second
    each at full Flux size); `plan(budget)` then searches in well under a second, so re-planning
    after an OOM or a calibration is cheap.
    """

    def __init__(self, spec, model: torch.nn.Module, workload: Workload, machine: Machine | None = None,
                 calibration: Calibration | None = None):
        if workload.mode == "lora" and workload.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {workload.rank}")
        if not workload.buckets:
            raise ValueError("the workload needs at least one resolution bucket")
        self.spec, self.workload = spec, workload
        self.machine = machine or assumed_machine()
        self.calibration = calibration or Calibration()
        self.weights = measure_weights(spec, model, workload)
        self.key = architecture_key(model, workload)
        self.dtype_bytes = DTYPE_BYTES.get(workload.dtype, 2)
        self.fp8_options = [False] + ([True] if workload.allow_fp8 and workload.mode != "full" else [])
        self.profiles = {fp8: {b: self._probe(model, b, fp8) for b in workload.buckets} for fp8 in self.fp8_options}
        self.kinds = [b.kind for b in self.weights.blocks]
        self.order = self._streaming_order()
        self._peaks: dict = {}

    # -- set-up ----------------------------------------------------------------------------------
    def _probe(self, model, bucket, fp8: bool) -> ActivationProfile:
        key = (self.key, bucket, fp8)
        if key not in _PROBE_CACHE:
            _PROBE_CACHE[key] = probe_activations(self.spec, model, self.workload, bucket, fp8=fp8)
        return _PROBE_CACHE[key]

    def _streaming_order(self) -> list[str]:
        """Block kinds in the order they start streaming: most forward FLOPs per byte first (their
        copies hide best behind their own compute; for Flux, single blocks move ~2.4x fewer bytes
        per FLOP than double blocks)."""
        prof = self.profiles[False][self.workload.buckets[0]]
        by_kind: dict[str, list[ModuleWeights]] = {}
        for b in self.weights.blocks:
            by_kind.setdefault(b.kind, []).append(b)

        def intensity(kind: str) -> float:
            nbytes = sum(b.bytes(self.dtype_bytes) for b in by_kind[kind]) / len(by_kind[kind])
            return prof.kinds[kind].fwd_flops / max(nbytes, 1)

        return sorted(by_kind, key=intensity, reverse=True)

    def streamed_set(self, n: int) -> list[int]:
        """Block indices (execution order) of the n blocks to stream: kinds in streaming order, each
        kind's share spread evenly through its list so resident blocks sit between streamed ones."""
        chosen: list[int] = []
        for kind in self.order:
            idx = [i for i, k in enumerate(self.kinds) if k == kind]
            take = min(n - len(chosen), len(idx))
            chosen.extend(idx[j] for j in _spread(take, len(idx)))
        return sorted(chosen)

    # -- the memory model ------------------------------------------------------------------------
    def activation_peak(self, bucket, fp8: bool, checkpointing: str) -> int:
        prof = self.profiles[fp8][bucket]
        seq = [prof.kinds[k] for k in self.kinds]
        scales = self.calibration.activation_scale   # measured for this mode, else for another mode
        scale = scales.get(f"{bucket_key(bucket)}:{checkpointing}", scales.get(f"{bucket_key(bucket)}:*", 1.0))
        return int(_compose(prof, seq, checkpointing, self.workload.mode) * scale)

    def _trainable(self) -> tuple[int, int, int]:
        """(parameter bytes, gradient bytes, optimizer-state bytes) of what trains."""
        w = self.workload
        if w.mode == "inference":
            return 0, 0, 0
        if w.mode == "lora":
            n = self.weights.adapter_params(w.rank)
            params = grads = 4 * n
            states = 8 * n if w.optimizer == "adamw" else 4 * self.weights.adafactor_state(w.rank)
            return params, grads, states
        n = self.weights.numel
        grads = n * self.dtype_bytes
        # AdamW: two fp32 moments. Adafactor factors matrices into row and column statistics; without
        # per-tensor shapes here, its unfactored size (one fp32 per parameter) is the upper bound used.
        states = 8 * n if w.optimizer == "adamw" else 4 * n
        return 0, grads, states   # full: the trained weights are the model's, already counted as weights

    def _units(self, plan: Plan) -> list[int]:
        """Packed bytes of each streamed unit, in the engine's unit order (non-block group first)."""
        wt = self.weights
        units = [wt.blocks[i].unit_bytes(self.dtype_bytes, plan.fp8) for i in sorted(self._indices(plan))]
        if plan.stream_non_blocks:
            units.insert(0, wt.non_blocks.unit_bytes(self.dtype_bytes))
        return units

    def memory(self, plan: Plan) -> tuple[dict[str, int], dict[str, int], dict[str, dict]]:
        """(VRAM components at the peak, host RAM components, per-bucket peaks) of a plan.

        The VRAM components add up to the peak: the backward peak (activations, plus gradients
        when they persist through accumulation) or the optimizer step (gradients and the
        optimizer's temporaries), whichever is larger, on top of what is always there.
        """
        w, wt = self.workload, self.weights
        streamed = self._indices(plan)
        units = self._units(plan)
        resident = sum(b.bytes(self.dtype_bytes, plan.fp8) for i, b in enumerate(wt.blocks) if i not in streamed)
        resident += 0 if plan.stream_non_blocks else wt.non_blocks.bytes(self.dtype_bytes)
        slots = min(plan.ring_slots, len(units)) * _align(max(units)) if units else 0
        params, grads, states = self._trainable()
        opt_tmp = {"lora": 2 * params, "full": 2 * grads, "inference": 0}[w.mode]
        keep_grads = w.gradient_accumulation > 1 or w.mode == "full"
        static = {"weights resident": resident, "stream slots": slots, "adapters": params,
                  "optimizer states": states, "workspace": self.machine.workspace}
        per_bucket: dict[str, dict] = {}
        worst = None
        for bucket in w.buckets:
            act = self.activation_peak(bucket, plan.fp8, plan.checkpointing)
            backward = {"activations": act, "gradients": grads if keep_grads else 0, "optimizer step": 0}
            step = {"activations": 0, "gradients": grads, "optimizer step": opt_tmp}
            part = backward if sum(backward.values()) >= sum(step.values()) else step
            top = sum(static.values()) + sum(part.values())
            per_bucket[bucket_key(bucket)] = {"peak_vram": top, "activations": act}
            if worst is None or top > worst[0]:
                worst = (top, part)
        vram = {**static, **worst[1]}
        order = ["weights resident", "stream slots", "adapters", "gradients", "optimizer states",
                 "optimizer step", "activations", "workspace"]
        return {k: vram[k] for k in order}, self._host(plan, units), per_bucket

    def estimate(self, plan: Plan) -> Estimate:
        vram, host, per_bucket = self.memory(plan)
        units = self._units(plan)
        timing = [self._time(plan, bucket, units) for bucket in self.workload.buckets]
        for bucket, t in zip(self.workload.buckets, timing):
            per_bucket[bucket_key(bucket)]["step_s"] = t[0]
        n = len(timing)
        return Estimate(vram=vram, peak_vram=sum(vram.values()), host=host, peak_host=host["peak"],
                        step_s=sum(t[0] for t in timing) / n, compute_s=sum(t[1] for t in timing) / n,
                        exposed_s=sum(t[2] for t in timing) / n, overhead_s=sum(t[3] for t in timing) / n,
                        h2d_bytes=int(sum(t[4] for t in timing) / n), per_bucket=per_bucket)

    def _indices(self, plan: Plan) -> set[int]:
        index = {b.name: i for i, b in enumerate(self.weights.blocks)}
        unknown = [n for n in plan.streamed_blocks if n not in index]
        if unknown:
            raise ValueError(f"plan streams unknown blocks {unknown[:3]}")
        return {index[n] for n in plan.streamed_blocks}

    def _host(self, plan: Plan, units: list[int]) -> dict[str, int]:
        """Host RAM: the engine packs every streamed unit before it re-points the module weights, so
        the stored model and all unit buffers coexist once, while memory is applied."""
        w, wt = self.workload, self.weights
        pinned = plan.pin_memory
        unit_ram = sum(_pow2(u) if pinned else u for u in units)
        staging = 2 * STAGING_CHUNK if units and not pinned else 0
        offload = 0
        if plan.checkpointing == "offload":
            for bucket in w.buckets:
                prof = self.profiles[plan.fp8][bucket]
                img = w.image_tokens(bucket) / prof.tokens
                per_block = sum(_pow2(int(prof.kinds[k].out * img)) + _pow2(int(prof.kinds[k].out * (1 - img)))
                                for k in self.kinds)
                offload = max(offload, per_block)
        loaded = wt.total(self.dtype_bytes)
        applying = wt.total(self.dtype_bytes, plan.fp8) + unit_ram + staging
        steady = unit_ram + staging + offload + w.host_cache_bytes
        return {"process baseline": HOST_BASELINE, "transformer while loading": loaded,
                "stored model + unit buffers while applying": applying,
                f"streamed blocks ({'pinned' if pinned else 'pageable'})": unit_ram,
                "staging buffers": staging, "offloaded activations": offload, "caches": w.host_cache_bytes,
                "peak": HOST_BASELINE + max(loaded, applying, steady)}

    # -- the timing model --------------------------------------------------------------------------
    def _time(self, plan: Plan, bucket, units: list[int]) -> tuple[float, float, float, float, int]:
        """(step, compute, exposed transfer, overhead, H2D bytes) for one bucket, from a simulation of
        the engine's schedule over two consecutive steps (the second, steady one is reported)."""
        m, w = self.machine, self.workload
        rate = m.flops * self.calibration.flops_scale
        bw = (self.calibration.h2d_pinned or m.h2d_pinned) if plan.pin_memory else m.h2d_pageable
        prof = self.profiles[plan.fp8][bucket]
        ref = self.profiles[False][bucket]
        streamed = sorted(self._indices(plan))
        unit_of = {i: n + int(plan.stream_non_blocks) for n, i in enumerate(streamed)}
        nb_unit = 0 if plan.stream_non_blocks else None
        k_slots = max(1, min(plan.ring_slots, len(units))) if units else 1
        ckpt = plan.checkpointing != "none"
        offload = plan.checkpointing == "offload"

        def dq(kind: str, phase: str) -> float:   # extra memory-bound traffic of fp8 dequantisation
            a, b = prof.kinds[kind], ref.kinds[kind]
            extra = (a.fwd_traffic - b.fwd_traffic) if phase == "fwd" else (a.bwd_traffic - b.bwd_traffic)
            return max(0, extra) / m.hbm

        uses: list[tuple[int | None, float, int, float]] = []   # (unit, compute s, extra H2D bytes, overhead s)
        uses.append((nb_unit, prof.nb_fwd_flops / rate, 0, 0.0))           # embedders
        for i, kind in enumerate(self.kinds):
            kp = prof.kinds[kind]
            uses.append((unit_of.get(i), kp.fwd_flops / rate, 0, dq(kind, "fwd")))
        uses.append((nb_unit, prof.nb_post_flops / rate, 0, 0.0))          # final norm and projection
        if w.mode != "inference":
            uses.append((nb_unit, prof.nb_bwd_flops / rate, 0, 0.0))
            for i in reversed(range(len(self.kinds))):
                kind = self.kinds[i]
                kp = prof.kinds[kind]
                c = kp.bwd_flops / rate + (kp.fwd_flops / rate if ckpt else 0.0)
                over = dq(kind, "bwd") + (dq(kind, "fwd") if ckpt else 0.0)
                uses.append((unit_of.get(i), c, kp.out if offload else 0, over))
        owner = [None] * k_slots
        ready = [0.0] * k_slots
        free_at = [0.0] * k_slots
        t = copy_free = 0.0
        moved = 0
        step_start = compute = overhead = 0.0
        for step in range(2):
            if step == 1:
                step_start, compute, overhead, moved = t, 0.0, 0.0, 0
            for unit, c, extra, over in uses:
                need = 0.0
                if unit is not None:
                    s = unit % k_slots
                    if owner[s] != unit:
                        start = max(copy_free, free_at[s])
                        copy_free = start + units[unit] / bw
                        owner[s], ready[s] = unit, copy_free
                        moved += units[unit]
                    need = ready[s]
                if extra:
                    copy_free = max(copy_free, t) + extra / m.h2d_pinned
                    need = max(need, copy_free)
                    moved += extra
                t = max(t, need) + c + over
                compute += c
                overhead += over
                if unit is not None:
                    free_at[unit % k_slots] = t
        params, grads, states = self._trainable()
        opt = 2 * (params + grads + states) / m.hbm         # the optimizer reads and writes its tensors
        step_s = t - step_start + opt + moved / m.hbm           # copies also cost device-memory bandwidth
        overhead += opt + moved / m.hbm
        return step_s, compute, max(0.0, step_s - compute - overhead), overhead, moved

    # -- the search --------------------------------------------------------------------------------
    def candidates(self):
        w = self.workload
        n_blocks = len(self.weights.blocks)
        ckpts = ("none",) if w.mode == "inference" else CHECKPOINTING
        counts = range(n_blocks + 1) if w.mode != "full" else range(1)
        for fp8 in self.fp8_options:
            for ckpt in ckpts:
                for n in counts:
                    names = tuple(self.weights.blocks[i].name for i in self.streamed_set(n))
                    if n == 0:
                        yield Plan(streamed_blocks=(), fp8=fp8, checkpointing=ckpt)
                        continue
                    for nb in ((False, True) if n == n_blocks else (False,)):
                        units = n + int(nb)
                        for k in RING_CHOICES:
                            if k > max(2, units):
                                continue
                            for pin in (True, False):
                                yield Plan(streamed_blocks=names, stream_non_blocks=nb, fp8=fp8,
                                           checkpointing=ckpt, ring_slots=k, pin_memory=pin)

    def plan(self, budget: Budget) -> Plan:
        """The fastest plan whose predicted peak plus the margin fits `budget` (VRAM and host RAM).

        Exhaustive over the candidates that fit, so a larger budget (a superset of fitting plans)
        never gives a slower plan. To keep it fast, candidates are grouped by (fp8, checkpointing):
        the group's plan with nothing streamed is a lower bound on every plan of the group (streaming
        only adds copies), and groups whose bound is already slower than the best plan are skipped.
        """
        ram_limit = budget.ram_limit(self.machine)
        groups: dict[tuple[bool, str], list[Plan]] = {}
        smallest_vram = smallest_host = None       # over plans that fit the other resource
        for plan in self.candidates():
            vram, host = self._cheap_estimate(plan)
            vram_ok, host_ok = vram <= budget.usable_vram, host <= ram_limit
            if host_ok and (smallest_vram is None or vram < smallest_vram[0]):
                smallest_vram = (vram, plan)
            if vram_ok and (smallest_host is None or host < smallest_host[0]):
                smallest_host = (host, plan)
            if vram_ok and host_ok:
                groups.setdefault((plan.fp8, plan.checkpointing), []).append(plan)
        if not groups:
            raise self._infeasible(budget, ram_limit, smallest_vram, smallest_host)
        bound = {g: round(self.step_time(Plan(fp8=g[0], checkpointing=g[1])), 6) for g in groups}
        best = best_key = None
        for g in sorted(groups, key=bound.__getitem__):
            if best_key is not None and bound[g] > best_key[0]:
                break
            for plan in groups[g]:
                # Step times are compared to the microsecond: equal-time plans (copies fully hidden)
                # tie, and the tie goes to no fp8, less checkpointing, fewer streamed blocks, the
                # smaller ring, pinned memory.
                key = (round(self.step_time(plan), 6), plan.fp8, CHECKPOINTING.index(plan.checkpointing),
                       len(plan.streamed_blocks), plan.stream_non_blocks, plan.ring_slots, not plan.pin_memory)
                if best_key is None or key < best_key:
                    best, best_key = plan, key
        return self._annotate(best, self.estimate(best), budget, ram_limit)

    def step_time(self, plan: Plan) -> float:
        """Predicted seconds per step (mean over the buckets), without the memory breakdown."""
        units = self._units(plan)
        return sum(self._time(plan, b, units)[0] for b in self.workload.buckets) / len(self.workload.buckets)

    def _cheap_estimate(self, plan: Plan) -> tuple[int, int]:
        """(peak VRAM, peak host) without the timing simulation: the search prunes with it."""
        key = (plan.streamed_blocks, plan.stream_non_blocks, plan.fp8, plan.checkpointing, plan.ring_slots,
               plan.pin_memory)
        if key not in self._peaks:
            vram, host, _ = self.memory(plan)
            self._peaks[key] = (sum(vram.values()), host["peak"])
        return self._peaks[key]

    def _infeasible(self, budget: Budget, ram_limit: int, smallest_vram, smallest_host) -> InfeasibleBudget:
        w = self.workload
        if smallest_vram is None:   # not even the most host-frugal plan fits host RAM
            frugal = min(self.candidates(), key=lambda p: self._cheap_estimate(p)[1])
            need = self._cheap_estimate(frugal)[1]
            est = self.estimate(frugal)
            return InfeasibleBudget(
                f"no memory plan fits host RAM: the smallest needs {_gib(need)} (loading the transformer "
                f"alone takes {_gib(est.host['transformer while loading'] + HOST_BASELINE)}), but ram_budget is "
                f"{_gib(ram_limit)}. Raise [memory] ram_budget, free host memory, or stream fewer blocks with "
                f"pinned memory off.", needed_ram=need, best=frugal)
        peak, plan = smallest_vram
        est = self.estimate(plan)
        need = budget.needed_for(peak)
        parts = est.vram
        act = parts["activations"]
        train = parts["adapters"] + parts["gradients"] + parts["optimizer states"]
        levers = []
        if act:
            sizes = ", ".join(f"{b[1]}x{b[0]}" for b in w.buckets)
            levers.append(f"activations take {_gib(act)} at {sizes}, batch {w.batch_size}: lower [data] resolutions "
                          f"or batch_size, or max_text_length")
        if train and w.mode == "lora":
            levers.append(f"adapters, gradients and optimizer states take {_gib(train)}: lower [lora] rank or "
                          f"narrow [lora] targets, or use [train] optimizer = \"adafactor\"")
        if w.mode == "full":
            levers.append(f"a full fine-tune keeps every weight, gradient and optimizer state on the GPU "
                          f"({_gib(parts['weights resident'] + train)}); train a LoRA instead")
        if parts["weights resident"] and w.mode != "full":
            levers.append(f"weights that cannot stream take {_gib(parts['weights resident'])}")
        message = (f"no memory plan fits a VRAM budget of {_gib(budget.vram)} (usable {_gib(budget.usable_vram)} after "
                   f"a {_gib(budget.margin_bytes)} safety margin) for {w.describe()}. The smallest budget that works "
                   f"is {_gib(need)}, with: {plan.describe()} (predicted peak {_gib(peak)}). To fit "
                   f"{_gib(budget.vram)}: " + "; ".join(levers) + ".")
        return InfeasibleBudget(message, needed_vram=need, best=plan)

    def _annotate(self, plan: Plan, est: Estimate, budget: Budget, ram_limit: int) -> Plan:
        notes = {
            "predicted_peak_vram": est.peak_vram,
            "predicted_peak_host": est.peak_host,
            "vram_breakdown": dict(est.vram),
            "host_breakdown": dict(est.host),
            "predicted_step_s": est.step_s,
            "compute_s": est.compute_s,
            "exposed_transfer_s": est.exposed_s,
            "overhead_s": est.overhead_s,
            "h2d_bytes_per_step": est.h2d_bytes,
            "per_bucket": est.per_bucket,
            "budget_vram": budget.vram,
            "margin_vram": budget.margin_bytes,
            "budget_ram": ram_limit,
            "machine": self.machine.describe(),
            "machine_measured": self.machine.measured,
            "workload": self.workload.describe(),
            "streamed_by_kind": _count_kinds(plan.streamed_blocks, self.weights),
            "total_blocks": len(self.weights.blocks),
            "architecture_key": self.key,
        }
        return replace(plan, notes=notes)


def _spread(count: int, total: int) -> list[int]:
    """`count` of `total` positions, evenly spread: 1 of 38 is the middle one, 38 of 38 all."""
    return sorted({min(total - 1, int((j + 0.5) * total / count)) for j in range(count)}) if count else []


def _compose(prof: ActivationProfile, seq: list[KindProfile], checkpointing: str, mode: str) -> int:
    """Peak activation bytes of a whole step from per-kind probe values (formulas in the module doc)."""
    if mode == "inference":
        top = max(k.nograd_transient + k.out for k in seq)
        return prof.nograd_pre + max(top, prof.nograd_post_transient + seq[-1].out)
    pre = prof.pre
    peak = pre
    if checkpointing == "none":
        live = pre
        for k in seq:
            live += k.saved
            peak = max(peak, live + k.fwd_transient)
        peak = max(peak, live + prof.post + prof.post_bwd_transient)
        for k in reversed(seq):
            peak = max(peak, live + k.out + k.bwd_transient)
            live -= k.saved
        return peak
    kept = pre
    for k in seq:                                    # no-grad forward, keeping each block's input
        peak = max(peak, kept + k.nograd_transient)
        kept = kept + k.out if checkpointing == "blocks" else pre + 2 * k.out
    peak = max(peak, kept + prof.post + prof.post_bwd_transient)
    for k in reversed(seq):                          # recompute, then backward, block by block
        peak = max(peak, kept + k.out + k.saved + max(k.fwd_transient, k.bwd_transient))
        if checkpointing == "blocks":
            kept -= k.out
    return peak


def _count_kinds(names, weights: ModelWeights) -> dict[str, int]:
    kinds = {b.name: b.kind for b in weights.blocks}
    out: dict[str, int] = {}
    for n in names:
        out[kinds[n]] = out.get(kinds[n], 0) + 1
    return out


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# -- entry points ------------------------------------------------------------------------------------

def build_meta_flux(variant: str = "dev"):
    """The full-size Flux.1 transformer (dev: with the guidance embedder; schnell: without) on the
    meta device: exact shapes and dtypes, no memory, in a fraction of a second."""
    from diffusers import FluxTransformer2DModel

    from ..models.component_files import packaged_config

    if variant not in ("dev", "schnell"):
        raise ValueError(f"unknown Flux variant {variant!r}; choose 'dev' or 'schnell'")
    cfg = {k: v for k, v in packaged_config(f"flux1_{variant}").items() if not k.startswith("_")}
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(cfg)
    model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)
    return model


def plan_memory(spec, model_or_meta: torch.nn.Module, workload: Workload, budget: Budget,
                machine: Machine | None = None, calibration: Calibration | None = None) -> Plan:
    """The fastest plan for `workload` on `model_or_meta` (real or meta weights) within `budget`.

    `plan.notes` carries the predicted peaks with their breakdowns, the predicted step time and
    the machine it assumed. Raises InfeasibleBudget when nothing fits.
    """
    return Planner(spec, model_or_meta, workload, machine, calibration).plan(budget)


def workload_from_config(cfg, model: torch.nn.Module | None = None) -> Workload:
    """The Workload a [data]/[lora]/[train]/[model] configuration trains."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    return Workload(mode="lora", rank=cfg.lora.rank, targets=cfg.lora.targets, lora_blocks=cfg.lora.blocks,
                    optimizer=cfg.train.optimizer, batch_size=cfg.data.batch_size,
                    buckets=Workload.square(cfg.data.resolutions), text_length=cfg.data.max_text_length,
                    gradient_accumulation=cfg.train.gradient_accumulation,
                    autocast=cfg.train.mixed_precision == "bf16", dtype=dtypes[cfg.model.dtype],
                    lora_dropout=cfg.lora.dropout)


def budget_from_config(memory_cfg, machine: Machine) -> Budget:
    """[memory] vram_budget / ram_budget as a Budget; "auto" is the free VRAM of the GPU here."""
    from ..config import ConfigError, parse_size

    value = memory_cfg.vram_budget
    if value is None:
        raise ConfigError("[memory] vram_budget is not set; the planner needs a budget (\"auto\" or a size)")
    if str(value).strip().lower() == "auto":
        if machine.vram_free is None:
            raise ConfigError("[memory] vram_budget = \"auto\" needs a GPU to measure free VRAM; none is visible "
                              "here, so give a size such as \"8GiB\"")
        vram = machine.vram_free
    else:
        try:
            vram = parse_size(value)
        except ValueError as e:
            raise ConfigError(f"[memory] vram_budget: {e}") from None
    ram = None
    if memory_cfg.ram_budget is not None:
        try:
            ram = parse_size(memory_cfg.ram_budget)
        except ValueError as e:
            raise ConfigError(f"[memory] ram_budget: {e}") from None
    return Budget(vram=vram, ram=ram)


def planner_for_config(cfg, spec, model: torch.nn.Module, machine: Machine | None = None,
                       store: CalibrationStore | None = None) -> tuple[Planner, Budget]:
    """The Planner and Budget of a run, with the stored calibration of its architecture and
    workload; the trainer keeps them for OomGuard and PlanCalibrator."""
    machine = machine or probe_machine()
    workload = workload_from_config(cfg, model)
    budget = budget_from_config(cfg.memory, machine)
    store = store if store is not None else CalibrationStore()
    return Planner(spec, model, workload, machine, store.get(architecture_key(model, workload))), budget


def choose_plan(planner: "Planner", budget: Budget, cfg) -> Plan:
    """The fastest plan under the run's budget, logged as a table; an impossible budget is a
    config error naming [memory] vram_budget and what would fit."""
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        from ..config import ConfigError

        raise ConfigError(f"[memory] vram_budget = {cfg.memory.vram_budget!r}: {e}") from None
    for line in format_plan(plan).splitlines():
        log.info("%s", line)
    return plan


def plan_for_config(cfg, spec, model: torch.nn.Module, machine: Machine | None = None,
                    store: CalibrationStore | None = None) -> Plan:
    """The plan for this config's workload when [memory] vram_budget is set.

    Uses the calibration stored for this architecture and workload, so a second run with the same
    model and resolutions starts from measured activations.
    """
    planner, budget = planner_for_config(cfg, spec, model, machine, store)
    return choose_plan(planner, budget, cfg)


def format_plan(plan: Plan) -> str:
    """The chosen plan and its predicted breakdown as an aligned text table."""
    n = plan.notes or {}
    lines = []
    if "workload" in n:
        lines.append(f"workload: {n['workload']}")
        lines.append(f"machine:  {n['machine']}")
    kinds = n.get("streamed_by_kind", {})
    by_kind = ", ".join(f"{v} {k}" for k, v in kinds.items())
    lines.append(f"plan:     {plan.describe()}" + (f" ({by_kind} of {n.get('total_blocks')})" if by_kind else ""))
    if plan.streamed_blocks:
        lines.append(f"streamed: {_compact_names(plan.streamed_blocks)}")
    if "vram_breakdown" in n:
        budget, margin = n["budget_vram"], n["margin_vram"]
        lines.append("")
        lines.append(f"{'VRAM at peak':<44}{'GiB':>9}")
        for k, v in n["vram_breakdown"].items():
            lines.append(f"  {k:<42}{v / GiB:>9.2f}")
        lines.append(f"  {'total (predicted peak)':<42}{n['predicted_peak_vram'] / GiB:>9.2f}")
        lines.append(f"  {'budget - safety margin':<42}{(budget - margin) / GiB:>9.2f}"
                     f"   ({budget / GiB:.2f} - {margin / GiB:.2f})")
        lines.append("")
        lines.append(f"{'host RAM':<44}{'GiB':>9}")
        host = n["host_breakdown"]
        for k, v in host.items():
            if k != "peak":
                lines.append(f"  {k:<42}{v / GiB:>9.2f}")
        lines.append(f"  {'peak (baseline + largest phase)':<42}{host['peak'] / GiB:>9.2f}")
        if n["budget_ram"] < 2**60:
            lines.append(f"  {'ram budget':<42}{n['budget_ram'] / GiB:>9.2f}")
        else:
            lines.append("  (host RAM not checked: planning for another machine; give --ram to check it)")
        lines.append("")
        lines.append(f"step time: {n['predicted_step_s']:.3f} s = compute {n['compute_s']:.3f} s + exposed transfer "
                     f"{n['exposed_transfer_s']:.3f} s + overhead {n['overhead_s']:.3f} s "
                     f"({n['h2d_bytes_per_step'] / 1e9:.1f} GB host->GPU per step)")
        if not n.get("machine_measured", True):
            lines.append("(rates assumed, not measured: no GPU here)")
    return "\n".join(lines)


def _compact_names(names) -> str:
    """('single_transformer_blocks.0', '...1', '...2', '...5') -> 'single_transformer_blocks.0-2,5'."""
    groups: dict[str, list[int]] = {}
    for n in names:
        attr, idx = n.rsplit(".", 1)
        groups.setdefault(attr, []).append(int(idx))
    parts = []
    for attr, idx in groups.items():
        idx.sort()
        runs, start, prev = [], idx[0], idx[0]
        for i in idx[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            if i is not None:
                start = prev = i
        parts.append(f"{attr}.{','.join(runs)}")
    return "; ".join(parts)


# -- calibration -----------------------------------------------------------------------------------------

def default_calibration_path() -> Path:
    base = os.environ.get("LEANTUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "leantune")
    return Path(base) / "calibration.json"


class CalibrationStore:
    """Calibrations on disk, one JSON file, keyed by `architecture_key`. Written atomically; an
    unreadable file is reported and ignored (the planner then starts from the uncalibrated model)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_calibration_path()

    def _read(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            return data
        except (OSError, ValueError, TypeError) as e:
            log.warning("planner: ignoring unreadable calibration file %s (%s)", self.path, e)
            return {}

    def get(self, key: str) -> Calibration | None:
        entry = self._read().get(key)
        return Calibration.from_dict(entry) if entry else None

    def put(self, key: str, calibration: Calibration) -> None:
        from ..io import atomic_write_json

        data = self._read()
        data[key] = calibration.to_dict()
        atomic_write_json(self.path, data)


class PlanCalibrator:
    """Compares the first steps' measurements with the plan's prediction; re-plans once if off.

    The trainer calls `observe` after each early step with the bucket it trained, the step's peak
    allocated VRAM (torch.cuda.max_memory_allocated after a reset) and its seconds, plus the
    streaming engine's step_report (measured H2D rate and stall). When the measured peak differs
    from the prediction by more than the budget's margin, the activation term is rescaled to match,
    the calibration is stored and, once, the plan is searched again: a different plan is returned
    for the trainer to apply (and log), otherwise None.
    """

    def __init__(self, planner: Planner, budget: Budget, plan: Plan, store: CalibrationStore | None = None,
                 steps: int = 3):
        self.planner, self.budget, self.plan, self.store = planner, budget, plan, store
        self.steps = steps
        self.seen = 0
        self.replanned = False
        self.changes: list[str] = []

    def observe(self, bucket: tuple[int, int], peak_allocated: int, step_s: float | None = None,
                report: dict | None = None) -> Plan | None:
        self.seen += 1
        if self.replanned or self.seen > self.steps:
            return None
        cal = self.planner.calibration
        bucket = self._nearest(bucket)
        predicted_bucket = self.planner.memory(self.plan)[2][bucket_key(bucket)]
        predicted, act = predicted_bucket["peak_vram"], predicted_bucket["activations"]
        error = peak_allocated - predicted
        if report and report.get("h2d_GBps"):
            cal.h2d_pinned = float(report["h2d_GBps"]) * 1e9
        if step_s and self.seen > 1:            # the first step also pays for warm-up
            est = self.planner.estimate(self.plan)
            stall = float((report or {}).get("stall_s") or 0.0)
            busy = max(step_s - stall - est.overhead_s, 1e-9)
            cal.flops_scale = cal.flops_scale * est.compute_s / busy
        off = abs(error) > self.budget.margin_bytes
        if off and act > 0:
            key = f"{bucket_key(bucket)}:{self.plan.checkpointing}"
            old = cal.activation_scale.get(key, 1.0)
            cal.activation_scale[key] = max(0.25, old * (act + error) / act)
            cal.activation_scale[f"{bucket_key(bucket)}:*"] = cal.activation_scale[key]
        if self.store is not None:
            self.store.put(self.planner.key, cal)
        if not off:
            return None
        self.replanned = True
        self.planner._peaks.clear()
        try:
            new = self.planner.plan(self.budget)
        except InfeasibleBudget as e:
            raise NoPlanFits(f"measured peak {_gib(peak_allocated)} at {bucket[1]}x{bucket[0]} is above the "
                             f"prediction, and with that correction {e}") from None
        what = (f"re-planned from [{self.plan.describe()}] to [{new.describe()}]" if new != self.plan
                else f"recalibrated; the plan [{new.describe()}] still fits")
        self.changes.append(f"measured peak {_gib(peak_allocated)} vs predicted {_gib(predicted)} at "
                            f"{bucket[1]}x{bucket[0]}: {what}")
        log.info("planner: %s", self.changes[-1])
        if new == self.plan:
            return None
        self.plan = new
        return new

    def _nearest(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """The planned bucket with the closest pixel count (aspect buckets of one resolution share
        their square's token count, and activation memory follows the token count)."""
        buckets = self.planner.workload.buckets
        if bucket in buckets:
            return bucket
        return min(buckets, key=lambda b: abs(b[0] * b[1] - bucket[0] * bucket[1]))


# -- out of memory -----------------------------------------------------------------------------------------

def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA allocator failure (torch.OutOfMemoryError) or an out-of-memory from cuBLAS/cuDNN."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "CUBLAS_STATUS_ALLOC_FAILED" in text)


class OomGuard:
    """Runs training steps; on a CUDA out-of-memory it frees, re-plans tighter and redoes the step.

    `apply_plan(plan)` must rebuild the memory setup for a plan (remove the engine's handle, apply the
    new plan) and clear the failed step's partial gradients, so the redone step uses the same batch
    and no sample is lost. Each retry shrinks the budget by `shrink` until the planner returns a
    different plan; when no plan fits (or after `max_replans`), NoPlanFits is raised and the caller
    saves a resumable state.
    """

    def __init__(self, planner: Planner, budget: Budget, plan: Plan, apply_plan: Callable[[Plan], None],
                 shrink: float = 0.9, max_replans: int = 4):
        self.planner, self.budget, self.plan, self.apply_plan = planner, budget, plan, apply_plan
        self.shrink, self.max_replans = shrink, max_replans
        self.replans = 0
        self.events: list[str] = []

    def run(self, step_fn: Callable, *args, step: int | None = None, **kwargs):
        while True:
            try:
                return step_fn(*args, **kwargs)
            except Exception as exc:  # only out-of-memory is handled; everything else propagates
                if not is_out_of_memory(exc):
                    raise
                where = f"step {step}" if step is not None else "a step"
                first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                del exc
                _free_memory()
                self.plan = self._tighter(where, first_line)
                self.apply_plan(self.plan)

    def _tighter(self, where: str, error: str) -> Plan:
        previous = self.plan
        while True:
            if self.replans >= self.max_replans:
                raise NoPlanFits(f"out of memory at {where} ({error}) after {self.replans} re-plans; last budget "
                                 f"{_gib(self.budget.vram)}. Lower the resolution, batch size or LoRA rank, or raise "
                                 f"[memory] vram_budget; the last saved state is resumable.")
            self.replans += 1
            # The failed plan's predicted peak did not really fit: ask for a plan predicted to need
            # `shrink` times less, whatever the nominal budget was.
            failed = (previous.notes or {}).get("predicted_peak_vram") or self.planner.estimate(previous).peak_vram
            vram = min(self.budget.vram, self.budget.needed_for(failed))
            self.budget = replace(self.budget, vram=int(vram * self.shrink))
            try:
                plan = self.planner.plan(self.budget)
            except InfeasibleBudget as e:
                raise NoPlanFits(f"out of memory at {where} ({error}), and no plan fits a tighter budget of "
                                 f"{_gib(self.budget.vram)}: {e} The last saved state is resumable.") from None
            if plan != previous:
                msg = (f"out of memory at {where}: re-planned with a budget of {_gib(self.budget.vram)}: "
                       f"[{previous.describe()}] -> [{plan.describe()}]; redoing the step")
                self.events.append(msg)
                log.warning("planner: %s", msg)
                return plan


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
