"""Predicted plans with the disk tier for the full-size Flux-dev and FLUX.2-dev LoRAs (issue 39):
host-RAM budgets of 16 and 32 GiB against 64 GiB, the three tiers and the step time, at a disk
rate measured here and at a given NVMe rate. Predictions only (no GPU, no weights: the planner on
the meta-built stock architectures with its assumed GPU rates), printed as markdown tables for
docs/benchmarks.md.

Two rows per budget:
- "today": `Planner.plan` as `leantune plan --disk-dir/--disk-read` answers it: the host peak is
  the largest phase; the disk-tier blocks load straight into the disk tier (memory/disk_load.py),
  the resident and RAM-tier blocks through host RAM.
- "steps only": the same search with the host peak taken over the steps alone (and previews):
  what the disk tier buys and costs in the steps, whatever the load.

    python bench/disk_tier_plans.py [--disk-dir DIR] [--nvme 3.5]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GiB = 2**30
MODELS = (("flux-dev", "12GiB"), ("flux2-dev", "24GiB"))
BUDGETS = ("16GiB", "32GiB", "64GiB")


def _planner_classes():
    from leantune.planner.host_model import HOST_BASELINE
    from leantune.planner.search import Planner

    class StepsOnly(Planner):
        """The planner with the host peak over the steps (and previews) alone."""

        def host(self, plan, phases=None):
            ph: dict = {}
            out = dict(super().host(plan, ph))
            out["peak"] = HOST_BASELINE + max(ph["steps"], ph["previewing"])
            if phases is not None:
                phases.update(ph)
            return out

    return Planner, StepsOnly


def _measured(name: str):
    from leantune.commands.plan import MODEL_FAMILY, MODELS as CONFIGS, TEXT_TOKENS
    from leantune.models.family import get_family
    from leantune.planner.meta import build_meta_packaged
    from leantune.planner.spec_cache import load_measured, measure_model, save_measured, source_key
    from leantune.planner.workload import Workload

    family = get_family(MODEL_FAMILY[name])
    workload = Workload(mode="lora", rank=16, targets="attention_mlp", buckets=((1024, 1024),),
                        text_length=family.text_rows(TEXT_TOKENS[name]), quantizes_on_load=True)
    source = source_key(f"packaged:{CONFIGS[name]}", "bf16")
    measured = load_measured(source, workload)
    if measured is None:
        measured = measure_model(family.spec, build_meta_packaged(family.name, CONFIGS[name]), workload)
        save_measured(source, workload, measured)
    return family.spec, measured, workload


def _row(kind: str, budget: str, plan, error) -> str:
    if plan is None:
        need = f"{error.needed_ram / GiB:.1f} GiB" if getattr(error, "needed_ram", None) else "?"
        return f"| {budget} | {kind} | refused: the load needs {need} of host RAM | | | | | |"
    n = plan.notes
    t = n["tiers"]
    cost = (f"+{n['disk_exposed_s']:.2f} s ({n['disk_bytes_per_step'] / 1e9:.1f} GB read)" if plan.disk_blocks
            else "none")
    return (f"| {budget} | {kind} | {plan.describe()} | {t['VRAM'] / GiB:.1f} / {t['host RAM'] / GiB:.1f} / "
            f"{t['disk'] / GiB:.1f} | {n['predicted_peak_host'] / GiB:.1f} | {n['predicted_step_s']:.2f} s | "
            f"{n['step_s_in_ram']:.2f} s | {cost} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--disk-dir", default=None, help="measure this folder's disk (planner/disk_rate.py)")
    ap.add_argument("--nvme", type=float, default=3.5, help="a given NVMe read rate, GB/s")
    args = ap.parse_args()
    from leantune.planner.machine import assumed_machine, with_disk
    from leantune.planner.workload import Budget, InfeasibleBudget

    disks = []
    if args.disk_dir:
        from leantune.planner.disk_rate import disk_read_rate

        rate = disk_read_rate(args.disk_dir)
        disks.append((f"this machine's disk, {rate.read / 1e9:.2f} GB/s measured", with_disk(assumed_machine(), rate.read, rate.describe())))
    disks.append((f"an NVMe drive, {args.nvme:.1f} GB/s given", with_disk(assumed_machine(), args.nvme * 1e9, "given")))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"predicted {datetime.date.today()}, commit {commit}: python bench/disk_tier_plans.py "
          + (f"--disk-dir {args.disk_dir} " if args.disk_dir else "") + f"--nvme {args.nvme}\n")
    Planner, StepsOnly = _planner_classes()
    from leantune.config import parse_size

    for name, vram in MODELS:
        spec, measured, workload = _measured(name)
        for label, machine in disks:
            print(f"#### {name}, LoRA r16 attention_mlp, 1024x1024, VRAM {vram}; disk: {label}\n")
            print("| host RAM | host peak priced | plan | tiers GiB (VRAM / host RAM / disk) | host peak GiB | "
                  "step | step with those blocks in RAM | disk cost per step |")
            print("|---|---|---|---|---|---|---|---|")
            today, steps = Planner(spec, measured, workload, machine), StepsOnly(spec, measured, workload, machine)
            for budget in BUDGETS:
                for kind, planner in (("today (load phase included)", today), ("steps only (load into the tiers)", steps)):
                    try:
                        plan, error = planner.plan(Budget(vram=parse_size(vram), ram=parse_size(budget))), None
                    except InfeasibleBudget as e:
                        plan, error = None, e
                    print(_row(kind, budget, plan, error))
            print()


if __name__ == "__main__":
    main()
