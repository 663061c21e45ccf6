"""Time `./scripts/demo.sh` as a newcomer runs it: the set-up phase and the demo run apart, on an
otherwise idle machine and under a load this bench makes itself.

Phases, each a child process timed for wall seconds and CPU seconds (user + system of its whole
process tree), with the machine's load average sampled every 5 s while it runs:

- setup, fresh: `scripts/setup.sh` into a throwaway venv under /tmp (LEANTUNE_VENV), as on a fresh
  clone: a venv, torch==2.13.0 (from whatever index pip is configured with), leantune and its
  runtime dependencies. The shared .venv is never touched. Skipped with --no-setup.
- setup, again: the same script once more (what every later `./scripts/demo.sh` pays).
- run: `scripts/demo.sh` (its set-up check, then `leantune demo`), with the fresh venv, or with
  .venv under --no-setup.

--load N starts N busy processes (pure Python loops, one core each) before the phases and ends
them after; each also ends by itself after --load-limit seconds, so none outlives a crashed bench.

    python bench/demo_time.py                      # fresh setup + run, idle
    python bench/demo_time.py --load 8             # the same at about load 8 more
    python bench/demo_time.py --no-setup [--family sd3]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUSY = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class LoadSampler:
    """The 1-minute load average every `every` seconds while a phase runs."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples, self._stop = every, [load()], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(load())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.samples.append(load())

    def describe(self) -> str:
        s = self.samples
        return f"load {min(s):.1f}-{max(s):.1f} (mean {sum(s) / len(s):.1f})"


def phase(name: str, argv: list[str], env: dict) -> dict:
    """Run one phase; its wall and CPU seconds and the load while it ran. Fails loudly."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with LoadSampler() as sampler:
        t0 = time.perf_counter()
        run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode:
        sys.stderr.write(run.stdout[-2000:] + run.stderr[-3000:])
        raise SystemExit(f"{name}: {' '.join(argv)} exited {run.returncode}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"name": name, "wall": wall, "cpu": cpu, "load": sampler.describe(), "stdout": run.stdout,
            "stderr": run.stderr}


def start_load(n: int, limit_s: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY, str(limit_s)]) for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="flux")
    p.add_argument("--no-setup", action="store_true", help="time the run alone, with .venv")
    p.add_argument("--load", type=int, default=0, metavar="N", help="busy processes to run meanwhile")
    p.add_argument("--load-limit", type=float, default=3600.0, metavar="S",
                   help="each busy process ends by itself after S seconds (default 3600)")
    p.add_argument("--keep-venv", action="store_true", help="leave the throwaway venv in place")
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    venv = None if args.no_setup else Path(tempfile.mkdtemp(prefix="leantune-demo-venv-"))
    if venv is not None:
        env["LEANTUNE_VENV"] = str(venv / "venv")
    print(f"commit {commit}, {os.cpu_count()} cores, load {load():.1f} before, {args.load} busy processes, "
          f"python {sys.version.split()[0]}, command: {' '.join(sys.argv)}", flush=True)
    busy = start_load(args.load, args.load_limit)
    out = tempfile.mkdtemp(prefix="leantune-demo-out-")
    try:
        if busy:
            time.sleep(30)       # the 1-minute load average catches up with the busy processes
        rows = []
        if venv is not None:
            rows.append(phase("setup, fresh", ["./scripts/setup.sh"], env))
            rows.append(phase("setup, again", ["./scripts/setup.sh"], env))
        rows.append(phase("run", ["./scripts/demo.sh", "--family", args.family, "--out", str(Path(out) / "demo")],
                          env))
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        shutil.rmtree(out, ignore_errors=True)
        if venv is not None and not args.keep_venv:
            shutil.rmtree(venv, ignore_errors=True)
    for r in rows:
        print(f"{r['name']:14} wall {r['wall']:7.1f} s  CPU {r['cpu']:7.1f} s  {r['load']}")
        for line in r["stderr"].splitlines():
            if line.startswith("setup"):
                print(f"    {line}")
    lines = rows[-1]["stdout"].splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("how the samples")), len(lines))
    print("\n".join(line for line in lines if line.startswith("demo finished")))
    print("\n".join(lines[start:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
