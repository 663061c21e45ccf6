"""Loading Flux.1 (dev, schnell) components from a diffusers folder or single safetensors files.

Sources: a diffusers folder in the FLUX.1-dev repository layout (transformer/, text_encoder/ (CLIP-L),
text_encoder_2/ (T5-XXL), tokenizer/, tokenizer_2/, vae/), with any component overridden by a
[model] key pointing at a diffusers sub-folder or a single .safetensors file; or a single BFL /
ComfyUI transformer file (bf16, fp8 e4m3, ComfyUI "scaled fp8"), possibly an all-in-one file that
also carries CLIP-L, T5 and the VAE under ComfyUI prefixes.

Every model is built on the meta device and filled tensor by tensor in its target dtype (see
weights.py), so a 12B transformer never exists twice in host RAM.

fp8 files stay fp8 (`load_transformer(keep_fp8=True)`, the default): a block Linear weight that
the file stores as float8_e4m3fn, the modulation/adaLN Linears included, is loaded as the stored
e4m3 bytes, and its scale (ComfyUI's per-tensor `scale_weight`, or 1 for plain e4m3 files) becomes
an fp32 `weight_scale` buffer of shape (out, 1) on the Linear, which dequantizes in its forward
(memory/fp8.py `use_fp8_weight`). That Linear is the contract with the memory engine, which keeps
such weights in e4m3 whatever memory.fp8 says. `fp8_modulation=False` (`[memory] fp8_modulation =
false`) upcasts the modulation Linears instead. Everything else (non-block modules, norms, biases)
is upcast to the compute dtype one tensor at a time.

Architectures come from the checkpoint itself (diffusers config.json, or the keys and shapes of a
single file; flux/keys.py / component_files.py), never from a hub. Only safetensors is read;
pickle checkpoints are refused. Every error names the file and the key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...io import save_safetensors
from . import keys as bfl_keys
from .. import component_files as cf
from ..bfl_layout import is_flux2_file
from .. import component_loading as cl
from ..component_loading import dtype_from_name, fingerprint
from .spec import FLUX_SPEC
from ..weights import LoadError, build_empty, copy_ops, load_into_empty

__all__ = [
    "FluxSources", "TextEncoders", "LoadError", "resolve_sources", "load_transformer", "load_vae",
    "load_text_encoders", "fingerprint", "detect_variant", "save_bfl_transformer", "dtype_from_name",
    "fp8_block_weights",
]

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "vae")
_LABEL = {"transformer": "Flux transformer", "text_encoder": "CLIP-L text encoder",
          "text_encoder_2": "T5-XXL text encoder", "tokenizer": "CLIP tokenizer", "tokenizer_2": "T5 tokenizer",
          "vae": "VAE"}
# Which component of an all-in-one single file each source is.
_EMBEDDED = {"text_encoder": "clip", "text_encoder_2": "t5", "vae": "vae"}


@dataclass(frozen=True)
class FluxSources:
    """Where each component comes from: a diffusers sub-folder or a .safetensors file (None: absent)."""

    transformer: Path | None
    text_encoder: Path | None
    text_encoder_2: Path | None
    tokenizer: Path | None
    tokenizer_2: Path | None
    vae: Path | None
    variant: str = "auto"     # [model] variant; load_transformer checks it against the weights


@dataclass
class TextEncoders:
    tokenizer: object
    text_encoder: torch.nn.Module      # CLIPTextModel
    tokenizer_2: object
    text_encoder_2: torch.nn.Module    # T5EncoderModel


# -- sources ----------------------------------------------------------------------------------------

def resolve_sources(model_cfg, base_dir: Path) -> FluxSources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`).

    A missing optional component resolves to None (the loader for it then says which key to
    set); a path that does not exist, a pickle file or a folder without a transformer is an error
    here, naming the key.
    """
    found = cl.resolve_components(model_cfg, base_dir, COMPONENTS, _EMBEDDED)
    return FluxSources(**found, variant=getattr(model_cfg, "variant", "auto"))


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


# -- transformer ---------------------------------------------------------------------------------------

def fp8_block_weights(transformer, modulation: bool = True) -> set[str]:
    """Names of the weights that may stay e4m3: every nn.Linear inside the spec's blocks except the
    norm Linears of `FLUX_SPEC.fp8_skip`, and except the modulation Linears unless `modulation`
    ('transformer_blocks.0.attn.to_q.weight')."""
    return cl.fp8_block_weights(transformer, FLUX_SPEC, modulation)


def load_transformer(sources: FluxSources, dtype: torch.dtype = torch.bfloat16, device="cpu", keep_fp8: bool = True,
                     fp8_modulation: bool = True, quantize_fp8: bool = False,
                     quantize_modulation: bool = False, trained=None):
    """The FluxTransformer2DModel, built on meta and loaded straight into `dtype` on `device`.

    `keep_fp8`: block Linear weights stored as float8_e4m3fn stay e4m3 with a `weight_scale`
    buffer (module docstring); False upcasts them to `dtype` like every other tensor.
    `fp8_modulation=False` upcasts the modulation Linears only ([memory] fp8_modulation = false).
    `quantize_fp8`: the block Linears a run stores in fp8 ([memory] fp8) are quantized as they are
    read, never held in `dtype` (`quantize_modulation`: the modulation Linears too; `trained(name)`:
    weights a full fine-tune trains stay in `dtype`); family.fp8_load_options gives these.
    """
    from diffusers import FluxTransformer2DModel

    from .block import split_blocks

    src = _require(sources.transformer, "transformer")
    bfl_prefix = None      # set for BFL files: missing keys are then reported by their BFL names

    def source_name(target: str) -> str:
        return target if bfl_prefix is None else bfl_prefix + bfl_keys.bfl_name(target)

    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, ("FluxTransformer2DModel",), "Flux transformer")
    else:
        files, prefix, shapes, meta = cl.single_file(src, "transformer", "Flux transformer")
        if is_flux2_file(shapes):       # FLUX.2 kept Flux.1's block names
            from ..family import guess_family

            raise LoadError(f"{src}: a FLUX.2 transformer, not a Flux.1 one; set [model] family = "
                            f"\"{guess_family(src) or 'flux2-dev'}\"")
        if bfl_keys.is_bfl(shapes):
            ops, unknown = bfl_keys.bfl_to_diffusers_ops(shapes, prefix)
            if unknown:
                raise LoadError(f"{src}: unexpected key(s) {unknown[:5]}: not part of a BFL Flux transformer")
            bfl_prefix = prefix
        elif bfl_keys.is_diffusers_flux(shapes):
            ops = copy_ops([prefix + k for k in shapes], strip=prefix)
        else:
            raise LoadError(f"{src}: not a Flux transformer: {cf.describe(files.keys())}")
        target_shapes = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(files.shape(op.source)))}
        try:
            config = bfl_keys.flux_config_from_shapes(target_shapes, meta.get("axes_dims_rope"))
        except KeyError as e:
            raise LoadError(f"{src}: missing key {source_name(e.args[0])!r} of a Flux transformer") from None
        except ValueError as e:
            raise LoadError(f"{src}: {e}") from None
        config.update({k: v for k, v in meta.items() if k in config})
    try:
        model = build_empty(lambda: FluxTransformer2DModel.from_config(config))
    except Exception as e:  # diffusers raises plain errors for impossible configs
        raise LoadError(f"{src}: cannot build a Flux transformer from its config ({e})") from None
    split_blocks(model)            # training's blocks, the same math (block.py), on every load, meta included
    detect_variant(model, sources.variant, source=src)      # from the structure, before reading weights
    fp8 = cl.fp8_hooks(model, FLUX_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    return load_into_empty(model, files, ops, what="a Flux transformer of this architecture", dtype=dtype,
                           device=device, source_name=source_name, **fp8)


def detect_variant(transformer, expected: str = "auto", source=None) -> str:
    """"dev" when the transformer has a guidance embedder (guidance-distilled), else "schnell".

    With `expected` other than "auto" (the [model] variant key), a contradiction is an error.
    """
    embedder = getattr(getattr(transformer, "time_text_embed", None), "guidance_embedder", None)
    has_guidance = embedder is not None or bool(getattr(transformer.config, "guidance_embeds", False))
    variant = "dev" if has_guidance else "schnell"
    if expected not in ("auto", variant):
        raise LoadError(f"{source or 'the transformer'}: [model] variant = {expected!r}, but the weights are "
                        f"{variant} (they {'have a' if has_guidance else 'have no'} guidance embedder)")
    return variant


# -- VAE -------------------------------------------------------------------------------------------------

def load_vae(sources: FluxSources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The AutoencoderKL, from a diffusers vae/ folder or an ae.safetensors (BFL/LDM or diffusers keys)."""
    return cl.load_vae(_require(sources.vae, "vae"), dtype, device, base_config="flux_vae", what="Flux VAE")


# -- text encoders -------------------------------------------------------------------------------------------

def load_text_encoders(sources: FluxSources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> TextEncoders:
    """CLIP-L and T5-XXL with their tokenizers; tokenizers first, so a missing one fails before any load."""
    from transformers import CLIPTokenizer, T5Tokenizer

    tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], CLIPTokenizer, "FLUX.1")
    tokenizer_2 = cl.load_tokenizer(sources.tokenizer_2, "tokenizer_2", _LABEL["tokenizer_2"], T5Tokenizer, "FLUX.1")
    clip = cl.load_clip(_require(sources.text_encoder, "text_encoder"), dtype, device)
    t5 = cl.load_t5(_require(sources.text_encoder_2, "text_encoder_2"), dtype, device)
    return TextEncoders(tokenizer=tokenizer, text_encoder=clip, tokenizer_2=tokenizer_2, text_encoder_2=t5)


# -- writing BFL files -----------------------------------------------------------------------------------

_dequantized = cl.dequantized_state     # (full_export.py imports it from here)


def save_bfl_transformer(transformer, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                         prefix: str = "", metadata: dict | None = None) -> Path:
    """Write a diffusers Flux transformer (model or state dict) as a BFL single file, atomically.

    fp8=None keeps `dtype` (default: the tensors' own); "e4m3" stores the Linear weights inside the
    blocks as plain float8_e4m3fn (as ComfyUI fp8 files); "scaled" stores them as e4m3 divided by
    a per-tensor `scale_weight` (ComfyUI "scaled fp8"). The rotary axes go into the metadata so
    widths other than Flux's load with the right positional split.
    """
    meta = dict(metadata or {})
    if isinstance(transformer, torch.nn.Module):
        state = transformer.state_dict()
        meta.setdefault(cf.METADATA_CONFIG_KEY, json.dumps({"axes_dims_rope": list(transformer.config.axes_dims_rope)}))
    else:
        state = dict(transformer)
    tensors = cl.file_tensors(bfl_keys.diffusers_to_bfl(_dequantized(state)), dtype=dtype, fp8=fp8, prefix=prefix,
                              in_block=lambda key: key.startswith(("double_blocks.", "single_blocks.")))
    return save_safetensors(tensors, path, metadata=meta)
