"""Host RAM of streamed weights with several processes: one shared copy vs one copy per process.

Each process builds the same wide real-class Flux (width 1024, 1 double + N single blocks, bf16,
every page touched: tiny.wide_flux_transformer), streams every block as a LoRA run does, and
reports its resident set (VmRSS) and proportional set (Pss: a page shared by k processes counts
1/k in each). RSS counts a shared page in full in every process, so the machine's cost is the sum
of Pss; both are printed.

    python bench/shared_host_rss.py                      # 1 process, 2 private, 2 shared
    python bench/shared_host_rss.py --single 16          # a bigger model
    python bench/shared_host_rss.py --load               # the machine's peak while 2 and 4 processes load:
                                                         # at once vs in turns ([distributed] load_in_turns)

The loading peak is sampled from outside: this script reads every worker's Pss and RSS every
10 ms while they build the model and pack its streamed blocks, and reports the largest sum.

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


def worker(single: int, share: bool, out: str, turns: bool = False) -> None:
    import torch.distributed as dist

    from leantune.distributed import DistContext
    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan
    from leantune.memory.host_buffers import return_freed_host_memory
    from leantune import tiny
    from leantune.models.flux import FLUX_SPEC

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    ctx = DistContext(rank=int(os.environ.get("RANK", 0)), world_size=world,
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                      local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                      strategy="ddp", backend="gloo")
    cfg = SimpleNamespace(distributed=SimpleNamespace(share_host_weights=share))
    shared = ctx.shared_host(cfg.distributed.share_host_weights, "lora")

    def load():                       # "loading": the whole model in this process, then packed
        model = tiny.wide_flux_transformer(n_single=single)
        names = [n for n, _ in FLUX_SPEC.blocks(model)]
        handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(names)), "cpu", host_buffers=shared)
        return_freed_host_memory()
        return model, handle

    if turns:                         # as the trainer does with [distributed] load_in_turns
        model, handle = ctx.local_turns(load, shared)
    else:                             # every process loads at once; packing leader first
        model = tiny.wide_flux_transformer(n_single=single)
        names = [n for n, _ in FLUX_SPEC.blocks(model)]
        handle = ctx.local_main_first(lambda: apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(names)),
                                                           "cpu", host_buffers=shared), shared)
        return_freed_host_memory()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
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


def run(n: int, share: bool, single: int, turns: bool = False) -> tuple[list[dict], dict]:
    """Per-rank steady numbers, and the peak sums of Pss / RSS over the run sampled every 10 ms."""
    import time

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
               "--worker", "--single", str(single), "--out", out] + (["--share"] if share else []) + \
              (["--turns"] if turns else [])
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peak = {"pss_mib": 0.0, "rss_mib": 0.0}
        while launcher.poll() is None:
            workers = _children(launcher.pid)
            pss = sum(_proc_kib_or_0("Pss", f"/proc/{p}/smaps_rollup") for p in workers) / 1024
            rss = sum(_proc_kib_or_0("VmRSS", f"/proc/{p}/status") for p in workers) / 1024
            peak = {"pss_mib": max(peak["pss_mib"], pss), "rss_mib": max(peak["rss_mib"], rss)}
            time.sleep(0.01)
        if launcher.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({launcher.returncode})")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(n)], peak


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _proc_kib_or_0(field: str, path: str) -> int:
    try:
        return _proc_kib(field, path)
    except OSError:                   # the process ended between listing and reading
        return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--single", type=int, default=16)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--share", action="store_true")
    ap.add_argument("--turns", action="store_true")
    ap.add_argument("--load", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args.single, args.share, args.out, args.turns)
    if args.load:
        print("| processes (shared host copy) | loading | model (MiB, per process) | peak sum of Pss (machine, MiB) | "
              "peak sum of RSS (MiB) | steady sum of Pss (MiB) |")
        print("|---|---|---|---|---|---|")
        for n, turns in ((1, False), (2, False), (2, True), (4, False), (4, True)):
            ranks, peak = run(n, True, args.single, turns)
            what = "-" if n == 1 else ("in turns" if turns else "at once")
            print(f"| {n} | {what} | {ranks[0]['model_mib']:.0f} | {peak['pss_mib']:.0f} | {peak['rss_mib']:.0f} | "
                  f"{sum(r['pss_mib'] for r in ranks):.0f} |")
        return
    print("| processes | host copy | model / streamed (MiB, per process) | RSS per rank (MiB) | sum of RSS | "
          "sum of Pss (machine) |")
    print("|---|---|---|---|---|---|")
    for n, share in ((1, False), (2, False), (2, True)):
        ranks, _ = run(n, share, args.single)
        rss = [r["rss_mib"] for r in ranks]
        pss = sum(r["pss_mib"] for r in ranks)
        what = "shared" if share else ("private" if n > 1 else "-")
        print(f"| {n} | {what} | {ranks[0]['model_mib']:.0f} / {ranks[0]['streamed_mib']:.0f} | "
              f"{' + '.join(f'{v:.0f}' for v in rss)} | {sum(rss):.0f} | {pss:.0f} |")


if __name__ == "__main__":
    main()
