"""Saving a fully fine-tuned transformer, block by block, without a second copy in host RAM.

Formats ([output] formats in full mode):
- "comfyui": one BFL / ComfyUI-layout single file (`<name>_comfyui.safetensors`: fused qkv /
  linear1, swapped final adaLN), the layout ComfyUI, leantune's loader and diffusers'
  `from_single_file` read; the rotary split goes into the metadata so other widths load too.
- "diffusers": a `<name>_diffusers/` folder with config.json and diffusion_pytorch_model.safetensors.

How: the file's header is laid out first from shapes alone (the BFL conversion run on meta
tensors), then each group (the non-block modules, then every block in order) is read from where it
lives (a streamed block: its host buffer, no copy; a resident block: its device tensors), converted,
cast to `[full] save_dtype` and written, before the next group is touched. Host RAM therefore holds
one converted block at a time. Writes are atomic; per-step exports are pruned to `[train] keep_last`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..io import save_safetensors_streamed
from ..models import bfl_keys
from ..models.component_files import METADATA_CONFIG_KEY
from ..models.flux_loading import _dequantized
from ..models.spec import ModelSpec
from .modes import prune_step_files

SAVE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def weight_groups(model: torch.nn.Module, spec: ModelSpec) -> list[list[tuple[str, torch.nn.Module, str]]]:
    """(state-dict key, owning module, attribute) of every persistent tensor, grouped as the non-block
    modules first and then each block in execution order."""
    blocks = [name for name, _ in spec.blocks(model)]
    groups: dict[str, list] = {"": []}
    groups.update({b: [] for b in blocks})
    for mname, m in model.named_modules():
        items = [(a, t) for a, t in m._parameters.items() if t is not None]
        items += [(a, t) for a, t in m._buffers.items() if t is not None and a not in m._non_persistent_buffers_set]
        for attr, _ in items:
            key = f"{mname}.{attr}" if mname else attr
            owner = next((b for b in blocks if key.startswith(b + ".")), "")
            groups[owner].append((key, m, attr))
    return [g for g in groups.values() if g]


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _converted(group, read, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for key, m, attr in group:
        if read is _meta and attr == "weight_scale" and getattr(m, "weight", None) is not None and m.weight.dtype in _FP8:
            continue          # _dequantized folds the scale into the weight (which _meta already shows as fp32)
        state[key] = read(m, attr)
    state = _dequantized(state)
    if fmt == "comfyui":
        state = bfl_keys.diffusers_to_bfl(state)
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


def _meta(m: torch.nn.Module, attr: str) -> torch.Tensor:
    t = m._parameters.get(attr)
    if t is None:
        t = m._buffers[attr]
    dtype = torch.float32 if t.dtype in _FP8 else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="meta")


def write_model_file(model, spec: ModelSpec, access, path: Path, fmt: str, dtype: torch.dtype,
                     metadata: dict | None = None) -> Path:
    """One safetensors file of the whole transformer in `fmt` key layout ("comfyui" = BFL keys,
    "diffusers" = the model's own), streamed group by group (see the module docstring)."""
    groups = weight_groups(model, spec)
    layout = []
    for g in groups:
        layout += [(k, tuple(v.shape), v.dtype) for k, v in _converted(g, _meta, fmt, dtype).items()]
    chunks = (_converted(g, access.get, fmt, dtype) for g in groups)
    return save_safetensors_streamed(path, layout, chunks, metadata)


def _config_metadata(model) -> dict:
    return {METADATA_CONFIG_KEY: json.dumps({"axes_dims_rope": list(model.config.axes_dims_rope)})}


def write_diffusers_folder(model, spec: ModelSpec, access, folder: Path, dtype: torch.dtype) -> Path:
    """A diffusers transformer folder (config.json + weights), written aside and renamed into place."""
    folder = Path(folder)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_config(str(tmp))
        write_model_file(model, spec, access, tmp / "diffusion_pytorch_model.safetensors", "diffusers", dtype)
        old = folder.parent / f".old-{folder.name}-{os.getpid()}"
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def export_full_model(mode, t, paths, step: int, intermediate: bool) -> list[Path]:
    """The run's model files in every [output] format; per-step names while training."""
    from ..memory.trainable_streaming import WeightAccess

    cfg = mode.cfg
    model = t.transformer
    access = WeightAccess(t.memory)
    dtype = SAVE_DTYPES[cfg.full.save_dtype]
    suffix = f"-step{step:06d}" if intermediate else ""
    files = []
    for fmt in cfg.output.formats:
        if fmt == "comfyui":
            meta = {**_config_metadata(model), "leantune.mode": "full", "leantune.step": str(step)}
            files.append(write_model_file(model, mode.spec, access, paths.root / f"{paths.name}{suffix}_comfyui.safetensors",
                                          "comfyui", dtype, meta))
        else:
            files.append(write_diffusers_folder(model, mode.spec, access, paths.root / f"{paths.name}{suffix}_diffusers",
                                                dtype))
    if intermediate:
        prune_step_files(paths, cfg, lambda fmt: f"{paths.name}-step*_{fmt}" + (".safetensors" if fmt == "comfyui" else ""))
    return files
