"""Training modes: what trains, how one optimizer step runs, what a resumable state holds and
which files a run exports. The trainer's loop is the same for every mode and asks the mode object:

- `check_before_load(meta)`      refuse what cannot fit before the weights load (full: host RAM);
- `prepare(transformer, spec)`   make the trainable parameters (LoRA: add adapters; full: unfreeze
                                 the selected weights), before the memory engine is applied;
- `memory_options()`             extra arguments for `apply_memory` (full mode: an engine that
                                 streams trainable weights and writes them back);
- `build_optimizer(params)`      after the memory plan is applied;
- `step(t, micro_batch)`         one optimizer step over the micro-batches (full mode steps inside
                                 backward, so gradients never all exist at once);
- `state(t)` / `load_state(...)` the trainable weights and the optimizer state, for exact resume;
- `export(...)`                  the files a user takes away (LoRA files, or the whole model).

`[train] mode` picks one: "lora" (`LoraMode`, here) or "full" (`FullMode`, in full_mode.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import RunConfig
from .optim import build_optimizer
from .state import CheckpointError

log = logging.getLogger("leantune")


class LoraMode:
    """Train a LoRA adapter on a frozen base: the plain `backward(); clip; opt.step()` loop."""

    name = "lora"

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.spec = None          # the family's spec, from prepare(): its LoRA names name the files

    # -- set-up ------------------------------------------------------------------------------------
    def prepare(self, transformer: torch.nn.Module, spec) -> list[torch.nn.Parameter]:
        from .lora import add_lora, load_lora_into_model, read_lora

        cfg = self.cfg
        self.spec = spec
        transformer.requires_grad_(False)
        params = add_lora(transformer, spec, cfg.lora)
        if cfg.lora.init_from:
            try:
                weights = read_lora(cfg.resolve(cfg.lora.init_from), spec.lora_keys)
            except (ValueError, FileNotFoundError) as e:    # same type, with the key that named the file
                raise type(e)(f"[lora] init_from: {e}") from None
            load_lora_into_model(transformer, weights, "default")
        n_params = sum(p.numel() for p in params)
        log.info("lora: rank %d alpha %g on %s: %d tensors, %.2fM parameters", cfg.lora.rank,
                 cfg.lora.effective_alpha, cfg.lora.targets, len(params), n_params / 1e6)
        return params

    def check_before_load(self, meta_model) -> None:
        """Nothing to check before loading (the planner prices LoRA runs)."""

    def memory_options(self) -> dict:
        return {}

    def build_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return build_optimizer(params, self.cfg.train)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, t, micro_batch) -> float:
        """`gradient_accumulation` micro-batches, global-norm clipping, one optimizer step."""
        cfg = self.cfg
        t.optimizer.zero_grad(set_to_none=True)
        accum = cfg.train.gradient_accumulation
        total = sum(micro_batch(1.0 / accum) for _ in range(accum))
        t.dist.sync_gradients(t.params)        # several processes: sum the ranks' shares (no-op for one)
        if cfg.train.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(t.params, cfg.train.max_grad_norm)
        t.optimizer.step()
        return total / accum

    def drop_partial_step(self, t) -> None:
        """Forget gradients of a step that did not finish (OOM, re-plan)."""
        t.optimizer.zero_grad(set_to_none=True)

    # -- resumable state -----------------------------------------------------------------------------
    def state(self, t) -> dict:
        trainable = {n: p.detach() for n, p in t.transformer.named_parameters() if p.requires_grad}
        return {"trainable": trainable, "optimizer": t.optimizer.state_dict()}

    def load_state(self, t, state: dict, ckpt: Path) -> None:
        named = dict(t.transformer.named_parameters())
        check_resumable(ckpt, state["trainable"], named, "[lora] settings (rank, targets, blocks)")
        with torch.no_grad():
            for n, v in state["trainable"].items():
                named[n].copy_(v.to(named[n].device, named[n].dtype))
        t.optimizer.load_state_dict(state["optimizer"])

    # -- exported files ----------------------------------------------------------------------------------
    def export(self, t, paths, step: int, intermediate: bool) -> list[Path]:
        """The LoRA in every [output] format (per-step names while training, final names at the end)."""
        from .lora import lora_weights_from_model, save_lora

        cfg = self.cfg
        weights = lora_weights_from_model(t.transformer)
        keys = self.spec.lora_keys if self.spec is not None else weights.keys
        files = []
        for fmt in cfg.output.formats:
            path = paths.lora_file(fmt, step if intermediate else None)
            save_lora(weights, path, fmt, metadata=self._metadata(step, keys), keys=keys)
            files.append(path)
        if intermediate:
            prune_step_files(paths, cfg, lambda fmt: f"{paths.name}-step*_{fmt}.safetensors")
        return files

    def _metadata(self, step: int, keys) -> dict:
        """Training notes for the header; the family's own notes (ss_network_module,
        ss_base_model_version) come from its LoRA names (`keys`, spec.lora_keys)."""
        cfg = self.cfg
        return {
            **(keys.header if keys is not None else {}), "ss_network_dim": cfg.lora.rank,
            "ss_network_alpha": cfg.lora.effective_alpha,
            "ss_output_name": cfg.output.name, "ss_steps": step, "ss_learning_rate": cfg.train.learning_rate,
            "ss_optimizer": cfg.train.optimizer, "ss_lr_scheduler": cfg.train.lr_scheduler,
            "ss_resolution": ",".join(str(r) for r in cfg.data.resolutions), "ss_seed": cfg.train.seed,
            "ss_timestep_sampling": self._sampling(), "ss_guidance_scale": cfg.train.guidance,
            "leantune_targets": cfg.lora.targets,
        }

    def _sampling(self) -> str:
        from ..models.family import get_family
        from .flow_matching import sampling_method

        return sampling_method(self.cfg.train.timestep_sampling, get_family(self.cfg.model.family))

    def close(self, t) -> None:
        pass


def make_mode(cfg: RunConfig, dist=None):
    """The mode object for `[train] mode` (`dist`: the run's DistContext, for the sharded full modes)."""
    if cfg.train.mode == "full":
        from .full_mode import FullMode
        from .sharded_full import sharded_full_mode

        sharded = sharded_full_mode(cfg, dist)    # several processes: FSDP2 owns the weights
        if sharded is not None:
            return sharded

        return FullMode(cfg)
    return LoraMode(cfg)


def prune_step_files(paths, cfg: RunConfig, pattern) -> None:
    """Keep the newest `[train] keep_last` per-step exports of each format (`pattern(fmt)` globs them)."""
    import shutil

    for fmt in cfg.output.formats:
        found = sorted(paths.root.glob(pattern(fmt)))
        for old in found[:-cfg.train.keep_last]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)


def check_resumable(ckpt: Path, saved: dict, named: dict, settings: str) -> None:
    """The saved trainable weights must be exactly this run's: same names, same shapes. A run
    resumed with other settings is refused with the weight that differs."""
    hint = f"it was saved with other {settings}; restore them or start a new [output] dir"
    missing = [n for n in saved if n not in named]
    if missing:
        raise CheckpointError(f"{ckpt}: checkpoint has weights this model lacks, e.g. {missing[0]!r}: {hint}")
    for n, v in saved.items():
        if tuple(v.shape) != tuple(named[n].shape):
            raise CheckpointError(f"{ckpt}: weight {n!r} has shape {tuple(v.shape)} in the checkpoint but "
                                  f"{tuple(named[n].shape)} in this run: {hint}")
    extra = [n for n, p in named.items() if p.requires_grad and n not in saved]
    if extra:
        raise CheckpointError(f"{ckpt}: checkpoint lacks trainable weights of this run, e.g. {extra[0]!r}: {hint}")
