"""fp8 accuracy against bf16 on a real-width Flux block, emulated on the CPU (finding 11 of issue 20).

What it measures: the relative error (||y - y_ref|| / ||y_ref||, and the largest per-output-channel
mean gain error) of one Linear of Flux-dev's double block at full width (3072 -> 12288, the MLP
up-projection, and 12288 -> 3072, the down-projection) for inputs with Flux's per-channel outliers
(a few hidden channels 50-200x the others, as Flux's modulated activations have), against the bf16
product with the unquantized weight:

- dequant-bf16-scale: the weight dequantized by multiplying the e4m3 values with scales rounded to
  bf16 (the old fp8.dequantize), then a bf16 product;
- dequant-fp32-scale: the e4m3 values times the fp32 scales in fp32, rounded once to bf16 (fixed);
- scaled_mm per-token: what torch._scaled_mm computes (fp8_matmul.py): the input quantized to e4m3
  per token row, the weight per output row, exact products accumulated in fp32;
- scaled_mm per-tensor: the input quantized with one scale.

The e4m3 rounding is torch's own (float8_e4m3fn casts on the CPU); the products run in fp32 here,
as the tensor cores accumulate, so the numbers are the quantization's error, not a GPU's.
Run: python bench/fp8_accuracy.py [--tokens 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leantune.memory.fp8 import FP8_DTYPE, FP8_MAX, dequantize, quantize  # noqa: E402
from leantune.memory.fp8_matmul import quantize_rows  # noqa: E402


def old_dequantize(q, scale, dtype):
    out_f, in_f = q.shape
    w = q.to(dtype)
    w.view(out_f, scale.shape[-1], -1).mul_(scale.to(dtype)[..., None])
    return w


def row_scaled_weight(w):
    amax = w.float().abs().amax(dim=1, keepdim=True)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def flux_like_input(tokens, width, g):
    x = torch.randn(tokens, width, generator=g)
    outliers = torch.randperm(width, generator=g)[: max(4, width // 512)]
    x[:, outliers] *= torch.empty(len(outliers)).uniform_(50, 200, generator=g)
    return x.bfloat16()


def rel(y, ref):
    y, ref = y.float(), ref.float()
    return float((y - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (i, o) in {"mlp up 3072->12288": (3072, 12288), "mlp down 12288->3072": (12288, 3072)}.items():
        w = (torch.randn(o, i, generator=g) * (1 / i) ** 0.5).bfloat16()
        x = flux_like_input(a.tokens, i, g)
        ref = (x.float() @ w.float().t()).bfloat16()                   # bf16 weight, fp32 accumulate
        q, s = quantize(w)                                             # block-scaled (the engine's)
        old = (x.float() @ old_dequantize(q, s, torch.bfloat16).float().t()).bfloat16()
        new = (x.float() @ dequantize(q, s, torch.bfloat16).float().t()).bfloat16()
        qr, sr = row_scaled_weight(w)                                  # per row (_scaled_mm's weights)
        xq, xs = quantize_rows(x)
        tok = ((xq.float() * xs) @ (qr.float() * sr).t()).bfloat16()
        amax = x.float().abs().amax()
        xt = (x.float() / (amax / FP8_MAX)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * (amax / FP8_MAX)
        ten = (xt @ (qr.float() * sr).t()).bfloat16()
        deq_row = (x.float() @ (qr.float() * sr).bfloat16().float().t()).bfloat16()
        gain_old = float(((old_dequantize(q, s, torch.bfloat16).float() / (q.float() * s.repeat_interleave(64, 1)))
                          .nan_to_num(1.0) - 1).abs().amax())
        rows.append((name, rel(old, ref), rel(new, ref), rel(deq_row, ref), rel(tok, ref), rel(ten, ref), gain_old))
    print(f"tokens {a.tokens}; relative error of the output against the bf16 product (lower is better)")
    print("| layer | dequant, bf16 scale (old) | dequant, fp32 scale | dequant per-row weight | "
          "scaled_mm per-token input | scaled_mm per-tensor input | old largest weight gain error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.4%} | {r[2]:.4%} | {r[3]:.4%} | {r[4]:.4%} | {r[5]:.4%} | {r[6]:.3%} |")


if __name__ == "__main__":
    main()
