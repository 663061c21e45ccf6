"""Time `leantune demo` end to end, as a newcomer runs it: wall seconds, CPU seconds of the process,
peak RSS, and the machine's load average before and after (a shared machine's wall time says little
without it). Also prints the demo's own before -> after scores.

    python bench/demo_time.py                  # the Flux demo
    python bench/demo_time.py --family sd3     # the SD3.5 demo
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="flux")
    args = p.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        before = load()
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "leantune", "demo", "--family", args.family, "--out",
                              str(Path(tmp) / "demo")], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = load()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode:
        print(run.stderr[-3000:], file=sys.stderr)
        return run.returncode
    print(f"leantune demo --family {args.family}: wall {wall:.1f} s, CPU {usage.ru_utime + usage.ru_stime:.1f} s "
          f"(user {usage.ru_utime:.1f}, sys {usage.ru_stime:.1f}), peak RSS {usage.ru_maxrss / 2**20:.2f} GiB, "
          f"{os.cpu_count()} cores, load average {before} before, {after} after")
    lines = run.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("how the samples")), len(lines))
    print("\n".join(line for line in lines if line.startswith("demo finished")))
    print("\n".join(lines[start:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
