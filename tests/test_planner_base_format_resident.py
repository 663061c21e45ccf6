"""The base-format line's fully resident alternative (issue 38): where a quantized format's best plan
streams blocks and a plan of that format streaming nothing also fits, `leantune plan` states both
predicted times (planner/search.Planner._with_base_choice, report.base_format_line), and each
format's best plan is chosen as plan() chooses, its unsplit and split plans swept apart.

The tiny Flux 128 wide (every block Linear holds whole NF4 / int8 blocks), at 256² so split blocks
pay off, over the budgets at which its NF4 plans streaming nothing fit.
"""

from __future__ import annotations

import pytest
import torch

from leantune import tiny
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC
from leantune.planner.machine import assumed_machine
from leantune.planner.report import base_format_line, format_plan
from leantune.planner.search import Planner
from leantune.planner.workload import UNLIMITED_RAM, Budget, Workload

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDE = dict(attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))   # inner width 128


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "cache"))


def _budget(vram: int) -> Budget:
    return Budget(vram=vram, ram=UNLIMITED_RAM, margin=0.0, min_margin=0)


def test_a_streaming_formats_resident_plan_is_stated_beside_it():
    model = tiny.flux_transformer(seed=3, dtype=torch.bfloat16, **WIDE).requires_grad_(False)
    workload = Workload(rank=4, targets="all", buckets=((256, 256),), text_length=16,
                        base_formats=("fp8", "int8", "nf4"), max_base_error=10.0)
    planner = Planner(FLUX_SPEC, model, workload, assumed_machine())
    assert planner.splits
    budgets = sorted({planner.estimate(Plan(fp8=True, base_format="nf4", checkpointing=c, split_blocks=s)).peak_vram
                      for c in ("none", "blocks", "offload") for s in (False, True)})
    stated = 0
    for vram in budgets:
        plan = planner.plan(_budget(vram))
        fits = [(v, p) for p in planner.candidates() if (v := planner._cheap_estimate(p)[0]) <= vram]
        fits = [vp for vp in fits if not vp[1].fp8_modulation] or fits        # "auto" modulation, as plan()
        line = format_plan(plan)
        for row in plan.notes["base_format"]["formats"]:
            same = [vp for vp in fits if (vp[1].fp8 and vp[1].base_format == row["format"]) if row["format"] != "bf16"]
            for split in (False, True):           # no slower than either sweep's plan (plan()'s rule)
                swept = planner._sweep([vp for vp in same if vp[1].split_blocks == split]) if same else None
                if swept is not None and not row["chosen"]:
                    assert row["step_s"] <= planner._timed(swept).step_s + 1e-12, (vram, row)
            resident = [p for _, p in same if not p.streamed_blocks and not p.stream_non_blocks]
            if row["streamed"] and resident:
                alt = row["resident"]
                assert alt["step_s"] == pytest.approx(min(planner._timed(p).step_s for p in resident))
                assert alt["step_s"] >= row["step_s"] and "stream 0 blocks" in alt["plan"]
                split = ", split blocks" if alt["split"] else ""
                assert f"(fully resident{split}: {alt['step_s']:.2f} s/step)" in line
                stated += 1
            else:
                assert "resident" not in row, (vram, row)
    assert stated                       # some budget has a format that streams with a resident plan fitting


def test_the_line_says_both_times():
    choice = {"chosen": "bf16", "pinned": False, "bound": 10.0, "formats": [
        {"format": "bf16", "step_s": 3.73, "streamed": 49, "split": False, "error": 0.0, "allowed": True,
         "chosen": True},
        {"format": "nf4", "step_s": 4.09, "streamed": 5, "split": False, "error": 9.2343, "allowed": True,
         "chosen": False, "resident": {"step_s": 5.31, "split": True, "plan": "stream 0 blocks, ..."}},
        {"format": "fp8", "step_s": 4.10, "streamed": 43, "split": False, "error": 2.5248, "allowed": True,
         "chosen": False}]}
    line = base_format_line(choice)
    assert ("runner-up nf4 streamed (5 blocks), 4.09 s/step predicted (fully resident, split blocks: 5.31 s/step), "
            "error 9.23 % vs bf16; then fp8 streamed (43 blocks), 4.10 s/step predicted, error 2.52 % vs bf16") in line
