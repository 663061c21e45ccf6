"""How long `leantune plan --model flux-dev --vram 8GiB` takes from a fresh process, first and repeated.

A first plan of a stock model at the default flags (512 or 1024 px) reads the package's shipped
profile (leantune/planner/profiles/); a first plan of another workload (--new-resolution, default
768 px) builds the meta model and traces the activation probes. The planner keeps what it
measured (leantune/planner/spec_cache.py), and a repeated
`--model` question on a machine without a GPU prints its kept answer without importing torch
(leantune/planner/answer_cache.py). Each run is a fresh Python process with its
own cache folder; wall seconds and the child's CPU seconds (user + system, less sensitive to other
load on a shared machine) are reported, with `import torch` alone for reference.

A first plan of a LoRA at another rank (--ranks) prices the adapters from the same profile
(ActivationProfile.at_rank); a first full fine-tune plan reads the shipped optimizer-step bytes
(planner/step_bytes.py) and times this machine's CPU optimizer rate. A plan whose answer is
infeasible (rank 100000 at 8 GiB) still counts: it is a full answer.

    python bench/plan_startup.py [--runs 3] [--model flux-dev] [--resolution 1024] [--vram 8GiB] [--ranks 64,100000]
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
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1):     # 1: an infeasible budget, a complete answer
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--new-resolution", type=int, default=768, help="a workload with no shipped profile")
    p.add_argument("--vram", default="8GiB")
    p.add_argument("--model", default="flux-dev")
    p.add_argument("--ranks", default="64,100000", help="LoRA ranks other than the shipped profiles' 16")
    args = p.parse_args()

    def plan(*flags: str, res: int | None = None) -> list[str]:
        return [sys.executable, "-m", "leantune.cli", "plan", "--model", args.model, "--resolution",
                str(res or args.resolution), "--vram", args.vram, *flags]

    questions = [("plan lora, first (shipped profile)", plan("--mode", "lora"), True),
                 ("plan lora, repeated (kept answer)", plan("--mode", "lora"), False),
                 ("plan full, first (shipped profile)", plan("--mode", "full"), True)]
    questions += [(f"plan lora --rank {r}, first", plan("--mode", "lora", "--rank", r), True)
                  for r in args.ranks.split(",") if r]
    questions.append((f"plan lora, first at {args.new_resolution} px (measures)",
                      plan("--mode", "lora", res=args.new_resolution), True))
    rows = []
    loads = [os.getloadavg()[0]]
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as root:
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "LEANTUNE_CACHE": os.path.join(root, "cache")}
            rows.append(("import torch", *timed([sys.executable, "-c", "import torch"], env)))
            for i, (name, argv, fresh) in enumerate(questions):
                if fresh:        # an empty cache: nothing measured or kept by the questions before
                    env = {**env, "LEANTUNE_CACHE": os.path.join(root, f"cache{i}")}
                rows.append((name, *timed(argv, env)))
        loads.append(os.getloadavg()[0])
    print(f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores, {args.runs} runs, "
          f"{args.model} {args.resolution} px --vram {args.vram}, command: {' '.join(sys.argv)}")
    print(f"{'':44}{'wall s (min/median)':>22}{'CPU s (min/median)':>22}")
    for name in dict.fromkeys(r[0] for r in rows):
        walls = sorted(r[1] for r in rows if r[0] == name)
        cpus = sorted(r[2] for r in rows if r[0] == name)
        mid = len(walls) // 2
        print(f"{name:44}{walls[0]:>11.2f}{walls[mid]:>11.2f}{cpus[0]:>11.2f}{cpus[mid]:>11.2f}")


if __name__ == "__main__":
    main()
