"""Micro-benchmark: one frozen Linear's forward + input-gradient on CPU, bf16 as torch runs it
against leantune's fp32-on-CPU path (memory/cpu_linear.py), for a plain bf16 weight and an fp8 one.

    python bench/cpu_backward.py                      # width 3072, 64 rows (a 64 px Flux step's image tokens x 4)
    python bench/cpu_backward.py --rows 528 --skip-torch-bf16

Why: torch's bf16 `mm` on CPUs without bf16 matmul units (AVX2) runs a generic fallback at well
under 1 GFLOP/s, and `grad_out @ W` of every frozen Linear in a LoRA step goes through it. Prints
seconds and GFLOP/s per case (the best of --repeat runs) and the speed-up.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from leantune.memory.cpu_linear import apply_cpu_linears
from leantune.memory.fp8 import _Fp8Linear, dequantize, quantize


def _timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--skip-torch-bf16", action="store_true", help="skip the slow torch bf16 rows")
    a = ap.parse_args()
    torch.manual_seed(0)
    n, rows = a.width, a.rows
    flops = 2 * 2 * rows * n * n                       # forward + input-gradient
    x = torch.randn(rows, n).bfloat16().requires_grad_(True)
    gy = torch.randn(rows, n).bfloat16()

    def fwd_bwd(f):
        def run():
            x.grad = None
            f(x).backward(gy)
        return run

    plain = nn.Linear(n, n, bias=False).bfloat16().requires_grad_(False)
    fast = nn.Linear(n, n, bias=False).bfloat16().requires_grad_(False)
    fast.load_state_dict(plain.state_dict())
    apply_cpu_linears(fast)
    q, s = quantize(plain.weight.float())

    def fp8_torch_bf16(inp):          # the fp8 Linear before: dequantize to bf16, bf16 matmuls
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, xx):
                return nn.functional.linear(xx, dequantize(q, s, xx.dtype))

            @staticmethod
            def backward(ctx, g):
                return g @ dequantize(q, s, g.dtype)
        return F.apply(inp)

    cases = [("bf16 Linear, leantune fp32-on-CPU", fwd_bwd(fast)),
             ("fp8 Linear, leantune fp32-on-CPU", fwd_bwd(lambda t: _Fp8Linear.apply(t, q, s, None)))]
    if not a.skip_torch_bf16:
        cases = [("bf16 Linear, torch bf16", fwd_bwd(plain)), cases[0],
                 ("fp8 Linear, bf16 dequant + bf16 matmuls", fwd_bwd(fp8_torch_bf16)), cases[1]]
    print(f"width {n}, {rows} rows, forward + input-gradient, best of {a.repeat}, "
          f"{torch.get_num_threads()} threads")
    for name, fn in cases:
        fn()                                          # warm-up
        sec = _timed(fn, a.repeat)
        print(f"  {name:42s} {sec:8.3f} s  {flops / sec / 1e9:7.2f} GFLOP/s")


if __name__ == "__main__":
    main()
