"""The planner's entry points for a run: a config in, a Workload, a Budget, a Planner and a Plan out.

The trainer calls `planner_for_config` + `choose_plan` (and keeps the Planner and Budget for the
runtime feedback, feedback/); the sampler and `leantune plan` build a Workload themselves and call
`plan_memory` or `Planner.plan`.
"""

from __future__ import annotations

from pathlib import Path

import dataclasses
import logging
import math

import torch

from ..config import ConfigError, parse_size
from ..memory.plan import Plan
from ..memory.switched import parts_of
from .corrections import Calibration, CalibrationStore, architecture_key
from .machine import Machine, probe_machine
from .report import format_plan
from .search import Planner
from .workload import Budget, InfeasibleBudget, Workload

log = logging.getLogger("leantune")


def plan_memory(spec, model_or_meta: torch.nn.Module, workload: Workload, budget: Budget,
                machine: Machine | None = None, calibration: Calibration | None = None) -> Plan:
    """The fastest plan for `workload` on `model_or_meta` (real or meta weights) within `budget`.

    `plan.notes` carries the predicted peaks with their breakdowns, the predicted step time and
    the machine it assumed. Raises InfeasibleBudget when nothing fits.
    """
    return Planner(spec, model_or_meta, workload, machine, calibration).plan(budget)


def workload_from_config(cfg, model: torch.nn.Module | None = None) -> Workload:
    """The Workload a [data]/[lora]/[full]/[train]/[model] configuration trains."""
    from ..models.family import get_family
    from ..models.component_loading import dtype_from_name

    text_rows = get_family(cfg.model.family).text_rows(cfg.data.max_text_length)   # SD3: 77 CLIP + T5
    tc, full = cfg.train, cfg.full
    # DoRA reads the base weights (train/lora._refuse_fp8_base_for_dora): never stored in fp8, for
    # the trained adapter and for a DoRA file among the base adapters alike
    adapters = base_adapters_read(cfg)
    dora = (tc.mode == "lora" and cfg.lora.type == "dora") or any(
        a.weights.kind == "dora" for stack in (adapters or ()) for a in (stack or ()))
    return Workload(mode=tc.mode, rank=cfg.lora.rank, targets=cfg.lora.targets, lora_blocks=cfg.lora.blocks,
                    adapter=cfg.lora.type, lokr_factor=cfg.lora.factor, lokr_decompose_both=cfg.lora.decompose_both,
                    allow_fp8=not dora,
                    optimizer=tc.optimizer, batch_size=cfg.data.batch_size,
                    buckets=Workload.square(cfg.data.resolutions), text_length=text_rows,
                    references=reference_count(cfg), frames=clip_frames(cfg),
                    gradient_accumulation=tc.gradient_accumulation,
                    autocast=tc.mixed_precision == "bf16", dtype=dtype_from_name(cfg.model.dtype),
                    lora_dropout=cfg.lora.dropout,
                    fp8_modulation=False if dora else fp8_modulation_choice(cfg.memory),
                    split_blocks=None if cfg.memory.split_blocks == "auto" else cfg.memory.split_blocks,
                    full_train=tuple(full.train), full_exclude=tuple(full.exclude),
                    state_dtype=full.state_dtype, master_weights=full.master_weights,
                    streamed_step=full.streamed_step,
                    lora_step=cfg.lora.optimizer_step if tc.mode == "lora" else "device",
                    stochastic_rounding=full.stochastic_rounding,
                    clip_per_param=tc.max_grad_norm > 0 and full.grad_clip == "parameter",
                    quantizes_on_load=True,      # the trainer's load (trainer._fp8_load_options)
                    **base_format_terms(cfg, dora, adapters), **preview_terms(cfg, adapters), **recipe_terms(cfg))


def base_format_terms(cfg, dora: bool, adapters: tuple | None) -> dict:
    """The Workload's base-format terms ([memory] base_format, max_base_error; base_formats.py):
    "auto" prices int8 and NF4 beside fp8 for a LoRA, LoKr or LoHa whose base adapters are plain
    LoRAs (base_formats.auto_candidates says why not the others), "int8" / "nf4" pin that format
    (the trainer loads the base so, and every plan stores it so)."""
    from .base_formats import auto_candidates

    fmt = cfg.memory.base_format
    if fmt in ("int8", "nf4"):
        return {"base_formats": (fmt,), "base_pinned": True}
    if fmt != "auto":
        return {}
    plain = all(a.weights.kind == "lora" for stack in (adapters or ()) for a in (stack or ()))
    formats = auto_candidates(cfg.train.mode, cfg.lora.type, not dora, plain)
    return {"base_formats": formats or ("fp8",), "max_base_error": cfg.memory.max_base_error}


def recipe_terms(cfg) -> dict:
    """The Workload's terms for the recipe options that cost memory or time beyond the step: [ema]'s
    host shadow, DOP's base prediction on the prior steps ([data] prior_ratio of them) and
    [validation]'s passes (held-out images in batches of [data] batch_size, times its noise levels,
    every `every` steps). The held-out images are counted, not read: a folder's image files, or the
    share of the training datasets' files [validation] fraction takes (data/held_out.py chooses by
    content; duplicates make it a little smaller). A folder not there yet counts 0 here; the
    trainer names it when it scans."""
    terms = {}
    if cfg.ema.enabled:
        terms["ema"] = True
    if cfg.data.prior_loss == "dop" and any(d.role == "prior" for d in cfg.data.datasets):
        terms["dop_share"] = float(cfg.data.prior_ratio)
    held_out = held_out_count(cfg)
    if held_out:
        v = cfg.validation
        passes = math.ceil(held_out / cfg.data.batch_size) * len(v.sigmas)
        terms["validation_forwards_per_step"] = passes / v.every
    return terms


def clip_frames(cfg) -> int:
    """The latent frames a step prices: for a video family whose datasets hold a clip (a video file
    or an image-sequence folder, data/video.py, listed by name, not decoded), those of [data]
    max_frames, the longest frame bucket a clip trains in (shorter clips and stills cost less: the
    plan is sized for the longest); 1 otherwise (images)."""
    from ..models.family import get_family

    video = get_family(cfg.model.family).video
    if video is None or not any(_holds_clips(cfg.resolve(d.path), d.recursive) for d in cfg.data.datasets):
        return 1
    return video.latent_frames(cfg.data.max_frames)


def _holds_clips(folder: Path, recursive: bool) -> bool:
    """Whether a dataset folder holds a video file or an image sequence (False when unlistable)."""
    from ..data.video import VIDEO_EXTENSIONS, sequence_frames

    try:
        entries = list(folder.rglob("*") if recursive else folder.iterdir())
    except OSError:
        return False
    return any((p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS) or (p.is_dir() and sequence_frames(p))
               for p in entries if not p.name.startswith("."))


def reference_count(cfg) -> int:
    """The references a training step conditions on, for a family whose probe prices them
    (activation_probe.prices_references): the most any target of the datasets has, counted by file
    name in the reference folders (data/references.py matches by stem: the trainer requires one
    count for the whole run and names a target that differs). 0 for other families, datasets
    without reference_path and folders that cannot be listed (the trainer's scan names those)."""
    from ..data.dataset import _image_files, _TooManyFiles
    from ..data.references import _index, find_references, reference_folder
    from ..models.family import get_family, prices_references

    if not prices_references(get_family(cfg.model.family)):
        return 0
    most = 0
    for d in cfg.data.datasets:
        folder = reference_folder(d, cfg.base_dir)
        if folder is None or not folder.is_dir():
            continue
        try:
            index = _index(folder)
            targets = _image_files(Path(cfg.resolve(d.path)), d.recursive).files
        except (OSError, _TooManyFiles):
            continue
        for target in targets:
            if Path(target).parent.resolve() != folder.resolve():
                most = max(most, len(find_references(index, Path(target).stem)))
    return most


def held_out_count(cfg) -> int:
    """How many images [validation] holds out (recipe_terms); 0 without [validation] or where a
    folder cannot be listed."""
    from pathlib import Path

    from ..data.dataset import _image_files, _TooManyFiles

    v = cfg.validation

    def count(path, recursive: bool) -> int:
        folder = Path(cfg.resolve(path))
        try:
            return len(_image_files(folder, recursive).files) if folder.is_dir() else 0
        except (OSError, _TooManyFiles):      # the trainer's scan names it; the plan counts none
            return 0

    if v.path is not None:
        return count(v.path, cfg.data.datasets[0].recursive)
    if v.fraction is not None:
        images = sum(count(d.path, d.recursive) for d in cfg.data.datasets if d.role == "train")
        return max(1, math.floor(v.fraction * images)) if images > 1 else 0
    return 0


def base_adapters_read(cfg) -> tuple | None:
    """[model] base_adapters and the [sample] ones the previews attach (None when previews use
    [model]'s or there are no previews), each file read once for every term that needs them (their
    bytes, and whether one is a DoRA, which the engine refuses over fp8 weights: the plan must not
    store them so); None when the run has neither."""
    from ..models.family import get_family

    previews = bool(cfg.sample.every and cfg.sample.prompts)     # the trainer attaches [sample]'s only then
    if not cfg.model.base_adapters and not (cfg.sample.base_adapters and previews):
        return None
    from ..train.base_adapters import read_run_adapters

    training, sampling = read_run_adapters(cfg.model, cfg.sample, cfg.resolve,
                                           get_family(cfg.model.family).spec.lora_keys)
    return training, (sampling if previews else None)


def preview_terms(cfg, adapters: tuple | None) -> dict:
    """The Workload's terms for [model] / [sample] base_adapters (their bytes, each file once:
    train/base_adapters.priced_bytes, and each weight by its module, which a streamed block carries:
    priced_tensors; a preview on another base carries [sample]'s) and a [sample] base (its
    transformer's bytes as loaded, built on meta: models/other_base.other_base_bytes); none when
    the run has neither. `adapters`: base_adapters_read(cfg)."""
    from pathlib import Path

    from ..models.family import loader_options
    from ..models.component_loading import dtype_from_name

    terms = {}
    previews = bool(cfg.sample.every and cfg.sample.prompts)
    if adapters is not None:
        from ..train.base_adapters import priced_bytes, priced_tensors, unit_tensors

        training, sampling = adapters
        terms["frozen_adapter_bytes"] = priced_bytes(training, sampling)
        terms["frozen_adapter_tensors"] = priced_tensors(training, sampling)
        if cfg.sample.base is not None and previews:       # the other base carries the preview's stack
            terms["preview_adapter_tensors"] = unit_tensors(training if sampling is None else sampling)
    if cfg.sample.base is not None and previews:
        from ..models.other_base import other_base_bytes

        terms["preview_base_bytes"] = other_base_bytes(cfg.model, cfg.resolve(cfg.sample.base), Path(cfg.base_dir),
                                                       dtype_from_name(cfg.model.dtype), **loader_options(cfg.memory))
    return terms


def fp8_modulation_choice(memory_cfg) -> bool | None:
    """[memory] fp8_modulation as the Workload takes it: "auto" -> None (the planner's call)."""
    value = memory_cfg.fp8_modulation
    return None if value == "auto" else bool(value)


def parse_vram(value, machine: Machine, key: str) -> int:
    """A VRAM budget in bytes from a size ("8GiB") or "auto" (the free VRAM of the GPU here).

    `key` names where the value came from ("[memory] vram_budget", "--vram") in the error.
    """
    if str(value).strip().lower() == "auto":
        if machine.vram_free is None:
            raise ConfigError(f'{key} = "auto" needs a GPU to measure free VRAM; none is visible here, so give '
                              f'a size such as "8GiB"')
        return machine.vram_free
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def budget_from_config(memory_cfg, machine: Machine) -> Budget:
    """[memory] vram_budget / ram_budget as a Budget; "auto" is the free VRAM of the GPU here."""
    if memory_cfg.vram_budget is None:
        raise ConfigError("[memory] vram_budget is not set; the planner needs a budget (\"auto\" or a size)")
    vram = parse_vram(memory_cfg.vram_budget, machine, "[memory] vram_budget")
    ram = None
    if memory_cfg.ram_budget is not None:
        try:
            ram = parse_size(memory_cfg.ram_budget)
        except ValueError as e:
            raise ConfigError(f"[memory] ram_budget: {e}") from None
    return Budget(vram=vram, ram=ram)


def with_disk_tier(cfg, machine: Machine) -> Machine:
    """The machine with the disk tier of [memory] disk_dir (its disk's read rate, measured once
    per disk and kept: planner/disk_rate.py), for a run that can use it (not a full fine-tune);
    as it is otherwise, or when it carries a disk rate already (agreed by several processes)."""
    if cfg.memory.disk_dir is None or cfg.train.mode == "full" or machine.disk_read is not None:
        return machine
    from .disk_rate import disk_read_rate
    from .machine import with_disk

    rate = disk_read_rate(cfg.resolve(cfg.memory.disk_dir))
    return with_disk(machine, rate.read, rate.describe())


def explicit_disk_room(memory_cfg) -> int:
    """Host bytes the streamed blocks' buffers may take under the explicit [memory] choices with
    [memory] disk_dir (no vram_budget, so no priced plan): [memory] ram_budget (else the default
    host-RAM budget) less the process baseline the planner prices (host_model.HOST_BASELINE); the
    streamed blocks beyond it are read from disk. Offloaded activations and caches are not
    subtracted here: a vram_budget has the planner price them and choose the tiers."""
    from .host_model import HOST_BASELINE
    from .workload import default_ram_budget

    if memory_cfg.ram_budget is not None:
        try:
            ram = parse_size(memory_cfg.ram_budget)
        except ValueError as e:
            raise ConfigError(f"[memory] ram_budget: {e}") from None
    else:
        ram = default_ram_budget()
    return max(0, ram - HOST_BASELINE)


def planner_for_config(cfg, spec, model: torch.nn.Module, machine: Machine | None = None,
                       store: CalibrationStore | None = None) -> tuple[Planner, Budget]:
    """The Planner and Budget of a run, with the stored calibration of its architecture and
    workload; the trainer keeps them for OomGuard and PlanCalibrator."""
    machine = with_disk_tier(cfg, machine or probe_machine())
    parts = parts_of(model)
    if parts is not None:        # parts that compute one at a time (memory/switched.py): priced as one, the rest parked
        model = next(iter(parts.values()))
    workload = workload_from_config(cfg, model)
    if parts is not None:
        shared = getattr(cfg.lora, "experts", "each") == "shared"
        workload = dataclasses.replace(workload, other_parts=len(parts) - 1, other_adapters=0 if shared else len(parts) - 1)
    budget = budget_from_config(cfg.memory, machine)
    store = store if store is not None else CalibrationStore()
    return Planner(spec, model, workload, machine, store.get(architecture_key(model, workload))), budget


def choose_plan(planner: Planner, budget: Budget, cfg) -> Plan:
    """The fastest plan under the run's budget, logged as a table; an impossible budget is a
    config error naming [memory] vram_budget and what would fit."""
    try:
        plan = planner.plan(budget)
    except InfeasibleBudget as e:
        raise ConfigError(f"[memory] vram_budget = {cfg.memory.vram_budget!r}: {e}") from None
    for line in format_plan(plan).splitlines():
        log.info("%s", line)
    return plan


def plan_for_config(cfg, spec, model: torch.nn.Module, machine: Machine | None = None,
                    store: CalibrationStore | None = None) -> Plan:
    """The plan for this config's workload when [memory] vram_budget is set.

    Uses the calibration stored for this architecture and workload, so a second run with the same
    model and resolutions starts from measured activations.
    """
    planner, budget = planner_for_config(cfg, spec, model, machine, store)
    return choose_plan(planner, budget, cfg)
