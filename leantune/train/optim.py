"""Optimizers and learning-rate schedules for the trainable parameters (LoRA adapters for now).

AdamW is torch's; Adafactor is torch's (>= 2.5) factored second-moment optimizer, which keeps
far less state for full fine-tunes. Prodigy, schedule-free AdamW, CAME and bitsandbytes' 8-bit
AdamW come from their own packages (optim_packages.py). Schedules are a warmup ramp followed by constant, cosine or
linear decay to zero, as a LambdaLR so its state is a plain dict (exact resume).
"""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig
from .optim_packages import PACKAGES, build_package_optimizer


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise RuntimeError("train.optimizer = \"adafactor\" needs torch >= 2.5")
        return torch.optim.Adafactor(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    if cfg.optimizer in PACKAGES:
        return build_package_optimizer(params, cfg)
    raise ValueError(f"train.optimizer: unknown optimizer {cfg.optimizer!r}")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based). Schedule-free AdamW:
    always 1, its warmup is its own (config.py refuses another schedule with it)."""
    if cfg.optimizer == "schedulefree_adamw":
        return 1.0
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_scheduler == "constant":
        return 1.0
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.lr_scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.lr_scheduler == "linear":
        return 1.0 - progress
    raise ValueError(f"train.lr_scheduler: unknown schedule {cfg.lr_scheduler!r}")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
