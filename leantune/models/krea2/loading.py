"""Loading Krea 2 components (Raw and Turbo): the diffusers folder and the single files people
download.

Sources: a diffusers folder in the Krea2Pipeline layout (transformer/ as Krea2Transformer2DModel,
text_encoder/ as transformers' Qwen3VLModel (Qwen3-VL-4B-Instruct), tokenizer/, vae/ as
AutoencoderKLQwenImage, scheduler/; model_index.json says which encoder layers the pipeline taps,
`text_encoder_select_layers`, and whether the transformer is the distilled Turbo, `is_distilled`),
any component overridden by a [model] key; or a single transformer file: krea-ai's own
(Krea-2-Raw / Krea-2-Turbo .safetensors, official names, no prefix), ComfyUI's repackaged ones (the
same names under `model.diffusion_model.`; bf16, plain e4m3 and "scaled" e4m3 with `scale_weight`),
or a diffusers-named transformer saved as one file. The architecture is read from the shapes
(krea2/keys.py); block weights a file stores in e4m3 stay e4m3 (the engine's fp8 Linear). The
text encoder comes from a transformers folder or a single file (ComfyUI's Qwen3-VL layout, below).

Raw and Turbo are the same architecture with other weights: no tensor name or shape tells them
apart, so a single file is sampled with Raw's schedule unless [sample] says otherwise; a diffusers
folder says which it is (model_index.json `is_distilled`, or the transformer config's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...io import save_safetensors
from .. import component_files as cf
from .. import component_loading as cl
from . import keys
from .spec import KREA2_SPEC
from ..weights import CheckpointFiles, KeyOp, LoadError, build_empty, copy_ops, load_into_empty

COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
_LABEL = {"transformer": "Krea 2 transformer", "text_encoder": "Qwen3-VL text encoder",
          "tokenizer": "Qwen2 tokenizer", "vae": "Qwen-Image VAE"}
_REPO = "krea/Krea-2-Raw"
TRANSFORMER_CLASS = "Krea2Transformer2DModel"
# Krea2Pipeline's default taps (pipeline_krea2.py; krea-ai/krea-2 encoder.py TextEncoderConfig)
DEFAULT_SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)


@dataclass(frozen=True)
class Krea2Sources:
    """Where each component comes from (None: absent), and what the folder's model_index.json says."""

    transformer: Path | None
    text_encoder: Path | None
    tokenizer: Path | None
    vae: Path | None
    select_layers: tuple[int, ...] = DEFAULT_SELECT_LAYERS
    distilled: bool = False


@dataclass
class Krea2TextEncoders:
    """The tokenizer and Qwen3-VL on the host; `device` is where encoding runs (its decoder layers
    are streamed there one at a time when it is not the host: krea2/text.py); `select_layers` the
    hidden states the pipeline stacks."""

    tokenizer: object
    text_encoder: torch.nn.Module         # transformers Qwen3VLModel
    device: torch.device
    select_layers: tuple[int, ...] = DEFAULT_SELECT_LAYERS


def pipeline_config(root: Path | None) -> dict:
    """model_index.json of a diffusers folder ({} when there is none)."""
    if root is None or not Path(root).is_dir():
        return {}
    path = Path(root) / "model_index.json"
    if not path.is_file():
        return {}
    data = cl.read_json(path)
    return data if isinstance(data, dict) else {}


def resolve_sources(model_cfg, base_dir: Path) -> Krea2Sources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`)."""
    found = cl.resolve_components(model_cfg, base_dir, COMPONENTS, {})
    root = cl.config_path(model_cfg.path, base_dir)
    index = pipeline_config(root)
    layers = index.get("text_encoder_select_layers") or DEFAULT_SELECT_LAYERS
    try:
        layers = tuple(int(i) for i in layers)
    except (TypeError, ValueError):
        raise LoadError(f"{root / 'model_index.json'}: text_encoder_select_layers = {layers!r} is not a list of "
                        f"layer indices") from None
    distilled = bool(index.get("is_distilled", False))
    if not distilled and found["transformer"] is not None and found["transformer"].is_dir():
        config = found["transformer"] / "config.json"
        distilled = config.is_file() and bool(cl.read_json(config).get("is_distilled", False))
    return Krea2Sources(**found, select_layers=layers, distilled=distilled)


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


# -- transformer -------------------------------------------------------------------------------------

def read_layout(path: Path):
    """(files, ops, config, source_name) of a Krea 2 single file, from its header alone."""
    cl.check_file(path, "transformer")
    from ..gguf_file import open_single_file

    files = open_single_file(path)                    # safetensors, or GGUF (models/gguf_file.py)
    all_keys = files.keys()
    found = keys.find_prefix(all_keys)
    if found is None:
        raise LoadError(f"{path}: not a {_LABEL['transformer']} (no {keys.NATIVE_ANCHOR!r}, the text fusion only "
                        f"Krea 2 has): {cf.describe(all_keys)}")
    prefix, layout = found
    outside = [k for k in all_keys if not k.startswith(prefix)]
    if outside:
        raise LoadError(f"{path}: unexpected key(s) {outside[:5]} outside {prefix!r}: not part of a "
                        f"{_LABEL['transformer']}")
    ops, shapes, unknown = [], {}, []
    for key in all_keys:
        name = key[len(prefix):]
        target = keys.to_diffusers(name) if layout == "native" else name
        if target is None:
            unknown.append(key)
            continue
        shape = files.shape(key)
        if layout == "native" and keys.is_block_modulation(target):
            if len(shape) != 1 or shape[0] % 6:
                raise LoadError(f"{path}: key {key!r} has shape {shape}; a block's modulation is (6 * width,)")
            reshaped = (6, shape[0] // 6)
            ops.append(KeyOp(key, (target,), reshape=reshaped))
            shapes[target] = reshaped
        else:
            ops.append(KeyOp(key, (target,)))
            shapes[target] = shape
    if unknown:
        raise LoadError(f"{path}: unexpected key(s) {unknown[:5]}: not part of a {_LABEL['transformer']}")
    meta = cf.metadata_config(files.metadata, str(path), "transformer")
    back = {op.targets[0]: op.source for op in ops}

    def source_name(target: str) -> str:
        if target in back:
            return back[target]
        native = keys.to_native(target) if layout == "native" else target
        return prefix + (native or target)

    try:
        config = keys.config_from_shapes(shapes, meta)
    except KeyError as e:
        raise LoadError(f"{path}: missing key {source_name(e.args[0])!r} of a {_LABEL['transformer']}") from None
    except (ValueError, TypeError) as e:
        raise LoadError(f"{path}: {e}") from None
    return files, ops, config, source_name


def _transformer_layout(src: Path):
    """(config, files, ops, source_name) of a transformer folder or single file, from headers only."""
    return cl.transformer_layout(src, (TRANSFORMER_CLASS,), _LABEL["transformer"], read_layout)


def transformer_config(sources: Krea2Sources) -> dict:
    return _transformer_layout(_require(sources.transformer, "transformer"))[0]


def load_transformer(sources: Krea2Sources, dtype: torch.dtype = torch.bfloat16, device="cpu",
                     keep_fp8: bool = True, fp8_modulation: bool = True, quantize_fp8: bool = False,
                     quantize_modulation: bool = False, trained=None):
    """The Krea2Transformer2DModel, built on meta and filled tensor by tensor in `dtype` on `device`
    (device="meta": shapes and dtypes only, for the planner). e4m3 block weights stay e4m3 with a
    per-row scale (`keep_fp8`); Krea 2's blocks hold no modulation Linear, so `fp8_modulation` and
    `quantize_modulation` change nothing. `quantize_fp8`: the block Linears a run stores in fp8 are
    quantized as they are read (`trained(name)`: weights a full fine-tune trains keep `dtype`)."""
    from diffusers import Krea2Transformer2DModel

    src = _require(sources.transformer, "transformer")
    config, files, ops, source_name = _transformer_layout(src)
    try:
        model = build_empty(lambda: Krea2Transformer2DModel.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a {_LABEL['transformer']} from its config ({e})") from None
    # The RMSNorm scales (norm, norm1, norm2, norm_q, norm_k) stay float32 whatever `dtype` is, as
    # diffusers' from_pretrained keeps a model's _keep_in_fp32_modules: the norms compute with
    # 1 + weight, which bf16 would round (weights.py reads the strict list for every low dtype).
    model._keep_in_fp32_modules_strict = list(model._keep_in_fp32_modules or ())
    fp8 = cl.fp8_hooks(model, KREA2_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    return load_into_empty(model, files, ops, what=f"a {_LABEL['transformer']} of this architecture", dtype=dtype,
                           device=device, source_name=source_name, **fp8)


def describe(transformer) -> str:
    cfg = transformer.config
    return (f"Krea 2 ({cfg.num_layers} single-stream blocks, width {cfg.num_attention_heads * cfg.attention_head_dim}, "
            f"{cfg.num_text_layers} text layers)")


def save_single_file(transformer, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                     prefix: str = "") -> Path:
    """Write a transformer in krea-ai's layout (prefix "": the official file; COMFY_PREFIX: ComfyUI's
    repackaged one), fp8 None / "e4m3" / "scaled" for the block Linears, atomically; a rotary split
    or base the shapes do not give goes into the metadata. (A full fine-tune's export goes through
    the spec's single_file layout group by group instead.)"""
    state = cl.dequantized_state(transformer.state_dict())
    tensors = cl.file_tensors(keys.native_state(state), dtype=dtype, fp8=fp8, prefix=prefix,
                              in_block=lambda key: key.startswith("blocks.") and key.endswith(".weight")
                              and ".mod." not in key and "norm" not in key)
    return save_safetensors(tensors, path, metadata=KREA2_SPEC.single_file.metadata(transformer))


# -- VAE ---------------------------------------------------------------------------------------------------

def load_raw_vae(sources: Krea2Sources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The AutoencoderKLQwenImage itself, from a diffusers vae/ folder or a diffusers-keyed single file."""
    from diffusers import AutoencoderKLQwenImage

    src = _require(sources.vae, "vae")
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, ("AutoencoderKLQwenImage",), _LABEL["vae"])
    else:
        files = CheckpointFiles([src])
        names = list(files.keys())
        if "encoder.conv_in.weight" not in names:
            raise LoadError(f"{src}: not a Qwen-Image VAE in diffusers' layout (no 'encoder.conv_in.weight'; "
                            f"ComfyUI's qwen_image_vae.safetensors uses the original Wan names: point [model] vae "
                            f"at the vae/ folder of a Krea 2 or Qwen-Image diffusers repository)")
        config = {**cf.packaged_config("qwen_image_vae"), **cf.metadata_config(files.metadata, str(src), "vae")}
        ops = copy_ops(names)
    try:
        model = build_empty(lambda: AutoencoderKLQwenImage.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a Qwen-Image VAE from its config ({e})") from None
    return load_into_empty(model, files, ops, what="a Qwen-Image VAE of this architecture", dtype=dtype, device=device)


# -- text encoder ---------------------------------------------------------------------------------------

def load_text_encoders(sources: Krea2Sources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> Krea2TextEncoders:
    """The Qwen2 tokenizer and Qwen3VLModel, on the host (encoding streams the language model's
    layers to `device`), from a transformers folder or a single file (ComfyUI's
    qwen3vl_4b_bf16.safetensors: load_text_encoder_file); an encoder that does not fit the
    host-RAM budget is left in its file(s) and read layer by layer (streamed_encoder.py)."""
    from transformers import AutoTokenizer, Qwen3VLModel

    from ..streamed_encoder import load_text_model

    tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], AutoTokenizer, _REPO)
    src = _require(sources.text_encoder, "text_encoder")
    if not src.is_dir():
        model = load_text_encoder_file(src, dtype)
        return _checked_encoders(sources, tokenizer, model, src, device)
    declared = (cl.read_json(src / "config.json").get("architectures") or [None])[0]
    if declared not in (None, "Qwen3VLModel", "Qwen3VLForConditionalGeneration"):
        raise LoadError(f"[model] text_encoder: {src / 'config.json'}: architectures = {declared!r}, but Krea 2's "
                        f"text encoder is Qwen3-VL (Qwen3VLModel)")
    try:
        model = load_text_model(Qwen3VLModel, src, dtype, module_path="language_model", blocks_path="layers",
                                label=_LABEL["text_encoder"])
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot load the {_LABEL['text_encoder']} ({e})") from None
    return _checked_encoders(sources, tokenizer, model, src, device)


def _checked_encoders(sources: Krea2Sources, tokenizer, model, src: Path, device) -> Krea2TextEncoders:
    layers = model.config.text_config.num_hidden_layers
    if max(sources.select_layers) > layers:
        raise LoadError(f"[model] text_encoder: {src}: the pipeline taps hidden state {max(sources.select_layers)} "
                        f"(text_encoder_select_layers), but the encoder has {layers} layers")
    return Krea2TextEncoders(tokenizer=tokenizer, text_encoder=model.eval(), device=torch.device(device),
                             select_layers=tuple(sources.select_layers))


def folder_distilled(folder) -> bool:
    """Whether a diffusers folder is Krea 2 Turbo (model_index.json or transformer/config.json
    `is_distilled`); False for anything else (a single file cannot say)."""
    if folder is None or not Path(folder).is_dir():
        return False
    if pipeline_config(Path(folder)).get("is_distilled"):
        return True
    config = Path(folder) / "transformer" / "config.json"
    try:
        return bool(json.loads(config.read_text(encoding="utf-8")).get("is_distilled", False))
    except (OSError, ValueError, AttributeError):
        return False


# -- the text encoder as a single file ------------------------------------------------------------------
#
# ComfyUI's Qwen3-VL file (Comfy-Org/Qwen3-VL text_encoders/qwen3vl_4b_bf16.safetensors, which
# musubi-tuner's Krea 2 trainer also reads) names the language model as the original checkpoint
# did, `model.layers.N...`, `model.embed_tokens`, `model.norm`, and the vision tower `visual.*`
# (musubi-tuner krea2_encoder.py `_convert_comfyui_qwen3vl_state_dict` maps the same); today's
# transformers names them `model.language_model.*` / `model.visual.*` (Qwen3VLForConditionalGeneration)
# or `language_model.*` / `visual.*` (Qwen3VLModel). All are read; `lm_head.weight` (tied to the
# embedding in the 4B) is not used for encoding. The architecture is the packaged
# Qwen3-VL-4B-Instruct config (models/configs/qwen3_vl_4b.json) with the depths read from the keys
# and, part by part, what the file's `leantune.config` metadata says.

_TEXT_ANCHORS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                 "language_model.embed_tokens.weight")


def text_target(key: str) -> str:
    """A text-encoder file key (prefix stripped) -> its Qwen3VLModel name."""
    if key.startswith(("model.language_model.", "model.visual.")):
        return key[len("model."):]
    if key.startswith(("language_model.", "visual.")):
        return key
    if key.startswith("model."):
        return "language_model." + key[len("model."):]
    return key


def _text_layout(src: Path):
    """(config, files, prefix, {Qwen3VLModel name: file key}) of a single text-encoder file."""
    cl.check_file(src, "text_encoder")
    files = CheckpointFiles([src])
    keys_ = list(files.keys())
    prefix = next((k[: -len(a)] for k in keys_ for a in _TEXT_ANCHORS if k.endswith(a)), None)
    if prefix is None:
        raise LoadError(f"[model] text_encoder: {src}: not a Qwen3-VL text encoder (no "
                        f"'model.embed_tokens.weight' or 'model.language_model.embed_tokens.weight'): "
                        f"{cf.describe(keys_)}")
    names = {text_target(k[len(prefix):]): k for k in keys_ if k.startswith(prefix)}
    config = cf.packaged_config("qwen3_vl_4b")
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "architectures"}
    meta = cf.metadata_config(files.metadata, str(src), "text_encoder")
    for part in ("text_config", "vision_config"):
        config[part] = {**config[part], **meta.pop(part, {})}
    config.update(meta)
    layers = {int(n.split(".")[2]) for n in names if n.startswith("language_model.layers.")}
    blocks = {int(n.split(".")[2]) for n in names if n.startswith("visual.blocks.")}
    if layers:
        config["text_config"]["num_hidden_layers"] = max(layers) + 1
    if blocks:
        config["vision_config"]["depth"] = max(blocks) + 1
    return config, files, prefix, names


def load_text_encoder_file(src: Path, dtype: torch.dtype = torch.bfloat16):
    """Qwen3VLModel from a single file, built on meta and filled tensor by tensor (fp8 weights
    upcast with their scale), or left in the file and read layer by layer when it does not fit the
    host-RAM budget (streamed_encoder.text_encoder_ram_budget)."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from ..streamed_encoder import file_backed, fits_host

    config, files, prefix, names = _text_layout(src)
    try:
        cfg = Qwen3VLConfig(**config)
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot build Qwen3-VL from its config ({e})") from None
    if not fits_host([src], dtype):
        return file_backed(lambda: Qwen3VLModel(cfg), [src], "language_model", "layers", dtype,
                           _LABEL["text_encoder"]).eval()
    model = build_empty(lambda: Qwen3VLModel(cfg))
    ops = copy_ops([k for n, k in names.items() if n != "lm_head.weight"], strip=prefix, rename=text_target)
    return load_into_empty(model, files, ops, what="a Qwen3-VL text encoder of this architecture", dtype=dtype,
                           device="cpu", source_name=lambda t: names.get(t, prefix + t)).eval()


def save_text_encoder_file(model, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write a Qwen3VLModel in ComfyUI's single-file layout (bare `model.` language model, `visual.`
    vision tower), its text and vision configs in the metadata, atomically."""
    tensors = {}
    for key, t in model.state_dict().items():
        if key.startswith("language_model."):
            key = "model." + key[len("language_model."):]
        tensors[key] = t if dtype is None else t.to(dtype)
    cfg = model.config.to_dict()
    skip = {"_name_or_path", "architectures", "transformers_version", "model_type", "torch_dtype", "dtype",
            "id2label", "label2id", "layer_types"}
    meta = {part: {k: v for k, v in cfg[part].items() if k not in skip and not k.startswith("_")}
            for part in ("text_config", "vision_config")}
    meta.update({k: cfg[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")})
    return save_safetensors(tensors, path, metadata={cf.METADATA_CONFIG_KEY: json.dumps(meta)})
