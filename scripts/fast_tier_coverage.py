"""Does the fast tier exercise every module of leantune? Measures it (issue 33's promise).

Runs, in .venv: (1) an import of every module under `coverage`, which gives the lines a module runs
just by being imported (definitions, constants); (2) the fast tier (`pytest --fast`, over the
pytest-xdist workers) under `coverage`. A module counts as exercised when the tier runs at least one
of its lines that importing it does not. Prints the tier's line coverage of leantune/ and every
module it leaves unexercised; exit status 1 if there is one.

    .venv/bin/python scripts/fast_tier_coverage.py            # about the tier's own time, plus coverage's
    .venv/bin/python scripts/fast_tier_coverage.py --all      # the whole suite instead of the tier
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
IMPORT_ALL = ("import importlib, pkgutil, leantune\n"
              "for m in pkgutil.walk_packages(leantune.__path__, 'leantune.'):\n"
              "    if not m.name.endswith('__main__'):\n"
              "        importlib.import_module(m.name)\n")


def _lines(report: Path, key: str = "executed_lines") -> dict[str, set[int]]:
    files = json.loads(report.read_text())["files"]
    return {os.path.relpath(os.path.abspath(f), ROOT): set(v[key]) for f, v in files.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--all", action="store_true", help="measure the whole suite instead of the fast tier")
    p.add_argument("--workers", default=str(len(os.sched_getaffinity(0))))
    args = p.parse_args()
    py = sys.executable
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "import_all.py").write_text(IMPORT_ALL)       # `coverage run` takes a file, not -c
        subprocess.run([py, "-m", "coverage", "run", f"--data-file={tmp}/imp", "--source=leantune",
                        str(tmp / "import_all.py")], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, check=True)
        subprocess.run([py, "-m", "coverage", "json", f"--data-file={tmp}/imp", "-o", str(tmp / "imp.json"), "-q"],
                       cwd=ROOT, env=env, check=True)
        tier = [] if args.all else ["--fast"]
        run = subprocess.run([py, "-m", "pytest", "-q", "-n", args.workers, "--dist", "loadgroup", *tier,
                              "--cov=leantune", f"--cov-report=json:{tmp}/tier.json", "-p", "no:cacheprovider"],
                             cwd=ROOT, env=env)
        imported, tier_lines = _lines(tmp / "imp.json"), _lines(tmp / "tier.json")
        beyond_import = _lines(tmp / "imp.json", "missing_lines")     # what only a call runs
        totals = json.loads((tmp / "tier.json").read_text())["totals"]
    # A module all of whose lines run at import (data, constants) has nothing more to exercise.
    idle = sorted(f for f, rest in beyond_import.items() if rest and not (tier_lines.get(f, set()) & rest))
    print(f"{'whole suite' if args.all else 'fast tier'}: line coverage of leantune/ {totals['percent_covered']:.1f}% "
          f"({totals['covered_lines']} of {totals['num_statements']}); pytest exit {run.returncode}")
    for f in idle:
        print(f"  not exercised beyond its import: {f}")
    print(f"{len(imported) - len(idle)} of {len(imported)} modules exercised")
    return 1 if idle or run.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
