"""LoRA mode (`[train] mode = "lora"`): adapters on a frozen base, the plain
`backward(); clip; opt.step()` loop. The interface every mode offers is described in modes.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import RunConfig
from .mode_shared import check_resumable, prune_step_files
from .optim import build_optimizer

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
            prune_step_files(paths, cfg.output.formats, cfg.train.keep_last, lambda fmt: f"{paths.name}-step*_{fmt}.safetensors")
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
