"""The stored formats of a frozen base the search chooses between, and what each one costs.

`[memory] base_format = "auto"` lets the plan search store the frozen block Linears of a LoRA run
in block-scaled fp8 (memory/fp8.py), int8 ConvRot rows (memory/int8_storage.py) or NF4 rows
(memory/nf4_storage.py, where bitsandbytes imports), beside keeping them in the load dtype. Each
format is priced three ways:

- bytes: exactly, per Linear, as the storage module lays its rows out (weight_bytes.py: e4m3 plus
  an fp32 scale per 64 inputs; int8 codes plus one fp32 scale per row; NF4's packed nibbles plus an
  8-bit absmax code per 64 and each row's nested statistics, an fp32 scale per 256 codes and an
  fp32 offset), resident and in the streaming engine's packed units;
- compute: each use of a stored weight dequantizes it to the compute dtype. fp8's cost is what the
  activation probe measures (timing.py: the extra memory-bound traffic at HBM bandwidth). The other
  formats add their own traffic beyond fp8's 7 bytes per weight (fp8.py's CUDA path) and, for
  int8, the inverse rotation: a (groups x 256) by (256 x 256) fp32 matmul per row, 512 FLOP per
  weight. Counted from their dequantize code (below), not measured on a GPU: no GPU was at hand
  when these were written. fp32 matmuls are priced at FP32_SHARE of the machine's sustained bf16
  rate (an RTX 4090: 82.6 of 165 dense TFLOP/s; a data-centre card is slower than that relative
  to its tensor cores, an H100 about 1/15: measure before trusting int8's time there);
- quality: each format's output error against bf16 on a real-width Flux MLP with outlier input
  channels, measured by bench/quant_accuracy.py and bench/fp8_accuracy.py (docs/benchmarks.md);
  the worse of the two layers (up 3072->12288, down 12288->3072) is the format's error. "auto"
  chooses only among formats whose error is within `[memory] max_base_error` (percent; default
  fp8 e4m3's own error, so int8 (more accurate) is a choice and NF4 (3.7x e4m3's error) is not,
  until a user raises the bound). A pinned `[memory] base_format` is used whatever its error.

torch-free: `leantune plan --model` reads these without importing torch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

FP32_SHARE = 0.5            # fp32 matmul rate / sustained bf16 rate (assumed, see the module docstring)
FP8_DEQUANT_BYTES = 7.0     # HBM bytes per weight of fp8.dequantize on CUDA (fp8._dequantize_in_output)


@dataclass(frozen=True)
class BaseFormat:
    name: str
    label: str
    bits: float                 # stored bits per weight of a 3072-wide row (scales included)
    error: float                # % output error against bf16 (docs/benchmarks.md, the worse layer)
    dequant_bytes: float        # HBM bytes moved per weight by one dequantization
    dequant_flops: float        # fp32 FLOPs per weight of one dequantization
    transient_bytes: float      # device bytes per weight its dequantization holds at once (bf16 output included)


FORMATS: dict[str, BaseFormat] = {
    # e4m3 -> bf16 copy (1 read + 2 written), the scale product in place (2 + 2); the bf16 weight alone
    "fp8": BaseFormat("fp8", "fp8 e4m3", 8.5, 2.5248, FP8_DEQUANT_BYTES, 0.0, 2.0),
    # codes copied out of the rows (1 + 1), to fp32 (1 + 4), times the row scale (4 + 4), rotated
    # back per group of 256 (4 + 4, 2 x 256 FLOP), to bf16 (4 + 2); the fp32 product and its
    # rotation coexist with the codes (4 + 4 + 1), the bf16 result follows
    "int8": BaseFormat("int8", "int8 ConvRot", 8.01, 0.9798, 29.0, 512.0, 9.0),
    # the packed codes copied out of the rows (0.5 + 0.5), the nested absmax decoded and its offset
    # added (1 / 64 read, 4 / 64 written; 4 / 64 read and written: 13 / 64), bitsandbytes'
    # dequantize_4bit straight to bf16 (0.5 + 4 / 64 read + 2 written). Held at once: the bf16
    # weight, and beside it one chunk of rows' codes and statistics (nf4_storage.decode_rows,
    # decode_temporaries: 5 MiB for Flux's proj_out on CUDA), less than the two fp32 chunks (32 MiB) the
    # probe traces beside every fp8 decode (fp8.dequantize off CUDA): so nothing beyond fp8's
    # (tests/test_nf4.py). Bits of a 3072-wide row: 8 x 1592 / 3072.
    "nf4": BaseFormat("nf4", "NF4", 4.1458, 9.2343, 3.7656, 0.0, 2.0),
}
ORDER = ("fp8", "int8", "nf4")          # the simpler-plan order at equal time (search._shape)
DEFAULT_BOUND = FORMATS["fp8"].error    # [memory] max_base_error unset: within fp8 e4m3's error
ERROR_SOURCE = "docs/benchmarks.md (bench/quant_accuracy.py, bench/fp8_accuracy.py)"


def bitsandbytes_importable() -> bool:
    """Whether NF4 storage can run here: bitsandbytes is installed (its CPU and CUDA backends both
    quantize and dequantize; config.py refuses a pinned "nf4" without it the same way)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def auto_candidates(mode: str, adapter: str, allow_fp8: bool, base_adapters_plain: bool = True) -> tuple[str, ...]:
    """The formats "auto" prices for a run: fp8 always (where fp8 is allowed); int8 and NF4 for a
    LoRA, LoKr or LoHa (their updates never read the base rows: train/quantized_adapters.py), NF4
    where bitsandbytes imports. Not for a full fine-tune (the formats hold frozen weights only) and
    not for DoRA, which decodes each base Linear once more per forward for its row norms, a cost
    this module does not price yet (a pinned format trains DoRA as well)."""
    if not allow_fp8:
        return ()
    if mode != "lora" or adapter == "dora" or not base_adapters_plain:
        return ("fp8",)
    return ("fp8", "int8") + (("nf4",) if bitsandbytes_importable() else ())


def bound(max_base_error: float | None) -> float:
    """The error bound "auto" chooses within, in percent."""
    return DEFAULT_BOUND if max_base_error is None else float(max_base_error)


def within(name: str, max_base_error: float | None) -> bool:
    return FORMATS[name].error <= bound(max_base_error) + 1e-9


def dequant_extra_s(name: str, weights: int, hbm: float, flops: float) -> float:
    """Seconds one dequantization of `weights` stored weights costs beyond fp8's (which the probe
    prices): the format's extra traffic at HBM bandwidth and its fp32 FLOPs. Negative where the
    format's decode moves fewer bytes than fp8's (NF4: bitsandbytes' one kernel to bf16, 3.8 bytes
    a weight against fp8's copy and scale product, 7)."""
    f = FORMATS[name]
    return weights * ((f.dequant_bytes - FP8_DEQUANT_BYTES) / hbm + f.dequant_flops / (flops * FP32_SHARE))
