"""Frozen-base formats other than GGUF against bf16 on a real-width Flux block, on the CPU (issue 38).

What it measures, as bench/fp8_accuracy.py and bench/gguf_accuracy.py do (their inputs and measure,
imported): the relative error ||y - y_ref|| / ||y_ref|| of one Linear of Flux-dev's double block at
full width (3072 -> 12288, the MLP up-projection, and 12288 -> 3072, the down-projection), inputs
with Flux's per-channel outliers, against the bf16 product with the unquantized weight, for:

- the engine's block-scaled e4m3 (memory/fp8.py), the reference row;
- NF4 as memory/nf4_storage.py stores it: bitsandbytes' quantize_4bit / dequantize_4bit (NF4, an
  absmax per 64 values, the absmax values nested in 8 bits per row), rounded once to bf16, product
  in fp32; beside it bitsandbytes' NF4 with fp32 absmax values (no nested statistics), to show
  what the nesting costs;
- int8 ConvRot as memory/int8_storage.py stores it (the layout of ComfyUI's *_int8_convrot
  layers, groups of 256 inputs rotated by the regular Hadamard matrix, one fp32 scale per row),
  decoded the same way, beside plain per-row int8 (no rotation) to show what the rotation buys.
  The weight only: ComfyUI's W8A8 product also rounds the activations to int8 (not measured).

Bits per weight count everything stored, on the 3072-wide rows (the larger): NF4's 4 bits plus 8
per 64 values of absmax code and each row's nested scale and offset (or 32 per 64 of fp32 absmax
without nesting); int8's 8 plus one fp32 scale per row.
Run: python bench/quant_accuracy.py [--tokens 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leantune.memory import int8_storage, nf4_storage  # noqa: E402
from leantune.memory.fp8 import dequantize, quantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_accuracy import flux_like_input, rel  # noqa: E402  (the same inputs and measure as the fp8 table)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)            # the same weights and inputs as gguf_accuracy.py
    layers = {"mlp up 3072->12288": (3072, 12288), "mlp down 12288->3072": (12288, 3072)}
    errs: dict[str, list[float]] = {}
    bits = {"fp8 e4m3, 64-value scales": 8 + 32 / 64,
            "NF4, 64-value absmax nested per row (bitsandbytes)": 8 * nf4_storage.row_bytes(3072) / 3072,
            "NF4, 64-value fp32 absmax (bitsandbytes, no nesting)": 4 + 32 / 64}
    for i, o in layers.values():
        w = (torch.randn(o, i, generator=g) * (1 / i) ** 0.5).bfloat16()
        x = flux_like_input(a.tokens, i, g)
        ref = (x.float() @ w.float().t()).bfloat16()                   # bf16 weight, fp32 accumulate
        q, s = quantize(w)
        errs.setdefault("fp8 e4m3, 64-value scales", []).append(
            rel((x.float() @ dequantize(q, s, torch.bfloat16).float().t()).bfloat16(), ref))
        wq = nf4_storage.dequantize(nf4_storage.quantize(w), i, torch.bfloat16)
        errs.setdefault("NF4, 64-value absmax nested per row (bitsandbytes)", []).append(
            rel((x.float() @ wq.float().t()).bfloat16(), ref))
        bnb = nf4_storage._bnb()
        packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
        state.dtype = torch.float32
        wq = bnb.dequantize_4bit(packed, state).bfloat16()
        errs.setdefault("NF4, 64-value fp32 absmax (bitsandbytes, no nesting)", []).append(
            rel((x.float() @ wq.float().t()).bfloat16(), ref))
        wq = int8_storage.dequantize(int8_storage.quantize(w, 256), i, 256, torch.bfloat16)
        errs.setdefault("int8 ConvRot, groups of 256, per-row scale", []).append(
            rel((x.float() @ wq.float().t()).bfloat16(), ref))
        scale = (w.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
        wq = ((w.float() / scale).round().clamp(-128, 127) * scale).bfloat16()
        errs.setdefault("int8 per-row scale, no rotation", []).append(rel((x.float() @ wq.float().t()).bfloat16(), ref))
        for name in ("int8 ConvRot, groups of 256, per-row scale", "int8 per-row scale, no rotation"):
            bits.setdefault(name, 8 + 32 / i)                          # the narrower layer's, the larger
    print(f"tokens {a.tokens}; relative error of the output against the bf16 product (lower is better)")
    print("| format | bits/weight | " + " | ".join(layers) + " |")
    print("|---" * (2 + len(layers)) + "|")
    for name, e in errs.items():
        print(f"| {name} | {bits[name]:.4g} | " + " | ".join(f"{v:.4%}" for v in e) + " |")


if __name__ == "__main__":
    main()
