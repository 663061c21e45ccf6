"""The planner: from a VRAM budget to the fastest memory plan that fits.

Other trainers answer "will it fit?" with fixed tiers (a table of `blocks_to_swap` values per card
size) that users then run out of memory with. Here the answer is computed: a memory model predicts
the peak VRAM and host RAM of every candidate plan, a timing model predicts its step time, and the
search keeps the fastest plan whose peak plus a safety margin is under the budget. The first
training steps check the prediction and correct it; an out-of-memory re-plans tighter.

This module is the planner's entry point (a config or a workload in, a Plan out); each part lives
in its own module, and the names callers use are re-exported here:

  workload.py          Workload, Budget, InfeasibleBudget: the inputs, and "nothing fits them"
  meta.py              full-size architectures on the meta device (build_meta_flux)
  weight_bytes.py      exact weight, fp8 and packed-unit bytes per block; adapter shapes
  activation_probe.py  activations and FLOPs traced on a meta copy; composition over the stack
  host_model.py        host RAM while loading, while memory is applied, and during the steps
  timing.py            step time: compute plus the copies the ring cannot hide
  memory_model.py      MemoryModel: all of the above for one plan, per component
  search.py            Planner: the search over plans, and why a budget is infeasible
  calibration.py       corrections from the first measured steps, stored per architecture
  oom.py               OomGuard: re-plan tighter and redo a step after a CUDA out-of-memory
  report.py            format_plan: the plan and its breakdown as a table
"""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError, parse_size
from .activation_probe import ActivationProfile, KindProfile, probe_activations
from .calibration import Calibration, CalibrationStore, PlanCalibrator, architecture_key, bucket_key
from .machine import Machine, probe_machine
from .memory_model import Estimate, MemoryModel
from .meta import TEXT_LENGTH, build_meta_flux
from .oom import NoPlanFits, OomGuard, is_out_of_memory
from .plan import Plan
from .report import format_plan
from .search import Planner
from .weight_bytes import AdapterShape, ModelWeights, ModuleWeights, fp8_scale_count, measure_weights
from .workload import Budget, InfeasibleBudget, Workload, default_ram_budget

__all__ = [  # the public names, for callers and re-export
    "TEXT_LENGTH", "ActivationProfile", "AdapterShape", "Budget", "Calibration", "CalibrationStore",
    "Estimate", "InfeasibleBudget", "KindProfile", "MemoryModel", "ModelWeights", "ModuleWeights",
    "NoPlanFits", "OomGuard", "Plan", "PlanCalibrator", "Planner", "Workload", "architecture_key",
    "bucket_key", "budget_from_config", "build_meta_flux", "choose_plan", "default_ram_budget", "format_plan",
    "fp8_scale_count", "is_out_of_memory", "measure_weights", "parse_vram", "plan_for_config", "plan_memory",
    "planner_for_config", "probe_activations", "workload_from_config",
]

log = logging.getLogger("leantune")


def plan_memory(spec, model_or_meta: torch.nn.Module, workload: Workload, budget: Budget,
                machine: Machine | None = None, calibration: Calibration | None = None) -> Plan:
    """The fastest plan for `workload` on `model_or_meta` (real or meta weights) within `budget`.

    `plan.notes` carries the predicted peaks with their breakdowns, the predicted step time and
    the machine it assumed. Raises InfeasibleBudget when nothing fits.
    """
    return Planner(spec, model_or_meta, workload, machine, calibration).plan(budget)


def workload_from_config(cfg, model: torch.nn.Module | None = None) -> Workload:
    """The Workload a [data]/[lora]/[train]/[model] configuration trains."""
    from ..models.flux_loading import dtype_from_name

    return Workload(mode="lora", rank=cfg.lora.rank, targets=cfg.lora.targets, lora_blocks=cfg.lora.blocks,
                    optimizer=cfg.train.optimizer, batch_size=cfg.data.batch_size,
                    buckets=Workload.square(cfg.data.resolutions), text_length=cfg.data.max_text_length,
                    gradient_accumulation=cfg.train.gradient_accumulation,
                    autocast=cfg.train.mixed_precision == "bf16", dtype=dtype_from_name(cfg.model.dtype),
                    lora_dropout=cfg.lora.dropout)


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


def planner_for_config(cfg, spec, model: torch.nn.Module, machine: Machine | None = None,
                       store: CalibrationStore | None = None) -> tuple[Planner, Budget]:
    """The Planner and Budget of a run, with the stored calibration of its architecture and
    workload; the trainer keeps them for OomGuard and PlanCalibrator."""
    machine = machine or probe_machine()
    workload = workload_from_config(cfg, model)
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
