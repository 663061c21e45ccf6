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


def fp8_tensor_cores(device: torch.device) -> bool:
    """True on a CUDA device of compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def usable(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether scaled_mm_linear can take this call (see module docstring)."""
    return (dtype not in _state["failed"] and hasattr(torch, "_scaled_mm") and q.dtype == _FP8
            and q.is_contiguous() and scale.dim() == 2 and scale.shape[1] == 1
            and dtype in (torch.bfloat16, torch.float16)
            and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0 and fp8_tensor_cores(x.device))


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (e4m3 (M, K), fp32 scale (M, 1)) with each row's amax mapped onto 448."""
    amax = x2.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    return (x2.float() / scale).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8), scale


def scaled_mm_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor | None:
    """x @ (q * scale)^T + bias in `dtype` on fp8 tensor cores, or None when not usable."""
    if not usable(x, q, scale, dtype):
        return None
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    pad = (-x2.shape[0]) % 16                       # _scaled_mm wants M a multiple of 16
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, k)])
    xq, xs = quantize_rows(x2)
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
