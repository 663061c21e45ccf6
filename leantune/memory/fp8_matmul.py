"""The fp8 Linear forward on fp8 tensor cores (CUDA sm_89+), through `torch._scaled_mm`.

Why: dequantizing an e4m3 weight to bf16 costs a full bf16 temporary and an elementwise pass per
call; with fp8 tensor cores the product can read the e4m3 bytes directly, scaled per row.

When: only for weights with one scale per output row (`weight_scale` of shape (out, 1): ComfyUI
per-tensor and per-row scaled checkpoints). `torch._scaled_mm` scales per row of each operand, not
per block of 64 inputs, so the engine's own block-scaled weights (out, in/64) keep the dequantize
path. The input is quantized to e4m3 per token row (its amax onto 448) for the product; backward
always dequantizes (fp8.py). If the device is older than sm_89, a dimension is not a multiple of
16, or the call is refused once for an output dtype, None is returned and the caller falls back;
after a refusal the path stays off for that output dtype (row-wise scaling takes bf16 output on
every build, fp16 only on some: an fp16 refusal must not turn off the bf16 path).

torch's contract (2.13): mat_a row-major (M, K), mat_b column-major (K, N) (the transpose of a
contiguous (N, K) weight), K and N multiples of 16, scale_a (M, 1) and scale_b (1, N) contiguous
fp32, bias in the output dtype. torch reports a broken contract as ValueError (TORCH_CHECK_VALUE)
or RuntimeError / NotImplementedError (an older build or driver); both mean "fall back". An
out-of-memory error is not a refusal: it propagates to the OOM guard, and the path stays on.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("leantune.memory")

_FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_state: dict = {"failed": set()}     # output dtypes torch refused (see module docstring)
# Off by default: quantizing the input per token row loses to Flux's per-channel outliers.
# bench/fp8_accuracy.py (docs/benchmarks.md) on a real-width Flux MLP with outlier inputs: 3.3-3.5 %
# output error against the bf16 product, where dequantizing the same per-row weight gives 2.7 %.
# _scaled_mm scales the input per row only (no per-channel scale), so the dequantizing path is the
# more accurate one and is kept; set True to trade that accuracy for the tensor-core speed.
SCALED_MM = False


def fp8_tensor_cores(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def usable(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether scaled_mm_linear can take this call (see module docstring)."""
    return (SCALED_MM and dtype not in _state["failed"] and hasattr(torch, "_scaled_mm") and q.dtype == _FP8
            and q.is_contiguous() and scale.dim() == 2 and scale.shape[1] == 1
            and dtype in (torch.bfloat16, torch.float16)
            and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0 and fp8_tensor_cores(x.device))


QUANT_CHUNK = 32 * 2**20      # bytes of fp32 temporary while quantizing the input, at most


def quantize_rows(x2: torch.Tensor, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (e4m3 (M + pad, K), fp32 scale (M + pad, 1)) with each row's amax mapped
    onto 448; `pad` zero rows (scale 1) appended.

    Bounded temporaries: the quotient is formed in fp32 QUANT_CHUNK bytes of rows at a time and
    stored straight into the e4m3 result, and the row amax is a min/max reduction (no |x| copy), so the
    transient memory is the (M, K) e4m3 result plus one chunk, not 9 bytes per input element
    (an fp32 copy of the input, an fp32 quotient, the e4m3 result) as one expression would take:
    for Flux's MLP down-projection at 1024 px (4608 x 12288) that was 0.5 GB, against the 75 MB
    bf16 weight the dequantizing path (the planner's measurement) allocates instead.
    """
    m, k = x2.shape
    # max |x| per row from one min/max reduction: no |x| copy, and not a norm (CUDA autocast runs
    # norms in fp32, which would copy a bf16 input to fp32 first)
    lo, hi = torch.aminmax(x2, dim=-1, keepdim=True)                                       # (M, 1)
    amax = torch.maximum(hi, -lo).float()
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    q = torch.empty(m + pad, k, dtype=_FP8, device=x2.device)
    rows = max(1, QUANT_CHUNK // (4 * k))
    for r in range(0, m, rows):
        e = min(r + rows, m)
        q[r:e] = (x2[r:e] / scale[r:e]).clamp_(-_FP8_MAX, _FP8_MAX)     # cast to e4m3 on store
    if pad:
        q[m:].view(torch.uint8).zero_()                                 # e4m3 0.0 is all zero bits
        scale = torch.cat([scale, scale.new_ones(pad, 1)])
    return q, scale


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor | None:
    """x @ (q * scale)^T + bias in `dtype` on fp8 tensor cores, or None when not usable."""
    if not usable(x, q, scale, dtype):
        return None
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    pad = (-x2.shape[0]) % 16                       # _scaled_mm wants M a multiple of 16 (older builds)
    xq, xs = quantize_rows(x2, pad)
    try:
        y = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.float().reshape(1, -1),
                             bias=None if bias is None else bias.to(dtype), out_dtype=dtype)
    except torch.OutOfMemoryError:
        raise                                       # not a refusal: the OOM guard re-plans
    except (RuntimeError, ValueError) as e:         # refused: fall back for this output dtype
        _state["failed"].add(dtype)
        log.warning("fp8: torch._scaled_mm refused a %s product (%s); dequantizing fp8 weights instead",
                    dtype, e)
        return None
    if pad:
        y = y[: y.shape[0] - pad]
    return y.reshape(*lead, q.shape[0])
