"""FLUX.2 transformers from one .safetensors file, and writing one.

Files read: BFL's own (flux2-dev.safetensors, flux-2-klein-4b.safetensors, ...: BFL names, no
prefix), ComfyUI's repackaged ones (the same names under `model.diffusion_model.`; bf16, plain
e4m3 "fp8" files and "scaled fp8" files with per-tensor `scale_weight`), and a diffusers-named
transformer saved as one file. The architecture (width, heads, double and single depth, input
channels, text width, MLP ratio, guidance embedder) is read from the tensors' shapes, so no config
file is needed; flux2/keys.py holds the names and the shape rules.

Loading follows weights.py: the model is built on the meta device, every file key is mapped to its
model key(s) and checked against the model's names and shapes from the header alone (a file of
another architecture, a truncated one or one missing a tensor fails before a weight is read, naming
the file and the key), then each parameter is allocated once in its final dtype and filled from
the file in small chunks. There is never a second, full-precision copy of the model. Block Linear
weights the file stores as e4m3 stay e4m3 with an fp32 `weight_scale` (the memory engine's fp8
Linear), as Flux.1's do (flux/loading.py); which Linears may stay so is the family spec's
business (component_loading.keep_fp8_hooks). On device "meta" nothing is read.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...io import save_safetensors
from .. import component_files as cf
from .. import component_loading as cl
from . import keys
from ..weights import CheckpointFiles, LoadError, build_empty, copy_ops, load_into_empty

__all__ = ["load_single_file_transformer", "read_layout", "save_single_file", "LoadError"]

LABEL = "FLUX.2 transformer"


def read_layout(path: str | Path):
    """(files, ops, config, source_name) of a FLUX.2 single file, from its header alone.

    `source_name(model_key)` is the file key a model key comes from (for missing-key messages).
    """
    path = Path(path)
    cl.check_file(path, "transformer")
    from ..gguf_file import open_single_file

    files = open_single_file(path)                    # safetensors, or GGUF (models/gguf_file.py)
    all_keys = files.keys()
    prefix = keys.find_prefix(all_keys)
    if prefix is None:
        raise LoadError(f"{path}: not a {LABEL} (no {keys.BFL_MARKERS[0]!r}, the shared modulation only "
                        f"FLUX.2 has): {cf.describe(all_keys)}")
    outside = [k for k in all_keys if not k.startswith(prefix)]
    if outside:
        raise LoadError(f"{path}: unexpected key(s) {outside[:5]} outside {prefix!r}: not part of a {LABEL}")
    shapes = {k[len(prefix):]: files.shape(k) for k in all_keys}
    if keys.is_flux2_bfl(shapes):
        ops, unknown = keys.bfl_to_diffusers_ops(shapes, prefix)
        if unknown:
            raise LoadError(f"{path}: unexpected key(s) {unknown[:5]}: not part of a BFL {LABEL}")

        def source_name(target: str) -> str:
            return prefix + keys.bfl_name(target)
    else:
        ops = copy_ops([prefix + k for k in shapes], strip=prefix)

        def source_name(target: str) -> str:
            return prefix + target
    for op in ops:
        problem = op.check(files.shape(op.source))
        if problem:
            raise LoadError(f"{path}: key {op.source!r}: {problem}; it is not a {LABEL}")
    target_shapes = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(files.shape(op.source)))}
    meta = cf.metadata_config(files.metadata, str(path), "transformer")
    try:
        config = keys.config_from_shapes(target_shapes, meta)
    except KeyError as e:
        raise LoadError(f"{path}: missing key {source_name(e.args[0])!r} of a {LABEL}") from None
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from None
    return files, ops, config, source_name


def check_variant(config, expected: str | None, source) -> str:
    """The FLUX.2 family `config` is (flux2_keys.variant_of); a LoadError naming `source` when
    `expected` (the [model] family, or "auto"/None: any) is another one that matters: dev against
    klein always (dev's guidance embedder and Mistral text encoder against klein's Qwen3 and
    classifier-free guidance), klein 4B against 9B when the weights are a released architecture
    (a tiny or pruned klein is either)."""
    found = keys.variant_of(config)
    if expected in (None, "auto") or found == expected:
        return found
    dev_differs = (found == "flux2-dev") != (expected == "flux2-dev")
    if dev_differs or keys.is_released(config):
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        width = get("num_attention_heads") * get("attention_head_dim")
        shape = (f"width {width}, {get('num_layers')} double + {get('num_single_layers')} single blocks, "
                 f"{'a' if get('guidance_embeds') else 'no'} guidance embedder")
        if keys.is_released(config) or found == "flux2-dev":
            family = f'"{found}"'
        else:
            family = '"flux2-klein-4b" or "flux2-klein-9b"'
        raise LoadError(f"{source}: the weights are {found} ({shape}), not {expected}; set [model] family = {family}")
    return found


def load_single_file_transformer(path: str | Path, dtype: torch.dtype = torch.bfloat16, device="cpu",
                                 fp8_modulation: bool = True, keep_fp8: bool = True, expected: str = "auto",
                                 spec=None, quantize_fp8: bool = False, quantize_modulation: bool = False,
                                 trained=None):
    """The Flux2Transformer2DModel of a BFL / ComfyUI / diffusers-named single file.

    `keep_fp8`: block Linear weights stored as e4m3 stay e4m3 with a `weight_scale` buffer; False
    upcasts them to `dtype`. `fp8_modulation=False` upcasts the modulation Linears the spec names
    ([memory] fp8_modulation = false). `expected`: the family the caller was asked for ("auto": any).
    `spec`: the family's ModelSpec (default FLUX.2's), which says which Linears may stay e4m3.
    `quantize_fp8` / `quantize_modulation` / `trained`: as flux_loading.load_transformer's.
    """
    from diffusers import Flux2Transformer2DModel

    path = Path(path)
    files, ops, config, source_name = read_layout(path)
    found = check_variant(config, expected, path)
    try:
        model = build_empty(lambda: Flux2Transformer2DModel.from_config(config))
    except Exception as e:  # diffusers raises plain errors for impossible configs
        raise LoadError(f"{path}: cannot build a {LABEL} from its shapes ({e})") from None
    if spec is None:          # the three FLUX.2 specs share their blocks; any names the same Linears
        from .spec import SPECS

        spec = SPECS.get(expected) or SPECS.get(found) or next(iter(SPECS.values()))
    fp8 = cl.fp8_hooks(model, spec, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    return load_into_empty(model, files, ops, what=f"a {LABEL} of this architecture", dtype=dtype, device=device,
                           source_name=source_name, **fp8)


def save_single_file(transformer, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                     prefix: str = "", metadata: dict | None = None) -> Path:
    """Write a diffusers FLUX.2 transformer (model or state dict) as a BFL single file, atomically.

    fp8=None keeps `dtype` (default: the tensors' own); "e4m3" stores the block Linear weights as
    plain float8_e4m3fn, "scaled" as e4m3 with a per-tensor `scale_weight` (ComfyUI's layouts).
    `prefix` "model.diffusion_model." writes ComfyUI's names. A model's rotary split goes into the
    metadata, so widths other than the released ones load back with the same config.

    This writes a whole in-memory state dict (tests, conversions); a full fine-tune's export goes
    through the spec's `single_file` layout group by group (train/full_export.py) instead.
    """
    meta = dict(metadata or {})
    if isinstance(transformer, torch.nn.Module):
        state = transformer.state_dict()
        for k, v in keys.native_metadata(transformer).items():
            meta.setdefault(k, v)
    else:
        state = dict(transformer)
    tensors = cl.file_tensors(keys.diffusers_to_bfl(cl.dequantized_state(state)), dtype=dtype, fp8=fp8,
                              prefix=prefix, in_block=lambda key: key.startswith(("double_blocks.", "single_blocks.")))
    return save_safetensors(tensors, path, metadata=meta)
