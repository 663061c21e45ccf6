"""Host memory that pinning a stock model's streamed blocks locks, three ways (CPU only, no weights).

Issue 34 reports a 16 GB machine running out of memory pinning Krea 2's 28 blocks: 11.3 GB of
weights became 16.6 GB locked, because pinning each tensor through torch's caching host allocator
(`tensor.pin_memory()`) rounds every allocation up to a power of two. This prints, per block of a
stock architecture (built on meta from models/configs/, the block's frozen tensors as the
streaming engine lays them out: memory/streaming_units.layout_unit):

- the tensors' bytes;
- what leantune's engine registers: one page-aligned buffer per block (memory/host_buffers.py
  alloc_host, cudaHostRegister of the unit rounded up to whole pages, one spare page allocated);
- what pinning each tensor with torch would reserve (memory/pinned_sizes.caching_host_size);
- what one torch-pinned buffer per block would reserve;

and the totals over the model's blocks, in the storage dtype given (bf16, or fp8: the block
Linears in e4m3 with their per-row scales, memory/fp8.py).

    python bench/pinned_overhead.py --model krea2 [--fp8]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    from leantune.family_registry import stock_models
    from leantune.memory.host_buffers import PAGE
    from leantune.memory.pinned_sizes import caching_host_size
    from leantune.memory.streaming_units import ALIGN, layout_unit
    from leantune.models.family import get_family
    from leantune.planner.meta import build_meta_packaged

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="krea2", choices=sorted(stock_models()))
    p.add_argument("--fp8", action="store_true", help="the block Linears stored in e4m3 (memory/fp8.py)")
    args = p.parse_args()
    family_name, stock = stock_models()[args.model]
    family = get_family(family_name)
    model = build_meta_packaged(family_name, stock.config).to(torch.bfloat16).requires_grad_(False)
    if args.fp8:
        from leantune.memory.fp8 import apply_fp8_storage

        apply_fp8_storage(model, family.spec)
    blocks = family.spec.blocks(model)
    totals = dict.fromkeys(("tensors", "leantune", "per_tensor", "per_block"), 0)
    for name, block in blocks:
        tensors = list({id(t): t for t in [*block.parameters(), *block.buffers()]}.values())
        raw = sum(t.numel() * t.element_size() for t in tensors)
        _, _, nbytes, _ = layout_unit([block], name)
        totals["tensors"] += raw
        totals["leantune"] += -(-max(nbytes, ALIGN) // PAGE) * PAGE
        totals["per_tensor"] += sum(caching_host_size(t.numel() * t.element_size()) for t in tensors)
        totals["per_block"] += caching_host_size(nbytes)
    gib = 2**30
    print(f"{args.model}: {len(blocks)} blocks, {'fp8' if args.fp8 else 'bf16'} storage")
    for key, label in (("tensors", "the blocks' tensors"), ("leantune", "leantune (one registered buffer per block)"),
                       ("per_tensor", "torch pin_memory() per tensor"), ("per_block", "torch pin_memory() per block")):
        extra = totals[key] / totals["tensors"] - 1
        print(f"  {label:45s} {totals[key] / gib:8.3f} GiB  ({extra:+.2%})")


if __name__ == "__main__":
    main()
