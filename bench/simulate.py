"""A full-size model on the simulated GPU, any family: does the planner's plan fit its budget, and
how close is the planner's predicted peak to the bytes the real engine keeps on the device?

For each VRAM budget and case (a training step at 512 and at 1024 px, a sampling step at 1024 px)
the planner chooses a plan as `leantune train` / `leantune sample` would (assumed GPU rates, a
64 GiB host-RAM budget), the real engine runs it on fake tensors (leantune/memory/simulated.py:
streaming, slots, fp8, checkpointing, offload, LoRA, the optimizer, the trainer's step and the
sampler's denoise), and the peak bytes live on the simulated GPU over one step are recorded
(training: with the optimizer's states already created, i.e. a steady-state step). Each case takes
1-4 minutes and about 0.5 GiB of RAM on a 2-core CPU.

The comparison leaves out what the simulation cannot see: the planner's workspace term (cuBLAS /
attention workspaces) is listed apart, and so is the budget's margin for the CUDA caching allocator
(rounding, fragmentation), which this simulation does not model; nor does it see the CUDA context.

`--model flux-dev | sd3.5-large | sd3.5-medium`: the architecture is built on meta through its
family from the config shipped in leantune/models/configs/, the trainer's step and the sampler's
denoise run through the family's `predict`, with its text rows (Flux: 512 T5 tokens; SD3.5: 77 CLIP
rows + 256 T5 tokens) and latents. Sampling a family with classifier-free guidance (SD3.5) plans, as
`leantune sample` does, for the doubled batch (negative and positive prompt in one forward) and runs
it so; where no plan fits that, for one half at a time (the "CFG" column says which ran).

    python bench/simulate.py --out bench/results/simulate_flux.json
    python bench/simulate.py --budgets 8 --cases train1024                  # one cell
    python bench/simulate.py --model sd3.5-large --out bench/results/simulate_sd35_large.json

`--references N` feeds an edit family's training step N reference images per target (Qwen-Image-2.1:
each at its pipeline's size, 1024² of area, whatever the bucket: 4096 latent tokens, and its tags and
1024 image slots in the caption's rows), priced as `leantune plan --references N` prices them;
`--ram GiB` plans the training cases for that host-RAM budget; `--optimizer adamw8bit` (LoRA):

    python bench/simulate.py --model qwen-image-2.1 --rank 32 --references 3 --ram 24 --budgets 6 8 \
        --cases train1024 --out bench/results/simulate_qwen_image21_lora_r32_3refs.json

`--resolution HxW` runs the training cases at that size (the case's square otherwise) and `--frames
N` a video family's on clips of N frames (4k+1), priced as `leantune plan --frames N` prices them:

    python bench/simulate.py --model wan2.2-a14b --rank 32 --resolution 480x832 --frames 81 --budgets 12 \
        --cases train1024 --out bench/results/simulate_wan22_a14b_r32_480x832x81.json

`--encoding` simulates the caching phase's text encoding instead (Qwen-Image-2.1's Qwen3-VL-8B, streamed
layer by layer, its vision tower unit by unit, through the family's encode_prompts): a batch of 8
captions, or one caption with `--references N` images of 1024²:

    python bench/simulate.py --model qwen-image-2.1 --encoding --references 3 \
        --out bench/results/simulate_qwen_image21_encoding_3refs.json

`--mode full` runs full fine-tuning steps instead ([train] mode = "full": every weight trains, the
optimizer steps inside backward, streamed blocks carry their optimizer state and are written back),
with `--optimizer` and `--state-dtype` (AdamW moments), planned with no host-RAM limit (the host
RAM is reported: predicted, and the fake host bytes the simulation created), two steps each, the
second measured (steady state: ring slots kept from the step before). Its table adds host RAM and
the bytes copied per step, H2D and the D2H write-back, predicted and simulated:

    python bench/simulate.py --mode full --optimizer adamw --state-dtype bf16 --budgets 8 12 16 24 \
        --cases train1024 --out bench/results/simulate_full_flux_adamw_bf16.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # simulate this checkout's leantune

from leantune.family_registry import stock_models  # noqa: E402  (this checkout's, above)

GiB = 2**30
CASES = {"train1024": ("train", 1024), "train512": ("train", 512), "sample1024": ("sample", 1024)}
# Every stock architecture (family_registry.py) but the variants that share another's transformer
# (Flux.1-schnell is Flux.1-dev without the guidance input, Qwen-Image-Edit is Qwen-Image).
MODELS = tuple(name for name in stock_models()
               if name not in ("flux-schnell", "qwen-image-edit"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, default="flux-dev")
    p.add_argument("--budgets", type=float, nargs="+", default=[4, 6, 8, 12, 16, 24], help="GiB")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--out", type=Path, default=None, help="JSON results (written after every case)")
    p.add_argument("--mode", choices=("lora", "full"), default="lora",
                   help="training cases: a LoRA step, or a full fine-tuning step (sampling cases are the same)")
    p.add_argument("--optimizer", choices=("adamw", "adafactor", "adamw8bit"), default="adamw",
                   help="the optimizer (--mode lora: also adamw8bit, 8-bit moments)")
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32", help="--mode full: AdamW moments")
    p.add_argument("--rank", type=int, default=16, help="--mode lora: the LoRA rank")
    p.add_argument("--fp8-base", action="store_true",
                   help="the base loaded from an fp8 checkpoint (block Linears e4m3, as ComfyUI's fp8 files)")
    p.add_argument("--references", type=int, default=None, metavar="N",
                   help="training cases of an edit family (qwen-image-2.1): N reference images per target, at the "
                        "size the family encodes them (Qwen-Image-2.1: 1024² of area), priced and fed to the step")
    p.add_argument("--resolution", type=_resolution, default=None, metavar="HxW",
                   help="the training cases at HEIGHTxWIDTH pixels (480x832: 480 high), not the case's square")
    p.add_argument("--frames", type=int, default=None, metavar="N",
                   help="training cases of a video family (wan2.2-a14b, wan2.2-ti2v-5b): clips of N frames (4k+1), "
                        "priced as leantune plan --frames prices them and fed to the step")
    p.add_argument("--ram", type=float, default=None, metavar="GiB",
                   help="the host-RAM budget the training cases plan for (default: LoRA 64 GiB, full unlimited)")
    p.add_argument("--encoding", action="store_true",
                   help="the caching phase's text encoding instead (qwen-image-2.1): a batch of 8 captions, or one "
                        "caption with --references N images; no budget (the phase's peak, against its price)")
    args = p.parse_args(argv)

    from leantune.memory.simulated import SimulatedDeviceUnavailable, enable

    try:
        enable()                      # before anything runs a backward (see simulated.enable)
    except SimulatedDeviceUnavailable as e:
        print(f"simulate: the simulated device is unavailable here: {e}", file=sys.stderr)
        return 2
    from leantune.simulated_run import planned_case

    meta = {"date": datetime.date.today().isoformat(), "commit": _commit(), "command": " ".join(sys.argv),
            "model": args.model, "device": "simulated GPU on CPU (fake tensors)", "mode": args.mode,
            "fp8_base": args.fp8_base, "references": args.references, "ram_budget_gib": args.ram,
            "resolution": args.resolution, "frames": args.frames}
    if args.mode == "full":
        meta.update(optimizer=args.optimizer, state_dtype=args.state_dtype)
    else:
        meta.update(rank=args.rank, optimizer=args.optimizer)
    full = {"optimizer": args.optimizer, "state_dtype": args.state_dtype} if args.mode == "full" else {}
    if args.encoding:
        return _encoding(args, meta)
    rows = []
    for case in args.cases:
        for budget in args.budgets:
            what, size = CASES[case]
            if what == "train" and args.mode == "full":
                what = "full"
            t0 = time.perf_counter()
            refs = {"references": args.references} if what != "sample" and args.references is not None else {}
            if what != "sample" and args.ram is not None:
                refs["ram_budget"] = int(args.ram * GiB)
            if what != "sample":
                refs.update(resolution=args.resolution, frames=args.frames)
            row = planned_case(what, size, int(budget * GiB), model_name=args.model, fp8_base=args.fp8_base, **refs,
                               **(full if what == "full" else {"rank": args.rank, "optimizer": args.optimizer}
                                  if what == "train" else {}))
            row["case"], row["wall_s"] = case, time.perf_counter() - t0
            rows.append(row)
            print(_line(row), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    print()
    ordered = sorted(rows, key=lambda r: (list(CASES).index(r["case"]), r["budget"]))
    print(markdown_full([r for r in ordered if r["what"] == "full"]) if args.mode == "full" else markdown(ordered))
    return 0


def _resolution(text: str) -> tuple[int, int]:
    """--resolution HxW as (height, width)."""
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HEIGHTxWIDTH (e.g. 480x832)") from None
    return h, w


def _case(r: dict) -> str:
    """The case's name, with the resolution and frames it ran at when given (train 480x832x81)."""
    if r.get("frames") is None and r.get("resolution") in (None, [r["size"], r["size"]]):
        return r["case"]
    h, w = r["resolution"]
    return f"{r['what']} {h}x{w}" + (f"x{r['frames']}" if r.get("frames") else "")


def _encoding(args, meta: dict) -> int:
    """The text-encoding phase on the simulated GPU (simulated_run.simulate_text_encoding)."""
    from leantune.simulated_run import simulate_text_encoding

    t0 = time.perf_counter()
    row = simulate_text_encoding(args.model, references=args.references or 0)
    row["wall_s"] = time.perf_counter() - t0
    print(f"{args.model} text encoding, {row['references']} reference(s), batch {row['batch']}: encoder tokens "
          f"{row['encoder_tokens']}, patches {row['vision_patches']}; predicted {_gib(row['predicted_this_encode'])} "
          f"GiB (phase {_gib(row['predicted'])}), simulated {_gib(row['simulated'])} GiB, ratio {row['ratio']:.3f}; "
          f"host {_gib(row['host_predicted'])} / {_gib(row['host_simulated'])} GiB (predicted / simulated) "
          f"({row['wall_s']:.0f} s)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**meta, "rows": [row]}, indent=1, default=str))
    return 0


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "unknown"


def _line(r: dict) -> str:
    head = f"{r['model']} {_case(r):>10} {r['budget'] / GiB:5.1f} GiB: "
    if "infeasible" in r:
        return head + f"no plan fits (needs {_gib(r['needed'])} GiB)"
    cfg = "" if r.get("cfg_batched") is None else f", CFG {'batched' if r['cfg_batched'] else 'halves'}"
    return head + (f"{r['plan']}{cfg}; predicted {_gib(r['predicted'] - r['workspace'])} GiB "
                   f"(+{_gib(r['workspace'])} workspace), simulated {_gib(r['simulated'])} GiB, "
                   f"ratio {r['ratio']:.3f}" + (_full_line(r) if r["what"] == "full" else "") +
                   f" ({r['wall_s']:.0f} s)")


def _full_line(r: dict) -> str:
    return (f"; host {_gib(r['host_predicted'] - r['host_breakdown']['process baseline'])} / "
            f"{_gib(r['host_simulated'])} GiB, H2D {_gib(r['h2d_predicted'])} / {_gib(r['h2d_simulated'])} GiB, "
            f"D2H {_gib(r['d2h_predicted'])} / {_gib(r['d2h_simulated'])} GiB (predicted / simulated)")


def markdown_full(rows: list[dict]) -> str:
    """The docs/benchmarks.md table of full fine-tuning cases: device peak, host RAM, copies per step.
    Host RAM predicted: the planner's peak less its process baseline (Python, torch, CUDA runtime),
    which holds no tensor; the simulation counts only the tensors it creates."""
    out = ["| case | budget GiB | optimizer (state) | plan chosen by the planner | predicted GiB (tensors) | "
           "+ workspace | simulated peak GiB | predicted / simulated | simulated + workspace ≤ budget | "
           "host GiB predicted (tensors) | host GiB simulated | H2D GiB/step predicted / simulated | "
           "D2H GiB/step predicted / simulated |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        opt = r["optimizer"] + (f" ({r['state_dtype']})" if r["optimizer"] == "adamw" else "")
        if "infeasible" in r:
            out.append(f"| {r['case']} | {r['budget'] / GiB:g} | {opt} | no plan fits: needs {_gib(r['needed'])} GiB "
                       f"| | | | | | | | | |")
            continue
        fits = "yes" if r["simulated"] + r["workspace"] <= r["budget"] else "**no**"
        host = r["host_predicted"] - r["host_breakdown"]["process baseline"]
        out.append(f"| {r['case']} | {r['budget'] / GiB:g} | {opt} | {r['plan']} | "
                   f"{_gib(r['predicted'] - r['workspace'])} | {_gib(r['workspace'])} | {_gib(r['simulated'])} | "
                   f"{r['ratio']:.3f} | {fits} | {_gib(host)} | {_gib(r['host_simulated'])} | "
                   f"{_gib(r['h2d_predicted'])} / {_gib(r['h2d_simulated'])} | "
                   f"{_gib(r['d2h_predicted'])} / {_gib(r['d2h_simulated'])} |")
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    """The docs/benchmarks.md table."""
    out = ["| case | budget GiB | plan chosen by the planner | CFG | predicted GiB (tensors) | + workspace | "
           "allocator margin | simulated peak GiB | predicted / simulated | simulated + workspace ≤ budget |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "infeasible" in r:
            out.append(f"| {_case(r)} | {r['budget'] / GiB:g} | no plan fits: needs {_gib(r['needed'])} GiB | | | | "
                       f"{_gib(r['margin'])} | | | |")
            continue
        plan = r["plan"]            # Plan.describe(): streamed blocks, fp8 (+ modulation), checkpointing, ring
        cfg = {None: "", True: "batched (x2)", False: "halves"}[r.get("cfg_batched")]
        fits = "yes" if r["simulated"] + r["workspace"] <= r["budget"] else "**no**"
        out.append(f"| {_case(r)} | {r['budget'] / GiB:g} | {plan} | {cfg} | {_gib(r['predicted'] - r['workspace'])} "
                   f"| {_gib(r['workspace'])} | {_gib(r['margin'])} | {_gib(r['simulated'])} | {r['ratio']:.3f} "
                   f"| {fits} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
