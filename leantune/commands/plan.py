"""`leantune plan`: print the memory plan and its predicted breakdown, without weights or a GPU.

Two forms:
  leantune plan my.toml [--set section.key=value] [--vram 8GiB]
  leantune plan --model flux-dev --mode lora --rank 16 --resolution 1024 --vram 8GiB [--vram 12GiB ...]
  (--model flux-dev | flux-schnell | sd3.5-large | sd3.5-medium: full-size architectures shipped in the package)

The config form reads the architecture from the config's model files (a diffusers config.json or
the header of a single safetensors file; no tensor is read) and the workload from its sections.
Both forms build the transformer on the meta device, so planning Flux-dev takes a few seconds on
any machine. With a GPU present its rates are measured; otherwise assumed rates are used and the
report says so. `--json` prints the plans with every predicted number for scripts.

Planning the same model and workload again reuses what was measured (planner/spec_cache.py); asking
the same `--model` question again on a machine without a GPU prints the kept answer without
importing torch (planner/answer_cache.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..family_registry import stock_models

# --model name -> the architecture shipped in models/configs/, its [model] family, and the text
# tokens it runs with: every family's stock models (family_registry.py).
_STOCK = stock_models()
MODELS = {name: model.config for name, (_, model) in _STOCK.items()}
MODEL_FAMILY = {name: family for name, (family, _) in _STOCK.items()}
TEXT_TOKENS = {name: model.text_tokens for name, (_, model) in _STOCK.items()}
_MODULATION_FLAG = {"auto": None, "on": True, "off": False}   # --fp8-modulation -> Workload.fp8_modulation


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="a run's TOML file (optional with --model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable)")
    p.add_argument("--model", choices=sorted(MODELS), help="plan for a full-size architecture instead of a config")
    p.add_argument("--mode", choices=["lora", "full", "inference"], default=None, help="what runs (default: lora)")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default 16)")
    p.add_argument("--lora-type", choices=_lora_types(), default=None,
                   help="the adapter ([lora] type; default lora): its parameters and activations are priced")
    p.add_argument("--targets", choices=["attention", "attention_mlp", "all"], default=None,
                   help="LoRA target preset (default attention_mlp)")
    p.add_argument("--optimizer", choices=_optimizers(), default=None,
                   help="[train] optimizer (default adamw); prodigy, schedulefree_adamw and came: LoRA only")
    p.add_argument("--state-dtype", choices=["fp32", "bf16"], default=None,
                   help="--mode full: dtype of AdamW's moments (default fp32)")
    p.add_argument("--exclude", action="append", default=None, metavar="PATTERN",
                   help="--mode full: freeze the weights whose diffusers name matches (fnmatch, repeatable), "
                        "e.g. 'single_transformer_blocks.*'")
    p.add_argument("--master-weights", action="store_true", help="--mode full: fp32 master weights in host RAM")
    p.add_argument("--streamed-step", choices=["auto", "device", "host"], default=None,
                   help="--mode full: where streamed blocks take their optimizer step: on the device (their state "
                        "travels with them), on the host (state stays in host RAM, the CPU steps: fits smaller "
                        "budgets), or auto (the faster of the two plans that fit, the CPU timed here; default: the "
                        "config's [full] streamed_step, else auto)")
    p.add_argument("--lora-step", choices=["auto", "device", "host"], default=None,
                   help="LoRA: where the adapters' optimizer step runs ([lora] optimizer_step): on the device, on "
                        "the host (their optimizer state in host RAM, the CPU steps after backward), or auto (the "
                        "host only where no device-step plan fits or it is faster; default: the config's, else auto)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--accumulation", type=int, default=None, help="gradient accumulation steps")
    p.add_argument("--resolution", type=_resolution, action="append", default=None, metavar="PX|HxW",
                   help="training resolution: PX square, or HEIGHTxWIDTH (480x832: 480 high, 832 wide); "
                        "repeatable for several buckets; default 1024")
    p.add_argument("--frames", type=int, default=None, metavar="N",
                   help="frames per clip for a video model (wan2.2-a14b: 4k+1, e.g. 81); priced as its latent "
                        "frames x the resolution's patches; default: images (one frame)")
    p.add_argument("--text-length", type=int, default=None, help="T5 tokens (default 512 flux-dev / 256 flux-schnell / 256 SD3.5, which adds 77 CLIP rows)")
    p.add_argument("--references", type=int, default=None, metavar="N",
                   help="reference images per sample (an edit model that prices them: qwen-image-2.1); "
                        "default: none with --model, the datasets' own with a config")
    p.add_argument("--vram", action="append", default=None, metavar="SIZE",
                   help='VRAM budget, e.g. 8GiB (a bare 8 is GiB), or "auto" (repeatable: one plan per budget)')
    p.add_argument("--gpu", choices=_cards(), default=None, metavar="CARD",
                   help="plan for this GPU instead of the one here (or the assumed RTX 4090 class): its memory, "
                        "PCIe link and compute from its spec sheet (planner/cards.py); \"auto\" as --vram is all "
                        "of its memory. One of: " + ", ".join(_cards()))
    p.add_argument("--ram", default=None, metavar="SIZE",
                   help="host RAM budget (default: available here minus a margin; unchecked when no GPU is here)")
    p.add_argument("--disk-dir", default=None, metavar="DIR",
                   help="the disk tier's folder ([memory] disk_dir): streamed blocks the host-RAM budget cannot "
                        "hold are read from there; its read rate is measured here once per disk and kept")
    p.add_argument("--disk-read", type=float, default=None, metavar="GBPS",
                   help="the disk tier's read rate in GB/s, for another machine's disk (e.g. 3.5 for a PCIe 4 "
                        "NVMe drive): plans with the disk tier without measuring one here")
    p.add_argument("--no-fp8", action="store_true", help="never store weights in fp8")
    p.add_argument("--fp8-modulation", choices=["auto", "on", "off"], default=None,
                   help="fp8 for the modulation Linears too: auto (only when nothing else fits; a file's e4m3 "
                        "modulation stays e4m3), on, off (default: the config's [memory] fp8_modulation, else auto)")
    p.add_argument("--expert", choices=["one", "both"], default=None,
                   help="a model of two experts (wan2.2-a14b): train one expert (default), or both in one run "
                        "([model] expert = \"both\"): the one not computing is held in host RAM (or on the disk "
                        "tier) and priced so")
    p.add_argument("--lora-experts", choices=["each", "shared"], default=None,
                   help="with --expert both: a LoRA per expert (default, as [lora] experts) or one both apply")
    p.add_argument("--split-blocks", choices=["auto", "on", "off"], default=None,
                   help="split blocks (Flux, Wan, Qwen-Image-2.1: each block's parts recomputed one at a time): auto "
                        "(the search's call), on (only split plans), off (default: the config's [memory] "
                        "split_blocks, else auto)")
    p.add_argument("--base-format", choices=["auto", "bf16", "fp8", "int8", "nf4"], default=None,
                   help="how the frozen base's block Linears are stored: auto (the search chooses among fp8, "
                        "int8 and, with bitsandbytes, NF4 within --max-base-error), or pinned (default: the "
                        "config's [memory] base_format, else auto)")
    p.add_argument("--max-base-error", type=float, default=None, metavar="PCT",
                   help="the output error against bf16 (percent) a format auto may choose has (default: the "
                        "config's [memory] max_base_error, else fp8 e4m3's, 2.52)")
    p.add_argument("--no-autocast", action="store_true", help="plan for mixed_precision = \"no\"")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="N processes (GPUs) on this machine: per-process VRAM and host RAM, and the machine total")
    p.add_argument("--strategy", choices=["ddp", "deepspeed", "fsdp2"], default=None,
                   help="how the processes share the work (LoRA: ddp; full fine-tunes are not planned yet)")
    p.add_argument("--no-shared-host", action="store_true",
                   help="with --gpus: each process keeps its own host copy of the streamed blocks")
    p.add_argument("--load-at-once", action="store_true",
                   help="with --gpus: the processes load the model at the same time "
                        "([distributed] load_in_turns = false) instead of one after another")


def run(args: argparse.Namespace) -> int:
    from ..planner.machine import gpu_device_visible

    keep = bool(args.model) and not args.config and not gpu_device_visible()
    if keep:
        from ..planner.answer_cache import load_answer

        answer = load_answer(_question(args))
        if answer is not None:
            return _replay(answer, args.json, getattr(args, "gpu", None))
    if not keep:
        return _run(args)
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc, machine = _run(args, with_machine=True)
    sys.stdout.write(out.getvalue())
    sys.stderr.write(err.getvalue())
    if not machine.measured:
        from ..planner.answer_cache import save_answer

        save_answer(_question(args), {"stdout": out.getvalue(), "stderr": err.getvalue(), "rc": rc,
                                      "machine": {"describe": machine.describe(), **machine.to_dict()}})
    return rc


def _question(args: argparse.Namespace) -> dict:
    """Every flag of the command: what a kept answer is the answer to."""
    return {k: v for k, v in sorted(vars(args).items()) if not callable(v)}


def _replay(answer: dict, as_json: bool, gpu: str | None = None) -> int:
    """Print a kept answer with this machine's host RAM as it is now (`gpu`: the --gpu it was for)."""
    from ..planner.machine import assumed_machine

    if gpu:
        from ..planner.cards import card_machine

        machine = card_machine(gpu)
    else:
        machine = assumed_machine()
    kept = answer["machine"]
    if kept.get("disk_read"):                  # the disk tier's rate, as the answer was planned with
        from ..planner.machine import with_disk

        machine = with_disk(machine, kept["disk_read"], kept.get("disk") or "")
    stdout = answer["stdout"]
    if as_json:
        out = json.loads(stdout)
        out["machine"] = machine.to_dict()
        for entry in out.get("plans", []):
            notes = entry.get("plan", {}).get("notes")
            if isinstance(notes, dict) and "machine" in notes:
                notes["machine"] = machine.describe()
        stdout = json.dumps(out, indent=2, default=str) + "\n"
    else:
        stdout = stdout.replace(answer["machine"]["describe"], machine.describe())
    from ..planner.answer_cache import describe_origin

    sys.stdout.write(stdout)
    sys.stderr.write(answer["stderr"])
    print(describe_origin(answer), file=sys.stderr)
    return int(answer["rc"])


def _run(args: argparse.Namespace, with_machine: bool = False):
    from ..config import ConfigError, parse_size
    from ..planner.machine import probe_machine
    from ..planner.report import format_plan
    from ..planner.search import Planner
    from ..planner.workload import UNLIMITED_RAM, Budget, InfeasibleBudget

    if bool(args.config) == bool(args.model):
        raise ConfigError(f"give either a config file or --model {'|'.join(sorted(MODELS))}")
    if getattr(args, "gpu", None):
        from ..planner.cards import card_machine

        machine = card_machine(args.gpu)
    else:
        machine = probe_machine()
    if args.config:
        spec, source, build, workload, vram_values, ram_value, config_sets, disk_dir = _from_config(args)
    else:
        spec, source, build, workload = _from_flags(args)
        vram_values, ram_value, config_sets, disk_dir = args.vram, args.ram, set(), None
    machine = _with_disk(machine, args, args.disk_dir or disk_dir)
    if not vram_values:
        raise ConfigError("no VRAM budget: give --vram SIZE (or set [memory] vram_budget in the config)")
    ram = None
    if ram_value is not None:
        try:
            ram = parse_size(ram_value)
        except ValueError as e:
            raise ConfigError(f"--ram / [memory] ram_budget: {e}") from None
    elif not machine.measured:
        # No GPU here, so the run will happen on another machine: this one's RAM says nothing about it.
        ram = UNLIMITED_RAM
    _check_ranks(args, workload)
    budgets = [Budget(vram=_vram_bytes(v, machine), ram=ram) for v in vram_values]
    measured = _measured(spec, source, build, workload)
    planner = Planner(spec, measured, workload, machine)
    results, failed = [], 0
    for value, budget in zip(vram_values, budgets):
        try:
            results.append((value, budget, planner.plan(budget), None))
        except InfeasibleBudget as e:
            failed += 1
            results.append((value, budget, None, e))
    ranks = _ranks(args, planner, results)
    phase = _text_phase(spec, workload, args)
    better = _better(args, spec, measured, workload, machine, results, config_sets)
    if args.json:
        out = _as_json(workload, machine, results)
        for entry, numbers, found in zip(out["plans"], ranks, better):
            if numbers is not None:
                entry["processes"] = {"count": args.gpus, **numbers}
            entry["better_choices"] = [{"key": b.choice.key, "flag": b.choice.flag, "why": b.why,
                                        "trade_off": b.choice.trade_off, "plan": b.plan.to_dict()} for b in found]
        if phase is not None:
            out["text_encoding"] = phase
        print(json.dumps(out, indent=2, default=str))
    else:
        _print_text(results, format_plan, ranks, args, better)
        if phase is not None:
            print("\n" + _text_phase_line(phase, vram_values, budgets, ram))
    rc = 1 if failed else 0
    return (rc, machine) if with_machine else rc


def _with_disk(machine, args, disk_dir):
    """The machine with the disk tier of --disk-read (a given rate) or of --disk-dir / the config's
    [memory] disk_dir (its disk's rate, planner/disk_rate.py); as it is without either."""
    from ..config import ConfigError, check_disk_dir
    from ..planner.machine import with_disk

    if args.disk_read is not None:
        if not args.disk_read > 0:
            raise ConfigError(f"--disk-read must be a positive rate in GB/s, got {args.disk_read}")
        return with_disk(machine, args.disk_read * 1e9, f"{args.disk_read:.2f} GB/s read (given: --disk-read)")
    if disk_dir is None:
        return machine
    from ..planner.disk_rate import disk_read_rate

    key = f"--disk-dir {args.disk_dir}" if args.disk_dir else f"[memory] disk_dir = {str(disk_dir)!r}"
    try:
        check_disk_dir(Path(disk_dir), key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    rate = disk_read_rate(disk_dir)
    return with_disk(machine, rate.read, rate.describe())


def _better(args, spec, measured, workload, machine, results, config_sets: set[str]) -> list[list]:
    """Per budget, the settings the user did not choose that would make its plan several times
    faster or smaller (planner/choices.py). One process only: --gpus N plans are not re-priced."""
    from ..planner.choices import better_choices, chosen_fields
    from ..planner.search import Planner

    if args.gpus > 1:
        return [[] for _ in results]
    chosen = chosen_fields(vars(args), config_sets)
    planners: dict = {}

    def make(w):
        if w not in planners:
            planners[w] = Planner(spec, measured, w, machine)
        return planners[w]

    return [better_choices(make, workload, budget, plan, chosen) for _, budget, plan, _ in results]


def _check_ranks(args, workload) -> None:
    from ..config import ConfigError

    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if args.strategy not in (None, "ddp") and workload.mode == "lora":
        raise ConfigError(f"--strategy {args.strategy}: shards a full fine-tune; LoRA training uses ddp")
    if args.gpus > 1 and workload.mode == "full":
        raise ConfigError(f"--gpus {args.gpus} with --mode full: this command plans a full fine-tune on one GPU "
                          f"(its weights stream with their optimizer state); plan it with --gpus 1")


def _ranks(args, planner, results) -> list:
    """Per-process and machine numbers of each plan for --gpus N (None for one process)."""
    from ..planner.ranks import per_rank

    if args.gpus <= 1:
        return [None] * len(results)
    grad_bytes = planner.trainable_bytes()[1]
    return [per_rank(plan, args.gpus, grad_bytes, shared=not args.no_shared_host,
                     turns=not args.load_at_once) if plan is not None else None
            for _, _, plan, _ in results]


def _measured(spec, source: str, build, workload):
    """The model as the planner measures it: from the cache when this source and workload shape
    were planned before (no model built, nothing traced), else measured from `build()` and kept."""
    from ..planner.spec_cache import load_measured, measure_model, save_measured

    measured = load_measured(source, workload)
    if measured is None:
        measured = measure_model(spec, build(), workload)
        save_measured(source, workload, measured)
    return measured


def _vram_bytes(value: str, machine) -> int:
    from ..planner.from_config import parse_vram

    return parse_vram(value, machine, "--vram")


def _from_flags(args):
    """(spec, model source, how to build it, workload) of the --model form."""
    from dataclasses import replace

    from ..models.family import get_family
    from ..planner.meta import build_meta_packaged
    from ..planner.spec_cache import source_key
    from ..planner.workload import Workload

    config_name, family = MODELS[args.model], get_family(MODEL_FAMILY[args.model])
    workload = Workload(
        mode=args.mode or "lora", rank=args.rank or 16, targets=args.targets or "attention_mlp",
        adapter=args.lora_type or "lora",
        optimizer=args.optimizer or "adamw", batch_size=args.batch_size or 1,
        gradient_accumulation=args.accumulation or 1, buckets=_buckets(args.resolution or [1024]),
        frames=_latent_frames(args.frames, family),
        text_length=family.text_rows(args.text_length or TEXT_TOKENS[args.model]), autocast=not args.no_autocast,
        references=args.references or 0,
        allow_fp8=not args.no_fp8 and args.lora_type != "dora",     # DoRA reads its base weights (no fp8)
        fp8_modulation=False if args.lora_type == "dora" else _MODULATION_FLAG[args.fp8_modulation or "auto"],
        split_blocks=_MODULATION_FLAG[args.split_blocks or "auto"],
        quantizes_on_load=(args.mode or "lora") != "inference",      # as the trainer loads
        **_full_flags(args, lora_default="auto"))          # [lora] optimizer_step's default
    workload = replace(workload, **_base_format_flags(args, workload))
    workload = replace(workload, **_expert_terms(args, args.model, args.expert == "both",
                                                 (args.lora_experts or "each") == "shared"))
    _check_workload(workload, family)
    return (family.spec, source_key(f"packaged:{config_name}", "bf16"),
            lambda: build_meta_packaged(family.name, config_name), workload)


def _from_config(args):
    """(spec, model source, how to build it, workload, VRAM budgets, RAM budget) of the config form."""
    from dataclasses import replace

    from ..config import load_config
    from ..models.family import get_family
    from ..planner.from_config import workload_from_config
    from ..planner.spec_cache import source_key

    cfg = load_config(args.config, args.overrides)
    workload = workload_from_config(cfg)
    mode = args.mode or ("full" if cfg.train.mode == "full" else None)
    asked = {"mode": mode, "rank": args.rank, "targets": args.targets, "optimizer": args.optimizer,
             "batch_size": args.batch_size, "gradient_accumulation": args.accumulation,
             "text_length": args.text_length, "buckets": _buckets(args.resolution) if args.resolution else None,
             "references": args.references,
             "frames": _latent_frames(args.frames, get_family(cfg.model.family)) if args.frames else None}
    changes = {k: v for k, v in asked.items() if v is not None}
    changes.update(_full_flags(args, mode=changes.get("mode", workload.mode)))
    both = args.expert == "both" if args.expert is not None else cfg.model.expert == "both"
    shared = (args.lora_experts or cfg.lora.experts) == "shared"
    changes.update(_expert_terms(args, cfg.model.family, both, shared))
    if args.lora_type is not None:
        changes["adapter"] = args.lora_type
    if args.no_fp8 or changes.get("adapter", workload.adapter) == "dora":
        changes["allow_fp8"] = False
    if args.fp8_modulation is not None:
        changes["fp8_modulation"] = _MODULATION_FLAG[args.fp8_modulation]
    if args.split_blocks is not None:
        changes["split_blocks"] = _MODULATION_FLAG[args.split_blocks]
    if args.no_autocast:
        changes["autocast"] = False
    changes["quantizes_on_load"] = changes.get("mode", workload.mode) != "inference"   # the sampler loads as stored
    workload = replace(workload, **changes)
    if args.base_format is not None or args.max_base_error is not None:
        workload = replace(workload, **_base_format_flags(args, workload, cfg.memory.max_base_error))
    _check_workload(workload, get_family(cfg.model.family))
    vram = args.vram or ([cfg.memory.vram_budget] if cfg.memory.vram_budget else None)
    keep_mod = workload.fp8_modulation is not False
    source = source_key(_transformer_source(cfg), cfg.model.dtype + ("" if keep_mod else "|modulation upcast"))
    ram = args.ram if args.ram is not None else cfg.memory.ram_budget
    config_sets = ({"optimizer"} & cfg.train.model_fields_set) | (
        {"state_dtype", "streamed_step"} & cfg.full.model_fields_set) | (
        {"lora_step"} if "optimizer_step" in cfg.lora.model_fields_set else set())
    return (get_family(cfg.model.family).spec, source, lambda: meta_model_for_config(cfg, keep_mod), workload, vram,
            ram, config_sets, cfg.resolve(cfg.memory.disk_dir))


def _base_format_flags(args, workload, config_bound: float | None = None) -> dict:
    """The Workload's base-format terms of --base-format / --max-base-error (as [memory]
    base_format / max_base_error give them a run: planner/from_config.base_format_terms)."""
    from ..planner.base_formats import auto_candidates

    fmt = args.base_format or "auto"
    if args.max_base_error is not None and args.max_base_error <= 0:
        from ..config import ConfigError
        raise ConfigError(f"--max-base-error {args.max_base_error}: a percentage above 0")
    if fmt == "bf16":
        return {"allow_fp8": False, "base_formats": ("fp8",), "base_pinned": False}
    if fmt != "auto":
        return {"base_formats": (fmt,), "base_pinned": True}
    bound = args.max_base_error if args.max_base_error is not None else config_bound
    return {"base_formats": auto_candidates(workload.mode, workload.adapter, workload.allow_fp8) or ("fp8",),
            "max_base_error": bound, "base_pinned": False}


def _resolution(text: str):
    """--resolution's value: "1024" (square) or "HxW" ("480x832"), as an int or (height, width)."""
    parts = text.lower().split("x")
    try:
        values = [int(v) for v in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r}: give pixels (1024) or HEIGHTxWIDTH (480x832)")
    return values[0] if len(values) == 1 else (values[0], values[1])


def _buckets(values) -> tuple[tuple[int, int], ...]:
    """--resolution values as the workload's (height, width) buckets."""
    return tuple((int(v), int(v)) if isinstance(v, int) else tuple(int(x) for x in v) for v in values)


def _latent_frames(frames: int | None, family) -> int:
    """--frames N as the workload's latent frames (1 without it); an image family or a length its
    VAE cannot encode is a ConfigError naming --frames."""
    from ..config import ConfigError

    if frames is None or frames == 1:
        return 1
    if family.video is None:
        raise ConfigError(f"--frames {frames}: {family.name} trains on images; leave --frames out")
    try:
        return family.video.latent_frames(frames)
    except ValueError as e:
        raise ConfigError(f"--frames {frames}: {e}") from None


def _full_flags(args, lora_default: str | None = None, mode: str | None = None) -> dict:
    """The --mode full flags given, as Workload fields, and a LoRA's --lora-step (`lora_default`
    where the flag is absent: [lora] optimizer_step's default)."""
    lora = (mode or args.mode or "lora") == "lora"
    out = {"state_dtype": args.state_dtype, "master_weights": args.master_weights or None,
           "full_exclude": tuple(args.exclude) if args.exclude else None, "streamed_step": args.streamed_step,
           "lora_step": (args.lora_step or lora_default) if lora else (args.lora_step or "device")}
    return {k: v for k, v in out.items() if v is not None}


def _lora_types() -> list[str]:
    """The --lora-type choices: [lora] type's own values."""
    import typing

    from ..config import LoraConfig

    return list(typing.get_args(LoraConfig.model_fields["type"].annotation))


def _optimizers() -> list[str]:
    """The --optimizer choices: [train] optimizer's own values."""
    import typing

    from ..config import TrainConfig

    return list(typing.get_args(TrainConfig.model_fields["optimizer"].annotation))


TWO_EXPERTS = ("wan2.2-a14b", "wan2.2")       # the stock model and the config family with two experts


def _expert_terms(args, model: str, both: bool, shared: bool) -> dict:
    """The Workload's terms for both experts in one run (planner_for_config prices the trainer's
    two parts so: the idle expert held beside the computing one, and its LoRA unless shared)."""
    from ..config import ConfigError

    if args.lora_experts is not None and not both:
        raise ConfigError("--lora-experts is for --expert both (a LoRA per expert or one for both)")
    if not both:
        return {}
    if model not in TWO_EXPERTS:
        raise ConfigError(f"--expert both: {model} has one transformer; wan2.2-a14b has two experts")
    return {"other_parts": 1, "other_adapters": 0 if shared else 1}


def _check_workload(w, family) -> None:
    from ..config import LORA_HOST_STEP_OPTIMIZERS, MAX_RESOLUTION, PACKAGE_ONLY_LORA, ConfigError
    from ..models.family import prices_references

    if w.references:
        most = family.references.most if family.references is not None else 0
        if w.references < 0:
            raise ConfigError(f"--references must be >= 0, got {w.references}")
        if not prices_references(family):
            raise ConfigError(f"--references {w.references}: the planner does not price reference images for "
                              f"{family.name} yet (it plans its text to image steps); leave --references out")
        if w.references > most:
            raise ConfigError(f"--references {w.references}: {family.name} takes at most {most} reference images")

    if w.mode != "full" and (w.state_dtype != "fp32" or w.master_weights or w.full_exclude
                             or w.streamed_step != "auto"):
        raise ConfigError("--state-dtype, --exclude, --master-weights and --streamed-step are for --mode full")
    if w.mode != "lora" and w.lora_step != "device":
        raise ConfigError("--lora-step is for LoRA training (a full fine-tune's is --streamed-step)")
    if w.mode == "lora" and w.lora_step == "host" and w.optimizer not in LORA_HOST_STEP_OPTIMIZERS:
        raise ConfigError(f"--lora-step host with --optimizer {w.optimizer}: a LoRA's host step runs "
                          f"{' or '.join(LORA_HOST_STEP_OPTIMIZERS)}")
    if w.mode == "full" and w.optimizer in PACKAGE_ONLY_LORA:
        raise ConfigError(f"--optimizer {w.optimizer}: for LoRA training; --mode full uses adamw, adafactor or "
                          f"adamw8bit")
    for h, wd in w.buckets:
        if h < 64 or h % 16 or wd < 64 or wd % 16:
            raise ConfigError(f"--resolution {h if h == wd else f'{h}x{wd}'}: must be a multiple of 16 of at least 64")
        if max(h, wd) > MAX_RESOLUTION:      # a run refuses it too ([data] resolutions): no plan is for it
            raise ConfigError(f"--resolution {max(h, wd)}: at most {MAX_RESOLUTION}, as [data] resolutions")
    for name, value in (("rank", w.rank), ("batch size", w.batch_size), ("accumulation", w.gradient_accumulation),
                        ("text length", w.text_length)):
        if value < 1:
            raise ConfigError(f"--{name.replace(' ', '-')} must be >= 1, got {value}")


def _transformer_source(cfg) -> Path:
    """The transformer file or folder of a config, with a config error naming [model] if there is none."""
    from ..config import ConfigError
    from ..models.family import get_family

    try:
        sources = get_family(cfg.model.family).resolve_sources(cfg.model, Path(cfg.base_dir))
    except (OSError, ValueError) as e:     # the message already names [model] and the path
        raise ConfigError(f"{e}; to plan without the weights, use --model with one of {', '.join(sorted(MODELS))}") from None
    if sources.transformer is None:
        raise ConfigError(f"[model] path = {cfg.model.path!r}: no transformer found to read the architecture from")
    return Path(sources.transformer)


def meta_model_for_config(cfg, fp8_modulation: bool | None = None):
    """The config's transformer on the meta device exactly as the loader would hold it: the
    architecture from config.json or a single file's header, every tensor in the dtype loading gives
    it (block weights a file stores in e4m3 stay e4m3, with their scales; the modulation Linears
    unless `fp8_modulation` is False, default: unless the config's [memory] fp8_modulation is false).
    No tensor is read."""
    from ..config import ConfigError
    from ..models.family import get_family, loader_options
    from ..models.component_loading import dtype_from_name
    from ..models.weights import LoadError

    _transformer_source(cfg)
    family = get_family(cfg.model.family)
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    try:
        options = {} if fp8_modulation is not False else {"fp8_modulation": False}
        if fp8_modulation is None:
            options = loader_options(cfg.memory)
        model = family.load_transformer(sources, dtype=dtype_from_name(cfg.model.dtype), device="meta", **options)
    except (OSError, LoadError) as e:
        raise ConfigError(f"{e}; cannot read the transformer architecture: plan with --model (one of {', '.join(sorted(MODELS))}) instead") from None
    from ..memory.switched import parts_of

    parts = parts_of(model)      # parts that compute one at a time (Wan 2.2's experts): priced as one, the
    return model if parts is None else next(iter(parts.values()))   # rest as other_parts (planner_for_config)


def _as_json(workload, machine, results) -> dict:
    out = []
    for value, budget, plan, error in results:
        entry = {"vram": value, "budget_bytes": budget.vram}
        if plan is not None:
            entry["plan"] = plan.to_dict()
        else:
            entry["error"] = str(error)
            entry["needed_vram"] = error.needed_vram
            entry["needed_ram"] = error.needed_ram
        out.append(entry)
    return {"workload": workload.describe(), "machine": machine.to_dict(), "plans": out}


def _text_phase_line(phase: dict, vram_values, budgets, ram: int | None) -> str:
    """What the caching phase's text encoding costs, in words: on the GPU per budget, and in host
    RAM as the encoder will be loaded under the host-RAM budget (whole, or read from its files)."""
    from ..host import host_ram
    from ..models.streamed_encoder import HOST_MARGIN
    from ..models.text_phase import from_files
    from ..planner.workload import UNLIMITED_RAM

    gib = 2**30
    fits = ", ".join(f"{'fits' if phase['device'] <= b.vram - b.margin_bytes else 'does NOT fit'} {v}"
                     for v, b in zip(vram_values, budgets))
    cut = phase.get("layers_run", 0) < phase.get("layers", 0)
    layers = f", {phase['layers_run']} of its {phase['layers']} layers" if cut else ""
    vision = phase.get("vision")
    refs = ""
    if vision is not None:
        n = phase["references"]
        refs = (f"; a caption with its {n} reference{'s' if n > 1 else ''} is encoded alone: "
                f"{phase['edit']['tokens']} tokens, the vision tower ({vision['weights'] / gib:.2f} GiB) streamed "
                f"unit by unit over {vision['patches']} patches, {vision['streamed_weights'] / gib:.2f} GiB of it "
                f"on the GPU at once")
    line = (f"text encoding (caching phase, once per caption; the text encoder streamed layer by layer{layers}"
            f"{refs}): {phase['device'] / gib:.2f} GiB on the GPU ({fits}), ")
    if "host_streamed" not in phase:
        return line + f"{phase['host'] / gib:.2f} GiB host RAM while it runs (freed before training)"
    # the caching phase decides against [memory] ram_budget, else the RAM available then (this machine's)
    budget = host_ram()[1] if ram is None else None if ram >= UNLIMITED_RAM else ram
    whole, streamed = phase["host"] / gib, phase["host_streamed"] / gib
    if from_files(phase, budget):
        return line + (f"{streamed:.2f} GiB host RAM: the encoder ({whole:.2f} GiB) does not fit the host-RAM "
                       f"budget, so each layer is read from its files when it runs")
    return line + (f"{whole:.2f} GiB host RAM while it runs (freed before training); {streamed:.2f} GiB when "
                   f"read from its files, as it is under a host-RAM budget below {whole / HOST_MARGIN:.1f} GiB")


def _text_phase(spec, workload, args) -> dict | None:
    """The family's priced text-encoding phase (ModelFamily.text_phase) for the config's text encoder,
    or the packaged one with --model; None for a family without one."""
    from ..models.family import get_family

    import inspect

    family = get_family(spec.family)
    if family.text_phase is None:
        return None
    extra = {"references": workload.references} if workload.references else {}
    if extra and "references" not in inspect.signature(family.text_phase).parameters:
        extra = {}
    if args.config:
        from ..config import load_config

        cfg = load_config(args.config, args.overrides)
        return family.text_phase(workload.text_length, model_cfg=cfg.model, base_dir=cfg.base_dir, **extra)
    return family.text_phase(workload.text_length, **extra)


def _print_text(results, format_plan, ranks, args, better) -> None:
    from ..planner.ranks import format_ranks

    for i, ((value, budget, plan, error), numbers, found) in enumerate(zip(results, ranks, better)):
        if i:
            print()
        print(f"== VRAM budget {value} ({budget.vram / 2**30:.2f} GiB) ==")
        if plan is not None:
            print(format_plan(plan))
            if numbers is not None:
                print(format_ranks(numbers, args.gpus, not args.no_shared_host, not args.load_at_once))
        else:
            print(f"infeasible: {error}", file=sys.stderr)
            print(f"infeasible: smallest working budget {error.needed_vram / 2**30:.2f} GiB"
                  if error.needed_vram else "infeasible: host RAM")
        for b in found:
            print(b.describe(plan.notes["predicted_step_s"] if plan is not None else None))


def _cards() -> list[str]:
    """The --gpu choices: the cards planner/cards.py knows (torch-free)."""
    from ..planner.cards import CARDS

    return list(CARDS)
