"""Loading Qwen-Image-2.1 components: the diffusers folder and the transformer single files.

Sources: a diffusers folder in the QwenImage21Pipeline layout (transformer/ as
QwenImage21Transformer2DModel, text_encoder/ as transformers' Qwen3VLForConditionalGeneration
(Qwen3-VL-8B), processor/ (Qwen3-VL's tokenizer, chat template and image processor), vae/ as
AutoencoderKLQwenImage21, scheduler/), any component overridden by a [model] key; or a single
transformer file in the official layout or ComfyUI's (keys.py), the architecture read from its
shapes. Every transformer is built on meta and filled tensor by tensor (weights.load_into_empty),
so a wrong or missing key is named with its file before anything is computed, and device="meta"
gives the planner shapes and dtypes without reading a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...io import save_safetensors
from .. import component_files as cf
from .. import component_loading as cl
from ..weights import CheckpointFiles, LoadError, build_empty, load_into_empty
from . import keys
from .spec import QWEN_IMAGE21_SPEC

COMPONENTS = ("transformer", "text_encoder", "processor", "vae")
_LABEL = {"transformer": "Qwen-Image-2.1 transformer", "text_encoder": "Qwen3-VL text encoder",
          "processor": "Qwen3-VL processor", "vae": "Qwen-Image-2.1 VAE"}
TRANSFORMER_CLASS = "QwenImage21Transformer2DModel"
VAE_CLASS = "AutoencoderKLQwenImage21"


@dataclass(frozen=True)
class QwenImage21Sources:
    """Where each component comes from (None: absent)."""

    transformer: Path | None
    text_encoder: Path | None
    processor: Path | None
    vae: Path | None


def resolve_sources(model_cfg, base_dir: Path) -> QwenImage21Sources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`)."""
    return QwenImage21Sources(**cl.resolve_components(model_cfg, base_dir, COMPONENTS, {}))


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


# -- transformer -------------------------------------------------------------------------------------

def read_layout(path: Path):
    """(files, ops, config, source_name) of a Qwen-Image-2.1 single file, from its header alone."""
    cl.check_file(path, "transformer")
    files = CheckpointFiles([path])
    all_keys = files.keys()
    prefix = keys.find_prefix(all_keys)
    if prefix is None:
        raise LoadError(f"{path}: not a {_LABEL['transformer']} (no {' / '.join(map(repr, keys.ANCHORS))}): "
                        f"{cf.describe(all_keys)}")
    outside = [k for k in all_keys if not k.startswith(prefix)]
    if outside:
        raise LoadError(f"{path}: unexpected key(s) {outside[:5]} outside {prefix!r}: not part of a "
                        f"{_LABEL['transformer']}")
    ops, shapes = [], {}
    for key in all_keys:
        try:
            op = keys.to_diffusers_ops(key, key[len(prefix):], files.shape(key))
        except ValueError as e:
            raise LoadError(f"{path}: {e}") from None
        ops.append(op)
        for target, shape in zip(op.targets, op.target_shapes(files.shape(key))):
            shapes[target] = shape
    meta = cf.metadata_config(files.metadata, str(path), "transformer")
    back = {t: op.source for op in ops for t in op.targets}

    def source_name(target: str) -> str:
        if target in back:
            return back[target]
        if target.endswith(("img_mlp.gate_layer.weight", "img_mlp.proj.weight")) and any(
                k.endswith(keys.FUSED) for k in all_keys):
            return prefix + target.rsplit("img_mlp.", 1)[0] + keys.FUSED
        return prefix + target

    try:
        config = keys.config_from_shapes(shapes, meta, str(path))
    except KeyError as e:
        raise LoadError(f"{path}: missing key {source_name(e.args[0])!r} of a {_LABEL['transformer']}") from None
    except (ValueError, TypeError) as e:
        raise LoadError(str(e)) from None
    return files, ops, config, source_name


def _transformer_layout(src: Path):
    """(config, files, ops, source_name) of a transformer folder or single file, from headers only."""
    return cl.transformer_layout(src, (TRANSFORMER_CLASS,), _LABEL["transformer"], read_layout)


def transformer_config(sources: QwenImage21Sources) -> dict:
    return _transformer_layout(_require(sources.transformer, "transformer"))[0]


def load_transformer(sources: QwenImage21Sources, dtype: torch.dtype = torch.bfloat16, device="cpu",
                     keep_fp8: bool = True, fp8_modulation: bool = True, quantize_fp8: bool = False,
                     quantize_modulation: bool = False, trained=None):
    """The QwenImage21Transformer2DModel, built on meta and filled tensor by tensor in `dtype` on
    `device` (device="meta": shapes and dtypes only). e4m3 block weights a file stores stay e4m3
    with their scale (`keep_fp8`); `quantize_fp8`: the block Linears a run stores in fp8 are
    quantized as they are read (`trained(name)`: weights a full fine-tune trains keep `dtype`).
    The blocks hold no modulation Linear, so the modulation switches change nothing."""
    from .block import split_blocks

    if str(device) == "meta":      # the planner's copy: its forward takes a host slot mask (meta_model.py)
        from .meta_model import QwenImage21Transformer2DModel
    else:
        from diffusers import QwenImage21Transformer2DModel

    src = _require(sources.transformer, "transformer")
    config, files, ops, source_name = _transformer_layout(src)
    try:
        model = build_empty(lambda: QwenImage21Transformer2DModel.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a {_LABEL['transformer']} from its config ({e})") from None
    split_blocks(model)            # training's block, the same math (block.py; meta_model's has its own)
    fp8 = cl.fp8_hooks(model, QWEN_IMAGE21_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation,
                       quantize=quantize_fp8, quantize_modulation=quantize_modulation, trained=trained)
    return load_into_empty(model, files, ops, what=f"a {_LABEL['transformer']} of this architecture", dtype=dtype,
                           device=device, source_name=source_name, **fp8)


def describe(transformer) -> str:
    cfg = transformer.config
    return (f"Qwen-Image-2.1 ({cfg.num_layers} single-stream blocks, width "
            f"{cfg.num_attention_heads * cfg.attention_head_dim})")


def save_single_file(transformer, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                     layout: str = "official") -> Path:
    """Write a transformer as one file, atomically: `layout` "official" (diffusers names, no
    prefix) or "comfyui" (model.diffusion_model., gate and up fused); fp8 None / "e4m3" / "scaled"
    for the block Linears; what the shapes do not give goes into the metadata."""
    if layout not in ("official", "comfyui"):
        raise ValueError(f"layout {layout!r}: 'official' or 'comfyui'")
    state = cl.dequantized_state(transformer.state_dict())
    if layout == "comfyui":
        state = keys.fuse_for_comfyui(state)
    prefix = keys.COMFY_PREFIX if layout == "comfyui" else ""
    tensors = cl.file_tensors(state, dtype=dtype, fp8=fp8, prefix=prefix,
                              in_block=lambda key: key.startswith("transformer_blocks.") and key.endswith(".weight")
                              and "norm" not in key)
    return save_safetensors(tensors, path, metadata=QWEN_IMAGE21_SPEC.single_file.metadata(transformer))


# -- VAE ---------------------------------------------------------------------------------------------------

def load_vae(sources: QwenImage21Sources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The AutoencoderKLQwenImage21 (RGBA in and out, 64 latent channels) from a diffusers vae/ folder."""
    from diffusers import AutoencoderKLQwenImage21

    src = _require(sources.vae, "vae")
    if not src.is_dir():
        raise LoadError(f"[model] vae: {src}: only the vae/ folder of a Qwen-Image-2.1 diffusers repository is read")
    config, files, ops = cl.diffusers_folder(src, (VAE_CLASS,), _LABEL["vae"])
    try:
        model = build_empty(lambda: AutoencoderKLQwenImage21.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a {_LABEL['vae']} from its config ({e})") from None
    return load_into_empty(model, files, ops, what=f"a {_LABEL['vae']} of this architecture", dtype=dtype,
                           device=device)


# -- text encoder and processor ------------------------------------------------------------------------

@dataclass
class QwenImage21TextEncoders:
    """Qwen3-VL and what feeds it: the tokenizer (with the chat template) and the image processor
    that turns references into the vision tower's patches; `device` is where encoding runs."""

    tokenizer: object
    image_processor: object
    text_encoder: torch.nn.Module         # transformers Qwen3VLForConditionalGeneration
    device: torch.device


def load_processor_parts(source: Path | None):
    """(tokenizer, image processor) from a processor/ folder (tokenizer files, chat template and
    processor_config.json's "image_processor" section or preprocessor_config.json)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = cl.load_tokenizer(source, "processor", _LABEL["processor"], AutoTokenizer, "Qwen/Qwen-Image-2.1")
    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(source), local_files_only=True)
    except Exception as e:
        raise LoadError(f"[model] processor: {source}: cannot read the image processor ({e})") from None
    if getattr(tokenizer, "chat_template", None) is None:
        template = Path(source) / "chat_template.jinja"
        if not template.is_file():
            raise LoadError(f"[model] processor: {source}: no chat template (chat_template.jinja)")
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    return tokenizer, image_processor


def load_text_encoders(sources: QwenImage21Sources, dtype: torch.dtype = torch.bfloat16,
                       device="cpu") -> QwenImage21TextEncoders:
    """Qwen3-VL (vision tower included) from a transformers folder, and the processor's parts."""
    from transformers import Qwen3VLForConditionalGeneration

    from ..streamed_encoder import load_text_model

    tokenizer, image_processor = load_processor_parts(sources.processor)
    src = _require(sources.text_encoder, "text_encoder")
    if not src.is_dir():
        raise LoadError(f"[model] text_encoder: {src}: only a transformers Qwen3-VL folder is read for now")
    declared = (cl.read_json(src / "config.json").get("architectures") or [None])[0]
    if declared not in (None, "Qwen3VLForConditionalGeneration", "Qwen3VLModel"):
        raise LoadError(f"[model] text_encoder: {src / 'config.json'}: architectures = {declared!r}, but "
                        f"Qwen-Image-2.1's text encoder is Qwen3-VL (Qwen3VLForConditionalGeneration)")
    try:
        model = load_text_model(Qwen3VLForConditionalGeneration, src, dtype, module_path="model.language_model",
                                blocks_path="layers", label=_LABEL["text_encoder"])
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot load the {_LABEL['text_encoder']} ({e})") from None
    _fill_vision_tower(model, src, dtype)
    return QwenImage21TextEncoders(tokenizer=tokenizer, image_processor=image_processor, text_encoder=model.eval(),
                                   device=torch.device(device))


def _fill_vision_tower(model, src: Path, dtype: torch.dtype) -> None:
    """When the language model was left in its files (over the host-RAM budget), the vision tower
    is read into host RAM whole (about 0.6B parameters of the 8B): references need it, and on a
    device it is streamed unit by unit from there (text.vision_units)."""
    from ..streamed_encoder import encoder_files
    from ..weights import copy_ops

    visual = model.model.visual
    if not any(p.is_meta for p in visual.parameters()):
        return
    files = CheckpointFiles(encoder_files(src))
    names = list(files.keys())
    prefix = next((p for p in ("model.visual.", "visual.") if any(k.startswith(p) for k in names)), None)
    if prefix is None:
        raise LoadError(f"[model] text_encoder: {src}: no vision tower ('model.visual.*' keys) in "
                        f"{files.name}: Qwen-Image-2.1 encodes references with it")
    ops = copy_ops([k for k in names if k.startswith(prefix)], strip=prefix)
    load_into_empty(visual, files, ops, what="the Qwen3-VL vision tower", dtype=dtype, device="cpu",
                    source_name=lambda target: prefix + target)
