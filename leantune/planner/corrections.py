"""Corrections to the memory and timing model, measured on this machine, and where they are kept.

The prediction reads them (memory_model.py, timing.py); the runtime feedback (feedback/calibrate.py)
writes them after comparing the first steps with the prediction. They live apart from both so the
prediction never imports the feedback.

Corrections are stored in one JSON file (`CalibrationStore`, written atomically) keyed by
`architecture_key`: the architecture config and the workload's shape, not the weight values, so
every checkpoint of one architecture at one batch/text length shares its calibration. An entry
that is not a calibration (a NaN scale: "cannot convert float NaN to integer" in the memory model)
is ignored with a warning naming the file and key, and the plan starts uncalibrated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..io import atomic_write_json
from ..native import make_private_folders

if TYPE_CHECKING:
    import torch

    from .workload import Workload

log = logging.getLogger("leantune")


@dataclass
class Calibration:
    """Corrections measured on this machine: activation scale per bucket key, compute and copy rates."""

    activation_scale: dict[str, float] = field(default_factory=dict)
    flops_scale: float = 1.0
    h2d_pinned: float | None = None

    def to_dict(self) -> dict:
        return {"activation_scale": dict(self.activation_scale), "flops_scale": self.flops_scale,
                "h2d_pinned": self.h2d_pinned}

    @classmethod
    def from_dict(cls, d: dict | None) -> Calibration:
        d = d or {}
        return cls(dict(d.get("activation_scale", {})), float(d.get("flops_scale", 1.0)), d.get("h2d_pinned"))

    @classmethod
    def from_kept(cls, d) -> Calibration:
        """A stored entry read as untrusted: every scale and rate a positive finite number, else
        kept_files.BadKeptFile (a ValueError) naming it."""
        from .kept_files import BadKeptFile, is_number

        if not isinstance(d, dict) or not isinstance(d.get("activation_scale", {}), dict):
            raise BadKeptFile("not a calibration's table")
        numbers = {f"activation_scale[{k!r}]": v for k, v in d.get("activation_scale", {}).items()}
        numbers["flops_scale"] = d.get("flops_scale", 1.0)
        if d.get("h2d_pinned") is not None:
            numbers["h2d_pinned"] = d["h2d_pinned"]
        for name, v in numbers.items():
            if not (is_number(v) and v > 0):
                raise BadKeptFile(f"{name} is {v!r}, not a positive number")
        return cls.from_dict(d)


def bucket_key(bucket: tuple[int, int]) -> str:
    return f"{bucket[0]}x{bucket[1]}"


def activation_key(bucket: tuple[int, int], checkpointing: str, split: bool = False) -> str:
    """Calibration.activation_scale's key of a plan's activations: its bucket and checkpointing,
    and whether its blocks split (Plan.split_blocks: other tensors kept, so another correction; an
    unsplit plan keeps the key it had before split blocks)."""
    return f"{bucket_key(bucket)}:{checkpointing}" + (":split" if split else "")


def architecture_key(model: torch.nn.Module, workload: Workload) -> str:
    """Identity of what decides activation memory: the architecture config and the workload's shape
    (not the weight values, so every checkpoint of one architecture shares a calibration)."""
    cfg = {k: v for k, v in dict(getattr(model, "config", {})).items() if not k.startswith("_")}
    shape = {"class": type(model).__name__, "config": cfg, "mode": workload.mode, "rank": workload.rank,
             "targets": workload.targets, "blocks": workload.lora_blocks, "batch": workload.batch_size,
             "text": workload.text_length, "autocast": workload.autocast, "dtype": str(workload.dtype),
             "dropout": workload.lora_dropout}
    if workload.mode == "lora" and workload.adapter != "lora":      # plain LoRA keeps its earlier key
        shape.update(adapter=workload.adapter, lokr=[workload.lokr_factor, workload.lokr_decompose_both])
    if workload.references:                                          # text to image keeps its earlier key
        shape["references"] = workload.references
    if workload.frames != 1:                                         # an image keeps its earlier key
        shape["frames"] = workload.frames
    blob = json.dumps(shape, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_calibration_path() -> Path:
    base = os.environ.get("LEANTUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "leantune")
    return Path(base) / "calibration.json"


class CalibrationStore:
    """Calibrations on disk, one JSON file, keyed by `architecture_key`. Written atomically; an
    unreadable file is reported and ignored (the planner then starts from the uncalibrated model)."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else default_calibration_path()

    def _read(self) -> dict:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            return data
        except (OSError, ValueError, TypeError) as e:
            log.warning("planner: ignoring unreadable calibration file %s (%s)", self.path, e)
            return {}

    def get(self, key: str) -> Calibration | None:
        entry = self._read().get(key)
        if not entry:
            return None
        try:
            return Calibration.from_kept(entry)
        except ValueError as e:
            log.warning("planner: ignoring calibration %s in %s (%s); planning uncalibrated", key, self.path, e)
            return None

    def put(self, key: str, calibration: Calibration) -> None:
        data = self._read()
        data[key] = calibration.to_dict()
        make_private_folders(self.path.parent)      # the cache's folders only this user can write (native.py)
        atomic_write_json(self.path, data)
