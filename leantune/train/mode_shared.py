"""What the training modes share: pruning old per-step exports and the check that a checkpoint's
trainable weights are this run's. Below every mode, so no mode imports another for it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import CheckpointError


def prune_step_files(paths, formats: list[str], keep_last: int, pattern) -> None:
    """Keep the newest `[train] keep_last` per-step exports of each format (`pattern(fmt)` globs them)."""
    for fmt in formats:
        found = sorted(paths.root.glob(pattern(fmt)))
        for old in found[:-keep_last]:
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
