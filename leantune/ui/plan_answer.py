"""`leantune plan`'s answer for a config, as the page shows it.

The planner runs in this process (no subprocess per keystroke) through the command itself, with
--json, so the page and the terminal can never disagree. The answer is reduced to what the page
draws: fits or not, predicted peak VRAM and host RAM, their breakdowns, streamed blocks, predicted
s/step, and for a budget that does not fit the smallest one that does.

The answer is said in words first (how much streams, how long the run takes and on which machine,
whether that machine is measured or assumed), then the numbers. Host RAM "auto" is this machine's
available RAM, passed to the planner explicitly: the command alone leaves host RAM unchecked on a
machine without a GPU (the run may happen elsewhere), but the page trains here. A stock model name
(flux-dev, sd3.5-large, ...) is planned from the architecture shipped in the package, without its
weights, as `leantune plan --model` does. The planner's advice names its CLI flags and config keys;
the page's words replace them with the page's field names.
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


def stock_models() -> list[str]:
    """The architectures `leantune plan --model` plans without weights."""
    from ..commands.plan import MODELS

    return sorted(MODELS)


def stock_for(path: str, family: str) -> str | None:
    """The stock architecture a model path most likely is (its family's, the one whose name's parts
    the path's last part holds most of: "/models/FLUX.1-dev" -> "flux-dev"), or None when the family
    has none. A preset whose model folder is not on this machine still plans under that name."""
    from ..family_registry import stock_models

    names = sorted(n for n, (fam, _) in stock_models().items() if fam == family)
    if not names:
        return None
    last = Path(path).name.lower()
    return max(names, key=lambda n: (sum(part in last for part in n.split("-")), -len(n)))


def missing_model(path: str, family: str) -> dict | None:
    """{"note", "stock"} when `path` names a model that is not on this machine (None when it is
    there, empty, or a stock name itself)."""
    path = path.strip()
    if not path or path in stock_models() or Path(path).expanduser().exists():
        return None
    stock = stock_for(path, family)
    offer = (f"; plan with the stock name {stock!r} meanwhile (no files needed), or give your model's folder"
             if stock else "; give your model's folder or .safetensors file")
    return {"note": f"the model {path!r} is not on this machine{offer}", "stock": stock}


def this_machine_ram() -> int:
    """Host RAM "auto": what a new trainer process here may use (available RAM minus the planner's
    margin, planner/workload.py default_ram_budget, without this server's own RSS)."""
    from ..host import host_ram

    total, avail = host_ram()
    n = int(avail - max(2 * GiB, 0.1 * total))
    return max(0, n - n % (64 * 2**20))      # in 64 MiB steps: a page re-planning as RAM drifts reuses its answer


def ram_argument(ram: str | None) -> tuple[str, str]:
    """(--ram value, words) for the form's host RAM field: a size as given, or "auto" as this
    machine's RAM, checked."""
    if ram and ram.strip().lower() not in ("", "auto"):
        return ram.strip(), f"host RAM budget {ram.strip()}"
    n = this_machine_ram()
    return f"{n}B", f"host RAM: this machine's {size_text(n)} available to a run"


def plan_json(config: Path | None, vram: str, ram: str | None = None, stock: dict | None = None,
              gpu: str = "") -> dict:
    """The JSON `leantune plan CONFIG --vram VRAM [--ram RAM] [--gpu CARD] --json` prints, or with
    `stock` ({"model": "flux-dev", "mode", "rank", "resolutions", "text_length", "batch_size", and
    for a video model "frames"}) the JSON of `leantune plan --model ...`; `gpu`: plan for that card (planner/cards.py), "" for the
    GPU here."""
    from ..commands import plan as plan_command

    parser = argparse.ArgumentParser()
    plan_command.configure(parser)
    if stock is None:
        argv = [str(config)]
    else:
        argv = ["--model", stock["model"], "--mode", stock["mode"], "--batch-size", str(stock["batch_size"]),
                "--text-length", str(stock["text_length"])]
        argv += ["--rank", str(stock["rank"])] if stock["mode"] == "lora" else []
        argv += ["--frames", str(stock["frames"])] if stock.get("frames") else []
        for r in stock["resolutions"]:
            argv += ["--resolution", str(r)]
    argv += ["--vram", vram, "--json"] + (["--ram", ram] if ram else []) + (["--gpu", gpu] if gpu else [])
    args = parser.parse_args(argv)
    out = io.StringIO()
    with _LOCK, contextlib.redirect_stdout(out):
        plan_command.run(args)
    return json.loads(out.getvalue())


def size_text(n: float) -> str:
    """Bytes as the page prints them: GiB to two places, MiB below one GiB (a small model's plans
    would otherwise all read "0.07 GiB")."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


# the planner's CLI words -> the page's fields (no advice may name a flag the page lacks)
PAGE_WORDS = [("use --model with one of", "give the model as one of the stock names"), ("--model", "the model"),
              ("--mode", "the mode"), ("[memory] vram_budget", "the VRAM budget"), ("[memory] ram_budget", "the host RAM budget"),
              ("--vram", "the VRAM budget"), ("--ram", "the host RAM budget"), ("--gpu", "the GPU to plan for"),
              ("--resolution", "the resolutions"), ("--rank", "the LoRA rank"), ("--batch-size", "the batch size"),
              ("--text-length", "the text tokens"), ("[data] resolutions", "the resolutions"),
              ("[lora] rank", "the LoRA rank"), ("[data] batch_size", "the batch size"),
              ("[data] max_text_length", "the text tokens")]


def page_words(text: str) -> str:
    for cli, page in PAGE_WORDS:
        text = text.replace(cli, page)
    return text


def budget_text(n: int) -> str:
    """A budget the VRAM field takes, rounded up: whole MiB below 1 GiB, else GiB to 0.1."""
    import math

    return f"{math.ceil(n / 2**20)}MiB" if n < GiB else f"{math.ceil(n / GiB * 10) / 10:g}GiB"


def duration_text(seconds: float) -> str:
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def words(plan: dict, machine: str, steps: int | None) -> str:
    """The plan in one sentence: what streams, how long, on what (assumed or measured)."""
    notes = plan["notes"]
    streamed = plan["streamed_blocks"]
    n = len(streamed) if isinstance(streamed, list) else int(streamed or 0)
    total = notes.get("total_blocks")
    if n == 0:
        where = "the whole model stays on the GPU"
    elif total and n >= total:
        where = f"all {total} blocks stream from host RAM"
    else:
        where = f"{n} of {total or '?'} blocks stream from host RAM"
    assumed = not notes.get("machine_measured", False) and "assumed" not in machine.lower()   # said once
    step_s = notes.get("predicted_step_s")
    if step_s and steps:
        took = duration_text(step_s * steps)
        when = (f"{took if took.startswith('under') else 'about ' + took} for {steps} steps on {machine}"
                + (" (assumed)" if assumed else ""))
    elif step_s:
        when = f"about {step_s:.3g} s a step on {machine}" + (" (assumed)" if assumed else "")
    else:
        when = ""
    return "; ".join(x for x in (where, when) if x)


def summarize(answer: dict, steps: int | None = None, ram_words: str | None = None) -> dict:
    """The page's view of one plan answer (the first budget's). `steps`: the run's, for the time it
    takes; `ram_words`: which host RAM was checked."""
    entry = answer["plans"][0]
    base = {"workload": answer["workload"], "machine": answer["machine"]["name"], "budget": entry["vram"],
            "budget_gib": entry["budget_bytes"] / GiB, "ram": ram_words}
    if "plan" not in entry:
        needed, needed_ram = entry.get("needed_vram"), entry.get("needed_ram")
        if needed:
            text = f"does not fit: the smallest budget is {size_text(needed)}"
        elif needed_ram:
            text = f"does not fit: needs {size_text(needed_ram)} of host RAM" + (f" ({ram_words})" if ram_words else "")
        else:
            text = "does not fit: not enough host RAM" + (f" ({ram_words})" if ram_words else "")
        return {**base, "fits": False, "message": text, "smallest_gib": needed / GiB if needed else None,
                "smallest_budget": budget_text(needed) if needed else None, "detail": page_words(entry["error"])}
    plan = entry["plan"]
    notes = plan["notes"]
    streamed = plan["streamed_blocks"]
    return {**base, "fits": True, "words": words(plan, answer["machine"]["name"], steps),
            "message": (f"fits: predicted peak VRAM {size_text(notes['predicted_peak_vram'])}, "
                        f"host RAM {size_text(notes['predicted_peak_host'])}"),
            "peak_vram_gib": notes["predicted_peak_vram"] / GiB, "peak_host_gib": notes["predicted_peak_host"] / GiB,
            "vram_breakdown_gib": {k: v / GiB for k, v in notes["vram_breakdown"].items()},
            "host_breakdown_gib": {k: v / GiB for k, v in notes["host_breakdown"].items() if k != "peak"},
            "streamed_blocks": len(streamed) if isinstance(streamed, list) else streamed,
            "total_blocks": notes.get("total_blocks"), "fp8": plan["fp8"], "checkpointing": plan["checkpointing"],
            "step_s": notes["predicted_step_s"], "assumed_machine": not notes.get("machine_measured", False)}
