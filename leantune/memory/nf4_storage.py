"""NF4 storage for frozen block Linears: 4-bit NormalFloat values and an fp32 absmax per 64, as
bitsandbytes quantizes them (QLoRA's base format).

What it trades: a frozen block Linear holds 0.5 byte per weight plus 4 bytes per 64 (4.5 bits per
weight, a little over a quarter of bf16), resident or streamed, and is dequantized by bitsandbytes in
every forward and backward. NF4's error on a Flux layer is ~3.7x e4m3's (docs/benchmarks.md), so it
is for a base that does not fit otherwise; `[memory] base_format = "nf4"` asks for it.

How it works (the seam of memory/gguf_storage.py, for bytes bitsandbytes writes):
- The Linear stays the same `nn.Linear` instance (peft wraps it as any Linear). Its `weight`
  Parameter holds one uint8 row per output row: the row's in/2 packed 4-bit codes (bitsandbytes'
  order: two values per byte, high nibble first), then its in/64 absmax values as fp32 bytes.
  Rows are independent (bitsandbytes' 64-value blocks never cross a row when in % 64 == 0), so a
  fused weight splits by rows, a file is quantized a chunk of rows at a time, and the streaming
  engine, the planner and state dicts see plain bytes. `in_features` / `out_features` keep the
  logical shape; the attribute `nf4_blocksize` marks the Linear.
- Quantization and dequantization are bitsandbytes' own (functional.quantize_4bit /
  dequantize_4bit, quant_type "nf4", blocksize 64, no nested statistics): nothing of the format
  is reimplemented, so the weights computed with are bitsandbytes' bitwise. Both run where the
  bytes are (bitsandbytes' CPU and CUDA backends).
- An instance-level forward calls `_Nf4Linear`, an autograd Function that saves the stored bytes
  (never a dequantized copy) and dequantizes again in backward; a streamed weight is a slot view
  that the streaming engine's saved-tensor handles replace. Poison mode's 0xFF bytes make every
  absmax NaN, so a use of a released slot shows in the loss.
- Quantizing while reading a bf16 file (`quantize_rows_into`): rows come from the file through
  the loader's staging buffers a bounded chunk at a time and are quantized as they arrive; the
  whole weight never exists in bf16 in host RAM. `apply_nf4_storage` quantizes a model that is
  already loaded, Linear by Linear, under the fp8 storage's rules of which Linears qualify.
- Refused on such a base (train/lora.py), as on a GGUF base: DoRA (it reads the base rows) and
  LoKr / LoHa (peft shapes them from the stored weight's shape). fp8 storage leaves these
  Linears alone (fp8.apply_fp8_storage skips them).

Differs from bitsandbytes' own Linear4bit / Params4bit (a Parameter subclass holding a QuantState,
which moves to the GPU to quantize): a plain uint8 Parameter that every engine path already handles,
quantized on the host as the file is read.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_linear import linear, linear_input_grad, matmul_dtype

BLOCK = 64                       # values per absmax (bitsandbytes' default blocksize for 4-bit)
TYPE_ATTR = "nf4_blocksize"      # marks an NF4-stored Linear (its value: the blocksize)
QUANT_CHUNK = 8 * 2**20          # bytes of fp32 rows quantized at a time while reading a file


def _bnb():
    """bitsandbytes.functional, its import chatter silenced (quiet.py)."""
    from ..quiet import quiet_bitsandbytes

    quiet_bitsandbytes()
    import bitsandbytes.functional as F

    return F


def available() -> bool:
    """True where bitsandbytes imports (an optional dependency: pip install leantune[bnb])."""
    try:
        _bnb()
    except ImportError:
        return False
    return True


def row_bytes(in_features: int) -> int:
    """Stored bytes of one row: in/2 of packed codes + 4 per 64 values of absmax (36 per 64)."""
    if in_features % BLOCK:
        raise ValueError(f"an NF4 row holds whole blocks of {BLOCK} values; {in_features} is not a multiple")
    return in_features // 2 + 4 * (in_features // BLOCK)


def is_nf4(linear: nn.Module) -> bool:
    """True for an nn.Linear whose weight holds NF4 rows (use_nf4_weight)."""
    return TYPE_ATTR in linear.__dict__


def quantize_into(weight: torch.Tensor, out: torch.Tensor) -> None:
    """(rows, in) float rows -> `out` (rows, row_bytes(in)) uint8, by bitsandbytes.quantize_4bit."""
    F = _bnb()
    rows, in_f = weight.shape
    packed, state = F.quantize_4bit(weight.contiguous(), blocksize=BLOCK, compress_statistics=False,
                                    quant_type="nf4", quant_storage=torch.uint8)
    out[:, :in_f // 2].copy_(packed.view(rows, in_f // 2))
    out[:, in_f // 2:].copy_(state.absmax.float().contiguous().view(rows, -1).view(torch.uint8))


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) float weight -> (out, row_bytes(in)) uint8 NF4 rows."""
    out = torch.empty(weight.shape[0], row_bytes(weight.shape[1]), dtype=torch.uint8, device=weight.device)
    quantize_into(weight.detach(), out)
    return out


def dequantize(raw: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """(out, row_bytes) uint8 NF4 rows -> (out, in) weight in `dtype`: bitsandbytes.dequantize_4bit
    in fp32, then one rounding to `dtype`, where the rows are."""
    F = _bnb()
    rows = raw.shape[0]
    half = in_features // 2
    packed = raw[:, :half].contiguous().view(-1, 1)
    absmax = raw[:, half:].contiguous().view(torch.float32).view(-1)
    state = F.QuantState(absmax=absmax, shape=torch.Size((rows, in_features)), code=_code(raw.device),
                         blocksize=BLOCK, quant_type="nf4", dtype=torch.float32)
    return F.dequantize_4bit(packed, state).to(dtype)


_CODES: dict[torch.device, torch.Tensor] = {}


def _code(device: torch.device) -> torch.Tensor:
    """bitsandbytes' NF4 code book (16 fp32 values) on `device`, built once per device."""
    if device not in _CODES:
        _CODES[device] = _bnb().get_4bit_type("nf4", device=device)
    return _CODES[device]


class _Nf4Linear(torch.autograd.Function):
    """y = x @ dequantize(rows).T + b, saving the stored rows rather than a dequantized copy; the
    weight decoded to the matmul's dtype (cpu_linear.matmul_dtype), products through cpu_linear."""

    @staticmethod
    def forward(ctx, x, raw, bias, in_features):
        dtype = matmul_dtype(x)
        ctx.save_for_backward(raw)
        ctx.in_features = in_features
        ctx.bias_needs_grad = bias is not None and bias.requires_grad
        ctx.bias_dtype = None if bias is None else bias.dtype
        return linear(x, dequantize(raw, in_features, dtype), bias, dtype)          # (..., out)

    @staticmethod
    def backward(ctx, grad_out):
        (raw,) = ctx.saved_tensors
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear_input_grad(grad_out, dequantize(raw, ctx.in_features, grad_out.dtype))
        if ctx.bias_needs_grad:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, grad_b, None


class _Nf4Forward:
    """Instance-level forward of an NF4-stored nn.Linear; reads the weight at call time, so a
    streamed weight (re-pointed at a slot) is always the current one."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear      # a strong reference, so copy.deepcopy maps it to the copied module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        return _Nf4Linear.apply(x, lin.weight, lin.bias, lin.in_features)


def use_nf4_weight(linear: nn.Linear) -> None:
    """Make an nn.Linear whose weight holds NF4 rows, (out, row_bytes) uint8, computable: mark it
    and dequantize in its forward. The weight is frozen (quantized bytes take no step)."""
    w = linear.weight
    if w.dtype != torch.uint8 or tuple(w.shape) != (linear.out_features, row_bytes(linear.in_features)):
        raise ValueError(f"use_nf4_weight: the weight is {w.dtype} {tuple(w.shape)}, not the ({linear.out_features}, "
                         f"{row_bytes(linear.in_features)}) uint8 rows of a ({linear.out_features}, "
                         f"{linear.in_features}) NF4 weight")
    linear.__dict__[TYPE_ATTR] = BLOCK
    w.requires_grad_(False)
    linear.forward = _Nf4Forward(linear)


def stored_weight(linear: nn.Linear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) weight an NF4-stored Linear computes with, in `dtype`."""
    return dequantize(linear.weight, linear.in_features, dtype)


# -- quantizing while a file is read ---------------------------------------------------------------

def quantize_rows_into(files, key: str, segments: list[tuple[int, int]], dtype: torch.dtype,
                       out: torch.Tensor) -> None:
    """The rows `segments` of file tensor `key` (a CheckpointFiles) as NF4 rows in `out`
    (rows, row_bytes) uint8: each chunk of at most QUANT_CHUNK bytes of fp32 is read (cast to
    `dtype` as a plain load holds it, so the bits equal quantizing that load) and quantized, and
    the next chunk reuses its buffer: no whole weight is ever held in `dtype`."""
    width = files.tensors[key].row_numel
    step = max(1, QUANT_CHUNK // (4 * width))
    buf = torch.empty(step * width, dtype=dtype)
    pos = 0
    for a, b in segments:
        for r0 in range(a, b, step):
            r1 = min(b, r0 + step)
            chunk = buf[:(r1 - r0) * width]
            files.read_rows_into(key, r0, r1, chunk)
            quantize_into(chunk.view(r1 - r0, width), out[pos:pos + r1 - r0])
            pos += r1 - r0


def fill_nf4(model: nn.Module, files, source: str, target: str, segments: list[tuple[int, int]],
             dtype: torch.dtype, meta: bool, device) -> None:
    """One Linear weight of a model being loaded (models/weights.load_into_empty) stored as NF4
    rows read from `source`; on meta, an empty uint8 tensor of the stored shape (what the planner
    prices)."""
    module = model.get_submodule(target[: -len(".weight")])
    rows = sum(b - a for a, b in segments)
    raw = torch.empty(rows, row_bytes(module.in_features), dtype=torch.uint8, device="meta" if meta else "cpu")
    if not meta:
        quantize_rows_into(files, source, segments, dtype, raw)
    module.weight = nn.Parameter(raw.to(device), requires_grad=False)
    use_nf4_weight(module)


def nf4_block_weights(model: nn.Module, spec, modulation: bool = False) -> set[str]:
    """Qualified names of the block Linear weights NF4 storage takes: those fp8 storage would take
    (not the spec's fp8_skip; modulation only with `modulation`), whose input width holds whole
    64-value blocks; the others keep their dtype."""
    from .block_linears import block_linears

    return {f"{qname}.weight" for qname, rel, lin in block_linears(spec, model)
            if lin.in_features % BLOCK == 0 and not spec.keeps_compute_dtype(rel, fp8_modulation=modulation)}


def apply_nf4_storage(model: nn.Module, spec, modulation: bool = False) -> list[str]:
    """Store the frozen block Linears of a loaded `model` as NF4, in place, one Linear at a time;
    returns their qualified names. A trainable weight, an fp8 / GGUF one and a DoRA base are
    refused or skipped as fp8 storage does (the weights must be plain and frozen)."""
    from .block_linears import block_linears, dora_bases as _dora_bases
    from .gguf_storage import is_gguf

    chosen = nf4_block_weights(model, spec, modulation)
    dora = _dora_bases(model)
    done = []
    for qname, _, lin in block_linears(spec, model):
        if f"{qname}.weight" not in chosen or is_gguf(lin) or is_nf4(lin):
            continue
        if not lin.weight.is_floating_point() or lin.weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            continue                                  # stored already (an fp8 checkpoint's e4m3)
        if lin.weight.requires_grad:
            raise ValueError(f"[memory] base_format = \"nf4\": {qname}.weight is trainable; NF4 storage is for a "
                             f"frozen base (LoRA, sampling)")
        if id(lin) in dora:
            raise ValueError(f"[memory] base_format = \"nf4\": {qname} carries a DoRA adapter, which reads the base "
                             f"rows themselves; use [lora] type \"lora\" on an NF4 base")
        with torch.no_grad():
            raw = quantize(lin.weight.data)
        lin.weight = nn.Parameter(raw, requires_grad=False)
        use_nf4_weight(lin)
        done.append(qname)
    return done
