"""int8 ConvRot storage for frozen block Linears, and ComfyUI's `*_int8_convrot.safetensors` layers.

What it trades: a frozen block Linear holds one int8 per weight plus one fp32 scale per output row
(8 bits and a little), resident or streamed; a block-diagonal Hadamard rotation spreads each input
group's outliers over the group before the per-row rounding (ConvRot, arXiv 2512.03673), which
keeps per-row int8 accurate where a plain per-row scale is set by one outlier.

The format is ComfyUI's `int8_tensorwise` with `convrot` (comfy-kitchen's TensorWiseINT8Layout,
the layout ComfyUI's `*_int8_convrot` files store): per layer `weight` int8 (out, in) holds the
codes of the rotated weight W_rot = W @ H^T (H the normalized regular Hadamard matrix of
`convrot_groupsize`, a power of 4, applied to each group of inputs), `weight_scale` fp32 (out, 1)
with W_rot ~ codes * scale, and `comfy_quant` the JSON {"format": "int8_tensorwise", "convrot":
true, "convrot_groupsize": g} as uint8 bytes. Its arithmetic, as comfy-kitchen defines it:
- H: Kronecker powers of H4 = [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]] over sqrt(g) (regular:
  no all-ones column, unlike Sylvester's); symmetric and orthogonal, so H^T H = I;
- quantize: the rotation in fp32, then per row scale = max(|row| / 127, 1e-30), codes =
  round(row / scale) clamped to [-128, 127];
- dequantize: codes.float() * scale, rotated back by the same (W_rot @ H^T = W), in fp32.

How it works (the seam of memory/gguf_storage.py and nf4_storage.py): the Linear stays the same
`nn.Linear`; its `weight` Parameter holds one uint8 row per output row, the row's `in` code bytes
then its fp32 scale's 4 bytes, so rows are independent and every engine path (streaming, the
planner's prices, state dicts) sees plain bytes; the attribute `int8_convrot_groupsize` marks it.
An autograd Function saves the stored bytes (never a dequantized copy). Poison mode's 0xFF bytes
make every scale NaN.
- The product, everywhere: the weight dequantized (codes * scale, rotated back) to the matmul's
  dtype, products through cpu_linear; the input gradient the same way.
- GPU-only, opt-in (`INT_MM = True`): the W8A8 forward ComfyUI runs, the input rotated by H per
  group and quantized per row to int8, torch._int_mm against the codes, rescaled by both scales.
  It moves a quarter of the bytes of a bf16 product but rounds the activations to int8 as well,
  so it is off by default (the dequantizing product is the more accurate one, as fp8_matmul's
  per-token path is); not measured here (no GPU in this session).
- DoRA, LoKr and LoHa are refused on such a base (train/lora.py), as on GGUF and NF4 bases; fp8
  storage leaves these Linears alone.
"""

from __future__ import annotations

import json
import math

import torch
from torch import nn

from .cpu_linear import linear, linear_input_grad, matmul_dtype

TYPE_ATTR = "int8_convrot_groupsize"      # marks an int8 ConvRot Linear (its value: the group size)
GROUP_SIZES = (256, 64, 16, 4)            # the rotation sizes quantize() picks from, largest dividing first
COMFY_FORMAT = "int8_tensorwise"          # comfy_quant's "format" of these layers
INT_MM = False                            # the W8A8 torch._int_mm forward on CUDA (module doc)
QUANT_CHUNK = 8 * 2**20                   # bytes of fp32 temporary while quantizing rows, at most (as fp8's)

_H4 = ((1.0, 1.0, 1.0, -1.0), (1.0, 1.0, -1.0, 1.0), (1.0, -1.0, 1.0, 1.0), (-1.0, 1.0, 1.0, 1.0))
_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized regular Hadamard matrix of `size` (a power of 4), fp32, built once per device."""
    if size < 4 or size & (size - 1) or math.log(size, 4) % 1:
        raise ValueError(f"a ConvRot group size is a power of 4 (4, 16, 64, 256, 1024, ...); got {size}")
    key = (size, str(device))
    if key not in _HADAMARD:
        h4 = torch.tensor(_H4, dtype=torch.float32)
        h = h4
        while h.shape[0] < size:
            h = torch.kron(h, h4)
        _HADAMARD[key] = (h / size ** 0.5).to(device)
    return _HADAMARD[key]


def group_size_for(in_features: int) -> int | None:
    """The largest of GROUP_SIZES that divides `in_features`, or None."""
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)


def rotate(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(rows, in) fp32 -> the same rotated per group of `group_size` inputs: w @ H^T per group."""
    rows, in_f = w.shape
    h = hadamard(group_size, w.device)
    return torch.matmul(w.reshape(rows, in_f // group_size, group_size), h.T).reshape(rows, in_f)


def row_bytes(in_features: int) -> int:
    """Stored bytes of one row: one int8 code per input, then the row's fp32 scale."""
    return in_features + 4


def is_int8(linear: nn.Module) -> bool:
    """True for an nn.Linear whose weight holds int8 ConvRot rows (use_int8_weight)."""
    return TYPE_ATTR in linear.__dict__


def quantize_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (codes (out, in) int8, scale (out, 1) fp32), as comfy-kitchen
    quantizes a ConvRot weight: rotation in fp32, then per-row absmax / 127 (at least 1e-30)."""
    rotated = rotate(weight.detach().float(), group_size)
    scale = (rotated.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
    codes = (rotated / scale).round_().clamp_(-128.0, 127.0).to(torch.int8)
    return codes, scale


def pack(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(out, in) int8 codes and (out, 1) / (out,) fp32 scales -> (out, row_bytes) uint8 rows."""
    rows, in_f = codes.shape
    out = torch.empty(rows, row_bytes(in_f), dtype=torch.uint8, device=codes.device)
    out[:, :in_f].copy_(codes.view(torch.uint8))
    out[:, in_f:].copy_(scale.to(torch.float32).reshape(rows, 1).contiguous().view(torch.uint8))
    return out


def unpack(raw: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, row_bytes) uint8 rows -> (codes (out, in) int8, scale (out, 1) fp32)."""
    codes = raw[:, :in_features].contiguous().view(torch.int8)
    scale = raw[:, in_features:].contiguous().view(torch.float32)
    return codes, scale


def quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in) float weight -> (out, row_bytes) uint8 int8 ConvRot rows."""
    return pack(*quantize_codes(weight, group_size))


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """ComfyUI's dequantization of an int8 ConvRot layer: codes.float() * scale, rotated back, fp32."""
    return rotate(codes.float() * scale.float().reshape(-1, 1), group_size)


def dequantize(raw: torch.Tensor, in_features: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """(out, row_bytes) stored rows -> (out, in) weight in `dtype` (fp32, then one rounding)."""
    return dequantize_codes(*unpack(raw, in_features), group_size).to(dtype)


def _int_mm_linear(x, raw, bias, in_features, group_size, dtype):
    """The W8A8 product on CUDA (INT_MM): x rotated per group and quantized per row, torch._int_mm
    against the codes, both scales applied in fp32; None where it does not apply."""
    if not (INT_MM and x.is_cuda):
        return None
    rows = x.reshape(-1, in_features)
    if rows.shape[0] <= 16 or in_features % 8 or raw.shape[0] % 8:
        return None                                    # torch._int_mm's shape limits
    xr = torch.matmul(rows.float().reshape(-1, in_features // group_size, group_size),
                      hadamard(group_size, x.device)).reshape(-1, in_features)
    x_scale = (xr.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-30)
    xq = (xr / x_scale).round_().clamp_(-128.0, 127.0).to(torch.int8)
    codes, w_scale = unpack(raw, in_features)
    y = torch._int_mm(xq, codes.t()).float() * x_scale * w_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype).reshape(*x.shape[:-1], raw.shape[0])


class _Int8Linear(torch.autograd.Function):
    """y = x @ dequantize(rows).T + b, saving the stored rows rather than a dequantized copy."""

    @staticmethod
    def forward(ctx, x, raw, bias, in_features, group_size):
        dtype = matmul_dtype(x)
        ctx.save_for_backward(raw)
        ctx.shape = (in_features, group_size)
        ctx.bias_needs_grad = bias is not None and bias.requires_grad
        ctx.bias_dtype = None if bias is None else bias.dtype
        y = _int_mm_linear(x, raw, bias, in_features, group_size, dtype)
        if y is not None:
            return y
        return linear(x, dequantize(raw, in_features, group_size, dtype), bias, dtype)   # (..., out)

    @staticmethod
    def backward(ctx, grad_out):
        (raw,) = ctx.saved_tensors
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear_input_grad(grad_out, dequantize(raw, *ctx.shape, grad_out.dtype))
        if ctx.bias_needs_grad:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, grad_b, None, None


class _Int8Forward:
    """Instance-level forward of an int8-stored nn.Linear; reads the weight at call time, so a
    streamed weight (re-pointed at a slot) is always the current one."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear      # a strong reference, so copy.deepcopy maps it to the copied module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        return _Int8Linear.apply(x, lin.weight, lin.bias, lin.in_features, lin.__dict__[TYPE_ATTR])


def use_int8_weight(linear: nn.Linear, group_size: int) -> None:
    """Make an nn.Linear whose weight holds int8 ConvRot rows, (out, in + 4) uint8, computable."""
    hadamard(group_size)                                              # a power of 4, or an error
    w = linear.weight
    if linear.in_features % group_size:
        raise ValueError(f"use_int8_weight: {linear.in_features} inputs do not split into ConvRot groups of {group_size}")
    if w.dtype != torch.uint8 or tuple(w.shape) != (linear.out_features, row_bytes(linear.in_features)):
        raise ValueError(f"use_int8_weight: the weight is {w.dtype} {tuple(w.shape)}, not the ({linear.out_features}, "
                         f"{row_bytes(linear.in_features)}) uint8 rows of a ({linear.out_features}, "
                         f"{linear.in_features}) int8 weight")
    linear.__dict__[TYPE_ATTR] = int(group_size)
    w.requires_grad_(False)
    linear.forward = _Int8Forward(linear)


def stored_weight(linear: nn.Linear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) weight an int8-stored Linear computes with, in `dtype`."""
    return dequantize(linear.weight, linear.in_features, linear.__dict__[TYPE_ATTR], dtype)


def set_int8_weight(linear: nn.Linear, raw: torch.Tensor, group_size: int) -> None:
    """Put stored rows `raw` into `linear` (a frozen uint8 Parameter) and make it computable."""
    linear.weight = nn.Parameter(raw, requires_grad=False)
    use_int8_weight(linear, group_size)


def apply_int8_storage(model: nn.Module, spec, modulation: bool = False) -> list[str]:
    """Store the frozen block Linears of a loaded `model` as int8 ConvRot rows, in place, Linear
    by Linear, each with the largest GROUP_SIZES rotation that divides its inputs; the same
    Linears fp8 storage takes (modulation only with `modulation`). Returns their names."""
    from .block_linears import block_linears, dora_bases as _dora_bases
    from .gguf_storage import is_gguf
    from .nf4_storage import is_nf4

    dora = _dora_bases(model)
    done = []
    for qname, rel, lin in block_linears(spec, model):
        g = group_size_for(lin.in_features)
        if (g is None or spec.keeps_compute_dtype(rel, fp8_modulation=modulation) or is_gguf(lin) or is_nf4(lin)
                or is_int8(lin) or not lin.weight.is_floating_point()
                or lin.weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)):
            continue
        if lin.weight.requires_grad:
            raise ValueError(f"int8 storage: {qname}.weight is trainable; int8 storage is for a frozen base (LoRA, "
                             f"sampling)")
        if id(lin) in dora:
            raise ValueError(f"int8 storage: {qname} carries a DoRA adapter, which reads the base rows themselves; "
                             f"use [lora] type \"lora\" on an int8 base")
        with torch.no_grad():
            set_int8_weight(lin, quantize_chunked(lin.weight.data, g), g)
        done.append(qname)
    return done


# -- quantizing while a file is read ([memory] base_format = "int8") -------------------------------

def int8_block_weights(model: nn.Module, spec, modulation: bool = False) -> dict[str, int]:
    """{qualified weight name: ConvRot group size} of the block Linears int8 storage takes: those
    apply_int8_storage would take (fp8 storage's set, modulation only with `modulation`) whose
    inputs split into one of GROUP_SIZES; the others keep their dtype."""
    from .block_linears import block_linears

    out = {}
    for qname, rel, lin in block_linears(spec, model):
        g = group_size_for(lin.in_features)
        if g is not None and not spec.keeps_compute_dtype(rel, fp8_modulation=modulation):
            out[f"{qname}.weight"] = g
    return out


def chunk_rows(width: int) -> int:
    """Rows quantized at once: as many as QUANT_CHUNK bytes of fp32 hold (at least one). Both
    paths (a loaded model, a file being read) quantize the same chunks of a weight's rows, since
    the rotation's matmul may round differently for a different number of rows."""
    return max(1, QUANT_CHUNK // (4 * width))


def quantize_chunked(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """quantize() a loaded (out, in) weight chunk_rows() rows at a time: a bounded fp32 temporary."""
    rows, width = weight.shape
    out = torch.empty(rows, row_bytes(width), dtype=torch.uint8, device=weight.device)
    step = chunk_rows(width)
    for r0 in range(0, rows, step):
        out[r0:r0 + step].copy_(quantize(weight[r0:r0 + step], group_size))
    return out


def quantize_rows_into(files, key: str, segments: list[tuple[int, int]], dtype: torch.dtype, group_size: int,
                       out: torch.Tensor) -> None:
    """The rows `segments` of file tensor `key` (a CheckpointFiles) as int8 ConvRot rows in `out`
    (rows, row_bytes) uint8: the chunks of quantize_chunked (counted in the weight's own rows,
    whichever segments they come from), each read (cast to `dtype` as a plain load holds it) into
    one reused buffer and quantized, so no whole weight is held in `dtype` and the rows equal
    quantize_chunked() of the plain load."""
    width = files.tensors[key].row_numel
    step = chunk_rows(width)
    buf = torch.empty(step * width, dtype=dtype)
    spans = [(a, b) for a, b in segments if b > a]
    total = sum(b - a for a, b in spans)
    seg, offset = 0, 0                      # the next source row: spans[seg][0] + offset
    for p0 in range(0, total, step):
        n = min(step, total - p0)
        filled = 0
        while filled < n:
            a, b = spans[seg]
            take = min(n - filled, b - a - offset)
            files.read_rows_into(key, a + offset, a + offset + take, buf[filled * width:(filled + take) * width])
            filled += take
            offset += take
            if a + offset == b:
                seg, offset = seg + 1, 0
        out[p0:p0 + n].copy_(quantize(buf[:n * width].view(n, width), group_size))


def fill_int8(model: nn.Module, files, source: str, target: str, segments: list[tuple[int, int]],
              dtype: torch.dtype, group_size: int, meta: bool, device) -> None:
    """One Linear weight of a model being loaded (models/weights.load_into_empty) stored as int8
    ConvRot rows read from `source`; on meta, an empty uint8 tensor of the stored shape (what the
    planner prices)."""
    module = model.get_submodule(target[: -len(".weight")])
    rows = sum(b - a for a, b in segments)
    raw = torch.empty(rows, row_bytes(module.in_features), dtype=torch.uint8, device="meta" if meta else "cpu")
    if not meta:
        quantize_rows_into(files, source, segments, dtype, group_size, raw)
    set_int8_weight(module, raw.to(device), group_size)


# -- ComfyUI's files ---------------------------------------------------------------------------------

def comfy_quant_bytes(group_size: int) -> torch.Tensor:
    """The `comfy_quant` tensor of an int8 ConvRot layer (uint8 JSON bytes, as ComfyUI writes)."""
    text = json.dumps({"format": COMFY_FORMAT, "convrot": True, "convrot_groupsize": int(group_size)})
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)


def parse_comfy_quant(raw: torch.Tensor, where: str) -> int:
    """The ConvRot group size of a layer's `comfy_quant` tensor; `where` ("file: key") names it in
    the error for anything that is not an int8 ConvRot layer."""
    try:
        conf = json.loads(bytes(raw.to(torch.uint8).reshape(-1).tolist()).rstrip(b"\0").decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"{where}: not readable JSON (a ComfyUI comfy_quant tensor holds a JSON object)") from None
    if not isinstance(conf, dict):
        raise ValueError(f"{where}: {conf!r} is not a JSON object")
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if conf.get("format") != COMFY_FORMAT or not conf.get("convrot", params.get("convrot", False)):
        raise ValueError(f"{where}: format {conf.get('format')!r} (convrot {conf.get('convrot')!r}) is not an int8 "
                         f"ConvRot layer; leantune reads {{\"format\": \"{COMFY_FORMAT}\", \"convrot\": true}} layers")
    try:
        g = int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))
        hadamard(g)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: convrot_groupsize: {e}") from None
    return g


def read_comfy_int8(path, prefix: str = "") -> dict[str, tuple[torch.Tensor, int]]:
    """The int8 ConvRot layers of a ComfyUI safetensors file, by layer name (without `prefix`,
    e.g. "model.diffusion_model."): name -> (stored rows (out, in + 4) uint8, group size). Each
    layer's three tensors are read alone (safetensors' lazy reader), never the whole file. A
    layer with a missing or ill-shaped tensor, or another format, is named with the file."""
    from safetensors import safe_open

    layers: dict[str, tuple[torch.Tensor, int]] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for key in sorted(k for k in keys if k.endswith(".comfy_quant") and k.startswith(prefix)):
            stem = key[: -len(".comfy_quant")]
            g = parse_comfy_quant(f.get_tensor(key), f"{path}: {key}")
            for part in ("weight", "weight_scale"):
                if f"{stem}.{part}" not in keys:
                    raise ValueError(f"{path}: {stem}.{part} is missing; an int8 ConvRot layer ({key}) has weight, "
                                     f"weight_scale and comfy_quant")
            codes, scale = f.get_tensor(f"{stem}.weight"), f.get_tensor(f"{stem}.weight_scale")
            if codes.dtype != torch.int8 or codes.dim() != 2:
                raise ValueError(f"{path}: {stem}.weight is {codes.dtype} {tuple(codes.shape)}, not a 2-D int8 weight")
            if scale.numel() != codes.shape[0] or not scale.is_floating_point():
                raise ValueError(f"{path}: {stem}.weight_scale has shape {tuple(scale.shape)} ({scale.dtype}), not one "
                                 f"float scale per row of {stem}.weight {tuple(codes.shape)}")
            if codes.shape[1] % g:
                raise ValueError(f"{path}: {stem}.weight has {codes.shape[1]} inputs, which do not split into the "
                                 f"ConvRot groups of {g} its comfy_quant names")
            layers[stem[len(prefix):]] = (pack(codes, scale.float()), g)
    return layers
