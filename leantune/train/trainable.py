"""Which transformer weights a full fine-tune trains (`[full] train` / `exclude`, fnmatch on diffusers
names). A fact of the full mode that the planner reads too (weight_bytes, the activation probe), so it
lives in a module of its own that imports nothing of leantune.
"""

from __future__ import annotations

import fnmatch

import torch


def trains_name(name: str, train, exclude) -> bool:
    """Whether `[full] train` / `exclude` select the parameter of this diffusers name."""
    return any(fnmatch.fnmatchcase(name, pat) for pat in train) and not any(
        fnmatch.fnmatchcase(name, pat) for pat in exclude)


def select_trainable(model: torch.nn.Module, train: list[str], exclude: list[str]) -> dict[str, torch.nn.Parameter]:
    """The parameters `[full] train` / `exclude` select, by diffusers name, in model order."""
    return {name: p for name, p in model.named_parameters() if trains_name(name, train, exclude)}
