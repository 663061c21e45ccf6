"""Measure the stock architectures and write the planner's shipped profiles (leantune/planner/profiles/).

Each profile is what `leantune plan --model M [--mode X] --resolution R` measures (the weights per
block and the activation probes: planner/spec_cache.py) at the default flags, so a first plan of a
stock model answers without building the model or tracing it; and the optimizer update's
temporaries per setting (planner/step_bytes.py), so a first full fine-tune plan runs no update. Run it after changing the measuring
code (spec_cache._MEASURING_CODE, step_bytes._STEP_CODE) or the torch/diffusers/peft versions: tests/test_plan_profiles.py
fails until then, and the planner meanwhile measures afresh instead of using a stale profile.
Profiles of another code version are removed.

    python scripts/make_plan_profiles.py            # about 2-4 CPU-minutes
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("lora", "full", "inference")
RESOLUTIONS = (1024, 512)


def questions() -> list[list[str]]:
    """The `leantune plan` flags whose measurements are shipped."""
    from leantune.commands.plan import MODELS

    return [["--model", model, "--mode", mode, "--resolution", str(res), "--vram", "8GiB"]
            for model in sorted(MODELS) for mode in MODES for res in RESOLUTIONS]


def question_of(flags: list[str]):
    """(spec, source, build, workload) of a `leantune plan` question, exactly as the command sees it."""
    from leantune.commands.plan import _from_flags, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    return _from_flags(parser.parse_args(flags))


def main() -> int:
    from leantune.planner import step_bytes
    from leantune.planner.spec_cache import SHIPPED_DIR, measure_model, ship_measured

    t0 = time.process_time()
    path = step_bytes.ship()
    print(f"optimizer step bytes, {len(step_bytes.every_setting())} settings: {path.name} "
          f"({time.process_time() - t0:.1f} CPU-s)", flush=True)
    written = set()
    for flags in questions():
        spec, source, build, workload = question_of(flags)
        t0 = time.process_time()
        # A fresh meta model per question, as the command builds it (a probe may change the model it traces).
        path = ship_measured(source, workload, measure_model(spec, build(), workload))
        written.add(path.name)
        print(f"{' '.join(flags)}: {path.name} ({path.stat().st_size} bytes, {time.process_time() - t0:.1f} CPU-s)",
              flush=True)
    for old in SHIPPED_DIR.glob("*.json.gz"):
        if old.name not in written:
            old.unlink()
            print(f"removed {old.name} (another code version)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
