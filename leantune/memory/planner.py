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
  For Flux at 3072 wide, bf16 autocast, LoRA r16: S_double ~ 29 and S_single ~ 31 times L*H*2 bytes,
  O ~ L*H*2, with L = (H/16)*(W/16) + text tokens per sample; the probe is the source of truth.
- workspace: cuBLAS/cuDNN workspaces and the fp8 dequantisation buffer of the largest Linear.
- host RAM: a process baseline, the transformer while it loads, the streamed blocks' host copies
  (pinned buffers are rounded up to a power of two by PyTorch's caching host allocator, which is why
  pageable copies can fit where pinned ones do not), offloaded activations and caches.

Timing model: compute time = FLOPs (counted in the same meta run) / sustained FLOP/s; transfers
run on a copy stream at the measured or assumed H2D bandwidth and are simulated through the ring
(a copy waits for its slot to be released by the block that used it K streamed uses earlier; the
compute of a block waits for its copy). Pageable copies cannot overlap compute. Step time =
compute + exposed transfer + fp8 dequantisation + optimizer.

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
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .fp8 import SCALE_BLOCK as FP8_GROUP
from .machine import GiB, Machine, assumed_machine, host_ram, probe_machine
from .plan import Plan
from .streaming import ALIGN as STREAM_ALIGN
from .streaming import STAGING_CHUNK

log = logging.getLogger("leantune")

MiB = 2**20
Mode = Literal["lora", "full", "inference"]
CHECKPOINTING = ("none", "blocks", "offload")
RING_CHOICES = (2, 3, 4)
CUDA_WORKSPACE = 64 * MiB      # cuBLAS(Lt) + cuDNN workspaces, allocated by the first matmuls
HOST_BASELINE = int(2.5 * GiB)  # python + torch + CUDA runtime + diffusers, before any weight
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}

# Full-size Flux.1 transformer (BFL's FluxParams in diffusers' naming), built on meta by build_meta_flux.
FLUX_ARCH = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))
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
        return int(max(peak / (1.0 - self.margin), peak + self.min_margin))


def default_ram_budget(machine: Machine | None = None) -> int:
    """What this process may use in total: its current RSS plus available RAM, minus a margin."""
    total, avail = (machine.host_ram_total, machine.host_ram_available) if machine else host_ram()
    return int(_rss() + avail - max(2 * GiB, 0.1 * total))


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


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
        q, k, v, out, lse = ctx.saved_tensors
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
    nb_fwd_flops: float
    nb_bwd_flops: float
    nograd_pre: int
    nograd_post_transient: int


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

    ng, ng_after, ng_outs = _run_probe(spec, probe, workload, bucket, grad=False)
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
                                 nb_fwd_flops=ng.windows["fwd:pre"]["flops"] + ng_post["flops"], nb_bwd_flops=0.0,
                                 nograd_pre=nograd_pre, nograd_post_transient=nograd_post)

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
        nb_fwd_flops=tr.windows["fwd:pre"]["flops"] + post_fwd["flops"], nb_bwd_flops=post_bwd["flops"],
        nograd_pre=nograd_pre, nograd_post_transient=nograd_post)
