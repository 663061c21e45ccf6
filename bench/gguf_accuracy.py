"""GGUF block types' accuracy against bf16 on a real-width Flux block, on the CPU (issue 38).

What it measures, as bench/fp8_accuracy.py does for fp8: the relative error ||y - y_ref|| / ||y_ref||
of one Linear of Flux-dev's double block at full width (3072 -> 12288, the MLP up-projection, and
12288 -> 3072, the down-projection), inputs with Flux's per-channel outliers (1 in 512 hidden
channels 50-200x the others), against the bf16 product with the unquantized weight, for:

- the engine's block-scaled e4m3 (memory/fp8.py, the current frozen-base storage);
- GGUF Q8_0, Q5_0, Q4_0, quantized by the gguf package (gguf.quants.quantize: the reference
  encoders, llama.cpp's reference rounding for these types) and decoded by gguf.quants.dequantize,
  as memory/gguf_storage.py decodes them in the forward (rounded once to bf16, product in fp32).

Not measured: Q5_K and Q4_K. The gguf package decodes them but has no encoder (llama.cpp's C
quantizer, with its scale search, writes the community's files), and a plain min/max encoder would
misstate what those files lose.
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

TYPES = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q4_0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (i, o) in {"mlp up 3072->12288": (3072, 12288), "mlp down 12288->3072": (12288, 3072)}.items():
        w = (torch.randn(o, i, generator=g) * (1 / i) ** 0.5).bfloat16()
        x = flux_like_input(a.tokens, i, g)
        ref = (x.float() @ w.float().t()).bfloat16()                   # bf16 weight, fp32 accumulate
        q, s = quantize(w)
        errs = [rel((x.float() @ dequantize(q, s, torch.bfloat16).float().t()).bfloat16(), ref)]
        bits = [8 + 32 / 64]                                           # e4m3 + one fp32 scale per 64
        for t in TYPES:
            blocks = torch.from_numpy(gguf.quants.quantize(w.float().numpy(), t))
            wq = gguf_dequantize(blocks, int(t), torch.bfloat16)
            errs.append(rel((x.float() @ wq.float().t()).bfloat16(), ref))
            values, nbytes = gguf.GGML_QUANT_SIZES[t]
            bits.append(8 * nbytes / values)
        rows.append((name, errs))
    print(f"tokens {a.tokens}; relative error of the output against the bf16 product (lower is better)")
    names = ["fp8 e4m3, 64-value scales"] + [t.name for t in TYPES]
    print("| layer | " + " | ".join(f"{n} ({b:g} bits/weight)" for n, b in zip(names, bits)) + " |")
    print("|---" * (len(bits) + 1) + "|")
    for name, errs in rows:
        print(f"| {name} | " + " | ".join(f"{e:.4%}" for e in errs) + " |")


if __name__ == "__main__":
    main()
