"""How long `leantune plan --model flux-dev --vram 8GiB` takes from a fresh process, first and repeated.

The first plan of an architecture and workload builds the meta model and traces the activation
probes; the planner keeps what it measured (leantune/planner/spec_cache.py), and a repeated
`--model` question on a machine without a GPU prints its kept answer without importing torch
(leantune/planner/answer_cache.py). Each run is a fresh Python process with its
own cache folder; wall seconds and the child's CPU seconds (user + system, less sensitive to other
load on a shared machine) are reported, with `import torch` alone for reference.

    python bench/plan_startup.py [--runs 3] [--resolution 1024] [--vram 8GiB]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time


def timed(argv: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--vram", default="8GiB")
    args = p.parse_args()
    plan = [sys.executable, "-m", "leantune.cli", "plan", "--model", "flux-dev", "--resolution",
            str(args.resolution), "--vram", args.vram]
    rows = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "LEANTUNE_CACHE": cache, "HF_HUB_OFFLINE": "1"}
            rows.append(("import torch", *timed([sys.executable, "-c", "import torch"], env)))
            rows.append(("plan, first (measures)", *timed(plan, env)))
            rows.append(("plan, repeated (cached)", *timed(plan, env)))
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, {args.runs} runs, {args.resolution} px")
    print(f"{'':26}{'wall s (min/median)':>22}{'CPU s (min/median)':>22}")
    for name in dict.fromkeys(r[0] for r in rows):
        walls = sorted(r[1] for r in rows if r[0] == name)
        cpus = sorted(r[2] for r in rows if r[0] == name)
        mid = len(walls) // 2
        print(f"{name:26}{walls[0]:>11.2f}{walls[mid]:>11.2f}{cpus[0]:>11.2f}{cpus[mid]:>11.2f}")


if __name__ == "__main__":
    main()
