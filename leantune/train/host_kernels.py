"""The host optimizer step's element loops in C, built on first use and called from threads.

Why: the host step ([full] streamed_step = "host", and every step on a CPU compute device) updates
billions of weights per optimizer step on the CPU. torch's fused CPU AdamW covers fp32 weights with
fp32 moments (train/fused_optim.py calls it there, bitwise torch's `AdamW(fused=True)`), but not
bf16 weights with fp32 moments, fp32 masters beside bf16 weights, stochastic rounding, or Adafactor;
as torch ops those take a dozen passes with full-size fp32 temporaries and run 10-25x below the
fused kernel. host_kernels.c does each AdamW setting in one pass per element and Adafactor in three
(clipping included), no temporaries the size of the tensor. Tolerances against the torch-op path
and torch's Adafactor: tests/test_host_kernels.py.

How it is built: leantune/native.py (shared with the fp8 quantizer): plain C, no torch headers,
compiled on first use with the system C compiler (-O3 -march=native) into a cache keyed by a hash
of the source, compiler, flags and CPU, loaded only from a folder only the user can write and only
as the bytes the build recorded (native.py says the rules). Where no compiler exists, a folder is
refused, the build fails, or LEANTUNE_HOST_KERNELS=0, `library()` returns None and the optimizer
keeps its torch-op path (same math in another operation order, slower); `unavailable_reason()`
says why, and a warning says it once.

Threads: a tensor is split into as many contiguous ranges as torch uses intra-op threads (one fewer
on a thread that called `native.leave_a_core`: the host-step worker beside a GPU backward, whose autograd
thread must keep a core to launch the device's kernels); each range is one C call on a worker
thread (ctypes drops the GIL during the call). The random bits of
stochastic rounding are a hash of (key, element index), and the sums (the clipping norm, Adafactor's
row and column sums) run over fixed blocks whose starts the ranges respect, so the result does not
depend on the split.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..native import NativeLibrary, kernel_threads, parallel

SOURCE = Path(__file__).with_name("host_kernels.c")
MIN_PER_THREAD = 1 << 16            # elements: below this a tensor is one call on the calling thread
SUM_BLOCK = 4096                    # host_kernels.c: lt_sumsq's fp32 blocks
ROW_BLOCK = 256                     # host_kernels.c: Adafactor's column sums, per block of rows

_i64, _i32, _u32, _f32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p


def _declare(lib: ctypes.CDLL) -> None:
    lib.lt_adamw.restype = _i32
    lib.lt_adamw.argtypes = [_i64, _i64, _p, _i32, _p, _p, _i32, _p, _p, _i32, _f32, _f32, _f32, _f32,
                             _f32, _f32, _f32, _f32, _i32, _i32, _u32]
    lib.lt_sumsq.restype = ctypes.c_double
    lib.lt_sumsq.argtypes = [_i64, _i64, _p, _i32]
    lib.lt_adafactor_sums.restype = ctypes.c_double
    lib.lt_adafactor_sums.argtypes = [_i64, _i64, _i64, _p, _i32, _p, _i32, _p, _p]
    lib.lt_adafactor_moments.restype = ctypes.c_double
    lib.lt_adafactor_moments.argtypes = [_i64, _i64, _p, _p, _f32, _f32, _p, _p, _p, _p]
    lib.lt_adafactor_update.restype = ctypes.c_double
    lib.lt_adafactor_update.argtypes = [_i64, _i64, _i64, _p, _i32, _f32, _p, _i32, _p, _p, _p, _f32,
                                        _f32, _f32, _f32, _f32, _i32, _i32, _u32]


# Said once, with the reason, where the kernels are not used: a user comparing runs should know.
NOTE = ("the torch-op step's results differ from the kernels' by up to about 1.2e-4 per tensor, so runs with "
        "and without the kernels are close, not bitwise equal")
_LIBRARY = NativeLibrary(SOURCE, _declare, note=NOTE)


def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they cannot be had (see unavailable_reason)."""
    return _LIBRARY.get()


def unavailable_reason() -> str:
    return _LIBRARY.unavailable_reason()


def handles(*tensors: torch.Tensor | None) -> bool:
    """Whether these tensors can go to the kernels: on the CPU, contiguous, bf16 or fp32."""
    return all(t is None or (t.device.type == "cpu" and t.is_contiguous()
                             and t.dtype in (torch.bfloat16, torch.float32)) for t in tensors)


def _ranges(n: int, align: int = 64) -> list[tuple[int, int]]:
    parts = max(1, min(kernel_threads(), n // MIN_PER_THREAD))
    step = -(-n // parts)
    step = -(-step // align) * align
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


_parallel = parallel


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _bf(t: torch.Tensor | None) -> int:
    return int(t is not None and t.dtype == torch.bfloat16)


def sumsq(x: torch.Tensor) -> float:
    """Sum of squares of x (fp32 arithmetic in blocks of SUM_BLOCK elements, double across them),
    threaded; the ranges start at multiples of SUM_BLOCK, so the blocks do not depend on the split."""
    lib = library()
    return sum(_parallel(lambda lo, hi: lib.lt_sumsq(lo, hi, _ptr(x), _bf(x)), _ranges(x.numel(), SUM_BLOCK)))


def adamw(w: torch.Tensor, master: torch.Tensor | None, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *,
          gscale: float, decay: float, beta1: float, beta2: float, eps: float, step_size: float, bc2_sqrt: float,
          sr_w: bool, sr_state: bool, key: int) -> bool:
    """One AdamW update of w (and master) in place; False where the kernel has no such combination."""
    lib = library()
    mv_bf = _bf(m)
    sr_w = bool(sr_w and w.dtype == torch.bfloat16 and master is None)
    sr_state = bool(sr_state and mv_bf)
    args = (_ptr(w), _bf(w), _ptr(master), _ptr(g), _bf(g), _ptr(m), _ptr(v), mv_bf, gscale, decay, 1 - beta1, beta2,
            1 - beta2, eps, step_size, bc2_sqrt, int(sr_w), int(sr_state), key & 0xFFFFFFFF)
    return not any(_parallel(lambda lo, hi: lib.lt_adamw(lo, hi, *args), _ranges(w.numel())))


def adafactor_matrix(w: torch.Tensor, g: torch.Tensor, row_var: torch.Tensor, col_var: torch.Tensor, *,
                     max_grad_norm: float, one_minus_beta2_t: float, rho_t: float, decay: float, eps1: float,
                     eps2: float, sr_w: bool, key: int) -> None:
    """torch's Adafactor update of a 2-D weight (factored second moment), in three passes over the
    gradient and none over a temporary (host_kernels.c): (A) the row and column sums of g^2 and
    ||w||, split by blocks of ROW_BLOCK rows; the per-parameter clipping scale (max_grad_norm > 0)
    follows from the row sums and scales the sums, no pass of its own; the moments' lerps on one
    thread; (B) ||update||; (C) the update itself. Scratch: a float per row, per column and per
    column and block of ROW_BLOCK rows (under 2 % of the weight's elements for a Flux Linear)."""
    lib = library()
    rows, cols = w.shape
    rv, cv = row_var.view(rows), col_var.view(cols)
    if not (rv.is_contiguous() and cv.is_contiguous()):
        raise ValueError("adafactor_matrix: the row/column moments must be contiguous")
    parts = len(_ranges(rows * cols))
    blocks = -(-rows // ROW_BLOCK)
    scratch = torch.empty(rows + blocks * cols + cols + 1, dtype=torch.float32)
    rowsq, colpart = scratch[:rows], scratch[rows:rows + blocks * cols]
    col_rs, col_min = scratch[rows + blocks * cols:-1], scratch[-1:]
    block_ranges = [(lo * ROW_BLOCK, min(rows, hi * ROW_BLOCK)) for lo, hi in _split(blocks, parts)]
    wsq = sum(_parallel(lambda r0, r1: lib.lt_adafactor_sums(
        r0, r1, cols, _ptr(g), _bf(g), _ptr(w), _bf(w), _ptr(rowsq), _ptr(colpart)), block_ranges))
    gscale = 1.0
    if max_grad_norm > 0:      # clip_in_place's coefficient, from the same sum of squares
        gscale = min(max_grad_norm / (float(rowsq.sum(dtype=torch.float64)) ** 0.5 + 1e-6), 1.0)
    rsum = lib.lt_adafactor_moments(rows, cols, _ptr(rowsq), _ptr(colpart), gscale * gscale, one_minus_beta2_t,
                                    _ptr(rv), _ptr(cv), _ptr(col_rs), _ptr(col_min))
    alpha = max(eps2, (wsq ** 0.5) / (w.numel() ** 0.5)) * rho_t
    inv_rmean = 1.0 / max(rsum / rows, eps1)
    cmin = float(col_min[0])
    row_ranges = _split(rows, parts)
    common = (cols, _ptr(g), _bf(g), gscale, _ptr(w), _bf(w), _ptr(rv), _ptr(cv), _ptr(col_rs), cmin, inv_rmean,
              eps1 * eps1, decay)
    usq = sum(_parallel(lambda r0, r1: lib.lt_adafactor_update(r0, r1, *common, 0.0, 0, 0, 0), row_ranges))
    denom = max(1.0, (usq ** 0.5) / (w.numel() ** 0.5))
    sr = int(sr_w and w.dtype == torch.bfloat16)
    _parallel(lambda r0, r1: lib.lt_adafactor_update(r0, r1, *common, alpha / denom, 1, sr, key & 0xFFFFFFFF),
              row_ranges)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    step = -(-n // max(1, parts))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]
