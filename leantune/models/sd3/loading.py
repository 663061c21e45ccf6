"""Loading SD3.5 (Large, Medium) components from a diffusers folder or Stability / ComfyUI single files.

Sources: a diffusers folder in the stabilityai/stable-diffusion-3.5-large layout (transformer/,
text_encoder/ (CLIP-L with projection), text_encoder_2/ (CLIP-G with projection), text_encoder_3/
(T5-XXL), tokenizer/, tokenizer_2/, tokenizer_3/, vae/), any component overridden by a [model] key
pointing at a diffusers sub-folder or a single .safetensors file; or Stability's single transformer
file (`sd3.5_large.safetensors`: `model.diffusion_model.*` keys, also without the prefix; bf16, fp8
e4m3 or ComfyUI scaled fp8), whose embedded VAE (`first_stage_model.*`) and, in all-in-one files,
text encoders (`text_encoders.clip_l|clip_g|t5xxl.transformer.*`) are found too; plus separate
`clip_l`, `clip_g` and `t5xxl` files.

`[model] t5 = false` leaves T5-XXL out (about 9.5 GB in bf16): the T5 part of the text sequence is
then zeros of T5's shape, as StableDiffusion3Pipeline does when it has no text_encoder_3.

Shared mechanics (meta-device build, tensor-by-tensor fill, fp8 kept fp8, pickle refused, errors
naming file and key) come from component_loading.py and weights.py; the Stability key mapping and
the architecture read from shapes from sd3/keys.py. Everything here is what SD3 names differently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...io import save_safetensors
from .. import component_files as cf
from .. import component_loading as cl
from . import keys as sd3_keys
from .spec import SD3_SPEC
from ..weights import LoadError, build_empty, copy_ops, load_into_empty

__all__ = ["SD3Sources", "SD3TextEncoders", "resolve_sources", "load_transformer", "load_text_encoders",
           "load_vae", "transformer_config", "fp8_block_weights", "save_stability_transformer", "LoadError"]

STABILITY_PREFIX = "model.diffusion_model."

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
              "tokenizer_3", "vae")
_LABEL = {"transformer": "SD3 transformer", "text_encoder": "CLIP-L text encoder",
          "text_encoder_2": "CLIP-G text encoder", "text_encoder_3": "T5-XXL text encoder",
          "tokenizer": "CLIP-L tokenizer", "tokenizer_2": "CLIP-G tokenizer", "tokenizer_3": "T5 tokenizer",
          "vae": "SD3 VAE"}
# Which component of an all-in-one single file each source is (component_files kinds).
_EMBEDDED = {"text_encoder": "clip", "text_encoder_2": "clip_g", "text_encoder_3": "t5", "vae": "vae"}
_REPO = "stable-diffusion-3.5"


@dataclass(frozen=True)
class SD3Sources:
    """Where each component comes from: a diffusers sub-folder or a .safetensors file (None: absent)."""

    transformer: Path | None
    text_encoder: Path | None
    text_encoder_2: Path | None
    text_encoder_3: Path | None      # None with [model] t5 = false
    tokenizer: Path | None
    tokenizer_2: Path | None
    tokenizer_3: Path | None
    vae: Path | None
    t5: bool = True                  # [model] t5


@dataclass
class SD3TextEncoders:
    tokenizer: object
    text_encoder: torch.nn.Module            # CLIPTextModelWithProjection (CLIP-L)
    tokenizer_2: object
    text_encoder_2: torch.nn.Module          # CLIPTextModelWithProjection (CLIP-G)
    tokenizer_3: object | None               # None: no T5 ([model] t5 = false)
    text_encoder_3: torch.nn.Module | None   # T5EncoderModel, or None
    t5_width: int                            # the transformer's joint_attention_dim: the zeros' width without T5


def resolve_sources(model_cfg, base_dir: Path) -> SD3Sources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`).
    With `t5 = false` the T5 encoder and tokenizer are not looked for (and a [model] text_encoder_3
    or tokenizer_3 key is refused by the config)."""
    found = cl.resolve_components(model_cfg, base_dir, COMPONENTS, _EMBEDDED)
    t5 = bool(getattr(model_cfg, "t5", True))
    if not t5:
        found["text_encoder_3"] = found["tokenizer_3"] = None
    return SD3Sources(**found, t5=t5)


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


# -- transformer -------------------------------------------------------------------------------------

def fp8_block_weights(transformer, modulation: bool = True) -> set[str]:
    """The block weights that stay e4m3 when a file stores them so (the adaLN Linears only with
    `modulation`), by name."""
    return cl.fp8_block_weights(transformer, SD3_SPEC, modulation)


def _transformer_layout(src: Path):
    """(config, files, ops, source_name) of a transformer folder or single file, from headers only."""
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, ("SD3Transformer2DModel",), "SD3 transformer")
        return config, files, ops, (lambda target: target)
    files, prefix, shapes, meta = cl.single_file(src, "transformer", "SD3 transformer")
    if sd3_keys.is_stability(shapes):
        ops, unknown = sd3_keys.stability_to_diffusers_ops(shapes, prefix)
        if unknown:
            raise LoadError(f"{src}: unexpected key(s) {unknown[:5]}: not part of a Stability SD3 transformer")
        n = max((int(k.split(".")[1]) for k in shapes if k.startswith("joint_blocks.")), default=-1) + 1

        def source_name(target: str) -> str:
            module, _, param = target.rpartition(".")
            if target == "pos_embed.pos_embed":
                return prefix + "pos_embed"
            try:
                return prefix + f"{sd3_keys.stability_module(module, n).module}.{param}"
            except KeyError:
                return target
    elif sd3_keys.is_diffusers_sd3(shapes):
        ops = copy_ops([prefix + k for k in shapes], strip=prefix)

        def source_name(target: str) -> str:
            return prefix + target
    else:
        raise LoadError(f"{src}: not an SD3 transformer: {cf.describe(files.keys())}")
    target_shapes = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(files.shape(op.source)))}
    try:
        config = sd3_keys.sd3_config_from_shapes(target_shapes, meta)
    except KeyError as e:
        raise LoadError(f"{src}: missing key {source_name(e.args[0])!r} of an SD3 transformer") from None
    except ValueError as e:
        raise LoadError(f"{src}: {e}") from None
    return config, files, ops, source_name


def transformer_config(sources: SD3Sources) -> dict:
    """The transformer's architecture config (from config.json or the file's keys and shapes; no
    weights read)."""
    return _transformer_layout(_require(sources.transformer, "transformer"))[0]


def load_transformer(sources: SD3Sources, dtype: torch.dtype = torch.bfloat16, device="cpu", keep_fp8: bool = True,
                     fp8_modulation: bool = True, quantize_fp8: bool = False,
                     quantize_modulation: bool = False, trained=None):
    """The SD3Transformer2DModel, built on meta and loaded straight into `dtype` on `device`
    (device="meta": shapes and dtypes only, for the planner).

    `keep_fp8`: block Linear weights stored as float8_e4m3fn stay e4m3 with a `weight_scale`
    buffer (as flux_loading explains); False upcasts them to `dtype`. `fp8_modulation=False` upcasts
    the adaLN Linears only ([memory] fp8_modulation = false).
    `quantize_fp8`: the block Linears a run stores in fp8 ([memory] fp8) are quantized as they are
    read, never held in `dtype` (`quantize_modulation`: the modulation Linears too; `trained(name)`:
    weights a full fine-tune trains stay in `dtype`); family.fp8_load_options gives these.
    """
    from diffusers import SD3Transformer2DModel

    src = _require(sources.transformer, "transformer")
    config, files, ops, source_name = _transformer_layout(src)
    try:
        model = build_empty(lambda: SD3Transformer2DModel.from_config(config))
    except Exception as e:  # diffusers raises plain errors for impossible configs
        raise LoadError(f"{src}: cannot build an SD3 transformer from its config ({e})") from None
    fp8 = cl.fp8_hooks(model, SD3_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    return load_into_empty(model, files, ops, what="an SD3 transformer of this architecture", dtype=dtype,
                           device=device, source_name=source_name, **fp8)


def describe(transformer) -> str:
    """"SD3.5 Large-style (38 joint blocks)" / "SD3.5 Medium-style (MMDiT-X, 24 joint blocks)"."""
    cfg = transformer.config
    kind = "Medium-style (MMDiT-X, " if tuple(cfg.dual_attention_layers or ()) else "Large-style ("
    return f"SD3.5 {kind}{cfg.num_layers} joint blocks, width {cfg.num_attention_heads * cfg.attention_head_dim})"


# -- VAE ---------------------------------------------------------------------------------------------------

def load_vae(sources: SD3Sources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The 16-channel AutoencoderKL. Its config carries SD3's latent scaling (1.5305) and shift
    (0.0609), which the cache and the decoder read; a single file is completed with them."""
    return cl.load_vae(_require(sources.vae, "vae"), dtype, device, base_config="sd3_vae", what="SD3 VAE")


# -- text encoders ---------------------------------------------------------------------------------------

def load_text_encoders(sources: SD3Sources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> SD3TextEncoders:
    """CLIP-L and CLIP-G (with projection) and T5-XXL (unless [model] t5 = false), with their
    tokenizers; tokenizers first, so a missing one fails before any load."""
    from transformers import CLIPTokenizer, T5Tokenizer

    tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], CLIPTokenizer, _REPO)
    tokenizer_2 = cl.load_tokenizer(sources.tokenizer_2, "tokenizer_2", _LABEL["tokenizer_2"], CLIPTokenizer, _REPO)
    tokenizer_3 = t5 = None
    if sources.t5:
        if sources.text_encoder_3 is None:
            raise LoadError("no T5-XXL text encoder: [model] path has no text_encoder_3/ folder and [model] "
                            "text_encoder_3 is not set; set it to a T5 folder or .safetensors file, or set "
                            "[model] t5 = false to train and sample without T5 (zeros in its place)")
        tokenizer_3 = cl.load_tokenizer(sources.tokenizer_3, "tokenizer_3", _LABEL["tokenizer_3"], T5Tokenizer, _REPO)
    width = int(transformer_config(sources)["joint_attention_dim"])
    clip_l = cl.load_clip(_require(sources.text_encoder, "text_encoder"), dtype, device, with_projection=True)
    clip_g = cl.load_clip(_require(sources.text_encoder_2, "text_encoder_2"), dtype, device, with_projection=True,
                          component="clip_g", base_config="clip_g", label=_LABEL["text_encoder_2"],
                          what=_LABEL["text_encoder_2"])
    if sources.t5:
        t5 = cl.load_t5(sources.text_encoder_3, dtype, device)
    return SD3TextEncoders(tokenizer=tokenizer, text_encoder=clip_l, tokenizer_2=tokenizer_2, text_encoder_2=clip_g,
                           tokenizer_3=tokenizer_3, text_encoder_3=t5, t5_width=width)



# -- writing Stability files ---------------------------------------------------------------------------------

def save_stability_transformer(transformer, path: str | Path, dtype: torch.dtype | None = None,
                               fp8: str | None = None, prefix: str = STABILITY_PREFIX,
                               metadata: dict | None = None) -> Path:
    """Write a diffusers SD3 transformer (model or state dict) in Stability's single-file layout
    (sd3_keys.diffusers_to_stability), atomically.

    fp8=None keeps `dtype` (default: the tensors' own); "e4m3" / "scaled" store the Linear weights
    inside the joint blocks as ComfyUI's fp8 / scaled-fp8 files do (component_loading.file_tensors).
    A model's sample_size and head size go into the `leantune.config` metadata, so the file loads
    back to the same config at any width (real Stability files need neither: 128 and 64).
    """
    meta = dict(metadata or {})
    if isinstance(transformer, torch.nn.Module):
        state = transformer.state_dict()
        cfg = transformer.config
        meta.setdefault(cf.METADATA_CONFIG_KEY, json.dumps({"sample_size": cfg.sample_size,
                                                            "attention_head_dim": cfg.attention_head_dim}))
    else:
        state = dict(transformer)
    stability = sd3_keys.diffusers_to_stability(cl.dequantized_state(state))
    tensors = cl.file_tensors(stability, dtype=dtype, fp8=fp8, prefix=prefix,
                              in_block=lambda key: key.startswith("joint_blocks."))
    return save_safetensors(tensors, path, metadata=meta)
