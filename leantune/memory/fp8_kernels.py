"""Block-scaled e4m3 quantization in C (fp8_kernels.c): what memory/fp8.quantize_into computes,
bitwise, in one pass over the bytes.

Why: a load that stores block Linears in fp8 (models/weights.py quantize_rows_into) quantizes
every block weight of the file as it reads it; the torch-op path runs five passes over an fp32
copy of each chunk, about 725 M values per CPU-second, while this kernel runs near memory speed.
Built on first use by leantune/native.py (with the host optimizer kernels' machinery, cache and
its rules on what is loaded); where it cannot be built or is refused, or LEANTUNE_HOST_KERNELS=0,
`library()` is None (said once, with the reason) and quantize_into keeps its torch ops, which give
the same bits.

Threads: rows are independent; `quantize_rows` splits them into as many ranges as torch uses
intra-op threads (the loader's workers run with one each, and quantize chunks side by side).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..native import NativeLibrary, parallel

SOURCE = Path(__file__).with_name("fp8_kernels.c")
MIN_ROWS_VALUES = 1 << 18          # values per thread at least: below, one call on the calling thread

_i64, _i32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def _declare(lib: ctypes.CDLL) -> None:
    lib.lt_fp8_quantize_rows.restype = None
    lib.lt_fp8_quantize_rows.argtypes = [_i64, _i64, _i64, _i64, _p, _i32, _p, _p]


# -fno-trapping-math: without it gcc keeps the per-value selects as branches (an FP compare
# "might trap") and the loops stay scalar; it changes no result (no reassociation, no reciprocal).
_LIBRARY = NativeLibrary(SOURCE, _declare, extra_flags=("-fno-trapping-math",),
                         note="the torch-op quantizer gives the same bits, only slower")


def library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be had (see unavailable_reason)."""
    return _LIBRARY.get()


def unavailable_reason() -> str:
    return _LIBRARY.unavailable_reason()


def handles(weight: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> bool:
    """Whether the kernel takes these: CPU tensors, contiguous, a bf16 or fp32 (rows, in) weight,
    e4m3 q_out and fp32 scale_out whose blocks divide the width; and the library is built."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and q_out.device.type == "cpu"
            and scale_out.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and q_out.dtype == torch.float8_e4m3fn and scale_out.dtype == torch.float32
            and weight.is_contiguous() and q_out.is_contiguous() and scale_out.is_contiguous()
            and q_out.shape == weight.shape and scale_out.dim() == 2 and scale_out.shape[0] == weight.shape[0]
            and scale_out.shape[1] > 0 and weight.shape[1] % scale_out.shape[1] == 0
            and library() is not None)


def quantize_rows(weight: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """q_out, scale_out = quantize(weight) for a (rows, in) weight `handles` accepts, threaded over rows."""
    lib = library()
    rows, width = weight.shape
    nb = scale_out.shape[1]
    parts = max(1, min(torch.get_num_threads(), rows * width // MIN_ROWS_VALUES, rows))
    step = -(-rows // parts)
    bf16 = int(weight.dtype == torch.bfloat16)
    x, q, s = weight.data_ptr(), q_out.data_ptr(), scale_out.data_ptr()
    parallel(lambda r0, r1: lib.lt_fp8_quantize_rows(r0, r1, width, width // nb, x, bf16, q, s),
             [(lo, min(rows, lo + step)) for lo in range(0, rows, step)])
