"""The optimizers leantune takes from their own packages, for LoRA training ([train] optimizer).

- "prodigy" (prodigyopt): Adam whose step size is d * lr, with d estimated as training goes; lr is
  a multiplier of that estimate (1.0 is the usual value). d is logged each step (`scalars`).
- "schedulefree_adamw" (schedulefree): AdamW without a learning-rate schedule. The parameters hold
  the point gradients are taken at (y) while training; the averaged point (x) is what to sample,
  validate and export: `evaluation_point` puts x in place for that and puts y back afterwards.
- "came" (came-pytorch): confidence-guided factored Adam (row/column statistics per matrix).
- "adamw8bit" (bitsandbytes): blockwise 8-bit AdamW moments. bitsandbytes' CPU backend runs its
  8-bit step too, so a CPU run takes it (tests/test_optimizers_recipe.py).

Each optimizer is the package's own class, constructed with the run's settings and nothing else:
tests/test_optimizers_recipe.py checks it bitwise against the package's optimizer built directly.
Their state is a plain state_dict (tensors, numbers, flags), so a checkpoint restores them exactly.
"""

from __future__ import annotations

import contextlib
import importlib
import logging

import torch

from ..config import TrainConfig

log = logging.getLogger("leantune")

PACKAGES = {"prodigy": "prodigyopt", "schedulefree_adamw": "schedulefree", "came": "came_pytorch",
            "adamw8bit": "bitsandbytes"}
PIP_NAMES = {"prodigyopt": "prodigyopt", "schedulefree": "schedulefree", "came_pytorch": "came-pytorch",
             "bitsandbytes": "bitsandbytes"}
CAME_BETA3 = 0.9999         # came-pytorch's default third beta (the instability average); not a key


def _package(optimizer: str):
    name = PACKAGES[optimizer]
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(f"[train] optimizer = \"{optimizer}\" needs the {PIP_NAMES[name]} package, which this "
                         f"environment lacks: pip install -e . (leantune pins it; bitsandbytes: pip install "
                         f"-e '.[bnb]')") from None


def build_package_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The package's optimizer for `cfg.optimizer` over `params`, in training mode."""
    kind = cfg.optimizer
    pkg = _package(kind)
    if kind == "prodigy":
        if cfg.learning_rate < 0.1:
            log.warning("[train] learning_rate = %g with optimizer = \"prodigy\": Prodigy's step is d * lr with d "
                        "estimated for lr = 1.0; a small lr scales the estimated step down as well", cfg.learning_rate)
        if cfg.warmup_steps and not cfg.prodigy_safeguard_warmup:
            # Prodigy's README: a warm-up's small early lr makes it overestimate d. The demo's run
            # (warmup 20) did: d rose 1e-6 -> 0.0046 by step 17 and the loss to ~470 at step 30
            # before it recovered (docs/benchmarks.md, "The adapter types and optimizers learn").
            log.warning("[train] warmup_steps = %d with optimizer = \"prodigy\" and prodigy_safeguard_warmup = false: "
                        "Prodigy overestimates d during a warm-up (its README's advice); set "
                        "prodigy_safeguard_warmup = true, or warmup_steps = 0", cfg.warmup_steps)
        return pkg.Prodigy(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, d_coef=cfg.prodigy_d_coef,
                           use_bias_correction=cfg.prodigy_use_bias_correction,
                           safeguard_warmup=cfg.prodigy_safeguard_warmup)
    if kind == "schedulefree_adamw":
        # Its own warmup ([train] warmup_steps): the LambdaLR stays at 1 (optim.lr_factor).
        opt = pkg.AdamWScheduleFree(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                                    weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps)
        opt.train()             # step() refuses an optimizer left in eval mode, its initial mode
        return opt
    if kind == "came":
        # CAME's two regularisation constants are its own (1e-30, 1e-16): [train] eps is refused (config.py).
        return pkg.CAME(params, lr=cfg.learning_rate, betas=(*cfg.betas, CAME_BETA3), weight_decay=cfg.weight_decay)
    if kind == "adamw8bit":
        return pkg.optim.AdamW8bit(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay)
    raise ValueError(f"[train] optimizer: {kind!r} is not a package optimizer")


def is_schedule_free(optimizer) -> bool:
    return type(optimizer).__module__.startswith("schedulefree.")


@contextlib.contextmanager
def evaluation_point(optimizer):
    """Inside: a schedule-free optimizer's parameters hold the averaged point x (samples, validation,
    exported files); after: the training point y again, *bit for bit*. The package's own `train()`
    recomputes y from x and z, which rounds differently from the y it left; restoring the saved y
    instead keeps training independent of when it samples or saves, so a resumed run (its state
    saved at y, in train mode) continues exactly as the straight run. Other optimizers: nothing."""
    if not is_schedule_free(optimizer):
        yield
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    kept = [p.detach().clone() for p in params]
    optimizer.eval()
    try:
        yield
    finally:
        optimizer.train()
        with torch.no_grad():
            for p, y in zip(params, kept):
                p.copy_(y)


def scalars(optimizer) -> dict[str, float]:
    """Numbers worth logging beside the learning rate: Prodigy's estimate d and its step d * lr
    (the effective learning rate); schedule-free AdamW's warmed-up learning rate."""
    mod = type(optimizer).__module__
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if mod.startswith("prodigyopt.") and "d" in group:
        return {"prodigy/d": float(group["d"]), "prodigy/d_lr": float(group["d"]) * float(group["lr"])}
    if mod.startswith("schedulefree.") and "scheduled_lr" in group:
        return {"schedulefree/lr": float(group["scheduled_lr"])}
    return {}
