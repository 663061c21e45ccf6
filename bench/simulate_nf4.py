"""Flux.1-dev LoRA 1024² on an NF4 base on the simulated GPU (issue 38): the planner's plans priced
and run on fake tensors, the NF4 rows held as the loader leaves them (nf4_storage.fill_nf4 on meta:
uint8 rows of the stored shape, each Linear dequantized by bitsandbytes' own ops in its forward and
backward, which run on fake tensors through their registered fake kernels).

    python bench/simulate_nf4.py --budget 8 --plans chosen resident-split --out bench/results/simulate_nf4_flux_8gib.json

`chosen`: the planner's plan with [memory] base_format = "nf4" pinned; `resident-split` / `resident`:
NF4 with nothing streamed, offload checkpointing, split blocks or not (priced by the same planner).
LoRA r16 attention_mlp, adamw8bit, fp8 (here NF4) modulation on, 64 GiB host RAM, as
`leantune plan --model flux-dev --resolution 1024 --vram 8GiB --ram 64GiB --fp8-modulation on
--optimizer adamw8bit --base-format nf4`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=8.0, help="GiB")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--plans", nargs="+", default=["chosen", "resident-split"],
                   choices=["chosen", "resident-split", "resident"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from leantune.memory.simulated import enable

    enable()
    import torch
    from torch import nn

    from leantune.config import validate
    from leantune.memory import nf4_storage
    from leantune.memory.plan import Plan
    from leantune.models.family import get_family
    from leantune.planner.corrections import Calibration
    from leantune.planner.from_config import workload_from_config
    from leantune.planner.machine import assumed_machine
    from leantune.planner.search import Planner
    from leantune.planner.workload import Budget
    from leantune.simulated_run import CASE_RAM_BUDGET, meta_model, simulate_training
    from leantune.train.modes import make_mode

    budget = int(args.budget * GiB)
    family = get_family("flux")
    spec = family.spec
    cfg = validate({"model": {"path": "unused", "family": "flux"},
                    "data": {"datasets": [{"path": "unused"}], "resolutions": [1024]},
                    "train": {"mode": "lora", "optimizer": "adamw8bit"}, "lora": {"rank": args.rank},
                    "memory": {"vram_budget": f"{budget}B", "ram_budget": f"{CASE_RAM_BUDGET}B",
                               "base_format": "nf4", "fp8_modulation": True}})

    def nf4_model():
        model = meta_model("flux-dev")
        for name in sorted(nf4_storage.nf4_block_weights(model, spec, modulation=True)):
            module = model.get_submodule(name[: -len(".weight")])
            raw = torch.empty(module.out_features, nf4_storage.row_bytes(module.in_features), dtype=torch.uint8,
                              device="meta")
            module.weight = nn.Parameter(raw, requires_grad=False)
            nf4_storage.use_nf4_weight(module, name)
        make_mode(cfg).prepare(model, spec)            # the LoRA, as the trainer attaches it after the load
        return model

    model = nf4_model()
    workload = dataclasses.replace(workload_from_config(cfg, model), buckets=((1024, 1024),))
    machine = assumed_machine(vram_total=budget)
    planner = Planner(spec, model, workload, machine, Calibration())
    budget_obj = Budget(vram=budget, ram=CASE_RAM_BUDGET)
    plans = {"chosen": lambda: planner.plan(budget_obj),
             "resident-split": lambda: Plan(fp8=True, fp8_modulation=True, checkpointing="offload", base_format="nf4",
                                            split_blocks=True),
             "resident": lambda: Plan(fp8=True, fp8_modulation=True, checkpointing="offload", base_format="nf4")}
    rows = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    for name in args.plans:
        plan = plans[name]()
        est = planner.estimate(plan)
        t0 = time.perf_counter()
        nf4_storage._CODES.clear()      # its code books are tensors of the last simulation's fake mode
        sim = simulate_training(nf4_model(), spec, cfg, plan, (1024, 1024))
        workspace = est.vram["workspace"]
        row = {"plan_name": name, "plan": plan.describe(), "predicted": est.peak_vram, "workspace": workspace,
               "usable": budget_obj.usable_vram, "breakdown": dict(est.vram), "simulated": sim.peak,
               "ratio": (est.peak_vram - workspace) / sim.peak, "step_s": est.step_s,
               "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"{name}: {row['plan']}; predicted {(est.peak_vram - workspace) / GiB:.3f} GiB (+{workspace / GiB:.2f} "
              f"workspace; usable {budget_obj.usable_vram / GiB:.2f}), simulated {sim.peak / GiB:.3f} GiB, ratio "
              f"{row['ratio']:.3f}, {est.step_s:.2f} s/step predicted ({row['wall_s']:.0f} s)", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "commit": commit,
                                            "command": " ".join(sys.argv), "device": "simulated GPU on CPU (fake tensors)",
                                            "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
