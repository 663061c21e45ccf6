"""Host RAM of streamed weights with several processes: one shared copy vs one copy per process.

Each process builds the same wide real-class Flux (width 1024, 1 double + N single blocks, bf16,
every page touched: tiny.wide_flux_transformer), streams every block as a LoRA run does, and
reports its resident set (VmRSS) and proportional set (Pss: a page shared by k processes counts
1/k in each). RSS counts a shared page in full in every process, so the machine's cost is the sum
of Pss; both are printed.

    python bench/shared_host_rss.py                      # 1 process, 2 private, 2 shared
    python bench/shared_host_rss.py --single 16          # a bigger model

Runs on CPU (gloo, torchrun); the numbers are host RAM, which the GPU does not change (pinning
registers the same pages, it does not copy them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _proc_kib(field: str, path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def worker(single: int, share: bool, out: str) -> None:
    import torch.distributed as dist

    from leantune.distributed import DistContext
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.memory.streaming import return_freed_host_memory
    from leantune.models import tiny
    from leantune.models.flux import FLUX_SPEC

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    ctx = DistContext(rank=int(os.environ.get("RANK", 0)), world_size=world,
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                      local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                      strategy="ddp", backend="gloo")
    model = tiny.wide_flux_transformer(n_single=single)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    names = [n for n, _ in FLUX_SPEC.blocks(model)]
    cfg = SimpleNamespace(distributed=SimpleNamespace(share_host_weights=share))
    shared = ctx.shared_host(cfg, "lora")
    handle = ctx.local_main_first(lambda: apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(names)), "cpu",
                                                       host_buffers=shared), shared)
    return_freed_host_memory()
    for u in handle.streaming.units:          # read every page, as a step's copies to the GPU do
        int(u.host[::4096].sum())
    ctx.barrier()
    x = {"rank": ctx.rank, "model_mib": model_bytes / 2**20,
         "streamed_mib": handle.streaming.host_bytes / 2**20,
         "rss_mib": _proc_kib("VmRSS", "/proc/self/status") / 1024,
         "pss_mib": _proc_kib("Pss", "/proc/self/smaps_rollup") / 1024}
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(x))
    ctx.barrier()                     # every rank measured while all mappings were alive
    if world > 1:
        dist.destroy_process_group()


def run(n: int, share: bool, single: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               "--worker", "--single", str(single), "--out", out] + (["--share"] if share else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--single", type=int, default=16)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--share", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args.single, args.share, args.out)
    print("| processes | host copy | model / streamed (MiB, per process) | RSS per rank (MiB) | sum of RSS | "
          "sum of Pss (machine) |")
    print("|---|---|---|---|---|---|")
    for n, share in ((1, False), (2, False), (2, True)):
        ranks = run(n, share, args.single)
        rss = [r["rss_mib"] for r in ranks]
        pss = sum(r["pss_mib"] for r in ranks)
        what = "shared" if share else ("private" if n > 1 else "-")
        print(f"| {n} | {what} | {ranks[0]['model_mib']:.0f} / {ranks[0]['streamed_mib']:.0f} | "
              f"{' + '.join(f'{v:.0f}' for v in rss)} | {sum(rss):.0f} | {pss:.0f} |")


if __name__ == "__main__":
    main()
