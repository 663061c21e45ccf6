"""Full fine-tuning ([train] mode = "full"): every selected transformer weight trains.

- What trains: the parameters whose diffusers name matches a `[full] train` pattern and no
  `[full] exclude` pattern (fnmatch); the rest is frozen (and may use fp8 storage).
- The step: inside backward, per parameter (train/in_backward.py, train/fused_optim.py); the
  trainer's `optimizer` is the FusedOptimizer, whose `step()` only closes the step.
- Streamed blocks: the memory engine gets memory/trainable_streaming.py's engine, which brings a
  block's weights and optimizer state to the device together and writes them back updated, or,
  under Plan.optimizer_on_host ([full] streamed_step), brings the weights only and steps them on
  the host, where their state stays.
- Resumable state: weights and optimizer state tensors by name, read from where they live (host
  buffers for streamed blocks, no copy); scalars (step counts, RNG of stochastic rounding).
- Export: the whole transformer as a BFL / ComfyUI single file, written block by block
  (train/full_export.py), and a diffusers folder on request.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from ..config import FullConfig, TrainConfig
from ..memory.trainable_streaming import TrainableStreamingEngine, WeightAccess
from .full_export import export_full_model
from .full_host_ram import check_host_ram
from .fused_optim import FusedOptimizer, _owner
from .in_backward import InBackwardStep
from .mode_shared import check_resumable
from .trainable import select_trainable

log = logging.getLogger("leantune")


class FullMode:
    name = "full"

    def __init__(self, train: TrainConfig, full: FullConfig, formats: list[str], ram_budget: str | None = None):
        """`formats`: [output] formats; `ram_budget`: [memory] ram_budget (None: available host RAM)."""
        self.train, self.full, self.formats, self.ram_budget = train, full, list(formats), ram_budget
        self.model = None
        self.named: dict[str, torch.nn.Parameter] = {}
        self.optimizer: FusedOptimizer | None = None
        self.stepper: InBackwardStep | None = None
        self.memory = None

    # -- set-up ------------------------------------------------------------------------------------
    def prepare(self, transformer: torch.nn.Module, spec) -> list[torch.nn.Parameter]:
        full = self.full
        named = select_trainable(transformer, full.train, full.exclude)
        if not named:
            raise ValueError(f"[full] train = {full.train} with exclude = {full.exclude} selects no weight of the "
                             f"transformer; names look like 'transformer_blocks.0.attn.to_q.weight'")
        stored = [n for n, p in named.items() if not p.is_floating_point()]
        if stored:                          # a GGUF base's blocks (memory/gguf_storage.py): bytes, not weights
            raise ValueError(f"[train] mode = \"full\": {stored[0]} (and {len(stored) - 1} more) is stored as "
                             f"quantized GGUF blocks ({named[stored[0]].dtype}), which cannot be trained; fine-tune "
                             f"a bf16 checkpoint, train a LoRA on the GGUF base, or [full] exclude those weights")
        transformer.requires_grad_(False)
        for p in named.values():
            p.requires_grad_(True)
        self.model, self.named, self.spec = transformer, named, spec
        tc = self.train
        self.optimizer = FusedOptimizer(transformer, named, tc.optimizer, lr=tc.learning_rate, betas=tc.betas,
                                        eps=tc.eps, weight_decay=tc.weight_decay, state_dtype=full.state_dtype,
                                        stochastic_rounding=full.stochastic_rounding,
                                        master_weights=full.master_weights, seed=tc.seed)
        clip = tc.max_grad_norm if full.grad_clip == "parameter" else 0.0
        self.stepper = InBackwardStep(self.optimizer, list(named.values()), accumulation=tc.gradient_accumulation,
                                      max_grad_norm=clip, on_step=self._stepped, hold=self._hold,
                                      host=self._host_engine)
        n = sum(p.numel() for p in named.values())
        total = sum(p.numel() for p in transformer.parameters())
        log.info("full fine-tune: %d of %d tensors, %.1fM of %.1fM parameters train; optimizer %s (state %s%s), "
                 "step inside backward", len(named), sum(1 for _ in transformer.parameters()), n / 1e6, total / 1e6,
                 tc.optimizer, full.state_dtype, ", fp32 master weights on host" if full.master_weights else "")
        return list(named.values())

    def check_before_load(self, meta_model) -> None:
        """Host RAM for weights + optimizer state (+ masters, accumulators): refused with numbers
        and alternatives before any weight is read (train/full_host_ram.py)."""
        parts = check_host_ram(self.train, self.full, self.ram_budget, meta_model())
        log.info("full fine-tune host RAM: %s", ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items() if v))

    def memory_options(self) -> dict:
        return {"streaming_engine": TrainableStreamingEngine}

    def build_optimizer(self, params) -> FusedOptimizer:
        return self.optimizer

    def _stepped(self, p: torch.nn.Parameter) -> None:
        streaming = getattr(self.memory, "streaming", None)
        if streaming is not None:
            streaming.engine.mark_stepped(p)

    def _host_engine(self, p: torch.nn.Parameter):
        """The streaming engine when `p` steps on the host (Plan.optimizer_on_host), else None."""
        streaming = getattr(self.memory, "streaming", None)
        if streaming is not None and streaming.engine.steps_on_host(p):
            return streaming.engine
        return None

    def _hold(self, p: torch.nn.Parameter):
        streaming = getattr(self.memory, "streaming", None)
        return streaming.engine.holding(p) if streaming is not None else contextlib.nullcontext()

    # -- the step ----------------------------------------------------------------------------------
    def step(self, t, micro_batch) -> float:
        self.memory = t.memory
        accum = self.train.gradient_accumulation
        self.stepper.begin_step()
        total = 0.0
        for i in range(accum):
            self.stepper.micro = i
            total += micro_batch(1.0 / accum)
        self.stepper.finish_step()
        t.optimizer.step()
        return total / accum

    def drop_partial_step(self, t) -> None:
        self.stepper.drop_partial()

    # -- resumable state -----------------------------------------------------------------------------
    def _access(self, t):
        return WeightAccess(t.memory)

    def state(self, t) -> dict:
        access = self._access(t)
        weights, tensors = {}, {}
        for n in self.named:
            owner, attr = _owner(self.model, n)
            weights[n] = access.get(owner, attr)
            holder = self.optimizer.holders[n]
            st = {k: access.get(holder, k) for k in holder.tensors()}
            if n in self.optimizer.masters:
                st["master"] = self.optimizer.masters[n]
            tensors[n] = st
        return {"trainable": weights, "optimizer": {"scalars": self.optimizer.state_dict(), "tensors": tensors}}

    def load_state(self, t, state: dict, ckpt: Path) -> None:
        check_resumable(ckpt, state["trainable"], dict(self.model.named_parameters()), "[full] train / exclude")
        access = self._access(t)
        for n, v in state["trainable"].items():
            owner, attr = _owner(self.model, n)
            access.set(owner, attr, v)
        for n, st in state["optimizer"]["tensors"].items():
            holder = self.optimizer.holders[n]
            for k, v in st.items():
                if k == "master":
                    self.optimizer.masters[n].copy_(v)
                else:
                    access.set(holder, k, v)
        self.optimizer.load_state_dict(state["optimizer"]["scalars"])

    # -- exported files ----------------------------------------------------------------------------------
    def export(self, t, paths, step: int, intermediate: bool) -> list[Path]:
        return export_full_model(self, t, paths, step, intermediate)

    def close(self, t) -> None:
        self.stepper.remove()
