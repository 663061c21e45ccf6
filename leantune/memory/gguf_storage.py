"""GGUF block storage for frozen block Linears: a GGUF file's quantized weights kept as stored.

What it trades: a Linear of a GGUF base (ComfyUI-GGUF's Flux files: Q8_0, Q6_K, Q5_K, Q4_K, ...)
holds the file's blocks themselves, 34 bytes per 32 weights for Q8_0 (8.5 bits), 210 per 256 for
Q6_K (6.56 bits), 176 per 256 for Q5_K (5.5 bits), 144 per 256 for Q4_K (4.5 bits), 136 per 256 for
IQ4_XS (4.25 bits), 110 / 84 per 256 for Q3_K / Q2_K (3.44 / 2.63 bits), and dequantizes them in
every forward and backward.
Resident or streamed, the bytes are the file's: a 4-bit base costs a little over a quarter of bf16.

How it works (the fp8 seam of memory/fp8.py, for another stored form):
- The Linear stays the same `nn.Linear` instance (peft wraps it as it wraps any Linear). Its
  `weight` Parameter holds the raw blocks as a uint8 tensor of shape (out, row_bytes) (one row of
  blocks per output row: GGUF rows are independent, so a fused qkv splits into row ranges as a bf16
  one does), and the block type is a plain attribute `gguf_type` (a gguf.GGMLQuantizationType).
  `in_features` / `out_features` keep the logical shape.
- An instance-level forward calls `_GgufLinear`, an autograd Function that saves the stored bytes
  (never the dequantized copy) and dequantizes again in backward. When the block streams, the saved
  weight is a view of a slot and the streaming engine's saved-tensor handles replace it as they do
  an fp8 weight; poison mode's 0xFF bytes make every block's fp16 scale NaN, so a use of a released
  slot shows in the loss.
- Dequantization happens where the bytes are: memory/gguf_decode.py reads every type leantune
  keeps with torch ops on the blocks' device (a CUDA weight never crosses PCIe to be decoded), fp32
  values equal to the `gguf` package's decoder (gguf.quants.dequantize) to the bit, then one
  rounding to the compute dtype. It is also the CPU path: on this project's 2-core CPU it decodes a
  3072 x 12288 Q8_0 / Q4_K weight faster than the numpy decoder per thread (docs/benchmarks.md,
  "GGUF decode rate"). A type without a torch decoder decodes through the package on the host,
  copied there and back, with a one-time warning.
- DoRA is refused on such a base (train/lora.py), as on fp8: it reads the base weight itself.
  fp8 storage leaves these Linears alone (fp8.apply_fp8_storage skips `is_gguf` Linears): they are
  already stored, and re-quantizing 4-bit blocks to e4m3 would cost bytes and accuracy.

Differs from ComfyUI-GGUF (a GGMLTensor subclass of torch.Tensor that the ops patch dequantizes):
the weight is a plain uint8 Parameter that every engine path (streaming packs, planner prices,
state dicts) already handles as bytes, and the decoding happens only inside this Function.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from . import gguf_decode
from .cpu_linear import linear, linear_input_grad, matmul_dtype

log = logging.getLogger("leantune.memory")

TYPE_ATTR = "gguf_type"       # the GGMLQuantizationType of a GGUF-stored Linear weight


def _gguf():
    import gguf                 # a dependency (pyproject); imported where a GGUF weight is met

    return gguf


def taken_types() -> dict[str, int]:
    """Block types leantune keeps as stored, by name -> GGMLQuantizationType value: the ones the
    gguf package dequantizes and the tests cover: the K types ComfyUI-GGUF publishes (Q8_0, Q6_K,
    Q5_K, Q4_K, Q3_K, Q2_K), the non-linear IQ4_NL / IQ4_XS, and the legacy 32-value types. The
    other IQ types (IQ1-IQ3 grids) and the ternary / fp4 ones stay refused by name."""
    t = _gguf().GGMLQuantizationType
    return {q.name: int(q) for q in (t.Q8_0, t.Q6_K, t.Q5_K, t.Q4_K, t.Q3_K, t.Q2_K, t.IQ4_NL, t.IQ4_XS,
                                     t.Q4_0, t.Q4_1, t.Q5_0, t.Q5_1)}


def block_size(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGUF type: Q8_0 (32, 34), Q4_K (256, 144), Q5_K (256, 176)."""
    g = _gguf()
    return g.GGML_QUANT_SIZES[g.GGMLQuantizationType(qtype)]


def row_bytes(qtype: int, in_features: int) -> int:
    """Stored bytes of one row of `in_features` values; the row must hold whole blocks."""
    values, nbytes = block_size(qtype)
    if in_features % values:
        raise ValueError(f"a {_gguf().GGMLQuantizationType(qtype).name} row holds whole blocks of {values} "
                         f"values; {in_features} is not a multiple")
    return in_features // values * nbytes


def is_gguf(linear: nn.Module) -> bool:
    """True for an nn.Linear whose weight holds GGUF blocks (use_gguf_weight)."""
    return TYPE_ATTR in linear.__dict__


_HOST_NOTED: set[int] = set()       # types already warned about decoding on the host


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype) -> torch.Tensor:
    """(out, row_bytes) uint8 blocks -> (out, in) weight in `dtype` on the blocks' device: the
    format's fp32 values (gguf.quants.dequantize's, bitwise), then one rounding to `dtype`."""
    if gguf_decode.supported(qtype):
        return gguf_decode.dequantize(raw, qtype, dtype)
    return _host_dequantize(raw, qtype, dtype)


def _host_dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype) -> torch.Tensor:
    """The package's numpy decoder, on the host: a weight on another device goes there and back."""
    g = _gguf()
    host = raw.detach()
    if host.device.type != "cpu":
        if int(qtype) not in _HOST_NOTED:
            _HOST_NOTED.add(int(qtype))
            log.warning("gguf: %s blocks have no device decoder; each use copies them to the host to decode",
                        g.GGMLQuantizationType(qtype).name)
        host = host.cpu()
    w = torch.from_numpy(g.quants.dequantize(np.ascontiguousarray(host.numpy()), g.GGMLQuantizationType(qtype)))
    return w.to(device=raw.device, dtype=dtype)


class _GgufLinear(torch.autograd.Function):
    """y = x @ dequantize(blocks).T + b, saving the stored blocks rather than a dequantized copy.

    The weight is decoded to the dtype the matmul runs in (cpu_linear.matmul_dtype, autocast's when
    on), as the fp8 Linear does; the products go through cpu_linear (fp32 on the CPU)."""

    @staticmethod
    def forward(ctx, x, raw, bias, qtype):
        dtype = matmul_dtype(x)
        ctx.save_for_backward(raw)
        ctx.qtype = qtype
        ctx.bias_needs_grad = bias is not None and bias.requires_grad
        ctx.bias_dtype = None if bias is None else bias.dtype
        return linear(x, dequantize(raw, qtype, dtype), bias, dtype)      # (..., out)

    @staticmethod
    def backward(ctx, grad_out):
        (raw,) = ctx.saved_tensors
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear_input_grad(grad_out, dequantize(raw, ctx.qtype, grad_out.dtype))   # (..., in)
        if ctx.bias_needs_grad:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, grad_b, None


class _GgufForward:
    """Instance-level forward of a GGUF-stored nn.Linear; reads the weight at call time, so a
    streamed weight (re-pointed at a slot) is always the current one."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear      # a strong reference, so copy.deepcopy maps it to the copied module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        return _GgufLinear.apply(x, lin.weight, lin.bias, lin.__dict__[TYPE_ATTR])


def use_gguf_weight(linear: nn.Linear, qtype: int) -> None:
    """Make an nn.Linear whose weight holds GGUF blocks, (out, row_bytes) uint8, computable: record
    its type and dequantize in its forward. The form in which the GGUF loader hands such weights to
    the engine. The weight is frozen: nothing could step a block of quantized bytes."""
    w = linear.weight
    if w.dtype != torch.uint8 or w.dim() != 2:
        raise ValueError(f"use_gguf_weight: the weight is {w.dtype} {tuple(w.shape)}, not (out, row_bytes) uint8")
    if w.shape != (linear.out_features, row_bytes(qtype, linear.in_features)):
        raise ValueError(f"use_gguf_weight: blocks of shape {tuple(w.shape)} do not hold a "
                         f"({linear.out_features}, {linear.in_features}) {_gguf().GGMLQuantizationType(qtype).name} weight")
    linear.__dict__[TYPE_ATTR] = int(qtype)
    w.requires_grad_(False)
    linear.forward = _GgufForward(linear)


def stored_weight(linear: nn.Linear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) weight a GGUF-stored Linear computes with, in `dtype`."""
    return dequantize(linear.weight, linear.__dict__[TYPE_ATTR], dtype)
