"""`leantune plan`'s answer for a config, as the page shows it.

The planner runs in this process (no subprocess per keystroke) through the command itself, with
--json, so the page and the terminal can never disagree. The answer is reduced to what the page
draws: fits or not, predicted peak VRAM and host RAM, their breakdowns, streamed blocks, predicted
s/step, and for a budget that does not fit the smallest one that does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import threading
from pathlib import Path

_LOCK = threading.Lock()      # the command prints to sys.stdout, which is process-wide

GiB = 2**30


def plan_json(config: Path, vram: str, ram: str | None = None) -> dict:
    """The JSON `leantune plan CONFIG --vram VRAM [--ram RAM] --json` prints."""
    from ..commands import plan as plan_command

    parser = argparse.ArgumentParser()
    plan_command.configure(parser)
    argv = [str(config), "--vram", vram, "--json"] + (["--ram", ram] if ram else [])
    args = parser.parse_args(argv)
    out = io.StringIO()
    with _LOCK, contextlib.redirect_stdout(out):
        plan_command.run(args)
    return json.loads(out.getvalue())


def size_text(n: float) -> str:
    """Bytes as the page prints them: GiB to two places, MiB below one GiB (a small model's plans
    would otherwise all read "0.07 GiB")."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def summarize(answer: dict) -> dict:
    """The page's view of one plan answer (the first budget's)."""
    entry = answer["plans"][0]
    base = {"workload": answer["workload"], "machine": answer["machine"]["name"], "budget": entry["vram"],
            "budget_gib": entry["budget_bytes"] / GiB}
    if "plan" not in entry:
        needed = entry.get("needed_vram")
        text = (f"does not fit: the smallest budget is {size_text(needed)}" if needed
                else "does not fit: not enough host RAM")
        return {**base, "fits": False, "message": text, "smallest_gib": needed / GiB if needed else None,
                "detail": entry["error"]}
    plan = entry["plan"]
    notes = plan["notes"]
    streamed = plan["streamed_blocks"]
    return {**base, "fits": True,
            "message": (f"fits: predicted peak VRAM {size_text(notes['predicted_peak_vram'])}, "
                        f"host RAM {size_text(notes['predicted_peak_host'])}"),
            "peak_vram_gib": notes["predicted_peak_vram"] / GiB, "peak_host_gib": notes["predicted_peak_host"] / GiB,
            "vram_breakdown_gib": {k: v / GiB for k, v in notes["vram_breakdown"].items()},
            "host_breakdown_gib": {k: v / GiB for k, v in notes["host_breakdown"].items() if k != "peak"},
            "streamed_blocks": len(streamed) if isinstance(streamed, list) else streamed,
            "total_blocks": notes.get("total_blocks"), "fp8": plan["fp8"], "checkpointing": plan["checkpointing"],
            "step_s": notes["predicted_step_s"], "assumed_machine": not notes.get("machine_measured", False)}
