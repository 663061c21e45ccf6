"""Saving a fully fine-tuned transformer, block by block, without a second copy in host RAM.

Formats ([output] formats in full mode):
- "comfyui": one single file in the family's reference layout (`<name>_comfyui.safetensors`),
  the one ComfyUI, leantune's loader and diffusers' `from_single_file` read: Flux in BFL's layout
  (fused qkv / linear1, swapped final adaLN), SD3.5 in Stability's (`model.diffusion_model.`
  keys, fused qkv, swapped adaLN halves of the final layer and the last joint block). The family's
  `spec.single_file` (leantune/spec.py, SingleFileLayout) says how; the config a width needs beyond the
  weights (Flux's rotary split, SD3's sample size and head size) goes into the metadata.
- "diffusers": a `<name>_diffusers/` folder with config.json and diffusion_pytorch_model.safetensors.

How: the file's header is laid out first from shapes alone (the layout conversion run on meta
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
from ..memory.trainable_streaming import WeightAccess
from ..models.component_loading import dequantized_state
from ..spec import ModelSpec
from .mode_shared import prune_step_files

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


def _converted(model, spec: ModelSpec, group, read, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = {}
    for key, m, attr in group:
        if read is _meta and attr == "weight_scale" and getattr(m, "weight", None) is not None and m.weight.dtype in _FP8:
            continue          # dequantized_state folds the scale into the weight (which _meta already shows as fp32)
        state[key] = read(m, attr)
    state = dequantized_state(state)
    if fmt == "comfyui":
        layout = _single_file(spec)
        state = {layout.prefix + k: v for k, v in layout.to_native(state, model).items()}
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


def _single_file(spec: ModelSpec):
    if spec.single_file is None:
        raise ValueError(f"[output] formats: the {spec.family} family has no single-file layout; use \"diffusers\"")
    return spec.single_file


def _meta(m: torch.nn.Module, attr: str) -> torch.Tensor:
    t = m._parameters.get(attr)
    if t is None:
        t = m._buffers[attr]
    dtype = torch.float32 if t.dtype in _FP8 else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="meta")


def write_model_file(model, spec: ModelSpec, access, path: Path, fmt: str, dtype: torch.dtype,
                     metadata: dict | None = None) -> Path:
    """One safetensors file of the whole transformer in `fmt` key layout ("comfyui" = the family's
    single-file layout, "diffusers" = the model's own), streamed group by group (see the module
    docstring)."""
    groups = weight_groups(model, spec)
    layout = []
    for g in groups:
        layout += [(k, tuple(v.shape), v.dtype) for k, v in _converted(model, spec, g, _meta, fmt, dtype).items()]
    chunks = (_converted(model, spec, g, access.get, fmt, dtype) for g in groups)
    return save_safetensors_streamed(path, layout, chunks, metadata)


def single_file_metadata(model, spec: ModelSpec, step: int) -> dict:
    """The header of a full fine-tune's single file: what its loader needs, and the step."""
    return {**_single_file(spec).metadata(model), "leantune.mode": "full", "leantune.step": str(step)}


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


def export_files(model, spec: ModelSpec, access, paths, step: int, intermediate: bool, *, formats: list[str],
                 save_dtype: str, keep_last: int) -> list[Path]:
    """The model files in every [output] format (`formats`; per-step names while training, the
    newest `keep_last` kept), in [full] `save_dtype`, through `access` (a WeightAccess: where each
    tensor lives now)."""
    dtype = SAVE_DTYPES[save_dtype]
    suffix = f"-step{step:06d}" if intermediate else ""
    files = []
    for fmt in formats:
        if fmt == "comfyui":
            files.append(write_model_file(model, spec, access, paths.root / f"{paths.name}{suffix}_comfyui.safetensors",
                                          "comfyui", dtype, single_file_metadata(model, spec, step)))
        else:
            files.append(write_diffusers_folder(model, spec, access, paths.root / f"{paths.name}{suffix}_diffusers",
                                                dtype))
    if intermediate:
        prune_step_files(paths, formats, keep_last, lambda fmt: f"{paths.name}-step*_{fmt}" + (".safetensors" if fmt == "comfyui" else ""))
    return files


def export_full_model(mode, t, paths, step: int, intermediate: bool) -> list[Path]:
    """The run's model files in every [output] format; per-step names while training."""
    return export_files(t.transformer, mode.spec, WeightAccess(t.memory), paths, step, intermediate,
                        formats=mode.formats, save_dtype=mode.full.save_dtype, keep_last=mode.train.keep_last)
