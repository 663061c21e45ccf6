"""LoRA mode (`[train] mode = "lora"`): adapters on a frozen base, the plain
`backward(); clip; opt.step()` loop. The interface every mode offers is described in modes.py.

Where the step runs ([lora] optimizer_step; the plan's `optimizer_on_host` under a budget): on the
device (the optimizer over the adapters themselves), or on the host (train/lora_host_step.py: the
optimizer over host copies, gradients down and weights up once per step). The trainer tells the
mode the plan before it builds the optimizer (`use_plan`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import LoraConfig, TrainConfig
from .mode_shared import check_resumable, prune_step_files
from .optim import build_optimizer

log = logging.getLogger("leantune")


class LoraMode:
    """Train a LoRA adapter on a frozen base: the plain `backward(); clip; opt.step()` loop."""

    name = "lora"

    def __init__(self, lora: LoraConfig, train: TrainConfig, formats: list[str], *,
                 init_from: Path | None = None, run_notes: dict | None = None):
        """`formats`: [output] formats; `init_from`: the resolved [lora] init_from; `run_notes`: the
        run's settings written into each file's header (make_mode gathers them)."""
        self.lora, self.train, self.formats = lora, train, list(formats)
        self.init_from, self.run_notes = init_from, dict(run_notes or {})
        self.spec = None          # the family's spec, from prepare(): its LoRA names name the files
        self.host_step = None     # a LoraHostStep when the optimizer steps on the host (use_plan)
        self.on_host = lora.optimizer_step == "host"

    # -- set-up ------------------------------------------------------------------------------------
    def prepare(self, transformer: torch.nn.Module, spec) -> list[torch.nn.Parameter]:
        from .lora import add_lora, load_lora_into_model, read_lora

        lora = self.lora
        self.spec = spec
        transformer.requires_grad_(False)
        params = add_lora(transformer, spec, lora)
        if self.init_from is not None:
            try:
                weights = read_lora(self.init_from, spec.lora_keys)
            except (ValueError, FileNotFoundError) as e:    # same type, with the key that named the file
                raise type(e)(f"[lora] init_from: {e}") from None
            load_lora_into_model(transformer, weights, "default")
        n_params = sum(p.numel() for p in params)
        log.info("lora: %s rank %d alpha %g on %s: %d tensors, %.2fM parameters", lora.type, lora.rank,
                 lora.effective_alpha, lora.targets, len(params), n_params / 1e6)
        return params

    def check_before_load(self, meta_model) -> None:
        """Nothing to check before loading (the planner prices LoRA runs)."""

    def memory_options(self) -> dict:
        return {}

    def use_plan(self, plan) -> None:
        """The memory plan the run applies: under a budget the planner chose where the step runs
        (Plan.optimizer_on_host); without one, [lora] optimizer_step = "host" alone puts it there.
        Called before build_optimizer; a later re-plan keeps the place (the planner is told so)."""
        self.on_host = bool(plan.optimizer_on_host) or self.lora.optimizer_step == "host"

    def build_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if not self.on_host:
            return build_optimizer(params, self.train)
        from .lora_host_step import LoraHostStep

        self.host_step = LoraHostStep(params, self.train)
        log.info("lora: optimizer step on the host (%s, %.2f GiB of host copies and gradient staging; the state "
                 "beside them)", self.train.optimizer, self.host_step.host_bytes / 2**30)
        return self.host_step.optimizer

    # -- the step ----------------------------------------------------------------------------------
    def step(self, t, micro_batch) -> float:
        """`gradient_accumulation` micro-batches, global-norm clipping, one optimizer step."""
        t.optimizer.zero_grad(set_to_none=True)
        if self.host_step is not None:
            self.host_step.zero_grad()
        accum = self.train.gradient_accumulation
        total = sum(micro_batch(1.0 / accum) for _ in range(accum))
        t.dist.sync_gradients(t.params)        # several processes: sum the ranks' shares (no-op for one)
        if self.host_step is not None:         # clip, step on the host; the adapters come back updated
            self.host_step.step(self.train.max_grad_norm)
            return total / accum
        if self.train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(t.params, self.train.max_grad_norm)
        t.optimizer.step()
        return total / accum

    def drop_partial_step(self, t) -> None:
        """Forget gradients of a step that did not finish (OOM, re-plan)."""
        t.optimizer.zero_grad(set_to_none=True)
        if self.host_step is not None:
            self.host_step.zero_grad()

    # -- resumable state -----------------------------------------------------------------------------
    def state(self, t) -> dict:
        trainable = {n: p.detach() for n, p in t.transformer.named_parameters() if p.requires_grad}
        return {"trainable": trainable, "optimizer": t.optimizer.state_dict()}

    def load_state(self, t, state: dict, ckpt: Path) -> None:
        named = dict(t.transformer.named_parameters())
        check_resumable(ckpt, state["trainable"], named, "[lora] settings (type, rank, targets, blocks)")
        with torch.no_grad():
            for n, v in state["trainable"].items():
                named[n].copy_(v.to(named[n].device, named[n].dtype))
        if self.host_step is not None:         # the host copies the optimizer steps are the saved weights
            self.host_step.pull_weights()
        t.optimizer.load_state_dict(state["optimizer"])

    # -- exported files ----------------------------------------------------------------------------------
    def export(self, t, paths, step: int, intermediate: bool) -> list[Path]:
        """The LoRA in every [output] format (per-step names while training, final names at the end).
        A schedule-free optimizer's files hold its averaged weights (optim_packages.evaluation_point)."""
        from .lora import lora_weights_from_model, save_lora
        from .optim_packages import evaluation_point

        with evaluation_point(getattr(t, "optimizer", None)):     # None: a caller exporting weights alone
            weights = lora_weights_from_model(t.transformer)
        keys = self.spec.lora_keys if self.spec is not None else weights.keys
        files = []
        for fmt in self.formats:
            path = paths.lora_file(fmt, step if intermediate else None)
            save_lora(weights, path, fmt, metadata=self._metadata(step, keys), keys=keys)
            files.append(path)
        if intermediate:
            prune_step_files(paths, self.formats, self.train.keep_last, lambda fmt: f"{paths.name}-step*_{fmt}.safetensors")
        return files

    def _metadata(self, step: int, keys) -> dict:
        """Training notes for the header; the family's own notes (ss_network_module,
        ss_base_model_version) come from its LoRA names (`keys`, spec.lora_keys). ss_network_dim
        and ss_network_alpha are what each file's tensors apply (save_lora writes them; a diffusers
        file folds alpha into lora_B and says alpha = rank), so the [lora] settings are noted apart."""
        return {
            **(keys.header if keys is not None else {}), **self.run_notes, "ss_steps": step,
            "leantune_targets": self.lora.targets, "leantune_lora_rank": self.lora.rank,
            "leantune_lora_alpha": self.lora.effective_alpha,
        }

    def close(self, t) -> None:
        pass
