"""Decode rate of GGUF blocks: leantune's torch decoder (memory/gguf_decode.py) beside the gguf
package's numpy one (gguf.quants.dequantize), per block type, on one weight of real width.

Reports, per type, the best of --repeat decodes of an (--out x --in) weight to fp32, as GB/s of
stored bytes (the blocks read) and ms per weight; on CUDA also the device bytes the torch decode
allocated above its fp32 output (the tile bound of gguf_decode.TILE_VALUES at work), and whether
the CUDA decode equals the CPU reference (every bit off NaN; NaN where it is NaN).

    python bench/gguf_decode_rate.py                               # CPU, Q8_0 and Q4_K, 3072 x 12288
    python bench/gguf_decode_rate.py --types all --device cuda     # every type, on the GPU

The blocks are random bytes (every fp16 scale pattern, NaN and inf included): decode time does
not depend on the values (no branch reads them), only IQ4's table lookups read codes as indices.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import gguf
import numpy as np
import torch

from leantune.memory import gguf_decode

NAMES = {gguf.GGMLQuantizationType(t).name: t for t in gguf_decode.SIZES}


def _best(fn, repeat: int, sync) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_K"], help="type names, or all")
    ap.add_argument("--out", type=int, default=3072, help="rows (output features)")
    ap.add_argument("--in", dest="inp", type=int, default=12288, help="values per row (input features)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy reference's timing")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    types = list(NAMES) if args.types == ["all"] else args.types
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rng = np.random.default_rng(0)
    rows = []
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), "
          f"torch threads {torch.get_num_threads()}, weight {args.out} x {args.inp}")
    print("| type | stored MB | torch ms | torch GB/s | numpy ms | numpy GB/s | torch / numpy |"
          + (" extra MiB | equal |" if dev.type == "cuda" else ""))
    for name in types:
        qtype = NAMES[name]
        values, nbytes = gguf_decode.SIZES[qtype]
        raw_np = rng.integers(0, 256, size=(args.out, args.inp // values * nbytes), dtype=np.uint8)
        raw = torch.from_numpy(raw_np).to(dev)
        stored = raw_np.nbytes
        gguf_decode.dequantize(raw, qtype)                               # warm-up
        t_torch = _best(lambda: gguf_decode.dequantize(raw, qtype), args.repeat, sync)
        row = dict(type=name, stored_bytes=stored, torch_s=t_torch, torch_gbs=stored / t_torch / 1e9)
        line = f"| {name} | {stored / 1e6:.1f} | {t_torch * 1e3:.1f} | {row['torch_gbs']:.2f} |"
        want = None
        if not args.no_numpy or dev.type == "cuda":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                want = gguf.quants.dequantize(raw_np, gguf.GGMLQuantizationType(qtype))
                t_np = time.perf_counter() - t0
                if not args.no_numpy:
                    t_np = min([t_np] + [_best(lambda: gguf.quants.dequantize(raw_np, gguf.GGMLQuantizationType(qtype)),
                                               1, lambda: None) for _ in range(args.repeat - 1)])
            if not args.no_numpy:
                row.update(numpy_s=t_np, numpy_gbs=stored / t_np / 1e9)
                line += f" {t_np * 1e3:.1f} | {row['numpy_gbs']:.2f} | {t_np / t_torch:.2f}x |"
            else:
                line += " - | - | - |"
        else:
            line += " - | - | - |"
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            got = gguf_decode.dequantize(raw, qtype)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated(dev) - base - got.numel() * got.element_size()
            ref = torch.from_numpy(want)
            g = got.cpu()
            nan = torch.isnan(ref)
            equal = bool(torch.equal(torch.isnan(g), nan)
                         and torch.equal(g.view(torch.int32)[~nan], ref.view(torch.int32)[~nan]))
            row.update(extra_bytes=int(extra), equal=equal)
            line += f" {extra / 2**20:.0f} | {equal} |"
            del got, g
        print(line, flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(dev), out=args.out, inp=args.inp, threads=torch.get_num_threads(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
