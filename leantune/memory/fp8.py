"""Scaled fp8 storage for the Linear weights inside transformer blocks.

What it trades: each frozen block Linear weight is stored as float8 e4m3 (1 byte per value instead
of 2 for bf16) plus a small fp32 scale tensor, and is dequantized to the matmul's dtype (the
autocast dtype when autocast is on, else the input's) inside the forward. That halves the resident (or streamed) bytes of those weights for one elementwise
dequantization per call; the matmul itself still runs in the compute dtype.

How it works:
- Scales are per output row and per block of 64 input features (`scale` shape (out, in/64));
  a Linear whose input width is not a multiple of 64 falls back to one scale per row ((out, 1)).
  Block scales keep one outlier from flattening the resolution of a whole row.
- The Linear module stays the same `nn.Linear` instance (peft and diffusers still recognise it):
  its `weight` Parameter now holds e4m3 data, a `weight_scale` buffer is registered beside it, and
  an instance-level `forward` calls `_Fp8Linear`, an autograd Function that saves the fp8 weight
  and scale (not the dequantized copy) and dequantizes again in backward. Saved activations thus
  stay small, and when the block streams, the saved weight is a view of a streaming slot that the
  streaming engine can replace with a handle.
- Skipped, kept in the compute dtype: modulation/adaLN linears and norms (the spec's `fp8_skip`),
  biases, everything outside the blocks (embedders, final layer), and adapter weights: peft's
  `lora_A`/`lora_B` (and LoKr's `lokr_*`, LoHa's `hada_*`, DoRA's magnitude) are never touched
  (only the wrapped `base_layer` of a peft layer is stored in fp8), so adapters train in their own
  dtype. A DoRA adapter's base Linear is refused: DoRA reads the base weight itself, as stored.
- Left alone: a GGUF base's Linears (memory/gguf_storage.py), an NF4 base's
  (memory/nf4_storage.py) and an int8 ConvRot base's (memory/int8_storage.py), already stored.
- Modulation in fp8 (`modulation=True`, the plan's `fp8_modulation`): the spec's `modulation`
  Linears are stored like the others. They are a quarter of Flux's parameters (6 GiB of a
  full-size model in bf16) and cost a little more accuracy than the rest, since their output
  scales and shifts every activation of the block (measured in tests/test_memory_fp8.py and
  docs/engine.md), so the planner turns it on only when nothing else fits.
- An fp8 checkpoint (ComfyUI e4m3 files, plain or "scaled") is kept as it is. The contract with the
  loader: a block Linear whose weight has dtype float8_e4m3fn carries its dequantization scale as
  an fp32 `weight_scale` buffer of shape (out, 1) (per tensor or per row) or (out, nb), and the
  fp8 forward (`use_fp8_weight`), so the loaded model computes as it is. apply_fp8_storage never
  requantizes such a weight (scale: that buffer, else `scales[name]`, else 1), and takes it
  whatever the plan says (`quantize_rest=False` leaves the other Linears alone), modulation Linears
  included: a checkpoint's e4m3 modulation weight is upcast only by the loader, when the user asks
  for it (`[memory] fp8_modulation = false`). remove_fp8_storage leaves such weights in e4m3 with
  their scale and forward. Nothing round-trips through bf16 in host RAM.

Differs from kohya's `--fp8_base` (which casts every parameter, norms and modulation included, to
unscaled fp8) and from diffusers' layerwise casting (unscaled, and it needs a bf16 model first).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..spec import ModelSpec
from .cpu_linear import linear, linear_input_grad, matmul_dtype
from .block_linears import block_linears, dora_bases
from .fp8_matmul import scaled_mm_linear
from .gguf_storage import is_gguf
from .int8_storage import is_int8
from .nf4_storage import is_nf4

log = logging.getLogger("leantune.memory")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0              # largest finite e4m3fn value
SCALE_BLOCK = 64             # input features per scale
SCALE_ATTR = "weight_scale"  # buffer name of the scale beside the fp8 weight


# -- quantization math -----------------------------------------------------------------------------

def scale_blocks(in_features: int, block: int = SCALE_BLOCK) -> int:
    """Scales per row of a Linear with `in_features` inputs: one per `block` inputs, else one per row."""
    return in_features // block if (block and in_features % block == 0) else 1


QUANT_CHUNK = 8 * 2**20        # bytes of fp32 temporary while quantizing, at most


def quantize(weight: torch.Tensor, block: int = SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (q (out, in) e4m3, scale fp32 (out, in/block) or (out, 1)).

    Each scale maps the block's largest magnitude onto FP8_MAX; an all-zero block gets scale 1.
    """
    if weight.dim() != 2:
        raise ValueError(f"fp8 quantize expects a 2-D Linear weight, got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    q = torch.empty(out_f, in_f, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(out_f, scale_blocks(in_f, block), dtype=torch.float32, device=weight.device)
    quantize_into(weight.detach(), q, scale)
    return q, scale


def quantize_into(weight: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor,
                  work: torch.Tensor | None = None) -> None:
    """quantize() of the (rows, in) float `weight` written into `q_out` (rows, in) e4m3 and
    `scale_out` (rows, nb) fp32. Rows are independent: the loader quantizes a file's rows as it
    reads them, and a whole weight never needs an fp32 copy.

    On the CPU a bf16 or fp32 weight goes to the C kernel (fp8_kernels.py: one pass, threaded over
    rows, bitwise this function's torch path); elsewhere, or where it is not built, torch ops."""
    from . import fp8_kernels

    if fp8_kernels.handles(weight, q_out, scale_out):
        fp8_kernels.quantize_rows(weight, q_out, scale_out)
        return
    quantize_into_torch(weight, q_out, scale_out, work)


def quantize_into_torch(weight: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor,
                        work: torch.Tensor | None = None) -> None:
    """quantize_into in torch ops, over row chunks whose fp32 temporary stays under QUANT_CHUNK
    bytes (or in `work`, a reusable fp32 buffer: fresh pages cost a fault each). Vectorised, on
    torch's intra-op threads; the same arithmetic per value as ever (fp32 division by the block
    scale, clamp, round to e4m3), so the bits do not depend on the chunking. The definition the C
    kernel is tested against."""
    rows, in_f = weight.shape
    nb = scale_out.shape[1]
    step = max(1, (work.numel() * 4 if work is not None else QUANT_CHUNK) // (4 * max(in_f, 1)))
    if work is None:
        work = torch.empty(min(rows, step) * in_f, dtype=torch.float32, device=weight.device)
    for r in range(0, rows, step):
        e = min(rows, r + step)
        x = work[:(e - r) * in_f].view(e - r, nb, in_f // nb)                 # (rows, nb, in/nb) fp32
        x.copy_(weight[r:e].view(e - r, nb, in_f // nb))
        amax = torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg_())        # the largest magnitude, exactly
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        x.div_(scale[..., None]).clamp_(-FP8_MAX, FP8_MAX)
        q_out[r:e].view(e - r, nb, in_f // nb).copy_(x)
        scale_out[r:e].copy_(scale)


DEQUANT_CHUNK = 16 * 2**20     # bytes of fp32 temporary while dequantizing to bf16/fp16 on CPU, at most


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(out, in) e4m3 and (out, nb) scale -> (out, in) weight in `dtype`.

    The product is formed in fp32 and rounded once: rounding the scale to bf16 first gave every
    value of a block the same gain error (up to 2^-9 relative, a systematic bias, not noise). It
    is formed in the output on CUDA, in bounded fp32 chunks on CPU, so the result is the one
    full-size allocation."""
    out_f, in_f = q.shape
    nb = scale.shape[-1]
    scale = scale.float()
    if dtype == torch.float32:
        w = q.to(dtype)                                                    # exact: e4m3 fits fp32
        w.view(out_f, nb, in_f // nb).mul_(scale[..., None])
        return w
    w = torch.empty(out_f, in_f, dtype=dtype, device=q.device)
    if q.device.type == "cuda":
        return _dequantize_in_output(q, scale, w)
    # CPU: torch's CPU kernels cast a mixed-dtype in-place product through a full fp32 copy, so
    # the product is formed in fp32 chunks of DEQUANT_CHUNK bytes instead (the same bits).
    rows = max(1, DEQUANT_CHUNK // (4 * in_f))
    for r in range(0, out_f, rows):
        e = min(r + rows, out_f)
        w[r:e] = (q[r:e].float().view(e - r, nb, in_f // nb) * scale[r:e, :, None]).view(e - r, in_f)
    return w


def _dequantize_in_output(q: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product formed in the bf16/fp16 output itself, the CUDA path (issue 40, finding 5).

    e4m3 -> bf16/fp16 is exact, and a bf16 tensor times an fp32 one computes in fp32 and rounds
    once into the output (CUDA's kernels cast per element): the bits of the fp32 product, without
    its temporary. Traffic per element: 1 byte read + 2 written, then 2 read + 2 written (7 bytes),
    where forming the fp32 product moved ~19. tests/test_memory_fp8.py checks the bits on CPU,
    tests/test_memory_gpu.py the allocation on CUDA."""
    out_f, in_f = q.shape
    nb = scale.shape[-1]
    w.copy_(q)
    w.view(out_f, nb, in_f // nb).mul_(scale[..., None])
    return w


class _Fp8Linear(torch.autograd.Function):
    """y = x @ dequant(q, scale)^T + b, saving the fp8 weight rather than its dequantized copy.

    The weight is dequantized to the dtype the matmul runs in (cpu_linear.matmul_dtype: autocast's
    when autocast is on), not to the input's: under bf16 autocast Flux's modulated inputs are fp32,
    and an fp32 temporary that autocast then casts to bf16 holds 3x the intended bytes. On CPU the
    products run through fp32 (cpu_linear), where bf16 matmuls are slow; with fp8 tensor cores
    (CUDA sm_89+) the forward uses torch._scaled_mm (fp8_matmul.py)."""

    @staticmethod
    def forward(ctx, x, q, scale, bias):
        dtype = matmul_dtype(x)
        ctx.save_for_backward(q, scale)
        ctx.bias_needs_grad = bias is not None and bias.requires_grad
        ctx.bias_dtype = None if bias is None else bias.dtype
        y = scaled_mm_linear(x, q, scale, bias, dtype)
        if y is not None:
            return y
        w = dequantize(q, scale, dtype)                                     # (out, in)
        return linear(x, w, bias, dtype)                                   # (..., out)

    @staticmethod
    def backward(ctx, grad_out):
        q, scale = ctx.saved_tensors
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            w = dequantize(q, scale, grad_out.dtype)
            grad_x = linear_input_grad(grad_out, w)                        # (..., in)
        if ctx.bias_needs_grad:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_b


class _Fp8Forward:
    """Instance-level forward of an fp8-stored nn.Linear; reads the weight at call time so a
    streamed weight (re-pointed at a slot) is always the current one."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear      # a strong reference, so copy.deepcopy maps it to the copied module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        return _Fp8Linear.apply(x, lin.weight, getattr(lin, SCALE_ATTR), lin.bias)


def use_fp8_weight(linear: nn.Linear, scale: torch.Tensor) -> None:
    """Make an nn.Linear whose weight is e4m3 computable: register `scale` (fp32, (out, 1) or
    (out, nb)) as its `weight_scale` buffer and dequantize in its forward. This is the form in
    which the loader hands fp8 checkpoint weights to the engine. The weight is frozen: the fp8
    forward gives it no gradient, and no optimizer could step an e4m3 tensor."""
    if linear.weight.dtype != FP8_DTYPE:
        raise ValueError(f"use_fp8_weight: the weight has dtype {linear.weight.dtype}, not {FP8_DTYPE}")
    out_f, in_f = linear.weight.shape
    if scale.dim() != 2 or scale.shape[0] != out_f or in_f % scale.shape[1]:
        raise ValueError(f"use_fp8_weight: scale of shape {tuple(scale.shape)} does not fit weight {(out_f, in_f)}")
    if hasattr(linear, SCALE_ATTR):
        delattr(linear, SCALE_ATTR)
    linear.register_buffer(SCALE_ATTR, scale.to(device=linear.weight.device, dtype=torch.float32))
    linear.weight.requires_grad_(False)
    linear.forward = _Fp8Forward(linear)


# -- applying to a model ---------------------------------------------------------------------------

_ADAPTER_PARAM = re.compile(r"\.(lora_|lokr_|hada_)")


@dataclass
class Fp8Handle:
    """What apply_fp8_storage changed, so remove_fp8_storage can undo it."""

    linears: dict[str, nn.Linear] = field(default_factory=dict)   # qualified name -> fp8 Linear
    compute_dtype: torch.dtype = torch.bfloat16
    bytes_before: int = 0
    bytes_after: int = 0
    kept: list[str] = field(default_factory=list)                 # block Linears left in compute dtype
    prequantized: set[str] = field(default_factory=set)           # of `linears`: e4m3 before apply
    modulation: set[str] = field(default_factory=set)             # of `linears`: modulation Linears
    quantized: bool = True                                         # the other block Linears were quantized
    trained: list[str] = field(default_factory=list)              # block Linears left alone: they train

    def describe(self) -> str:
        nblocks = len({".".join(n.split(".")[:2]) for n in self.linears})   # "transformer_blocks.3"
        dtype = str(self.compute_dtype).replace("torch.", "")
        mod = f" ({len(self.modulation)} modulation)" if self.modulation else ""
        if not self.quantized:
            return (f"fp8: {len(self.linears)} Linear weights{mod} in {nblocks} blocks kept in e4m3 as the checkpoint "
                    f"stores them ({_gb(self.bytes_after)} with scales); memory.fp8 = false leaves the other block "
                    f"Linears in their dtype")
        own = f", {len(self.prequantized)} of them e4m3 as loaded" if self.prequantized else ""
        return (f"fp8: {len(self.linears)} Linear weights{mod} in {nblocks} blocks stored as e4m3 "
                f"(scales per row x {SCALE_BLOCK} inputs{own}), {_gb(self.bytes_before)} -> {_gb(self.bytes_after)}; "
                f"{len(self.kept)} modulation/norm Linears kept in {dtype}"
                + (f", {len(self.trained)} trained Linears kept in their dtype" if self.trained else ""))


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**28 else f"{n / 2**20:.1f} MB"


def _default_compute_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point() and p.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return p.dtype
    return torch.bfloat16


def has_prequantized(model: nn.Module, spec: ModelSpec) -> bool:
    """True if some block Linear weight of `model` is already stored in a float8 dtype (an fp8
    checkpoint): the engine must then apply fp8 storage whatever the plan says."""
    return any(lin.weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for _, _, lin in block_linears(spec, model))


def apply_fp8_storage(model: nn.Module, spec: ModelSpec, *, scales: Mapping[str, torch.Tensor] | None = None,
                      quantize_rest: bool = True, modulation: bool = False, compute_dtype: torch.dtype | None = None,
                      work_device: str | torch.device | None = None, keep_trainable: bool = False) -> Fp8Handle:
    """Store the block Linear weights of `model` as block-scaled e4m3, in place.

    Weights that are already e4m3 are kept as they are, with their scales, modulation Linears
    included. `quantize_rest=False` does only that, leaving every other block Linear in its dtype:
    the engine's path for an fp8 checkpoint under memory.fp8 = false. `modulation`: also quantize
    the spec's modulation Linears (Plan.fp8_modulation); they are otherwise left in their dtype.
    Other Linears of `spec.fp8_skip` that arrive in fp8 go back to the compute dtype.
    `scales`: per-Linear scales of weights that are already e4m3 and carry no `weight_scale`
    buffer (qualified name -> tensor of shape (), (out,), (out, 1) or (out, nb)). `compute_dtype`:
    dtype of skipped Linears that arrive as fp8 (default: the model's first non-fp8 floating dtype).
    `work_device`: where to run the quantization arithmetic (a GPU makes a 12B model quick); results
    return to each weight's device. `keep_trainable`: a full fine-tune with a frozen part stores only
    the frozen block Linears in fp8 and leaves the trained ones in their dtype (without it a trained
    weight is refused: fp8 storage of a LoRA base must not meet a trainable weight).
    """
    scales = dict(scales or {})
    compute_dtype = compute_dtype or _default_compute_dtype(model)
    handle = Fp8Handle(compute_dtype=compute_dtype, quantized=quantize_rest)
    for block_name, block in spec.blocks(model):
        for name, p in block.named_parameters():
            if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and _ADAPTER_PARAM.search(f".{name}"):
                raise ValueError(
                    f"memory.fp8: adapter weight {block_name}.{name} has dtype {p.dtype}; adapters must stay in "
                    f"their own dtype (cast LoRA parameters to float32 after adding them)")
    dora = dora_bases(model)
    for qname, rel, lin in block_linears(spec, model):
        if is_gguf(lin) or is_nf4(lin) or is_int8(lin):
            continue                      # GGUF / NF4 / int8 rows as stored (memory/*_storage.py)
        w = lin.weight
        if w.dtype == torch.float8_e5m2:
            raise ValueError(f"memory.fp8: {qname}.weight is float8_e5m2; only e4m3fn checkpoints are supported")
        prequantized = w.dtype == FP8_DTYPE
        given = scales.pop(qname, None)
        if given is None and hasattr(lin, SCALE_ATTR):
            given = getattr(lin, SCALE_ATTR)
        is_mod = spec.is_modulation(rel)
        if spec.keeps_compute_dtype(rel, fp8_modulation=modulation or (is_mod and prequantized)):
            if prequantized:      # a norm Linear that arrived in fp8: back to compute dtype
                s = _scale_for(given, w.shape, qname)
                with torch.no_grad():
                    w.data = dequantize(w.data, s.to(w.device), compute_dtype)
                if hasattr(lin, SCALE_ATTR):
                    delattr(lin, SCALE_ATTR)
            handle.kept.append(qname)
            continue
        if not (prequantized or (modulation if is_mod else quantize_rest)):
            continue                      # memory.fp8 = false: only checkpoint e4m3 weights are handled
        if w.requires_grad and prequantized:
            raise ValueError(
                f"memory.fp8: {qname}.weight is trainable, but it is e4m3 as the checkpoint stores it; an fp8 "
                f"checkpoint can only be a frozen base (LoRA, sampling): use a bf16 checkpoint to train it")
        if w.requires_grad and keep_trainable:
            handle.trained.append(qname)
            continue
        if w.requires_grad:
            raise ValueError(
                f"memory.fp8: {qname}.weight is trainable; fp8 storage is for frozen base weights "
                f"(LoRA bases, sampling). Freeze the base model or set [memory] fp8 = false")
        if id(lin) in dora:
            raise ValueError(
                f"memory.fp8: {qname} carries a DoRA adapter ([lora] type = \"dora\"), which normalises the rows of "
                f"the base weight itself, as stored: in fp8 it would be read without its scale. DoRA needs a bf16 "
                f"base: set [memory] fp8 = false (and fp8_modulation = false), or use [lora] type \"lora\", "
                f"\"lokr\" or \"loha\"")
        handle.bytes_before += w.numel() * (2 if prequantized else w.element_size())
        with torch.no_grad():
            if prequantized:
                q, s = w.data, _scale_for(given, w.shape, qname).to(w.device)
            else:
                src = w.data.to(work_device) if work_device is not None else w.data
                q, s = quantize(src)
                q, s = q.to(w.device), s.to(w.device)
            w.data = q
        if hasattr(lin, SCALE_ATTR):
            delattr(lin, SCALE_ATTR)
        lin.register_buffer(SCALE_ATTR, s)
        lin.forward = _Fp8Forward(lin)
        handle.bytes_after += q.numel() + s.numel() * s.element_size()
        handle.linears[qname] = lin
        if prequantized:
            handle.prequantized.add(qname)
        if is_mod:
            handle.modulation.add(qname)
    if scales:
        raise ValueError(f"memory.fp8: scales given for modules that are not fp8 block Linears: {sorted(scales)[:5]}")
    return handle


def _scale_for(given: torch.Tensor | None, shape: torch.Size, qname: str) -> torch.Tensor:
    """A checkpoint's scale (scalar, per row or per block) as an fp32 (out, nb) tensor."""
    out_f, in_f = shape
    if given is None:
        return torch.ones(out_f, 1)
    s = given.detach().float()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(out_f, 1).clone()
    if s.dim() == 1 and s.shape[0] == out_f:
        return s.reshape(out_f, 1).clone()
    if s.dim() == 2 and s.shape[0] == out_f and in_f % s.shape[1] == 0:
        return s.clone()
    raise ValueError(f"memory.fp8: scale of {qname} has shape {tuple(s.shape)}, which does not fit weight {tuple(shape)}")


def remove_fp8_storage(handle: Fp8Handle, dtype: torch.dtype | None = None) -> None:
    """Dequantize every weight this handle quantized back to `dtype` (default: the compute dtype)
    and drop the forward override. Lossy by nature: the original weights were not kept. Weights
    that were e4m3 before apply stay e4m3 with their `weight_scale` and fp8 forward: that is how
    they were (and a bf16 copy of a whole fp8 checkpoint is what fp8 loading avoids)."""
    dtype = dtype or handle.compute_dtype
    for name, lin in handle.linears.items():
        if name in handle.prequantized:
            if not isinstance(lin.__dict__.get("forward"), _Fp8Forward):
                lin.forward = _Fp8Forward(lin)
            continue
        with torch.no_grad():
            lin.weight.data = dequantize(lin.weight.data, getattr(lin, SCALE_ATTR), dtype)
        delattr(lin, SCALE_ATTR)
        if isinstance(lin.__dict__.get("forward"), _Fp8Forward):
            del lin.forward
    handle.linears.clear()
