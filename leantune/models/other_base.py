"""Another base checkpoint of a run's family, for previews ([sample] base, `leantune sample --base`).

Krea 2 is published as a Raw base to train on and a Turbo checkpoint (or a Turbo LoRA over Raw) to
sample with; previews of a LoRA trained on Raw are worth seeing on Turbo, at Turbo's few steps.
This module finds and loads that other transformer through the run's own family: `[model]` with
its transformer taken from the other checkpoint, so the text encoders and VAE stay the run's (the
cached prompts and the decode are the same), and the family's loader reads the file (its single
file layouts, fp8 kept fp8, and its refusal of another family's file, naming the family).

Refused before training starts (`check_other_base`): a path that does not exist, a pickle file, a
folder or file that names another family. Refused when loaded (`load_other_base`): a checkpoint of
the family with another architecture (a config key differs: Flux.1 schnell for a dev run), since
the trained LoRA would not fit it.

What it costs (`other_base_bytes`, the planner's "another base for previews" host-RAM term): the
whole transformer as loaded, in host RAM beside the training model, for the time of each preview,
and its read from disk each time (about the training model's own load time: a 12B model in bf16
is 24 GB). It is loaded per preview and dropped after, not held through the run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .weights import LoadError

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")


def other_base_config(model_cfg, path: Path):
    """[model] with its transformer taken from `path` (a diffusers folder's transformer/, a
    transformer folder or a single file); everything else stays the run's."""
    transformer = path / "transformer" if path.is_dir() and (path / "transformer").is_dir() else path
    return model_cfg.model_copy(update={"transformer": str(transformer)})


def check_other_base(model_cfg, path: Path, key: str) -> None:
    """Refuse, naming `key` and the file, a path that is missing, a pickle, or of another family."""
    from .family import get_family, guess_family

    if not path.exists():
        raise LoadError(f"{key}: {path}: no such file or folder")
    if path.is_file() and (path.suffix.lower() in PICKLE_SUFFIXES or path.suffix.lower() != ".safetensors"):
        raise LoadError(f"{key}: {path}: not a .safetensors file (pickle checkpoints are never loaded)")
    other = guess_family(path)
    if other is None:
        return                   # nothing says: the family's loader reads it and says what is wrong
    wanted, found = get_family(model_cfg.family), get_family(other)
    if other != model_cfg.family and not set(found.transformer_classes) & set(wanted.transformer_classes):
        raise LoadError(f"{key}: {path} is a {other} model, but the run's [model] family is "
                        f"\"{model_cfg.family}\"; previews with another base need a checkpoint of the same "
                        f"family (the trained LoRA fits only its architecture)")


def load_other_base(model_cfg, path: Path, base_dir: Path, dtype: torch.dtype, device="cpu", key: str = "[sample] base",
                    **options):
    """The other base's transformer, read by the run's family loader (`options`: loader_options)."""
    from .family import get_family

    check_other_base(model_cfg, path, key)
    family = get_family(model_cfg.family)
    try:
        sources = family.resolve_sources(other_base_config(model_cfg, path), base_dir)
        return family.load_transformer(sources, dtype=dtype, device=device, **options)
    except (LoadError, ValueError, FileNotFoundError) as e:
        raise LoadError(f"{key}: {path}: {e}") from None


def architecture(transformer) -> dict:
    """The config keys that decide a transformer's shapes (diffusers' config, private keys left out)."""
    config = getattr(transformer, "config", {}) or {}
    return {k: v for k, v in dict(config).items() if not k.startswith("_")}


def check_same_architecture(trained, other, path: Path, key: str = "[sample] base") -> None:
    """The other base must have the training model's architecture, or the trained LoRA cannot fit."""
    a, b = architecture(trained), architecture(other)
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            raise LoadError(f"{key}: {path} has {k} = {b.get(k)!r} where the training model has {a.get(k)!r}: "
                            f"another architecture of the family, which the trained LoRA does not fit")


def other_base_bytes(model_cfg, path: Path, base_dir: Path, dtype: torch.dtype, **options) -> int:
    """Host bytes of the other base as loaded (built on meta: nothing is read but headers)."""
    model = load_other_base(model_cfg, path, base_dir, dtype, device="meta", **options)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
