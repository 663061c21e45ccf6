"""GGUF block types' accuracy against bf16 on a real-width Flux block, on the CPU (issue 38).

What it measures, as bench/fp8_accuracy.py does for fp8: the relative error ||y - y_ref|| / ||y_ref||
of one Linear of Flux-dev's double block at full width (3072 -> 12288, the MLP up-projection, and
12288 -> 3072, the down-projection), inputs with Flux's per-channel outliers (1 in 512 hidden
channels 50-200x the others), against the bf16 product with the unquantized weight, for:

- the engine's block-scaled e4m3 (memory/fp8.py, the current frozen-base storage);
- GGUF Q8_0, Q5_0, Q4_0, quantized by the gguf package (gguf.quants.quantize: the reference
  encoders, llama.cpp's reference rounding for these types), and the K / IQ4 types (Q6_K, Q5_K,
  Q4_K, IQ4_XS, IQ4_NL, Q3_K, Q2_K), which gguf 0.19 decodes but cannot encode, packed by
  tests/gguf_encoders.py (plain per-sub-block scales, round to nearest: llama.cpp's quantizer
  searches the scales, so a published file of these types errs somewhat less than its row says);
  all decoded by gguf.quants.dequantize as memory/gguf_storage.py decodes them in the forward
  (rounded once to bf16, product in fp32).

Run: python bench/gguf_accuracy.py [--tokens 256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from leantune.memory.fp8 import dequantize, quantize  # noqa: E402
from leantune.memory.gguf_storage import dequantize as gguf_dequantize  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_accuracy import flux_like_input, rel  # noqa: E402  (the same inputs and measure as the fp8 table)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_encoders import PLAIN_ENCODED, encode  # noqa: E402  (the K / IQ4 types' encoders)

Q = gguf.GGMLQuantizationType
TYPES = (Q.Q8_0, Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.Q4_K, Q.IQ4_XS, Q.IQ4_NL, Q.Q4_0, Q.Q3_K, Q.Q2_K)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    layers = {"mlp up 3072->12288": (3072, 12288), "mlp down 12288->3072": (12288, 3072)}
    errs: dict[str, list[float]] = {}
    bits = {"fp8 e4m3, 64-value scales": 8 + 32 / 64}                  # e4m3 + one fp32 scale per 64
    for i, o in layers.values():
        w = (torch.randn(o, i, generator=g) * (1 / i) ** 0.5).bfloat16()
        x = flux_like_input(a.tokens, i, g)
        ref = (x.float() @ w.float().t()).bfloat16()                   # bf16 weight, fp32 accumulate
        q, s = quantize(w)
        errs.setdefault("fp8 e4m3, 64-value scales", []).append(
            rel((x.float() @ dequantize(q, s, torch.bfloat16).float().t()).bfloat16(), ref))
        for t in TYPES:
            blocks = torch.from_numpy(encode(w.float().numpy(), t))
            wq = gguf_dequantize(blocks, int(t), torch.bfloat16)
            errs.setdefault(t.name, []).append(rel((x.float() @ wq.float().t()).bfloat16(), ref))
            values, nbytes = gguf.GGML_QUANT_SIZES[t]
            bits[t.name] = 8 * nbytes / values
    print(f"tokens {a.tokens}; relative error of the output against the bf16 product (lower is better)")
    print("| format | bits/weight | encoder | " + " | ".join(layers) + " |")
    print("|---" * (3 + len(layers)) + "|")
    for name, e in errs.items():
        encoder = ("leantune (memory/fp8.py)" if name.startswith("fp8") else
                   "plain (tests/gguf_encoders.py)" if Q[name] in PLAIN_ENCODED else "gguf package")
        print(f"| {name} | {bits[name]:.4g} | {encoder} | " + " | ".join(f"{v:.4%}" for v in e) + " |")


if __name__ == "__main__":
    main()
