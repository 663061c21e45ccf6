"""Activation memory, measured on the meta device rather than guessed from a formula.

What it trades: a second of tracing per resolution bucket for activation numbers that follow the
real diffusers/peft code, whatever that code keeps for backward. `probe_activations` runs a
copy of the model with two blocks of each kind (Flux: two double, two single; SD3.5 Medium: two
joint blocks with the second attention, "joint_dual", and two without, spec.block_kinds) on the
meta device (no memory, milliseconds) under the workload's batch, tokens, LoRA and bf16 autocast,
with a dispatch mode that tracks every tensor storage as it is created and freed. That gives, per
block kind, what is kept for backward (S_k),
the block output (O_k), and the transient peaks in forward (Tf_k), backward (Tb_k) and no-grad
forward (Tn_k), plus the FLOPs of every op (the timing model's compute term). A full fine-tune's
backward also records where each trained tensor's gradient completes (the post-accumulate-grad
hook, where train/in_backward.py runs its update) and what is live then, above the start of the
backward it happens in (KindProfile.step_points): the memory model prices each update there.

Two things are emulated because they depend on the GPU: bf16 autocast (CUDA's op lists: matmuls in
bf16, norms/pow/softmax in fp32; autocast itself ignores meta tensors) and attention (flash/efficient
kernels keep q, k, v, out and a (B, heads, L) fp32 logsumexp, never the L x L matrix).

The LoRA rank is priced, not traced: the adapters are built at a trace rank (trace_rank: a prime
no other dimension of the model or workload has), every tensor with that dimension is an adapter's,
and the tracker keeps the adapters' share of each number per rank unit and each window's candidate
peaks, so the profile at any rank follows exactly (ActivationProfile.at_rank; tests/
test_planner_rank.py compares it with the probe built at that rank). `leantune plan --rank 100000`
builds no rank-100000 adapter and reuses the measurement of any rank.

The profiles and their composition over the whole stack are in activations.py.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..config import LoraConfig
from ..memory.fp8 import apply_fp8_storage
from ..memory.split_parts import set_split_parts
from ..train.lora import LoraRankWarning, add_lora
from .activations import ActivationProfile, KindProfile, frontier
from .meta import short_copy
from .workload import Workload


def _to_meta(t):
    return t.to("meta") if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0 else t


class _Tracker(TorchDispatchMode):
    """An allocator simulation: bytes of tensor storages created under it and still alive.

    A storage counts as new when no input of the op shares it (views and in-place results do not
    allocate). Its bytes are released when the storage object dies. Also counts FLOPs of every op
    torch's flop counter knows. Both are attributed to the open "window" (a block's forward, ...).
    A window also counts the bytes released in it of storages created in the "fwd:pre" window (the
    embedders' outputs, the inputs of the block stack): `pre_freed`.

    Every quantity is kept as a pair (bytes or FLOPs that do not depend on the LoRA rank, per rank
    unit): with `rank_dim` (the rank the adapters were built at, a number no other dimension of the
    trace has), a storage one of whose dimensions is `rank_dim` is the adapters' (a down-projection
    output, an autocast copy of an adapter weight, their gradients) and counts `bytes / rank_dim`
    per rank; so do the FLOPs of an op one of whose tensors has that dimension, and the traffic of
    such tensors. A window keeps every moment that can be its peak at some rank (`points`: the
    pairs of live bytes no other moment of the window beats at every rank), so the peak at any rank
    is a maximum over them (LoRA adds only tensors proportional to the rank, and the same ops at
    every rank).
    """

    def __init__(self, rank_dim: int | None = None):
        super().__init__()
        self.rank_dim = rank_dim
        self.live = 0
        self.live_r = 0           # of which the adapters' rank-proportional storages
        # storage id -> (bytes, created in "fwd:pre", rank-proportional)
        self._sizes: dict[int, tuple[int, bool, bool]] = {}
        self.windows: dict[str, dict] = {}
        self._open: dict | None = None
        from torch.utils.flop_counter import flop_registry

        self._flop_registry = flop_registry

    def pair(self) -> tuple[int, int]:
        """Live bytes now as (not rank-dependent, per rank unit)."""
        if self.rank_dim is None:
            return (self.live, 0)
        return (self.live - self.live_r, self.live_r // self.rank_dim)

    def _ranked(self, t: torch.Tensor) -> bool:
        return self.rank_dim is not None and self.rank_dim in t.shape

    def open(self, name: str) -> None:
        """Close the current window and start `name` (a window seen again keeps its first record)."""
        self.close()
        now = self.pair()
        self._open = {"name": name, "start": now, "points": [now], "flops": (0.0, 0.0), "traffic": (0, 0),
                      "pre_freed": (0, 0)}

    def close(self) -> None:
        if self._open is not None:
            self._open["end"] = self.pair()
            self.windows.setdefault(self._open["name"], self._open)
            self._open = None

    def add_flops(self, flops: float, ranked: bool = False) -> None:
        if self._open is not None:
            a, b = self._open["flops"]
            self._open["flops"] = (a, b + flops / self.rank_dim) if ranked else (a + flops, b)

    def _add_point(self) -> None:
        points = self._open["points"]
        a, b = now = self.pair()
        if any(pa >= a and pb >= b for pa, pb in points):
            return
        points[:] = [(pa, pb) for pa, pb in points if not (a >= pa and b >= pb)]
        points.append(now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:
            if "same device" not in str(e):
                raise
            # A host index meeting meta tensors in backward (Qwen-Image-2.1's layout indices,
            # qwen_image21/meta_model.py, are real host tensors; the forward's mode moves them,
            # autograd's backward of an index op runs outside it): shapes only, so on meta too.
            args, kwargs = tree_map(_to_meta, (args, kwargs))
            out = func(*args, **kwargs)
        in_tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out_tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        counter = self._flop_registry.get(func._overloadpacket)
        if counter is not None:
            self.add_flops(float(counter(*args, **kwargs, out_val=out)),
                           ranked=any(self._ranked(t) for t in (*in_tensors, *out_tensors)))
        inputs = {id(t.untyped_storage()) for t in in_tensors}
        created = created_r = 0
        for t in out_tensors:
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._sizes:
                continue
            n = storage.nbytes()
            ranked = self._ranked(t)
            created += n
            created_r += n if ranked else 0
            self._sizes[key] = (n, self._open is not None and self._open["name"] == "fwd:pre", ranked)
            self.live += n
            self.live_r += n if ranked else 0
            weakref.finalize(storage, self._release, key)
        if created and self._open is not None:
            self._add_point()
        if created and counter is None and self._open is not None:
            # memory-bound op (cast, dequantisation, norm, activation): bytes read + written
            moved_r = created_r + sum(t.numel() * t.element_size() for t in in_tensors if self._ranked(t))
            moved = created + sum(t.numel() * t.element_size() for t in in_tensors)
            a, b = self._open["traffic"]
            self._open["traffic"] = (a + moved - moved_r, b + (moved_r // self.rank_dim if moved_r else 0))
        return out

    def _release(self, key: int) -> None:
        n, pre, ranked = self._sizes.pop(key, (0, False, False))
        self.live -= n
        self.live_r -= n if ranked else 0
        if pre and self._open is not None:
            a, b = self._open["pre_freed"]
            self._open["pre_freed"] = (a, b + n // self.rank_dim) if ranked else (a + n, b)


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
# F.rms_norm: torch.nn.RMSNorm (Wan's q/k norms), in CUDA's fp32 list as layer_norm is
_FP32_FUNCS = {F.layer_norm, F.group_norm, F.rms_norm, torch.pow, torch.Tensor.pow, torch.Tensor.__pow__,
               torch.rsqrt, torch.Tensor.rsqrt, F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax,
               torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.sum, torch.Tensor.sum, F.mse_loss,
               torch.norm, torch.cumsum, torch.prod}
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


class _GpuSemantics(TorchFunctionMode):
    """On meta tensors, behave as a CUDA training step would: flash attention, and bf16 autocast
    following CUDA's op lists (autocast itself only acts on CUDA tensors)."""

    def __init__(self, autocast: bool):
        super().__init__()
        self.autocast = autocast
        self.depth = 0               # times entered and not left (2 and more: a recompute's)

    def __enter__(self):
        self.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        return super().__exit__(*exc)

    def _autocast_now(self) -> bool:
        # In backward (autocast "recompute"), a checkpoint recomputing a forward under the modes of
        # that forward (qwen_image21/block.py's branches enter this mode again) casts as the forward
        # did: torch.utils.checkpoint restores the autocast state of the forward it recomputes.
        return self.autocast is True or (self.autocast == "recompute" and self.depth > 1)

    def emulated_autocast_dtype(self) -> torch.dtype | None:
        """The dtype a stored-format Linear's product runs in here (memory/cpu_linear.matmul_dtype):
        bf16 where this mode casts, as CUDA's autocast would; None where it does not."""
        return torch.bfloat16 if self._autocast_now() else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        autocast = self._autocast_now()
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value")
            q, k, v = (list(args) + [kwargs.get(n) for n in names][len(args):])[:3]
            if autocast:
                q, k, v = (_cast(t, torch.bfloat16) for t in (q, k, v))
            return _FlashAttention.apply(q, k, v)
        if autocast:
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


def _probe_model(spec, model: torch.nn.Module, workload: Workload, with_lora: bool, fp8: bool,
                 modulation: bool = False, rank: int | None = None, split: bool = False):
    """A copy of `model`'s architecture with two blocks of each kind, on meta, in the workload's dtype,
    with the run's adapters (the trainer's own add_lora) and fp8 storage (the engine's own), its split
    blocks (memory/split_parts.py) switched as `split` (the engine sets them from Plan.split_blocks)."""
    probe = short_copy(spec, model, workload.dtype)
    set_split_parts(probe, split)
    probe.requires_grad_(False)
    if workload.mode == "full":      # the run's [full] train / exclude, on the probe's names
        from ..train.trainable import select_trainable

        for p in select_trainable(probe, list(workload.full_train), list(workload.full_exclude)).values():
            p.requires_grad_(True)
    if with_lora:
        blocks = None
        if workload.lora_blocks is not None:   # a kind with any LoRA block is probed with LoRA
            blocks = {kind: (list(range(len(getattr(probe, spec.block_list(kind).attr)))) if idx else [])
                      for kind, idx in workload.lora_blocks.items()}
        # Created on meta: peft builds each adapter on the CPU (and draws its init) before moving it
        # to the base layer's device, which at a large rank (`leantune plan --rank 100000`) allocated
        # gigabytes and took minutes. On meta the adapters cost nothing, and the probe still sees
        # their activations (their bytes are weight_bytes.AdapterShape's), at the trace rank.
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", LoraRankWarning)     # a trace rank beyond a tiny model's layers
            options = {"factor": workload.lokr_factor, "decompose_both": workload.lokr_decompose_both} \
                if workload.adapter == "lokr" else {}
            add_lora(probe, spec, LoraConfig(type=workload.adapter, rank=rank or workload.rank, targets=workload.targets,
                                             blocks=blocks, dropout=workload.lora_dropout, **options))
    if fp8 or modulation:
        apply_fp8_storage(probe, spec, quantize_rest=fp8, modulation=modulation, compute_dtype=workload.dtype,
                          keep_trainable=workload.mode == "full")
    return probe


def _probe_inputs(spec, model, workload: Workload, bucket: tuple[int, int]) -> dict:
    """The forward kwargs of the model's family on the meta device (models/family.py probe_inputs)."""
    from ..models.family import family_of_spec, prices_references

    family = family_of_spec(spec)
    latent_hw = (bucket[0] // family.vae_scale_factor, bucket[1] // family.vae_scale_factor)
    extra = {"references": workload.references} if workload.references else {}
    if workload.frames != 1:            # a video family's latent frames (its probe_inputs takes frames)
        if family.video is None:
            raise ValueError(f"{family.name} trains on images: plan it with one frame")
        extra["frames"] = workload.frames
    if workload.references and not prices_references(family):
        raise ValueError(f"the planner prices reference images for no {family.name} model yet (its probe is "
                         f"text to image); plan without references")
    return family.probe_inputs(model.config, workload.batch_size, latent_hw, workload.text_length, workload.dtype,
                               **extra)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


def _run_probe(spec, probe, workload: Workload, bucket, grad: bool,
               rank_dim: int | None = None, steps: list | None = None) -> tuple[_Tracker, dict, dict]:
    """One forward (and backward when `grad`) of the probe model; returns the tracker's windows,
    the live bytes after each block (pairs: _Tracker) and the output bytes of each block.
    A full fine-tune's backward appends to `steps`, for each trained tensor as its gradient
    completes, (the block owning it or None, the open window, live bytes then above the window's
    start, its elements): where train/in_backward.py runs its update."""
    tracker = _Tracker(rank_dim)
    after: dict[str, tuple[int, int]] = {}
    outs: dict[str, int] = {}
    handles = []
    for name, block in _named_blocks(spec, probe):
        def pre(_m, _a, _k, name=name):
            tracker.open(f"fwd:{name}")

        def post(_m, _a, _k, output, name=name):
            after[name] = tracker.pair()
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
    if grad and workload.mode == "full":
        # The optimizer steps each weight inside backward and frees its gradient at once
        # (train/in_backward.py): a gradient lives only until its weight's AccumulateGrad ran.
        # That moment is recorded (the gradient still live): the update's temporaries come on top there.
        owner = {id(p): name for name, block in _named_blocks(spec, probe) for p in block.parameters()}

        def on_step(p: torch.Tensor) -> None:
            window = tracker._open
            if steps is not None and window is not None:
                live, start = tracker.pair(), window["start"]
                steps.append((owner.get(id(p)), window["name"], live[0] - start[0], p.numel()))
            p.grad = None

        for p in probe.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(on_step))
    from ..models.family import family_of_spec, probe_output

    inputs = _probe_inputs(spec, probe, workload, bucket)
    _FlashAttention.tracker = tracker
    try:
        semantics = _GpuSemantics(workload.autocast)
        with semantics, tracker, torch.set_grad_enabled(grad):
            tracker.open("fwd:pre")
            pred = probe_output(family_of_spec(spec), probe(**inputs))    # (B, N_img, 64)
            if grad:
                target = torch.empty(pred.shape, device="meta", dtype=torch.float32)
                loss = ((pred.float() - target) ** 2).mean()
                tracker.open("fwd:post_end")
                tracker.open("bwd:post")
                # autocast does not reach the backward pass, but for a checkpoint's recompute in it
                semantics.autocast = "recompute" if semantics.autocast else False
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


def _named_blocks(spec, probe) -> list[tuple[str, torch.nn.Module]]:
    """Every block of the probe copy in execution order, named "<kind>.<index in its list>" with
    the kind it is priced as (spec.block_kinds: "double", "joint_dual", ...)."""
    kinds = spec.block_kinds(probe)
    return [(f"{kind}.{qname.rsplit('.', 1)[1]}", block) for kind, (qname, block) in zip(kinds, spec.blocks(probe))]


def trace_rank(spec, model: torch.nn.Module, workload: Workload, bucket: tuple[int, int]) -> int:
    """The rank the probe builds its adapters at: a prime that is no dimension of the model's
    parameters and no token count of the workload, so a tensor of the trace with that dimension is
    an adapter's (see _Tracker). The activations of any other rank follow from it
    (ActivationProfile.at_rank)."""
    dims = {d for p in model.parameters() for d in p.shape}
    tokens = workload.image_tokens(bucket), workload.text_length, workload.image_tokens(bucket) + workload.text_length
    dims |= {n * m for n in tokens for m in (1, workload.batch_size)} | {workload.batch_size}
    # The inputs' dimensions, and any two of them joined (image and text streams concatenated).
    inputs = {d for t in tree_leaves(_probe_inputs(spec, model, workload, bucket)) if isinstance(t, torch.Tensor)
              for d in t.shape}
    dims |= inputs | {a + b for a in inputs for b in inputs}
    for candidate in _TRACE_RANKS:
        if candidate not in dims:
            return candidate
    raise ValueError(f"no trace rank among {_TRACE_RANKS} is free of the model's dimensions")


# Primes above any head count, head size or small channel count of the families.
_TRACE_RANKS = (257, 263, 269, 271, 277, 281, 283, 293, 307, 311, 313, 317, 331, 337, 347, 349)


def probe_activations(spec, model: torch.nn.Module, workload: Workload, bucket: tuple[int, int],
                      fp8: bool = False, modulation: bool = False, rank: int | None = None,
                      split: bool = False) -> ActivationProfile:
    """Activation bytes and FLOPs of `model`'s architecture for one bucket, measured on meta.

    Each kind is characterised by its last block in the probe copy, whose input comes from a block
    of the same kind (or the kind before), as almost every block in the full model does. Its S is the
    growth of the live set over it and the gap before it, not counting the embedder outputs the model
    drops there: that happens once per step (after the first block), not once per block.

    A LoRA workload's adapters are built at `rank` (default: trace_rank, a rank no other dimension
    of the trace has) and their share of every number is kept per rank unit, so the profile is
    given at the workload's rank and prices any other rank without tracing again
    (ActivationProfile.at_rank). With `rank` given the probe builds its adapters at that rank
    (the direct measurement the per-rank pricing is tested against).
    `split`: the model's split blocks split their parts (Plan.split_blocks; memory/split_parts.py).
    """
    with_lora = workload.mode == "lora" and (workload.lora_blocks is None or any(workload.lora_blocks.values()))
    if with_lora and rank is None and workload.adapter == "lokr":
        # LoKr's factor shapes change with the rank (a factor is whole from rank >= half its side
        # on), so its activations are no function of the rank per unit: traced at the workload's rank
        rank = workload.rank
    dim = None
    if with_lora:
        dim = rank if rank is not None else trace_rank(spec, model, workload, bucket)
    probe = _probe_model(spec, model, workload, with_lora, fp8, modulation, rank=dim, split=split)
    ranked = with_lora and rank is None      # per-rank pricing: the trace rank is a unique dimension
    at = workload.rank if ranked else 0      # the profile's rank (the probe's own when not ranked)
    rank_dim = dim if ranked else None

    def val(pair) -> int | float:
        return pair[0] + at * pair[1]

    def sub(x, y):
        return (x[0] - y[0], x[1] - y[1])

    def peaks(window, ref) -> list[list]:
        """The window's candidate peaks above `ref` (a pair), as [bytes, bytes per rank] pairs."""
        return [list(sub(p, ref)) for p in window["points"]]

    def top(pts) -> int:
        return max(0, max(a + at * b for a, b in pts))

    order = [name for name, _ in _named_blocks(spec, probe)]
    last = {name.split(".")[0]: name for name in order}          # kind -> its last block in the probe
    kinds = list(last)
    tokens = workload.image_tokens(bucket) + workload.text_length

    ng, _, ng_outs = _run_probe(spec, probe, workload, bucket, grad=False, rank_dim=rank_dim)
    ng_win = {k: ng.windows[f"fwd:{last[k]}"] for k in kinds}
    nograd = {k: peaks(ng_win[k], ng_win[k]["start"]) for k in kinds}
    ng_post = ng.windows[f"fwd:after:{order[-1]}"]
    nograd_pre = ng.windows["fwd:pre"]["end"]
    nograd_post = peaks(ng_post, ng_post["start"])
    if workload.mode == "inference":
        profiles = {k: KindProfile(saved=0, out=ng_outs[last[k]], fwd_transient=top(nograd[k]), bwd_transient=0,
                                   nograd_transient=top(nograd[k]), fwd_flops=val(ng_win[k]["flops"]),
                                   bwd_flops=0.0, fwd_traffic=val(ng_win[k]["traffic"]))
                    for k in kinds}
        return ActivationProfile(bucket, tokens, profiles, pre=val(nograd_pre), post=0, post_bwd_transient=0,
                                 nb_fwd_flops=val(ng.windows["fwd:pre"]["flops"]), nb_bwd_flops=0.0,
                                 nograd_pre=val(nograd_pre), nograd_post_transient=top(nograd_post),
                                 nb_post_flops=val(ng_post["flops"]))

    steps: list = []
    tr, after, outs = _run_probe(spec, probe, workload, bucket, grad=True, rank_dim=rank_dim, steps=steps)
    points, first_points, post_points, loose = _step_points(steps, order, last)
    profiles, per_kind = {}, {}
    for k in kinds:
        name = last[k]
        idx = order.index(name)
        before = after[order[idx - 1]] if idx > 0 else tr.windows[f"fwd:{name}"]["start"]
        fw, bw = tr.windows[f"fwd:{name}"], tr.windows.get(f"bwd:{name}")
        # The stack's inputs (embedder outputs) die after the first block when it does not keep them
        # (a LoRA step: they need no grad), once per step: not part of what each block adds.
        released = fw["pre_freed"]
        if idx > 0:
            prev = tr.windows[f"fwd:after:{order[idx - 1]}"]["pre_freed"]
            released = (released[0] + prev[0], released[1] + prev[1])
        saved = sub(after[name], before)
        saved = (saved[0] + released[0], saved[1] + released[1])
        parts = {"saved": saved, "fwd_transient": peaks(fw, fw["end"]),
                 "bwd_transient": peaks(bw, bw["start"]) if bw else [[0, 0]], "nograd_transient": nograd[k],
                 "fwd_flops": fw["flops"], "bwd_flops": bw["flops"] if bw else (0.0, 0.0),
                 "fwd_traffic": fw["traffic"], "bwd_traffic": bw["traffic"] if bw else (0, 0)}
        profiles[k] = KindProfile(
            saved=val(saved), out=outs[name], fwd_transient=top(parts["fwd_transient"]),
            bwd_transient=top(parts["bwd_transient"]), nograd_transient=top(nograd[k]),
            fwd_flops=val(parts["fwd_flops"]), bwd_flops=val(parts["bwd_flops"]),
            fwd_traffic=val(parts["fwd_traffic"]), bwd_traffic=val(parts["bwd_traffic"]),
            step_points=points.get(k, ()), nb_first_step_points=first_points.get(k, ()))
        per_kind[k] = {f: (v if f.endswith("transient") else v[1]) for f, v in parts.items()}
    post_fwd = tr.windows[f"fwd:after:{order[-1]}"]
    post_bwd = tr.windows["bwd:post"]
    pre = tr.windows[f"fwd:{order[0]}"]["start"]
    post = sub(tr.windows["fwd:post_end"]["start"], after[order[-1]])
    post_bwd_peaks = peaks(post_bwd, post_bwd["start"])
    per_rank = None
    if ranked:
        per_rank = {"rank": workload.rank, "kinds": per_kind, "pre": pre[1], "post": post[1],
                    "post_bwd_transient": post_bwd_peaks, "nb_fwd_flops": tr.windows["fwd:pre"]["flops"][1],
                    "nb_bwd_flops": post_bwd["flops"][1], "nograd_pre": nograd_pre[1],
                    "nograd_post_transient": nograd_post, "nb_post_flops": post_fwd["flops"][1]}
    return ActivationProfile(
        bucket=bucket, tokens=tokens, kinds=profiles,
        pre=val(pre), post=val(post), post_bwd_transient=top(post_bwd_peaks),
        nb_fwd_flops=val(tr.windows["fwd:pre"]["flops"]), nb_bwd_flops=val(post_bwd["flops"]),
        nograd_pre=val(nograd_pre), nograd_post_transient=top(nograd_post), nb_post_flops=val(post_fwd["flops"]),
        per_rank=per_rank, post_step_points=post_points, loose_step_numel=loose)


def _step_points(steps: list, order: list[str], last: dict[str, str]):
    """Where each trained tensor of a full fine-tune steps (_run_probe's `steps`), as the memory
    model composes it over the whole stack: (per kind: its last probe block's own tensors, every
    block of the kind steps so; per kind: non-block tensors completing in the backward of the first
    probe block of that kind, i.e. of the kind's first block in the model; the final layers'
    backward; the largest tensor completing anywhere else). Each a frontier (activations.frontier).
    A full fine-tune builds no adapters, so no point depends on a LoRA rank."""
    first = {}
    for name in order:
        first.setdefault(name.split(".")[0], name)
    by_window = {f"bwd:{name}": kind for kind, name in last.items()}
    first_window = {f"bwd:{name}": kind for kind, name in first.items()}
    points: dict[str, list] = {}
    first_points: dict[str, list] = {}
    post, loose = [], 0
    for block, window, above, numel in steps:
        kind = by_window.get(window)
        if block is not None and kind is not None and window == f"bwd:{block}":
            points.setdefault(kind, []).append((above, numel))     # a block's own tensor, in its backward
        elif block is not None and block not in last.values() and window == f"bwd:{block}":
            continue     # another probe block's own tensor: its kind is priced by the kind's last block
        elif block is None and window == "bwd:post":
            post.append((above, numel))
        elif block is None and window in first_window:
            first_points.setdefault(first_window[window], []).append((above, numel))
        else:
            loose = max(loose, numel)
    return ({k: frontier(v) for k, v in points.items()}, {k: frontier(v) for k, v in first_points.items()},
            frontier(post), loose)
