"""What changed in the config between a checkpoint and a `--resume`, and whether the run can continue.

Every checkpoint stores the resolved config it was saved under (`config.json` beside its state).
On resume the two are compared key by key. A change that makes the saved state meaningless — the
model, the adapter's shape (rank, alpha, targets, blocks), the training mode, what a full
fine-tune trains, the optimizer whose moments were saved — is refused, naming each key. Anything
else (more steps, another learning rate, sampling, logging, the dataset) continues, with one line
per change saying so; a changed dataset or batch size restarts the batch order at the next epoch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .state import CheckpointError

log = logging.getLogger("leantune")

# Dotted key prefixes whose change the saved state cannot follow.
# The optimizer's own settings (betas, eps, weight decay) come back from its saved state, so a
# change there would be silently ignored: refused too.
REFUSED = ("model.family", "model.path", "model.variant", "model.transformer", "model.base_adapters",
           "lora.type", "lora.factor", "lora.decompose_both", "lora.rank", "lora.alpha",
           "lora.targets", "lora.blocks", "train.mode", "train.optimizer", "train.betas", "train.eps",
           "train.weight_decay", "train.prodigy_d_coef", "train.prodigy_use_bias_correction",
           "train.prodigy_safeguard_warmup", "full.train", "full.exclude")
# Refused only with a given optimizer, whose saved state holds the key: schedule-free AdamW warms up
# by itself ([train] warmup_steps is its own argument, saved in its param groups), so a changed
# warmup would come back from the state as it was.
REFUSED_WITH = {"schedulefree_adamw": ("train.warmup_steps",)}
# Keys added to leantune after checkpoints were written, at the value every earlier run had.
ADDED_DEFAULTS = {"model.image_to_video": False,
                  "lora.type": "lora", "lora.factor": -1, "lora.decompose_both": False,
                  "train.prodigy_d_coef": 1.0, "train.prodigy_use_bias_correction": False,
                  "train.prodigy_safeguard_warmup": False,
                  "data.prior_ratio": 0.25, "data.prior_loss": "plain", "data.prior_weight": 1.0,
                  "ema.enabled": False, "ema.decay": 0.999, "ema.every": 1, "ema.sample": False,
                  "sample.base_variant": "auto",
                  "validation.every": 100, "validation.sigmas": [0.1, 0.3, 0.5, 0.7, 0.9], "validation.seed": 0}
# The same for the keys of each [[data.datasets]] table (compared as a whole list).
ADDED_DATASET_DEFAULTS = {"mask_path": None, "mask_suffix": None, "mask_floor": 0.0, "role": "train"}
_NONE = object()
# Changes that alter the sample list: the saved batch position cannot be resumed exactly.
DATA_ORDER = ("data.datasets", "data.resolutions", "data.batch_size", "data.shuffle", "train.seed",
              "data.prior_ratio", "validation.path", "validation.fraction")


def resolved_config(cfg) -> dict:
    """The run's config as stored with each save (defaults filled in, JSON types)."""
    return cfg.model_dump(mode="json")


def _flat(obj, prefix: str = "") -> dict[str, object]:
    if isinstance(obj, dict):
        out: dict[str, object] = {}
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


@dataclass
class ConfigChanges:
    changed: dict[str, tuple[object, object]] = field(default_factory=dict)   # key -> (saved, now)
    also_refused: tuple[str, ...] = ()       # REFUSED_WITH the run's optimizer

    @property
    def refused(self) -> list[str]:
        return [k for k in self.changed if _under(k, REFUSED + self.also_refused)]

    @property
    def data_order_changed(self) -> bool:
        return any(_under(k, DATA_ORDER) for k in self.changed)


def compare(saved: dict, current: dict) -> ConfigChanges:
    """Key-by-key differences; lists of tables (datasets) compare as whole values."""
    def flat(d: dict) -> dict:
        out = _flat({k: v for k, v in d.items() if k != "data"})
        out.update({f"data.{k}": v for k, v in (d.get("data") or {}).items()})
        if isinstance(out.get("data.datasets"), list):      # a save from before a dataset key existed
            out["data.datasets"] = [{**ADDED_DATASET_DEFAULTS, **ds} if isinstance(ds, dict) else ds
                                    for ds in out["data.datasets"]]
        return out

    a, b = flat(saved), flat(current)
    changes = ConfigChanges(also_refused=REFUSED_WITH.get(b.get("train.optimizer"), ()))
    for key in sorted(set(a) | set(b)):
        if key not in a and (b[key] in ([], None) or ADDED_DEFAULTS.get(key, _NONE) == b[key]):
            continue          # a key added to leantune since the save, at its empty default: no change
        if a.get(key) != b.get(key):
            changes.changed[key] = (a.get(key), b.get(key))
    return changes


def check_resume(saved: dict | None, cfg, checkpoint) -> ConfigChanges:
    """Raise `CheckpointError` for changes the state cannot follow; log the ones it can."""
    if saved is None:
        log.warning("%s was saved without its config: changes since then cannot be listed", checkpoint)
        return ConfigChanges()
    changes = compare(saved, resolved_config(cfg))
    if changes.refused:
        lines = "\n  ".join(f"{k}: {changes.changed[k][0]!r} -> {changes.changed[k][1]!r}" for k in changes.refused)
        raise CheckpointError(f"--resume from {checkpoint}: the config changed in ways the saved state cannot "
                              f"follow:\n  {lines}\nput these back, or start a new run (another [output] dir, or "
                              f"--overwrite)")
    for key, (old, new) in changes.changed.items():
        if key == "train.steps":
            note = "training continues to the new step count" if (new or 0) > (old or 0) else \
                "training stops at the new step count"
        elif _under(key, DATA_ORDER):
            note = "the batch order restarts at the next epoch"
        elif key == "lora.init_from":
            note = "ignored on resume: the saved adapter continues"
        else:
            note = "applies from the resumed step on"
        log.info("--resume: %s changed %r -> %r: %s", key, old, new, note)
    return changes


def apply_learning_rate(changes: ConfigChanges, optimizer, scheduler) -> None:
    """A changed [train] learning_rate takes effect: the scheduler's base rates and the optimizer's
    current rates come back from the saved state, so both are scaled by new / old."""
    if "train.learning_rate" not in changes.changed:
        return
    old, new = changes.changed["train.learning_rate"]
    ratio = float(new) / float(old)
    scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
