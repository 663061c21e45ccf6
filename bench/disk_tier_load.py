"""Peak host RSS and page-cache growth of a transformer load with and without loading straight into
the disk tier (memory/disk_load.py; issue 39).

A real-class Flux at width 1024 (tiny.wide_flux_transformer: 1 double + N single blocks, bf16) is
written once as a diffusers transformer folder; each measurement runs in a fresh subprocess, which
loads it through the loader every family ends in (models/weights.load_into_empty), then applies
the engine (every block streamed, the disk-tier ones packed into the disk tier's file). Reported
per phase: the process's peak resident set above what it held before the load (VmHWM, reset with
/proc/self/clear_refs before the load), and the pages of the checkpoint file and of the loading
file left in the page cache (mincore), the checkpoint's pages dropped before each run.

    .venv/bin/python bench/disk_tier_load.py [--single 24] [--dir /path/on/the/disk]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")     # VmHWM := VmRSS


def _child(folder: Path, disk_dir: str | None, on_disk: float) -> dict:
    import torch

    from leantune.memory.disk_load import BlockSpill
    from leantune.memory.disk_tier import _drop_cache, cached_pages
    from leantune.memory.engine import apply_memory
    from leantune.memory.host_buffers import return_freed_host_memory
    from leantune.memory.plan import Plan
    from leantune.models import component_loading as cl
    from leantune.models.flux import FLUX_SPEC
    from leantune.models.weights import build_empty, load_into_empty, parking

    torch.set_num_threads(2)
    from diffusers import FluxTransformer2DModel

    config, files, ops = cl.diffusers_folder(folder, ("FluxTransformer2DModel",), "Flux transformer")
    shard = files.paths[0]
    fd = os.open(shard, os.O_RDONLY)
    _drop_cache(fd, 0, 0)
    model = build_empty(lambda: FluxTransformer2DModel.from_config(config))
    names = [n for n, _ in FLUX_SPEC.blocks(model)]
    count = round(on_disk * len(names))
    disk = tuple(names[i] for i in range(len(names)) if count and i % max(1, len(names) // count) == 0)[:count]
    spill = BlockSpill(disk_dir, disk) if disk_dir and disk else None
    return_freed_host_memory()
    before = _status("VmRSS")
    _reset_peak()
    with parking(spill) if spill is not None else _null():
        load_into_empty(model, files, ops, what="a Flux transformer", dtype=torch.bfloat16)
    out = {"blocks": len(names), "disk_blocks": len(disk),
           "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           "load_peak": _status("VmHWM") - before,
           "load_rss_after": _status("VmRSS") - before,
           "source_cached_after_load": cached_pages(fd) * 4096,
           "spill_cached_after_load": spill.cached_pages() * 4096 if spill else 0}
    model.requires_grad_(False)                       # a LoRA run's frozen base
    plan = Plan(streamed_blocks=tuple(names), ring_slots=2, disk_blocks=disk if disk_dir else ())
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu", **({"disk_dir": disk_dir, "parked": spill} if disk_dir else {}))
    return_freed_host_memory()
    out.update(pack_peak=_status("VmHWM") - before, rss_after_pack=_status("VmRSS") - before,
               host_bytes=handle.streaming.host_bytes, disk_bytes=handle.streaming.disk_bytes,
               spill_cached_after_pack=spill.cached_pages() * 4096 if spill else 0)
    if spill is not None:
        spill.close()
    handle.release()
    os.close(fd)
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _write_model(folder: Path, single: int) -> None:
    from leantune.tiny import wide_flux_transformer

    wide_flux_transformer(n_single=single).save_pretrained(folder, safe_serialization=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--single", type=int, default=24, help="single blocks of the width-1024 Flux")
    ap.add_argument("--dir", default=None, help="where the model and the disk tier's files go (default: a temp dir)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        folder, disk_dir, on_disk = args.child
        print(json.dumps(_child(Path(folder), None if disk_dir == "-" else disk_dir, float(on_disk))))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "transformer"
        _write_model(folder, args.single)
        tier = Path(tmp) / "tier"
        tier.mkdir()
        rows = []
        for label, disk_dir, frac in (("whole load, all blocks in RAM", "-", 0.0),
                                      ("disk tier, half the blocks", str(tier), 0.5),
                                      ("disk tier, every block", str(tier), 1.0)):
            r = subprocess.run([sys.executable, __file__, "--child", str(folder), disk_dir, str(frac)],
                               capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                raise SystemExit(f"{label}: the measuring process failed:\n{r.stderr[-3000:]}")
            rows.append((label, json.loads(r.stdout.strip().splitlines()[-1])))
    mib = lambda n: f"{n / 2**20:.0f}"                                        # noqa: E731
    print(f"model: {rows[0][1]['blocks']} blocks, {mib(rows[0][1]['model_bytes'])} MiB (bf16)\n")
    print("| load | blocks on disk | peak RSS during load (MiB) | RSS after load | checkpoint pages cached "
          "after load | loading file cached | peak RSS through packing | streamed in RAM / on disk |")
    print("|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['disk_blocks']} | {mib(r['load_peak'])} | {mib(r['load_rss_after'])} | "
              f"{mib(r['source_cached_after_load'])} | {mib(r['spill_cached_after_load'])} | {mib(r['pack_peak'])} | "
              f"{mib(r['host_bytes'])} / {mib(r['disk_bytes'])} |")


if __name__ == "__main__":
    main()
