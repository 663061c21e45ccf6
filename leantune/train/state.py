"""Training checkpoints and exact resume.

A checkpoint is a folder `step-000120/` holding `tensors.safetensors` (every tensor of the state:
trainable weights, optimizer moments, RNG states) and `state.json` (everything else, with
references to those tensors). The nested state (optimizer.state_dict() with its integer keys,
data position, RNG states) is flattened generically, so no pickle is ever written or read.

Saves are atomic at the folder level: written into a hidden temporary folder, every file fsynced,
then renamed into place; `state.json` is written last and a folder without it is ignored, so an
interrupted save never shadows the previous good checkpoint. Each checkpoint also stores the
resolved run config (`config.json`), so a resume can say what changed (train/resume_config.py).

Nothing non-finite is ever saved or resumed: a state holding NaN or inf (a diverged run) is
refused before anything is written, so the previous save stays the resumable one. `state.json`
records the sha256 of every tensor file, computed while it is written; a file whose bytes no longer
match (bit rot, length unchanged, which safetensors itself would load without complaint) does not
load, and neither does a checkpoint whose values are non-finite.

`load_latest` falls back past a checkpoint that does not load: it is renamed `corrupt-step-*`
(kept for inspection, never picked up again) and the previous one is used, with a warning.
A full disk during a save is reported with the folder and the bytes needed (leantune/disk.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..io import load_safetensors, save_safetensors_streamed

PREFIX = "step-"
CORRUPT_PREFIX = "corrupt-"
log = logging.getLogger("leantune")


class NonFiniteStateError(FloatingPointError):
    """A state to save holds NaN or inf; nothing was written and the previous save is kept."""


TENSOR_FILE = "tensors.safetensors"


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """'key (NaN)' / 'key (inf)' for each floating tensor holding a non-finite value."""
    bad = []
    for key, t in tensors.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if bool(torch.isfinite(t).all()):
            continue
        what = "NaN" if bool(torch.isnan(t).any()) else "inf"
        bad.append(f"{key} ({what})")
    return bad


def _flatten(obj, tensors: dict[str, torch.Tensor], path: str):
    """Replace tensors by {"__tensor__": key} and remember dicts with non-string keys."""
    if isinstance(obj, torch.Tensor):
        key = path or "root"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _flatten(v, tensors, f"{path}.{k}" if path else k) for k, v in obj.items()}
        items = [[_flatten(k, tensors, f"{path}.k{i}"), _flatten(v, tensors, f"{path}.{i}")]
                 for i, (k, v) in enumerate(obj.items())]
        return {"__items__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} at {path!r} in a checkpoint")


def _unflatten(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, dict):
        if "__tensor__" in obj and len(obj) == 1:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj and len(obj) == 1:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj and len(obj) == 1:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: str | Path, step: int, state: dict, keep_last: int | None = None,
                    config: dict | None = None) -> Path:
    """Write `state` (and the run's `config`) as root/step-XXXXXX atomically; prune to the newest
    `keep_last` checkpoints. A full disk raises `DiskFullError` naming the folder and the size."""
    from ..disk import disk_full_guard

    root = Path(root)
    previous = latest_checkpoint(root)
    intact = f"the last save ({previous.name}) is intact" if previous else "no earlier save exists"
    tensors: dict[str, torch.Tensor] = {}
    tree = _flatten(state, tensors, "")
    bad = non_finite(tensors)
    if bad:
        kept = f"the last save ({previous}) is kept" if previous else "no earlier save exists"
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteStateError(
            f"step {step}: the state to save holds non-finite values ({', '.join(bad[:3])}{more}): the training "
            f"diverged; nothing was saved and {kept}. Lower [train] learning_rate (or raise max_grad_norm "
            f"clipping) and resume from the last save, or start again")
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    with disk_full_guard(root, needed, intact):
        return _write_checkpoint(root, step, tensors, tree, keep_last, config)


def _write_checkpoint(root: Path, step: int, tensors: dict, tree, keep_last: int | None, config: dict | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    tmp = root / f".tmp-{PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # Written tensor by tensor: safetensors' save_file would first serialize all of them to
        # bytes, a second copy of a full fine-tune's weights and optimizer state in host RAM.
        digest = hashlib.sha256()
        save_safetensors_streamed(tmp / TENSOR_FILE, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()],
                                  ({k: v} for k, v in tensors.items()), digest=digest)
        _fsync_path(tmp / TENSOR_FILE)
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            _fsync_path(tmp / "config.json")
        (tmp / "state.json").write_text(json.dumps({"step": step, "state": tree,
                                                    "checksums": {TENSOR_FILE: f"sha256:{digest.hexdigest()}"}}))
        _fsync_path(tmp / "state.json")
        if final.exists():
            old = root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints (with state.json), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> tuple[int, dict]:
    path = Path(path)
    try:
        meta = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / 'state.json'}: unreadable checkpoint state ({e})") from None
    _verify_checksums(path, meta.get("checksums"))
    tensors, _ = load_safetensors(path / TENSOR_FILE)
    bad = non_finite(tensors)
    if bad:
        raise CheckpointError(f"{path / TENSOR_FILE}: holds non-finite values ({', '.join(bad[:3])})")
    try:
        return int(meta["step"]), _unflatten(meta["state"], tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: state.json does not match tensors.safetensors ({type(e).__name__}: {e})") \
            from None


def _verify_checksums(path: Path, checksums: dict | None) -> None:
    """Each tensor file's sha256 against the one recorded when it was written (checkpoints from
    before checksums were stored have none: their values are still checked for NaN/inf)."""
    from ..io import file_sha256

    for name, recorded in (checksums or {}).items():
        algorithm, _, want = str(recorded).partition(":")
        if algorithm != "sha256":
            raise CheckpointError(f"{path / 'state.json'}: unknown checksum {recorded!r} for {name}")
        try:
            got = file_sha256(path / name)
        except OSError as e:
            raise CheckpointError(f"{path / name}: unreadable ({e})") from None
        if got != want:
            raise CheckpointError(f"{path / name}: its bytes changed since it was saved (sha256 {got[:12]}..., "
                                  f"saved as {want[:12]}...): damaged on disk")


def saved_config(path: str | Path) -> dict | None:
    """The resolved config a checkpoint was saved under; None for checkpoints from before it was stored."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{Path(path) / 'config.json'}: unreadable ({e})") from None


def load_latest(root: str | Path) -> tuple[Path, int, dict] | None:
    """(checkpoint, step, state) of the newest checkpoint that loads; None if there is none.

    A newer one that does not load is renamed `corrupt-step-*` (kept aside, never resumed from)
    and the next older one is tried, with a warning naming both."""
    from ..io import UnreadableFileError

    root = Path(root)
    for ckpt in reversed(list_checkpoints(root)):
        try:
            step, state = load_checkpoint(ckpt)
            saved_config(ckpt)
        except (CheckpointError, UnreadableFileError, OSError) as e:
            aside = root / f"{CORRUPT_PREFIX}{ckpt.name}"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(ckpt, aside)
            log.warning("checkpoint %s does not load (%s); kept aside as %s, trying the previous save",
                        ckpt, e, aside.name)
            continue
        return ckpt, step, state
    return None


# -- RNG -------------------------------------------------------------------------------------------

def rng_state(generator: torch.Generator, device: torch.device | None = None) -> dict:
    """The run's random state. CUDA's is the run's own device's only (`device`; the current one
    when None): a save holding every visible GPU's state could not be restored by index on a
    machine, or under a CUDA_VISIBLE_DEVICES, with fewer GPUs (IndexError at resume)."""
    import random

    st = {"torch": torch.get_rng_state(), "generator": generator.get_state(),
          "python": _py_random_state(random.getstate())}
    index = _cuda_index(device)
    if index is not None:
        st["cuda"] = torch.cuda.get_rng_state(index)
    return st


def set_rng_state(state: dict, generator: torch.Generator, device: torch.device | None = None) -> None:
    """Restore `rng_state`'s state; CUDA's goes to the run's device (`device`; the current one when
    None), whichever index it had when saved. A save of an older version holds a list of every
    visible GPU's state: the entry of the run's device is taken where there is one, else the first
    (the device the saving rank used by default)."""
    import random

    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    index = _cuda_index(device)
    if "cuda" not in state or index is None:
        return
    saved = state["cuda"]
    if isinstance(saved, (list, tuple)):
        if not saved:
            return
        saved = saved[index] if index < len(saved) else saved[0]
    torch.cuda.set_rng_state(saved, index)


def _cuda_index(device: torch.device | None) -> int | None:
    """The CUDA device index whose random state a run saves, or None (no CUDA, or a CPU run)."""
    if device is not None and device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def _py_random_state(st):
    version, internal, gauss = st
    return [version, list(internal), gauss]
