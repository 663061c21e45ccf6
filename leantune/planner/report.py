"""The plan as people read it: what streams, the predicted VRAM and host RAM at the peak by
component, the budget it was checked against, and where the step time goes.

Printed by `leantune plan` and logged by the trainer when it starts, so a run that does not fit
shows which term to shrink before any weight is loaded.
"""

from __future__ import annotations

from .machine import GiB
from ..memory.plan import Plan


def format_plan(plan: Plan) -> str:
    """The chosen plan and its predicted breakdown as an aligned text table."""
    n = plan.notes or {}
    lines = []
    if "workload" in n:
        lines.append(f"workload: {n['workload']}")
        lines.append(f"machine:  {n['machine']}")
    described = plan.describe(lora=bool(n.get("lora_host_step")))
    lines.append(f"plan:     {described}")
    if plan.streamed_blocks:
        lines.append(f"streamed: {_streamed_counts(plan, n)}: {_compact_names(plan.streamed_blocks)}")
    if "split_blocks" in n:
        lines.append(_split_line(n["split_blocks"]))
    if "base_format" in n:
        lines.append(base_format_line(n["base_format"]))
    if n.get("stored_fp8"):
        mod = " (the modulation Linears too)" if n.get("stored_fp8_modulation") else ""
        lines.append(f"weights:  the block weights the checkpoint stores in fp8 (e4m3){mod} stay e4m3 in every plan; "
                     "fp8 above is about the others")
    if "vram_breakdown" in n:
        budget, margin = n["budget_vram"], n["margin_vram"]
        host = n["host_breakdown"]
        # Label column as wide as the longest label, so the numbers line up whatever the names.
        w = max(42, *(len(k) + 1 for k in (*n["vram_breakdown"], *host)))
        lines.append("")
        lines.append(f"{'VRAM at peak':<{w + 2}}{'GiB':>9}")
        for k, v in n["vram_breakdown"].items():
            lines.append(f"  {k:<{w}}{v / GiB:>9.2f}")
        lines.append(f"  {'total (predicted peak)':<{w}}{n['predicted_peak_vram'] / GiB:>9.2f}")
        lines.append(f"  {'budget - safety margin':<{w}}{(budget - margin) / GiB:>9.2f}"
                     f"   ({budget / GiB:.2f} - {margin / GiB:.2f})")
        lines.append("")
        lines.append(f"{'host RAM':<{w + 2}}{'GiB':>9}")
        for k, v in host.items():
            if k != "peak":
                lines.append(f"  {k:<{w}}{v / GiB:>9.2f}")
        lines.append(f"  {'peak (baseline + largest phase)':<{w}}{host['peak'] / GiB:>9.2f}")
        if n["budget_ram"] < 2**60:
            lines.append(f"  {'ram budget':<{w}}{n['budget_ram'] / GiB:>9.2f}")
        else:
            lines.append("  (host RAM not checked: planning for another machine; give --ram to check it)")
        lines.append("")
        cpu_step = n.get("host_step_s", 0.0)
        lines.append(f"step time: {n['predicted_step_s']:.3f} s = compute {n['compute_s']:.3f} s + exposed transfer "
                     f"{n['exposed_transfer_s']:.3f} s"
                     + (f" + CPU optimizer step {cpu_step:.3f} s" if n.get("host_step_params") else "")
                     + f" + overhead {n['overhead_s']:.3f} s "
                     f"({n['h2d_bytes_per_step'] / 1e9:.1f} GB host->GPU"
                     + (f", {n['d2h_bytes_per_step'] / 1e9:.1f} GB GPU->host" if n.get("d2h_bytes_per_step") else "")
                     + " per step)")
        if "tiers" in n:
            lines.append(_tiers(n))
        if n.get("recipe_forwards"):
            lines.append("included: " + _recipe_forwards(n["recipe_forwards"]))
        if n.get("lora_host_step"):
            lines.append(_lora_host_line(n))
        elif n.get("host_step_params"):
            rate = n["host_optimizer_rate"]
            lines.append(f"CPU optimizer step: {n['host_step_params'] / 1e6:.0f} M streamed parameters stepped on the "
                         f"CPU at {rate / 1e6:.1f} M/s (measured on this machine's CPU) = "
                         f"{n['host_step_params'] / rate:.1f} s of CPU time per step, {cpu_step:.1f} s of it not "
                         f"hidden behind the GPU's backward")
        if not n.get("machine_measured", True):
            lines.append(f"(rates assumed, not measured: {n.get('machine_assumed_from') or 'no GPU here'})")
    return "\n".join(lines)


def _lora_host_line(n: dict) -> str:
    """A LoRA host step: its CPU time, and why "auto" put the step there (search._lora_step_note)."""
    rate, params = n["host_optimizer_rate"], n["host_step_params"]
    line = (f"optimizer step on the host: {params / 1e6:.1f} M adapter parameters stepped on the CPU at "
            f"{rate / 1e6:.0f} M/s (measured on this machine's CPU), with their gradients down and weights up: "
            f"{n.get('host_step_s', 0.0):.3f} s per step, not hidden; the optimizer state is in host RAM, not VRAM")
    why = n.get("lora_step")
    if why and why.get("other_needs_vram") is not None:
        line += f"\n  why: no plan stepping on the GPU fits; its smallest budget is {why['other_needs_vram'] / GiB:.2f} GiB"
    elif why and "other_step_s" in why:
        line += (f"\n  why: preferred to the best plan stepping on the GPU, {why['other_step_s']:.3f} s per step "
                 f"(fp8 priced at its minimum gain): {why['other_plan']}")
    return line


def base_format_line(choice: dict) -> str:
    """The base format chosen, with its measured error against bf16 and its predicted step, and the
    best plan of each other format beside it: 'base:     nf4 resident, 2.1 s/step predicted, error
    9.23 % vs bf16; runner-up fp8 streamed (24 blocks) 2.9 s/step, error 2.52 %'. A quantized
    format whose best plan streams also says its fastest fully resident plan's time where one fits
    ('nf4 streamed (5 blocks), 4.09 s/step predicted (fully resident, split blocks: 5.31 s/step)')."""
    from .base_formats import ERROR_SOURCE

    def said(row: dict) -> str:
        split = ", split blocks" if row.get("split") else ""
        where = f"streamed ({row['streamed']} blocks{split})" if row["streamed"] else f"resident{split}"
        err = "no quantization error" if row["format"] == "bf16" else f"error {row['error']:.2f} % vs bf16"
        resident = row.get("resident")
        also = "" if resident is None else (f" (fully resident{', split blocks' if resident['split'] else ''}: "
                                             f"{resident['step_s']:.2f} s/step)")
        return f"{row['format']} {where}, {row['step_s']:.2f} s/step predicted{also}, {err}"

    rows = choice["formats"]
    chosen = next(r for r in rows if r["chosen"])
    others = sorted((r for r in rows if not r["chosen"]), key=lambda r: r["step_s"])
    why = "pinned by [memory] base_format" if choice["pinned"] else (
        f"the fastest within the error bound {choice['bound']:.2f} % ([memory] max_base_error)")
    line = f"base:     {said(chosen)} ({why})"
    allowed = [r for r in others if r["allowed"]]
    if allowed:
        line += f"; runner-up {said(allowed[0])}"
    if allowed[1:]:
        line += "; then " + ", ".join(said(r) for r in allowed[1:])
    over = [r for r in others if not r["allowed"]]
    if over:
        line += "; over the bound: " + ", ".join(said(r) for r in over)
    return line + f"\n          (errors: real-width Flux MLP with outlier channels, {ERROR_SOURCE})"


def _tiers(n: dict) -> str:
    """The three tiers of the weights and what the disk costs a step, in words."""
    t = n["tiers"]
    head = (f"tiers:    VRAM {t['VRAM'] / GiB:.2f} GiB (resident weights + ring slots), host RAM "
            f"{t['host RAM'] / GiB:.2f} GiB (streamed blocks), disk {t['disk'] / GiB:.2f} GiB "
            f"({n['disk_blocks']} streamed blocks) at {n['disk_read_rate'] / 1e9:.2f} GB/s read")
    if not n["disk_blocks"]:
        return head + "\ndisk:     nothing on disk: the host-RAM budget holds every streamed block"
    return head + (f"\ndisk:     {n['disk_bytes_per_step'] / 1e9:.1f} GB read per step = {n['disk_read_s']:.3f} s of "
                   f"reading, overlapped with compute on the staging worker; the step takes "
                   f"{n['disk_exposed_s']:.3f} s more than with those blocks in RAM ({n['step_s_in_ram']:.3f} s)")


def _recipe_forwards(extra: dict) -> str:
    """The forwards without a graph the step time averages in, said as the recipe sets them."""
    parts = []
    if extra.get("dop"):
        parts.append(f"one more forward on {extra['dop']:.0%} of the steps ([data] prior_loss = \"dop\": the "
                     f"base's prediction)")
    if extra.get("validation"):
        parts.append(f"{extra['validation']:.3g} forwards per step on average ([validation]'s passes)")
    return "; ".join(parts) + ", each priced as this plan's forward, streamed blocks and all"


def _streamed_counts(plan: Plan, notes: dict) -> str:
    """'51 of 57 blocks (13 of 19 double, 38 of 38 single)': every count against its total, so the
    streamed blocks read one way whatever the kinds."""
    total, kinds, totals = notes.get("total_blocks"), notes.get("streamed_by_kind", {}), notes.get("total_by_kind", {})
    head = f"{len(plan.streamed_blocks)} of {total} blocks" if total else f"{len(plan.streamed_blocks)} blocks"
    parts = [f"{kinds.get(k, 0)} of {t} {k}" for k, t in totals.items()] if totals else \
        [f"{v} {k}" for k, v in kinds.items()]
    return head + (f" ({', '.join(parts)})" if len(parts) > 1 else "")


def _compact_names(names) -> str:
    """('single_transformer_blocks.0', '...1', '...2', '...5') -> 'single_transformer_blocks.0-2,5'."""
    groups: dict[str, list[int]] = {}
    for n in names:
        attr, idx = n.rsplit(".", 1)
        groups.setdefault(attr, []).append(int(idx))
    parts = []
    for attr, idx in groups.items():
        idx.sort()
        runs, start, prev = [], idx[0], idx[0]
        for i in idx[1:] + [None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            runs.append(f"{start}" if start == prev else f"{start}-{prev}")
            if i is not None:
                start = prev = i
        parts.append(f"{attr}.{','.join(runs)}")
    return "; ".join(parts)


def _split_line(note: dict) -> str:
    """Why the plan splits blocks (search.Planner._split_note)."""
    head = "split:    each block's parts recomputed in their own backward (one more forward per block); "
    if note.get("pinned"):
        return head + "asked for by [memory] split_blocks = true (--split-blocks on)"
    if "unsplit_step_s" in note:
        return head + f"faster than the fastest unsplit plan that fits ({note['unsplit_step_s']:.2f} s/step predicted)"
    need = note.get("unsplit_needs_vram")
    if need is None:
        return head + "no unsplit plan fits the host-RAM budget"
    return head + f"no unsplit plan fits: the smallest needs {need / GiB:.2f} GiB"
