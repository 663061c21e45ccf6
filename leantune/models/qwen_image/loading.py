"""Loading Qwen-Image (and Qwen-Image-Edit) components: the diffusers folder and the single files
people download.

Sources: a diffusers folder in the Qwen/Qwen-Image layout (transformer/ in 9 official safetensors
shards with an index, text_encoder/ (Qwen2.5-VL-7B, transformers layout), tokenizer/, vae/
(AutoencoderKLQwenImage), scheduler/; the Edit-2509 folders add processor/), any component
overridden by a [model] key; or a single transformer file: ComfyUI's repackaged
`qwen_image_bf16.safetensors` / `qwen_image_fp8_e4m3fn.safetensors` (diffusers' names under
`model.diffusion_model.`, fp8 weights plain or "scaled" with `scale_weight`), the same without a
prefix, or one of the official shards (`diffusion_pytorch_model-00001-of-00009.safetensors`: its
sibling shards are read with it). Block weights a file stores in e4m3 stay e4m3 (the engine's fp8
Linear), as for Flux and SD3.5.

Architecture from shapes: depth from the block indices, width from `img_in`, text width from
`txt_in`, head size from the q-norm; the rotary axes are Qwen-Image's (16, 56, 56) for heads of 128
(a smaller head, as in the tests' tiny files, needs `axes_dims_rope` in the file's `leantune.config`
metadata). A Flux or SD3.5 file is refused with what it looks like.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...io import save_safetensors
from .. import component_files as cf
from .. import component_loading as cl
from .spec import COMFY_PREFIX, QWEN_IMAGE_SPEC
from ..weights import CheckpointFiles, LoadError, build_empty, copy_ops, load_into_empty

COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
_LABEL = {"transformer": "Qwen-Image transformer", "text_encoder": "Qwen2.5-VL text encoder",
          "tokenizer": "Qwen2 tokenizer", "vae": "Qwen-Image VAE"}
_REPO = "Qwen/Qwen-Image"
_CLASS = "QwenImageTransformer2DModel"
_ANCHOR = "transformer_blocks.0.img_mod.1.weight"
_SHARD = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.safetensors")
AXES_128 = (16, 56, 56)        # Qwen-Image's rotary axes for heads of 128


@dataclass(frozen=True)
class QwenImageSources:
    """Where each component comes from: a diffusers sub-folder or a .safetensors file (None: absent)."""

    transformer: Path | None
    text_encoder: Path | None
    tokenizer: Path | None
    vae: Path | None


@dataclass
class QwenImageTextEncoders:
    """The tokenizer and Qwen2.5-VL, on the host; `device` is where encoding runs (the encoder's
    layers are streamed there one at a time when it is not the host: qwen_image.encode_prompts)."""

    tokenizer: object
    text_encoder: torch.nn.Module         # Qwen2_5_VLForConditionalGeneration
    device: torch.device
    image_processor: object = None        # Qwen2-VL's image processor: the Edit family's references


def resolve_sources(model_cfg, base_dir: Path) -> QwenImageSources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`)."""
    return QwenImageSources(**cl.resolve_components(model_cfg, base_dir, COMPONENTS, {}))


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


# -- transformer -------------------------------------------------------------------------------------

def fp8_block_weights(transformer, modulation: bool = True) -> set[str]:
    return cl.fp8_block_weights(transformer, QWEN_IMAGE_SPEC, modulation)


def _shard_paths(src: Path) -> list[Path]:
    """An official shard and its siblings (all of `name-XXXXX-of-NNNNN.safetensors`), else the file."""
    m = _SHARD.fullmatch(src.name)
    if not m:
        return [src]
    stem, total = m.group(1), int(m.group(3))
    paths = [src.with_name(f"{stem}-{i:05d}-of-{total:05d}.safetensors") for i in range(1, total + 1)]
    absent = [p.name for p in paths if not p.is_file()]
    if absent:
        raise LoadError(f"{src}: an official shard of {total}; the others must sit beside it, missing {absent[:3]}")
    return paths


def _prefix(keys) -> str | None:
    for k in keys:
        if k.endswith(_ANCHOR):
            return k[: -len(_ANCHOR)]
    return None


def config_from_shapes(shapes: dict[str, tuple[int, ...]], meta: dict, where: str) -> dict:
    """QwenImageTransformer2DModel's config from tensor shapes (names without prefix)."""
    try:
        inner, in_channels = shapes["img_in.weight"]
        text_dim = shapes["txt_in.weight"][1]
        head = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
        out_rows = shapes["proj_out.weight"][0]
    except KeyError as e:
        raise LoadError(f"{where}: missing key {e.args[0]!r} of a Qwen-Image transformer") from None
    layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("transformer_blocks."))
    patch = 2
    config = {"_class_name": _CLASS, "patch_size": patch, "in_channels": in_channels,
              "out_channels": out_rows // (patch * patch), "num_layers": layers, "attention_head_dim": head,
              "num_attention_heads": inner // head, "joint_attention_dim": text_dim, "guidance_embeds": False,
              "use_additional_t_cond": "time_text_embed.addition_t_embedding.weight" in shapes}
    config.update(meta)
    if "axes_dims_rope" not in config:
        if head != 128:
            raise LoadError(f"{where}: heads of {head} (not Qwen-Image's 128): the rotary axes cannot be read from "
                            f"the weights; give axes_dims_rope in the file's {cf.METADATA_CONFIG_KEY!r} metadata")
        config["axes_dims_rope"] = AXES_128
    return config


def _transformer_layout(src: Path):
    """(config, files, ops, source_name) of a transformer folder or single file, from headers only."""
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, (_CLASS,), _LABEL["transformer"])
        return config, files, ops, (lambda target: target)
    if src.suffix.lower() == ".gguf":                   # ComfyUI-GGUF: ComfyUI's names (models/gguf_file.py)
        from ..gguf_file import GgufFiles

        files = GgufFiles(src)
    else:
        files = CheckpointFiles(_shard_paths(src))
    keys = list(files.keys())
    prefix = _prefix(keys)
    if prefix is None:
        raise LoadError(f"{src}: not a Qwen-Image transformer (no {_ANCHOR!r}): {cf.describe(keys)}")
    shapes = {k[len(prefix):]: files.shape(k) for k in keys if k.startswith(prefix)}
    others = [k for k in keys if not k.startswith(prefix)]
    if others:
        raise LoadError(f"{src}: unexpected key(s) {others[:5]}: not part of a Qwen-Image transformer")
    meta = cf.metadata_config(files.metadata, str(src), "transformer")
    config = config_from_shapes(shapes, meta, str(src))
    return config, files, copy_ops(keys, strip=prefix), (lambda target: prefix + target)


def transformer_config(sources: QwenImageSources) -> dict:
    return _transformer_layout(_require(sources.transformer, "transformer"))[0]


def load_transformer(sources: QwenImageSources, dtype: torch.dtype = torch.bfloat16, device="cpu",
                     keep_fp8: bool = True, fp8_modulation: bool = True, quantize_fp8: bool = False,
                     quantize_modulation: bool = False, trained=None):
    """The QwenImageTransformer2DModel, built on meta and filled tensor by tensor in `dtype` on `device`
    (device="meta": shapes and dtypes only, for the planner). e4m3 block weights stay e4m3 with a
    per-row scale (`keep_fp8`); `fp8_modulation=False` upcasts the img_mod / txt_mod Linears.
    `quantize_fp8`: the block Linears a run stores in fp8 ([memory] fp8) are quantized as they are
    read, never held in `dtype` (`quantize_modulation`: the modulation Linears too; `trained(name)`:
    weights a full fine-tune trains stay in `dtype`); family.fp8_load_options gives these.
    """
    from diffusers import QwenImageTransformer2DModel

    src = _require(sources.transformer, "transformer")
    config, files, ops, source_name = _transformer_layout(src)
    try:
        model = build_empty(lambda: QwenImageTransformer2DModel.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a Qwen-Image transformer from its config ({e})") from None
    fp8 = cl.fp8_hooks(model, QWEN_IMAGE_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    return load_into_empty(model, files, ops, what="a Qwen-Image transformer of this architecture", dtype=dtype,
                           device=device, source_name=source_name, **fp8)


def describe(transformer) -> str:
    cfg = transformer.config
    return f"Qwen-Image ({cfg.num_layers} blocks, width {cfg.num_attention_heads * cfg.attention_head_dim})"


def save_comfy_transformer(transformer, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                           prefix: str = COMFY_PREFIX) -> Path:
    """Write a transformer in ComfyUI's repackaged single-file layout (fp8 None / "e4m3" / "scaled"
    for the block Linears), atomically; a head size other than 128 goes into the metadata."""
    cfg = transformer.config
    meta = {}
    if cfg.attention_head_dim != 128:
        meta[cf.METADATA_CONFIG_KEY] = json.dumps({"axes_dims_rope": list(cfg.axes_dims_rope)})
    state = cl.dequantized_state(transformer.state_dict())
    tensors = cl.file_tensors(state, dtype=dtype, fp8=fp8, prefix=prefix,
                              in_block=lambda key: key.startswith("transformer_blocks."))
    return save_safetensors(tensors, path, metadata=meta)


# -- VAE ---------------------------------------------------------------------------------------------------

def load_raw_vae(sources: QwenImageSources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The AutoencoderKLQwenImage itself, from a diffusers vae/ folder or a diffusers-keyed single file."""
    from diffusers import AutoencoderKLQwenImage

    src = _require(sources.vae, "vae")
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, ("AutoencoderKLQwenImage",), _LABEL["vae"])
    else:
        files = CheckpointFiles([src])
        keys = list(files.keys())
        if "encoder.conv_in.weight" not in keys:
            raise LoadError(f"{src}: not a Qwen-Image VAE in diffusers' layout (no 'encoder.conv_in.weight'; "
                            f"ComfyUI's qwen_image_vae.safetensors uses the original Wan names: point [model] vae "
                            f"at the vae/ folder of {_REPO})")
        config = {**cf.packaged_config("qwen_image_vae"), **cf.metadata_config(files.metadata, str(src), "vae")}
        ops = copy_ops(keys)
    try:
        model = build_empty(lambda: AutoencoderKLQwenImage.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a Qwen-Image VAE from its config ({e})") from None
    return load_into_empty(model, files, ops, what="a Qwen-Image VAE of this architecture", dtype=dtype, device=device)


# -- text encoder ---------------------------------------------------------------------------------------

def load_text_encoders(sources: QwenImageSources, dtype: torch.dtype = torch.bfloat16,
                       device="cpu", keep_fp8: bool = False) -> QwenImageTextEncoders:
    """The Qwen2 tokenizer and Qwen2.5-VL, on the host (encoding streams the encoder's layers to
    `device`: 7B parameters, 15 GiB in bf16, never on the device at once). The encoder comes from
    a transformers folder or a single file (ComfyUI's qwen_2.5_vl_7b*.safetensors: load_text_encoder_file);
    a folder's encoder that does not fit the host-RAM budget is left in its files (streamed_encoder.py)."""
    from ..streamed_encoder import load_text_model
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], Qwen2Tokenizer, _REPO)
    src = _require(sources.text_encoder, "text_encoder")
    if src.is_dir():
        try:
            # loaded when it fits the host-RAM budget, else read from its files layer by layer
            model = load_text_model(Qwen2_5_VLForConditionalGeneration, src, dtype, module_path="model.language_model",
                                    blocks_path="layers", label=_LABEL["text_encoder"])
        except LoadError:
            raise
        except Exception as e:
            raise LoadError(f"[model] text_encoder: {src}: cannot load the {_LABEL['text_encoder']} ({e})") from None
    else:
        model = load_text_encoder_file(src, dtype, "cpu", keep_fp8=keep_fp8)
    return QwenImageTextEncoders(tokenizer=tokenizer, text_encoder=model.eval(), device=torch.device(device))


# -- the text encoder as a single file ------------------------------------------------------------------
#
# ComfyUI's split text encoder (qwen_2.5_vl_7b.safetensors, bf16; qwen_2.5_vl_7b_fp8_scaled.safetensors)
# holds Qwen2.5-VL under the names of the original checkpoint (transformers before its 4.52 layout):
# the language model as `model.layers.N...`, `model.embed_tokens`, `model.norm`; the vision tower as
# `visual.*`; `lm_head.weight` where kept. An all-in-one checkpoint puts them under
# `text_encoders.qwen25_7b.transformer.`. Today's transformers class names them
# `model.language_model.*` and `model.visual.*`; both layouts are read. fp8 weights carry a
# per-tensor scale (`.scale_weight`, or `.weight_scale` in ComfyUI's newer quantized files).

TEXT_PREFIXES = ("text_encoders.qwen25_7b.transformer.", "text_encoders.qwen25_7b.", "")
_TEXT_ANCHORS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def _text_target(key: str) -> str:
    """A file key (prefix stripped) -> today's Qwen2_5_VLForConditionalGeneration name."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + key[len("model."):]
    return key


def _text_layout(src: Path):
    """(config, files, prefix) of a single text-encoder file, from its header."""
    files = CheckpointFiles([src])
    keys = list(files.keys())
    prefix = next((p for p in TEXT_PREFIXES if any(p + a in keys for a in _TEXT_ANCHORS)), None)
    if prefix is None:
        raise LoadError(f"[model] text_encoder: {src}: not a Qwen2.5-VL text encoder (no 'model.embed_tokens.weight' "
                        f"under {[p for p in TEXT_PREFIXES if p]} or at the top): {cf.describe(keys)}")
    names = {_text_target(k[len(prefix):]): k for k in keys if k.startswith(prefix)}
    config = cf.packaged_config("qwen25_vl_7b")
    config.pop("_comment", None)
    meta = cf.metadata_config(files.metadata, str(src), "text_encoder")
    for part in ("text_config", "vision_config"):            # a file's metadata overrides part by part
        config[part] = {**config[part], **meta.pop(part, {})}
    config.update(meta)
    layers = {int(n.split(".")[3]) for n in names if n.startswith("model.language_model.layers.")}
    blocks = {int(n.split(".")[3]) for n in names if n.startswith("model.visual.blocks.")}
    if layers:
        config["text_config"]["num_hidden_layers"] = max(layers) + 1
    if blocks:
        config["vision_config"]["depth"] = max(blocks) + 1
    if "lm_head.weight" not in names:           # unused for encoding: tied to the embedding, nothing stored
        config["tie_word_embeddings"] = True
    return config, files, prefix, names


def load_text_encoder_file(src: Path, dtype: torch.dtype = torch.bfloat16, device="cpu", keep_fp8: bool = False):
    """Qwen2_5_VLForConditionalGeneration from a single file, built on meta and filled tensor by tensor.

    fp8 weights are upcast to `dtype` with their scale, tensor by tensor (the default), or, with
    `keep_fp8`, the language model's layer Linears stay e4m3 with their scale (the engine's fp8
    Linear computes in `dtype`): 7.6 GB instead of 15 GB of host RAM for the 7B."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config, files, prefix, names = _text_layout(src)
    try:
        cfg = Qwen2_5_VLConfig(**{k: v for k, v in config.items() if k != "model_type"})
        model = build_empty(lambda: Qwen2_5_VLForConditionalGeneration(cfg))
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot build Qwen2.5-VL from its config ({e})") from None
    ops = copy_ops(list(names.values()), strip=prefix, rename=_text_target)
    keep = attach = None
    if keep_fp8:
        from ...memory.fp8 import use_fp8_weight

        def keep(target: str) -> bool:
            return target.startswith("model.language_model.layers.") and ("_proj." in target)

        def attach(target: str, scale: torch.Tensor) -> None:
            use_fp8_weight(model.get_submodule(target[: -len(".weight")]), scale)
    return load_into_empty(model, files, ops, what="a Qwen2.5-VL text encoder of this architecture", dtype=dtype,
                           device=device, source_name=lambda t: names.get(t, t), keep_fp8=keep, on_fp8=attach)


def save_text_encoder_file(model, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                           prefix: str = "") -> Path:
    """Write Qwen2.5-VL in ComfyUI's single-file layout (the original checkpoint's names; fp8 None /
    "e4m3" / "scaled" for the language model's layer Linears), its config in the metadata, atomically."""
    legacy = {}
    for key, t in cl.dequantized_state(model.state_dict()).items():
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        elif key.startswith("model.visual."):
            key = key[len("model."):]
        legacy[key] = t
    tensors = cl.file_tensors(legacy, dtype=dtype, fp8=fp8, prefix=prefix,
                              in_block=lambda key: key.startswith("model.layers.") and "_proj." in key)
    cfg = model.config.to_dict()
    meta = {"text_config": _plain(cfg["text_config"]), "vision_config": _plain(cfg["vision_config"]),
            **{k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}}
    return save_safetensors(tensors, path, metadata={cf.METADATA_CONFIG_KEY: json.dumps(meta)})


def _plain(section: dict) -> dict:
    """A config section without transformers' bookkeeping keys (what a file's metadata states)."""
    skip = {"_name_or_path", "architectures", "transformers_version", "model_type", "torch_dtype", "dtype",
            "id2label", "label2id", "_attn_implementation_autoset", "layer_types"}
    return {k: v for k, v in section.items() if k not in skip and not k.startswith("_")}
