"""NF4 storage for frozen block Linears: 4-bit NormalFloat values, an absmax per 64 and nested
statistics (the absmax values themselves in 8 bits), as bitsandbytes quantizes them (QLoRA's base
format with its double quantization).

What it trades: a frozen block Linear holds 0.5 byte per weight plus, per 64 values, one 8-bit
absmax code, and per row an fp32 scale per 256 absmax codes and an fp32 offset: 4.146 bits per
weight on a 3072-wide row, 4.130 on a 12288-wide one (an fp32 absmax per 64 would be 4.5; on
Flux.1-dev the nested statistics hold 0.53 GiB less), resident or streamed, and is dequantized by
bitsandbytes in every forward and backward. NF4's error on a Flux layer is ~3.7x e4m3's, the nested
statistics adding <0.1 % of it (docs/benchmarks.md), so it is for a base that does not fit
otherwise; `[memory] base_format = "nf4"` asks for it.

How it works (the seam of memory/gguf_storage.py, for bytes bitsandbytes writes):
- The Linear stays the same `nn.Linear` instance (peft wraps it as any Linear). Its `weight`
  Parameter holds one uint8 row per output row: the row's in/2 packed 4-bit codes (bitsandbytes'
  order: two values per byte, high nibble first), its in/64 absmax codes (uint8), the fp32 bytes of
  one nested absmax per 256 absmax codes, and the fp32 bytes of the row's offset.
  Rows are independent (bitsandbytes' 64-value blocks never cross a row when in % 64 == 0, and the
  nested statistics are the row's own: its offset is the mean of its own absmax values, its
  256-code nested blocks start at the row), so a fused weight splits by rows, a file is quantized a
  chunk of rows at a time, and the streaming engine, the planner and state dicts see plain bytes. `in_features` / `out_features` keep the
  logical shape; the attribute `nf4_blocksize` marks the Linear.
- Quantization and dequantization are bitsandbytes' own (functional.quantize_4bit /
  dequantize_4bit, quant_type "nf4", blocksize 64; the nested statistics by quantize_blockwise /
  dequantize_blockwise, blocksize 256, bitsandbytes' dynamic 8-bit code, the offset subtracted
  before and added after, as quantize_4bit(compress_statistics=True) does). Only the grouping is
  ours: bitsandbytes nests the statistics of a whole tensor at once (one offset, 256-code blocks
  running across rows), we nest each row's, which is bitsandbytes' nested quantization of that row
  as a (1, in) tensor: the rows, their dequantized weights and so the weights computed with equal
  bitsandbytes' own, per row, bit for bit (tests/test_nf4.py). Both run where the bytes are
  (bitsandbytes' CPU and CUDA backends).
- An instance-level forward calls `_Nf4Linear`, an autograd Function that saves the stored bytes
  (never a dequantized copy) and dequantizes again in backward; a streamed weight is a slot view
  that the streaming engine's saved-tensor handles replace. Poison mode's 0xFF bytes make every
  row's offset and nested absmax NaN, so a use of a released slot shows in the loss.
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
NESTED_BLOCK = 256               # absmax codes per nested absmax (quantize_4bit's compress_statistics)
TYPE_ATTR = "nf4_blocksize"      # marks an NF4-stored Linear (its value: the blocksize)
QUANT_CHUNK = 8 * 2**20          # bytes of fp32 rows quantized at a time while reading a file
# weights decoded at a time (dequantize): a chunk's temporaries (decode_temporaries: ~1 byte per
# weight of a 3072-wide chunk, ~0.6 of a 15360-wide one, and off CUDA the chunk's copy) stay under
# the 32 MiB of fp32 chunks fp8.dequantize forms on a non-CUDA device, which the planner's probe
# traces for every stored-format Linear (planner/base_formats.py prices NF4's decode at nothing beyond it)
DECODE_CHUNK = 8 * 2**20


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
    """Stored bytes of one row: in/2 of packed codes, in/64 absmax codes, 4 per 256 absmax codes
    (nested absmax) and 4 (offset): 1592 for a 3072-wide row."""
    if in_features % BLOCK:
        raise ValueError(f"an NF4 row holds whole blocks of {BLOCK} values; {in_features} is not a multiple")
    blocks = in_features // BLOCK
    return in_features // 2 + blocks + 4 * _nested_blocks(blocks) + 4


def _nested_blocks(blocks: int) -> int:
    return -(-blocks // NESTED_BLOCK)


def _layout(in_features: int) -> tuple[int, int, int]:
    """(packed code bytes, absmax codes, nested blocks) of one row."""
    blocks = in_features // BLOCK
    return in_features // 2, blocks, _nested_blocks(blocks)


def is_nf4(linear: nn.Module) -> bool:
    """True for an nn.Linear whose weight holds NF4 rows (use_nf4_weight)."""
    return TYPE_ATTR in linear.__dict__


def quantize_into(weight: torch.Tensor, out: torch.Tensor) -> None:
    """(rows, in) float rows -> `out` (rows, row_bytes(in)) uint8, by bitsandbytes.quantize_4bit and
    its nested statistics, row by row (each row's offset and 256-code nested blocks its own)."""
    F = _bnb()
    rows, in_f = weight.shape
    half, nb, nested = _layout(in_f)
    packed, state = F.quantize_4bit(weight.contiguous(), blocksize=BLOCK, compress_statistics=False,
                                    quant_type="nf4", quant_storage=torch.uint8)
    absmax = state.absmax.float().view(rows, nb)
    offset = absmax.mean(dim=1, keepdim=True)                                   # (rows, 1)
    # Each row's centred absmax values padded with zeros to whole nested blocks: a zero never
    # raises a block's absmax, so the codes and scales are those of the row's own partial block.
    centred = absmax.new_zeros(rows, nested * NESTED_BLOCK)
    centred[:, :nb] = absmax - offset
    qabsmax, state2 = F.quantize_blockwise(centred.view(-1), blocksize=NESTED_BLOCK)
    out[:, :half].copy_(packed.view(rows, half))
    out[:, half:half + nb].copy_(qabsmax.view(rows, -1)[:, :nb])
    out[:, half + nb:-4].copy_(state2.absmax.float().contiguous().view(rows, nested).view(torch.uint8))
    out[:, -4:].copy_(offset.contiguous().view(torch.uint8))


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) float weight -> (out, row_bytes(in)) uint8 NF4 rows."""
    out = torch.empty(weight.shape[0], row_bytes(weight.shape[1]), dtype=torch.uint8, device=weight.device)
    quantize_into(weight.detach(), out)
    return out


def decode_rows(in_features: int) -> int:
    """Rows `dequantize` decodes at a time: DECODE_CHUNK weights' worth, at least one row."""
    return max(1, DECODE_CHUNK // in_features)


def decode_temporaries(rows: int, in_features: int, device_type: str = "cuda", itemsize: int = 2) -> int:
    """Bytes `dequantize` of `rows` rows holds at once beside its output, at most: one chunk's
    packed codes copied out and its fp32 statistics, with the larger of its absmax step (the codes
    padded to whole nested blocks, their fp32 decode, the row-offset sum) and its decode (the
    absmax values; off CUDA also the decoded chunk, `itemsize` bytes a weight, before its copy)."""
    half, nb, nested = _layout(in_features)
    n = min(rows, decode_rows(in_features))
    small = n * (4 * nested + 4)                                   # the nested absmax and offsets, fp32
    statistics = n * (5 * NESTED_BLOCK * nested + 4 * nb)          # codes padded, their fp32 decode, the sum
    decode = n * 4 * nb + (0 if device_type in _DECODES_IN_OUTPUT else n * in_features * itemsize)
    return n * half + small + max(statistics, decode)


def dequantize(raw: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """(out, row_bytes) uint8 NF4 rows -> (out, in) weight in `dtype`: the absmax values by
    bitsandbytes.dequantize_blockwise plus the row's offset (dequantize_4bit's nested step), the
    weight by bitsandbytes.dequantize_4bit in `dtype` (its fp32 products rounded once), where the rows are.

    Decoded into the one full-size output a chunk of rows at a time (decode_rows): a chunk's packed
    codes copied out of the rows and its absmax values are all the decode holds beside the output
    (decode_temporaries: 5 MiB for Flux's 3072 x 15360 proj_out on CUDA, 21 MiB on the CPU, whose
    whole decode held 28 MiB),
    which planner/base_formats.py prices. Rows are independent, so the bits do not depend on the
    chunking (tests/test_nf4.py)."""
    rows = raw.shape[0]
    # Decoded straight into a 16-bit `dtype`: bitsandbytes forms each product in fp32 and rounds it
    # once, the bits of decoding to fp32 and rounding (tests/test_nf4.py), without an fp32 weight.
    direct = dtype in (torch.float32, torch.bfloat16, torch.float16)
    out = torch.empty(rows, in_features, dtype=dtype if direct else torch.float32, device=raw.device)
    step = decode_rows(in_features)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        _dequantize_into(raw[r0:r1], in_features, out[r0:r1])
    return out if direct else out.to(dtype)


def _dequantize_into(raw: torch.Tensor, in_features: int, out: torch.Tensor) -> None:
    """Rows `raw` decoded into `out` ((rows, in), contiguous, bf16 / fp16 / fp32)."""
    F = _bnb()
    rows = raw.shape[0]
    half, nb, nested = _layout(in_features)
    packed = raw[:, :half].contiguous().view(-1, 1)
    qabsmax = raw.new_zeros(rows, nested * NESTED_BLOCK)
    qabsmax[:, :nb] = raw[:, half:half + nb]
    absmax2 = _floats(raw[:, half + nb:-4]).view(-1)
    offset = _floats(raw[:, -4:])                                                # (rows, 1)
    code2 = _code(raw.device, "dynamic")
    absmax = F.dequantize_blockwise(qabsmax.view(-1), absmax=absmax2, code=code2, blocksize=NESTED_BLOCK)
    del qabsmax
    absmax = absmax.view(rows, -1)[:, :nb] + offset
    state = F.QuantState(absmax=absmax.contiguous().view(-1), shape=torch.Size((rows, in_features)),
                         code=_code(raw.device), blocksize=BLOCK, quant_type="nf4", dtype=out.dtype)
    if out.device.type in _DECODES_IN_OUTPUT:
        F.dequantize_4bit(packed, state, out=out)
    else:                       # bitsandbytes' CPU backend has no out= kernel: the chunk, then its copy
        out.copy_(F.dequantize_4bit(packed, state))


# Backends whose bitsandbytes kernels decode into a given output (dequantize_4bit.out). Not the
# simulated GPU (memory/simulated.py): bitsandbytes 0.50's fake kernel of the out= op compares
# out.shape (a torch.Size) with a list and always refuses, so it decodes a chunk and copies it, as
# the CPU does (a chunk's bf16 copy, <= 16 MiB, above what CUDA holds).
_DECODES_IN_OUTPUT = ("cuda", "xpu", "mps")


def _floats(stored: torch.Tensor) -> torch.Tensor:
    """Stored fp32 bytes, (rows, 4k) uint8, as (rows, k) fp32: copied out first, as a row's fp32
    fields need not start at a multiple of 4 bytes."""
    return torch.empty(stored.shape, dtype=torch.uint8, device=stored.device).copy_(stored).view(torch.float32)


_CODES: dict[tuple[torch.device, str], torch.Tensor] = {}


def _code(device: torch.device, kind: str = "nf4") -> torch.Tensor:
    """bitsandbytes' code book on `device`, built once per device: "nf4" (16 fp32 values, the
    weights') or "dynamic" (256, the nested absmax codes', as quantize_blockwise makes it)."""
    if (device, kind) not in _CODES:
        F = _bnb()
        _CODES[device, kind] = (F.get_4bit_type("nf4", device=device) if kind == "nf4"
                                else F.create_dynamic_map().to(device))
    return _CODES[device, kind]


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


def use_nf4_weight(linear: nn.Linear, name: str = "") -> None:
    """Make an nn.Linear whose weight holds NF4 rows, (out, row_bytes) uint8, computable: mark it
    and dequantize in its forward. The weight is frozen (quantized bytes take no step). Rows whose
    statistics cannot be bitsandbytes' (a nested absmax or offset not finite, a nested absmax
    below zero: bytes altered after quantizing) are refused, the first one named (`name`: the
    Linear's)."""
    w = linear.weight
    if w.dtype != torch.uint8 or tuple(w.shape) != (linear.out_features, row_bytes(linear.in_features)):
        raise ValueError(f"use_nf4_weight: the weight is {w.dtype} {tuple(w.shape)}, not the ({linear.out_features}, "
                         f"{row_bytes(linear.in_features)}) uint8 rows of a ({linear.out_features}, "
                         f"{linear.in_features}) NF4 weight")
    if not w.is_meta:
        _check_statistics(w, linear.in_features, name or "an NF4 Linear")
    linear.__dict__[TYPE_ATTR] = BLOCK
    w.requires_grad_(False)
    linear.forward = _Nf4Forward(linear)


def _check_statistics(raw: torch.Tensor, in_features: int, name: str) -> None:
    half, nb, _ = _layout(in_features)
    stats = _floats(raw[:, half + nb:])                                # (rows, nested + 1): scales, offset
    bad = ~stats.isfinite().all(dim=1) | (stats[:, :-1] < 0).any(dim=1)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name}: NF4 row {row} (of {raw.shape[0]}) holds statistics no quantization writes "
                         f"(nested absmax / offset {stats[row].tolist()}): the stored bytes were altered")


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
    use_nf4_weight(module, target[: -len(".weight")])


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
        use_nf4_weight(lin, qname)
        done.append(qname)
    return done
