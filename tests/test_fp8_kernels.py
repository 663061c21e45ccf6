"""The C fp8 quantizer (memory/fp8_kernels.c) against the torch path it replaces, bit for bit.

memory/fp8.quantize_into hands CPU bf16/fp32 weights to the kernel; quantize_into_torch is the
definition (fp32 division by the block scale amax / 448, clamp to +-448, torch's round-to-nearest-
even cast to float8_e4m3fn). Every bf16 bit pattern is quantized under scales set by anchors from
the subnormal range to inf and NaN (and as its own block's largest magnitude), as bf16 and as fp32
input; random fp32 bit patterns cover fp32 inputs; odd widths take the per-row scale and the
scalar tail; the split over threads changes nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from leantune.memory import fp8_kernels
from leantune.memory.fp8 import FP8_DTYPE, quantize, quantize_into, quantize_into_torch, scale_blocks

needs_kernel = pytest.mark.skipif(fp8_kernels.library() is None, reason=fp8_kernels.unavailable_reason())

# bf16 bit patterns of the anchors that set a block's scale: zero, the smallest subnormal, a
# subnormal, the smallest normal, tiny and ordinary normals, 448, the largest finite, inf, NaN.
ANCHORS = [0x0000, 0x0001, 0x0055, 0x0080, 0x0D8F, 0x3A83, 0x3F80, 0x4040, 0x43E0, 0x5E80, 0x7F7F, 0x7F80, 0x7FC0]


def _both(weight: torch.Tensor, nb: int):
    rows, width = weight.shape
    want_q, want_s = torch.empty(rows, width, dtype=FP8_DTYPE), torch.empty(rows, nb)
    got_q, got_s = torch.empty_like(want_q), torch.empty_like(want_s)
    quantize_into_torch(weight, want_q, want_s)
    assert fp8_kernels.handles(weight, got_q, got_s)
    fp8_kernels.quantize_rows(weight, got_q, got_s)
    return (want_q.view(torch.uint8), want_s.view(torch.int32)), (got_q.view(torch.uint8), got_s.view(torch.int32))


def _assert_bitwise(weight: torch.Tensor, nb: int) -> None:
    (wq, ws), (gq, gs) = _both(weight, nb)
    bad = (wq != gq).nonzero()
    assert bad.numel() == 0, [(f"{weight[r, c].item()!r}", hex(wq[r, c].item()), hex(gq[r, c].item()))
                              for r, c in bad[:8].tolist()]
    bad = (ws != gs).nonzero()
    assert bad.numel() == 0, [(hex(ws[r, c].item()), hex(gs[r, c].item())) for r, c in bad[:8].tolist()]


def _every_bf16_pattern_under_each_anchor(width: int) -> torch.Tensor:
    """Rows of `width`: per anchor (and its negative), the anchor followed by patterns no larger in
    magnitude (so the anchor sets the scale and each pattern is divided by it), and the patterns
    larger than the anchor in blocks of their own (each block's largest sets its scale)."""
    patterns = torch.arange(65536, dtype=torch.int32)
    magnitude = patterns & 0x7FFF
    order = torch.argsort(magnitude * 2 + (patterns >> 15), stable=True)     # by magnitude, then sign
    patterns, magnitude = patterns[order], magnitude[order]
    rows = []
    for anchor in ANCHORS:
        for signed in (anchor, anchor | 0x8000):
            under = patterns[magnitude <= anchor]
            over = patterns[magnitude > anchor]
            pad = (-under.numel()) % (width - 1)
            under = torch.cat([under, torch.zeros(pad, dtype=torch.int32)]).view(-1, width - 1)
            rows.append(torch.cat([torch.full((under.shape[0], 1), signed, dtype=torch.int32), under], 1))
            pad = (-over.numel()) % width
            rows.append(torch.cat([over, torch.zeros(pad, dtype=torch.int32)]).view(-1, width))
    bits = torch.cat(rows)
    return bits.to(torch.int16).view(torch.bfloat16)      # (rows, width), every pattern in every role


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_bf16_bit_pattern_quantizes_bitwise_as_torch(dtype):
    blocks = _every_bf16_pattern_under_each_anchor(64).to(dtype)                  # (n, 64): the vector path
    assert blocks.shape[0] > 26 * 1000
    _assert_bitwise(blocks, 1)
    _assert_bitwise(blocks[: blocks.shape[0] // 4 * 4].reshape(-1, 256), 4)      # 4 blocks a row
    rows = _every_bf16_pattern_under_each_anchor(31).to(dtype)                    # a row's scale, the scalar path
    _assert_bitwise(rows, scale_blocks(31))


@needs_kernel
def test_random_fp32_bit_patterns_quantize_bitwise_as_torch():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31, (1 << 18,), generator=g, dtype=torch.int64).to(torch.int32)
    # a quarter of them scaled down into fp32's subnormal range, a quarter with their exponent
    # near 448's: random bit patterns are otherwise mostly huge or tiny
    bits[: 1 << 16] &= ~0x7F800000
    bits[1 << 16: 1 << 17] = (bits[1 << 16: 1 << 17] & ~0x7F800000) | (torch.randint(
        118, 138, (1 << 16,), generator=g, dtype=torch.int32) << 23)
    x = bits.view(torch.float32)
    _assert_bitwise(x.view(-1, 64), 1)
    _assert_bitwise(x[torch.randperm(x.numel(), generator=g)][: 85 * 3072].view(-1, 3072), 48)
    ordered = x[torch.argsort(bits & 0x7FFFFFFF)]                                 # blocks of like magnitude
    _assert_bitwise(ordered.view(-1, 128), 2)


@needs_kernel
@pytest.mark.parametrize("width", [8, 40, 100, 129, 3072 + 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_widths_without_64_blocks_take_one_scale_per_row(width, dtype):
    g = torch.Generator().manual_seed(width)
    w = (torch.randn(67, width, generator=g) * torch.logspace(-30, 3, 67)[:, None]).to(dtype)
    w[3, width // 2] = float("nan")
    w[5, 0] = float("-inf")
    w[7] = 0
    w[9, 1:] = 0
    nb = scale_blocks(width)
    _assert_bitwise(w, nb)
    q, s = quantize(w)                                                            # the public path
    (wq, ws), _ = _both(w, nb)
    assert torch.equal(q.view(torch.uint8), wq) and torch.equal(s.view(torch.int32), ws)


@needs_kernel
def test_the_split_over_threads_changes_nothing():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(1000, 3072, generator=g) * 0.02).to(torch.bfloat16)
    threads = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2, 5):
            torch.set_num_threads(n)
            q, s = torch.empty(w.shape, dtype=FP8_DTYPE), torch.empty(1000, 48)
            quantize_into(w, q, s)
            out.append((q.view(torch.uint8), s))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a[0], out[0][0]) and torch.equal(a[1], out[0][1]) for a in out[1:])
    _assert_bitwise(w, 48)


def test_the_kernel_takes_only_what_it_can():
    w = torch.randn(4, 128)
    q, s = torch.empty(4, 128, dtype=FP8_DTYPE), torch.empty(4, 2)
    built = fp8_kernels.library() is not None
    assert fp8_kernels.handles(w, q, s) == built
    assert not fp8_kernels.handles(w.half(), q, s)                                # fp16: torch ops
    assert not fp8_kernels.handles(w.t(), q.t(), s)                               # not contiguous
    assert not fp8_kernels.handles(w, q, torch.empty(4, 3))                       # blocks do not divide


def test_without_the_kernel_quantize_runs_torch_ops(tmp_path):
    """LEANTUNE_HOST_KERNELS=0 (as on a machine without a C compiler): no library, and quantize()
    still gives torch's bits (the reference path)."""
    code = ("import torch\n"
            "from leantune.memory import fp8_kernels\n"
            "from leantune.memory.fp8 import quantize, quantize_into_torch, FP8_DTYPE\n"
            "assert fp8_kernels.library() is None, 'built'\n"
            "print(fp8_kernels.unavailable_reason())\n"
            "w = torch.randn(16, 128).bfloat16()\n"
            "q, s = quantize(w)\n"
            "q2, s2 = torch.empty(16, 128, dtype=FP8_DTYPE), torch.empty(16, 2)\n"
            "quantize_into_torch(w, q2, s2)\n"
            "assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)\n")
    env = {**os.environ, "LEANTUNE_HOST_KERNELS": "0", "LEANTUNE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "LEANTUNE_HOST_KERNELS=0" in done.stdout
