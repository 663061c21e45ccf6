"""Loading Z-Image components (Turbo and base): the diffusers folder and the single transformer files
people download.

Sources: a diffusers folder in the Tongyi-MAI/Z-Image-Turbo (or Z-Image) layout (transformer/ as
ZImageTransformer2DModel, text_encoder/ Qwen3-4B in the transformers layout, tokenizer/ Qwen2's with
Qwen3's chat template, vae/ the Flux.1 AutoencoderKL, scheduler/), any component overridden by a
[model] key; or a single transformer .safetensors file: the original checkpoint's names (fused
`attention.qkv`, `x_embedder`, `final_layer`: z_image/keys.py), bare (Tongyi-MAI's, ComfyUI's
repackaged z_image_turbo_bf16.safetensors) or under `model.diffusion_model.`, in bf16 or fp8 e4m3
(plain, or ComfyUI's "scaled" with a per-tensor `scale_weight`); or diffusers' names in one file.
The text encoder comes from its transformers folder or from one file (ComfyUI's qwen_3_4b.safetensors:
load_text_encoder_file).

Every model is built on the meta device and filled tensor by tensor in its target dtype
(weights.py): no second, full-precision copy. Block Linear weights a file stores in e4m3 stay e4m3
(the engine's fp8 Linear), the adaLN Linears too unless `fp8_modulation=False`. The architecture of a
single file is read from its shapes (keys.config_from_shapes); what the weights cannot show comes
from the released config (models/configs/z_image_turbo.json) or the file's `leantune.config`
metadata. A file of another family is refused before a tensor is read, naming the family to set.
Only safetensors is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...io import save_safetensors
from .. import component_files as cf
from .. import component_loading as cl
from . import keys
from .spec import Z_IMAGE_SPEC
from ..weights import CheckpointFiles, LoadError, build_empty, copy_ops, load_into_empty

COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
_LABEL = {"transformer": "Z-Image transformer", "text_encoder": "Z-Image text encoder (Qwen3)",
          "tokenizer": "Z-Image tokenizer (Qwen3)", "vae": "Z-Image VAE"}
_REPO = "Tongyi-MAI/Z-Image-Turbo"
TRANSFORMER_CLASS = "ZImageTransformer2DModel"
TEXT_ENCODER_CLASSES = ("Qwen3Model", "Qwen3ForCausalLM")     # the hub folder's config says the latter
RELEASED_CONFIG = "z_image_turbo"


@dataclass(frozen=True)
class ZImageSources:
    """Where each component comes from: a diffusers sub-folder or a .safetensors file (None: absent)."""

    transformer: Path | None
    text_encoder: Path | None
    tokenizer: Path | None
    vae: Path | None


@dataclass
class ZImageTextEncoders:
    """The Qwen3 tokenizer and Qwen3Model, on the host; `device` is where encoding runs (z_image/text.py
    streams the layers there when it is not the host)."""

    tokenizer: object
    text_encoder: torch.nn.Module
    device: torch.device


def resolve_sources(model_cfg, base_dir: Path) -> ZImageSources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`)."""
    return ZImageSources(**cl.resolve_components(model_cfg, base_dir, COMPONENTS, {}))


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


# -- transformer -------------------------------------------------------------------------------------

def _released() -> dict:
    return cf.packaged_config(RELEASED_CONFIG)


def read_layout(path: Path):
    """(files, ops, config, source_name) of a single transformer file, from its header alone.
    `source_name(model_key)` is the file key a model key comes from (for missing-key messages)."""
    cl.check_file(path, "transformer")
    from ..gguf_file import open_single_file

    files = open_single_file(path)                    # safetensors, or GGUF (models/gguf_file.py)
    all_keys = list(files.keys())
    prefix = keys.find_prefix(all_keys)
    if prefix is None or not keys.recognizes_keys(all_keys):
        raise LoadError(f"{path}: not a {_LABEL['transformer']} (no 'cap_pad_token' and 'context_refiner.0.*'): "
                        f"{cf.describe(all_keys)}")
    outside = [k for k in all_keys if not k.startswith(prefix)]
    if outside:
        raise LoadError(f"{path}: unexpected key(s) {outside[:5]} outside {prefix!r}: not part of a "
                        f"{_LABEL['transformer']}")
    shapes = {k[len(prefix):]: files.shape(k) for k in all_keys}
    if keys.is_native(shapes):
        ops = keys.to_diffusers_ops(shapes, prefix)

        def source_name(target: str) -> str:
            return prefix + keys.native_name(target)
    else:
        ops = copy_ops([prefix + k for k in shapes], strip=prefix)

        def source_name(target: str) -> str:
            return prefix + target
    for op in ops:
        problem = op.check(files.shape(op.source))
        if problem:
            raise LoadError(f"{path}: key {op.source!r}: {problem}; it is not a {_LABEL['transformer']}")
    target_shapes = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(files.shape(op.source)))}
    meta = cf.metadata_config(files.metadata, str(path), "transformer")
    try:
        config = keys.config_from_shapes(target_shapes, _released(), meta)
    except KeyError as e:
        raise LoadError(f"{path}: missing key {source_name(e.args[0])!r} of a {_LABEL['transformer']}") from None
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from None
    return files, ops, config, source_name


def transformer_config(sources: ZImageSources) -> dict:
    """The transformer's diffusers config: a folder's config.json, or read from a file's shapes."""
    src = _require(sources.transformer, "transformer")
    if src.is_dir():
        return cl.diffusers_folder(src, (TRANSFORMER_CLASS,), _LABEL["transformer"])[0]
    return read_layout(src)[2]


def load_transformer(sources: ZImageSources, dtype: torch.dtype = torch.bfloat16, device="cpu",
                     keep_fp8: bool = True, fp8_modulation: bool = True, quantize_fp8: bool = False,
                     quantize_modulation: bool = False, trained=None):
    """The ZImageTransformer2DModel of a diffusers folder or a single .safetensors file, in `dtype`
    on `device` (device "meta": shapes and dtypes only, for the planner). e4m3 block weights stay
    e4m3 with their scale (`keep_fp8`); `fp8_modulation=False` upcasts the adaLN Linears.
    `quantize_fp8` / `quantize_modulation` / `trained`: the block Linears a run stores in fp8 are
    quantized as they are read (family.fp8_load_options gives these)."""
    from diffusers import ZImageTransformer2DModel

    src = _require(sources.transformer, "transformer")
    source_name = None
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, (TRANSFORMER_CLASS,), _LABEL["transformer"])
    else:
        files, ops, config, source_name = read_layout(src)
    if config.get("siglip_feat_dim") is not None:
        raise LoadError(f"{src}: a Z-Image-Omni transformer (siglip_feat_dim set): only the text-to-image "
                        f"Z-Image (Turbo, base) is supported")
    try:
        model = build_empty(lambda: ZImageTransformer2DModel.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a {_LABEL['transformer']} from its config ({e})") from None
    fp8 = cl.fp8_hooks(model, Z_IMAGE_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    extra = {} if source_name is None else {"source_name": source_name}
    return load_into_empty(model, files, ops, what=f"a {_LABEL['transformer']} of this architecture", dtype=dtype,
                           device=device, **extra, **fp8)


def describe(transformer) -> str:
    cfg = transformer.config
    return (f"Z-Image ({cfg.n_refiner_layers} + {cfg.n_refiner_layers} refiner + {cfg.n_layers} blocks, "
            f"width {cfg.dim})")


def save_single_file(transformer, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                     prefix: str = "", metadata: dict | None = None) -> Path:
    """Write a transformer (model or diffusers state dict) in the original single-file names,
    atomically: fp8 None / "e4m3" / "scaled" for the block Linears (ComfyUI's layouts), `prefix`
    "model.diffusion_model." for ComfyUI's all-in-one naming. A model's unseen config (rotary split,
    eps) goes into the metadata. (A full fine-tune's export goes through the spec's layout group by
    group, train/full_export.py.)"""
    meta = dict(metadata or {})
    if isinstance(transformer, torch.nn.Module):
        state = transformer.state_dict()
        for k, v in keys.native_metadata(transformer).items():
            meta.setdefault(k, v)
    else:
        state = dict(transformer)
    tensors = cl.file_tensors(keys.diffusers_to_native(cl.dequantized_state(state)), dtype=dtype, fp8=fp8,
                              prefix=prefix, in_block=lambda key: key.startswith(keys.BLOCK_LISTS))
    return save_safetensors(tensors, path, metadata=meta)


# -- VAE ---------------------------------------------------------------------------------------------

def load_vae(sources: ZImageSources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The Flux.1 AutoencoderKL Z-Image uses, from a diffusers vae/ folder or a single file (LDM or
    diffusers keys; ComfyUI's ae.safetensors)."""
    return cl.load_vae(_require(sources.vae, "vae"), dtype, device, "flux_vae", what=_LABEL["vae"])


# -- text encoder ------------------------------------------------------------------------------------

def load_text_encoders(sources: ZImageSources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> ZImageTextEncoders:
    """The Qwen3 tokenizer (a folder) and Qwen3Model (Qwen3-4B: a transformers folder or a single file),
    on the host: loaded when it fits the host-RAM budget, else left in its files and read layer by
    layer when it runs (streamed_encoder.py). A Qwen3ForCausalLM folder (the hub's config) loads as
    its base model."""
    from transformers import AutoTokenizer, Qwen3Model

    from ..streamed_encoder import load_text_model

    tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], AutoTokenizer, _REPO)
    src = _require(sources.text_encoder, "text_encoder")
    if src.is_file():
        cl.check_file(src, "text_encoder")
        model = load_text_encoder_file(src, dtype)
        return ZImageTextEncoders(tokenizer=tokenizer, text_encoder=model.eval(), device=torch.device(device))
    declared = (cl.read_json(src / "config.json").get("architectures") or [None])[0]
    if declared is not None and declared not in TEXT_ENCODER_CLASSES:
        raise LoadError(f"[model] text_encoder: {src / 'config.json'}: architectures = {declared!r}, but Z-Image's "
                        f"text encoder is a Qwen3 ({'/'.join(TEXT_ENCODER_CLASSES)})")
    try:
        model = load_text_model(Qwen3Model, src, dtype, label=_LABEL["text_encoder"], blocks_path="layers",
                                module_path="")
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot load the {_LABEL['text_encoder']} ({e})") from None
    return ZImageTextEncoders(tokenizer=tokenizer, text_encoder=model.eval(), device=torch.device(device))


# -- the text encoder as a single file ------------------------------------------------------------------
#
# ComfyUI's text_encoders/qwen_3_4b.safetensors (its Z-Image and FLUX.2 klein 4B workflows) holds
# Qwen3-4B under transformers' own names below `model.` (comfy/text_encoders/llama.py names its
# Qwen3 so: model.embed_tokens, model.layers.N.self_attn.q_proj / q_norm, mlp.gate_proj, model.norm),
# an `lm_head.weight` where kept (unused here). The architecture is read from the shapes; what they
# cannot show (rope base, norm eps, positions) is Qwen3-4B's (models/configs/qwen3_4b.json) unless the
# file's `leantune.config` metadata says otherwise.

TEXT_PREFIXES = ("model.", "text_encoders.qwen3_4b.transformer.model.", "")
_TEXT_ANCHOR = "embed_tokens.weight"


def text_encoder_file_config(src: Path, files: CheckpointFiles) -> tuple[dict, str]:
    """(Qwen3Config kwargs, key prefix) of a single text-encoder file, from its header."""
    keys = list(files.keys())
    prefix = next((p for p in TEXT_PREFIXES if p + _TEXT_ANCHOR in keys), None)
    if prefix is None:
        raise LoadError(f"[model] text_encoder: {src}: not a Qwen3 text encoder (no 'model.embed_tokens.weight'): "
                        f"{cf.describe(keys)}")

    def shape(key: str) -> tuple[int, ...]:
        if prefix + key not in keys:
            raise LoadError(f"[model] text_encoder: {src}: missing key {prefix + key!r} of a Qwen3 text encoder")
        return files.shape(prefix + key)

    vocab, hidden = shape("embed_tokens.weight")
    layers = {int(k[len(prefix) + len("layers."):].split(".", 1)[0]) for k in keys if k.startswith(prefix + "layers.")}
    if not layers or layers != set(range(max(layers) + 1)):
        raise LoadError(f"[model] text_encoder: {src}: decoder layers {sorted(layers)[:5]} are not numbered 0..N-1")
    head_dim = shape("layers.0.self_attn.q_norm.weight")[0]
    config = {k: v for k, v in cf.packaged_config("qwen3_4b").items() if not k.startswith("_") and k != "architectures"}
    config.update(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=max(layers) + 1, head_dim=head_dim,
                  intermediate_size=shape("layers.0.mlp.gate_proj.weight")[0],
                  num_attention_heads=shape("layers.0.self_attn.q_proj.weight")[0] // head_dim,
                  num_key_value_heads=shape("layers.0.self_attn.k_proj.weight")[0] // head_dim)
    config.update(cf.metadata_config(files.metadata, str(src), "text_encoder"))
    return config, prefix


def load_text_encoder_file(src: Path, dtype: torch.dtype = torch.bfloat16):
    """Qwen3Model from a single file, on the host: built on meta and filled tensor by tensor (fp8
    weights upcast with their scale) when it fits the host-RAM budget, else left in the file and
    read layer by layer when it runs (streamed_encoder.py)."""
    from transformers import Qwen3Config, Qwen3Model

    from ..streamed_encoder import file_backed, fits_host

    files = CheckpointFiles([src])
    config, prefix = text_encoder_file_config(src, files)
    try:
        cfg = Qwen3Config(**config)
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot build Qwen3 from its config ({e})") from None
    if not fits_host([src], dtype):
        return file_backed(lambda: Qwen3Model(cfg), [src], "", "layers", dtype, _LABEL["text_encoder"]).eval()
    model = build_empty(lambda: Qwen3Model(cfg))
    names = [k for k in files.keys() if k.startswith(prefix) and not k.startswith("lm_head.")]
    return load_into_empty(model, files, copy_ops(names, strip=prefix), what="a Qwen3 text encoder of this architecture",
                           dtype=dtype, device="cpu").eval()
