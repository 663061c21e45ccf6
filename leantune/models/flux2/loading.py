"""Loading FLUX.2 components (dev, klein 4B, klein 9B): the diffusers folders, and the single
transformer files BFL and ComfyUI publish (read by flux2/single_file.py).

Sources: a diffusers folder in the black-forest-labs/FLUX.2-dev or FLUX.2-klein layout
(transformer/ as Flux2Transformer2DModel, text_encoder/ in the transformers layout: Mistral Small
3.x (Mistral3ForConditionalGeneration) for dev, Qwen3 (Qwen3ForCausalLM) for klein, tokenizer/,
vae/ as AutoencoderKLFlux2, scheduler/), any component overridden by a [model] key; or a single
transformer .safetensors file.

Every model is built on the meta device and filled tensor by tensor in its target dtype
(weights.py); device "meta" builds the architecture with the loader's dtypes and reads nothing (the
planner). Block weights a file stores in e4m3 stay e4m3 (the engine's fp8 Linear); FLUX.2's
modulation Linears are outside the blocks, so they never do. Only safetensors is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import component_files as cf
from .. import component_loading as cl
from .keys import is_released, variant_of
from .spec import FLUX2_DEV_SPEC
from ..weights import CheckpointFiles, LoadError, build_empty, copy_ops, load_into_empty

COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
_LABEL = {"transformer": "FLUX.2 transformer", "text_encoder": "FLUX.2 text encoder", "tokenizer": "FLUX.2 tokenizer",
          "vae": "FLUX.2 VAE"}
TRANSFORMER_CLASS = "Flux2Transformer2DModel"
VAE_CLASS = "AutoencoderKLFlux2"
# text encoder kind -> (transformers architectures it accepts, the published repository holding it)
TEXT_ENCODERS = {
    "mistral3": (("Mistral3ForConditionalGeneration",), "black-forest-labs/FLUX.2-dev"),
    "qwen3": (("Qwen3ForCausalLM",), "black-forest-labs/FLUX.2-klein-4B"),
}


@dataclass(frozen=True)
class Flux2Sources:
    """Where each component comes from: a diffusers sub-folder or a .safetensors file (None: absent)."""

    transformer: Path | None
    text_encoder: Path | None
    tokenizer: Path | None
    vae: Path | None


@dataclass
class Flux2TextEncoders:
    """The tokenizer (dev: a processor or tokenizer with Mistral's chat template; klein: Qwen's) and
    the text model, on the host; `device` is where encoding runs (flux2_text.encode_prompts)."""

    kind: str                              # "mistral3" or "qwen3"
    tokenizer: object
    text_encoder: torch.nn.Module          # Mistral3ForConditionalGeneration / Qwen3ForCausalLM
    device: torch.device


def resolve_sources(model_cfg, base_dir: Path) -> Flux2Sources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`)."""
    return Flux2Sources(**cl.resolve_components(model_cfg, base_dir, COMPONENTS, {}))


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


# -- transformer -------------------------------------------------------------------------------------

def transformer_config(sources: Flux2Sources) -> dict:
    """The transformer's diffusers config (a folder's config.json)."""
    src = _require(sources.transformer, "transformer")
    if not src.is_dir():
        raise LoadError(f"{src}: a single file's config comes from its shapes (flux2_single_file)")
    return cl.diffusers_folder(src, (TRANSFORMER_CLASS,), _LABEL["transformer"])[0]


def load_transformer(sources: Flux2Sources, dtype: torch.dtype = torch.bfloat16, device="cpu",
                     keep_fp8: bool = True, fp8_modulation: bool = True, quantize_fp8: bool = False,
                     quantize_modulation: bool = False, trained=None, expected: str = "auto"):
    """The Flux2Transformer2DModel of a diffusers folder or a single .safetensors file, in `dtype`
    on `device` (device "meta": shapes and dtypes only). e4m3 block weights stay e4m3 (`keep_fp8`);
    `fp8_modulation` is passed on to the single-file reader (FLUX.2's modulation is outside the
    blocks, so a folder never keeps it fp8). `quantize_fp8` / `quantize_modulation` / `trained`:
    the block Linears a run stores in fp8 are quantized as they are read (as flux_loading's).
    `expected`: the [model] family asked for; weights of another FLUX.2 (a klein file or folder
    under flux2-dev) are refused before a tensor is read, naming the file and the family to set
    (flux2_single_file.check_variant)."""
    from .single_file import check_variant, load_single_file_transformer

    src = _require(sources.transformer, "transformer")
    if src.is_file():
        if src.suffix.lower() not in (".safetensors", ".gguf"):
            raise LoadError(f"[model] transformer: {src}: only .safetensors (or .gguf) files are read")
        return load_single_file_transformer(src, dtype, device, fp8_modulation=fp8_modulation, keep_fp8=keep_fp8,
                                            quantize_fp8=quantize_fp8, quantize_modulation=quantize_modulation,
                                            trained=trained, expected=expected)
    from diffusers import Flux2Transformer2DModel

    config, files, ops = cl.diffusers_folder(src, (TRANSFORMER_CLASS,), _LABEL["transformer"])
    check_variant(config, expected, src / "config.json")
    try:
        model = build_empty(lambda: Flux2Transformer2DModel.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a FLUX.2 transformer from its config ({e})") from None
    fp8 = cl.fp8_hooks(model, FLUX2_DEV_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    return load_into_empty(model, files, ops, what="a FLUX.2 transformer of this architecture", dtype=dtype,
                           device=device, **fp8)


_NAMES = {"flux2-dev": "FLUX.2-dev", "flux2-klein-4b": "FLUX.2-klein-4B", "flux2-klein-9b": "FLUX.2-klein-9B"}


def describe(transformer) -> str:
    """"FLUX.2-dev (8 double + 48 single blocks, width 6144)"; a klein that is not a released
    architecture (tiny, pruned) is "FLUX.2-klein" (its size is not one of the released two)."""
    cfg = transformer.config
    width = cfg.num_attention_heads * cfg.attention_head_dim
    variant = variant_of(cfg)
    name = _NAMES[variant] if variant == "flux2-dev" or is_released(cfg) else "FLUX.2-klein"
    return f"{name} ({cfg.num_layers} double + {cfg.num_single_layers} single blocks, width {width})"


# -- VAE ---------------------------------------------------------------------------------------------

def load_raw_vae(sources: Flux2Sources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The AutoencoderKLFlux2 itself (its batch-norm running statistics included), from a diffusers
    vae/ folder or a diffusers-keyed single file (the published architecture, models/configs/flux2_vae.json)."""
    from diffusers import AutoencoderKLFlux2

    src = _require(sources.vae, "vae")
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, (VAE_CLASS,), _LABEL["vae"])
    else:
        files = CheckpointFiles([src])
        keys = list(files.keys())
        if "encoder.conv_in.weight" not in keys or "bn.running_mean" not in keys:
            raise LoadError(f"{src}: not a FLUX.2 VAE in diffusers' layout (no 'encoder.conv_in.weight' and "
                            f"'bn.running_mean'); point [model] vae at the vae/ folder of a FLUX.2 repository")
        config = {**cf.packaged_config("flux2_vae"), **cf.metadata_config(files.metadata, str(src), "vae")}
        ops = copy_ops(keys)
    try:
        model = build_empty(lambda: AutoencoderKLFlux2.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a FLUX.2 VAE from its config ({e})") from None
    return load_into_empty(model, files, ops, what="a FLUX.2 VAE of this architecture", dtype=dtype, device=device)


# -- text encoder ------------------------------------------------------------------------------------

def _architecture(folder: Path) -> str | None:
    config = cl.read_json(folder / "config.json")
    return (config.get("architectures") or [None])[0]


def load_text_encoders(sources: Flux2Sources, kind: str, dtype: torch.dtype = torch.bfloat16,
                       device="cpu") -> Flux2TextEncoders:
    """The tokenizer and the text model of `kind` ("mistral3": FLUX.2-dev; "qwen3": klein) from their
    folders, on the host (encoding places the model's layers on `device`)."""
    from transformers import AutoProcessor, AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3ForCausalLM

    from ..streamed_encoder import load_text_model

    classes, repo = TEXT_ENCODERS[kind]
    src = _require(sources.text_encoder, "text_encoder")
    if not src.is_dir():
        raise LoadError(f"[model] text_encoder: {src}: the {kind} text encoder loads from a transformers folder "
                        f"(the text_encoder/ folder of {repo}), not a single file")
    declared = _architecture(src)
    if declared not in classes:
        raise LoadError(f"[model] text_encoder: {src / 'config.json'}: architectures = {declared!r}, but this "
                        f"FLUX.2 variant's text encoder is a {'/'.join(classes)}")
    if kind == "mistral3":
        # FLUX.2-dev's tokenizer/ is a Pixtral processor (a tokenizer with Mistral's chat template
        # under it); a folder with the tokenizer files alone loads as the tokenizer.
        tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], AutoProcessor, repo)
        model_cls = Mistral3ForConditionalGeneration
    else:
        tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], AutoTokenizer, repo)
        model_cls = Qwen3ForCausalLM
    try:
        # loaded when it fits the host-RAM budget, else left in its files and read layer by layer
        # when it runs (dev's 24B Mistral is 48 GB in bf16: streamed_encoder.py)
        model = load_text_model(model_cls, src, dtype, label=_LABEL["text_encoder"], blocks_path="layers",
                                module_path="model.language_model" if kind == "mistral3" else "model")
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot load the {_LABEL['text_encoder']} ({e})") from None
    return Flux2TextEncoders(kind=kind, tokenizer=tokenizer, text_encoder=model.eval(), device=torch.device(device))
