"""Loading Wan components: the diffusers folders and the single transformer files people download.

Sources: a diffusers folder in the Wan-AI/Wan2.2-T2V-A14B-Diffusers layout (transformer/ the
high-noise expert and transformer_2/ the low-noise one, both WanTransformer3DModel, with the
pipeline's `boundary_ratio` in model_index.json; Wan 2.1's folders have transformer/ alone),
text_encoder/ umT5-XXL (UMT5EncoderModel), tokenizer/ umT5's, vae/ AutoencoderKLWan; any component
overridden by a [model] key; or a single transformer .safetensors file: Wan-AI's own
names (wan/keys.py), bare or under ComfyUI's `model.diffusion_model.` (wan2.2_t2v_high_noise_14B_*
.safetensors), in bf16 or fp8 e4m3 (plain, or ComfyUI's "scaled" with a per-tensor
`scale_weight`), or diffusers' names in one file. The VAE and the text encoder may be single files too:
the Wan 2.1 VAE in Wan-AI's names (ComfyUI's wan_2.1_vae.safetensors: wan/vae_keys.py) and umT5-XXL in
transformers' names (ComfyUI's umt5_xxl_*.safetensors, bf16 or scaled fp8). Wan 2.1 I2V's folders
add image_encoder/ (CLIPVisionModel) and image_processor/ (CLIPImageProcessor); the encoder may be
one file in transformers' names too (ComfyUI's clip_vision_h.safetensors): `load_image_encoder`.

`[model] expert` picks the expert a run trains: "high" (or "auto") the folder's transformer/,
"low" its transformer_2/; a single file is the expert it holds. `load_experts` loads both for
sampling (wan/experts.py).

Every model is built on the meta device and filled tensor by tensor in its target dtype
(weights.py): no second, full-precision copy. Block Linear weights a file stores in e4m3 stay e4m3
(the engine's fp8 Linear). The architecture of a single file is read from its shapes
(keys.config_from_shapes); the head size the weights cannot show comes from the released config
(models/configs/wan22_a14b.json) or the file's `leantune.config` metadata. A file of another family is
refused before a tensor is read, naming the family to set. Only safetensors is read.
"""

from __future__ import annotations

import logging
import re
from functools import lru_cache
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import component_files as cf
from .. import component_loading as cl
from . import i2v, keys
from .spec import WAN_SPEC
from ..weights import CheckpointFiles, LoadError, build_empty, copy_ops, load_into_empty

log = logging.getLogger(__name__)

COMPONENTS = ("transformer", "transformer_2", "text_encoder", "tokenizer", "vae", "image_encoder", "image_processor")
_LABEL = {"transformer": "Wan transformer", "transformer_2": "Wan low-noise transformer (transformer_2)",
          "text_encoder": "Wan text encoder (umT5)", "tokenizer": "Wan tokenizer (umT5)", "vae": "Wan VAE",
          "image_encoder": "Wan 2.1 I2V image encoder (CLIPVisionModel)",
          "image_processor": "Wan 2.1 I2V image processor (CLIPImageProcessor)"}
_REPO = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
TRANSFORMER_CLASS = "WanTransformer3DModel"
VAE_CLASS = "AutoencoderKLWan"
TEXT_ENCODER_CLASSES = ("UMT5EncoderModel", "UMT5Model", "umt5")
IMAGE_ENCODER_CLASSES = ("CLIPVisionModel", "CLIPVisionModelWithProjection", "clip_vision_model")
RELEASED_CONFIG = "wan22_a14b"
# The released boundary of a two-expert model whose folder does not say (a pair of single files):
# T2V-A14B's 0.875, I2V-A14B's 0.9 (its transformer takes 36 channels: 16 noisy + 20 condition)
T2V_BOUNDARY, I2V_BOUNDARY = 0.875, 0.9
I2V_IN_CHANNELS = 36
TI2V_CHANNELS = 48          # Wan 2.2 TI2V-5B: the Wan 2.2 VAE's latent channels, in and out
EXPERTS = ("high", "low")


@dataclass(frozen=True)
class WanSources:
    """Where each component comes from (None: absent), the expert a run trains, and the folder's
    two-expert boundary (model_index.json's boundary_ratio; None for a one-transformer folder)."""

    transformer: Path | None
    transformer_2: Path | None
    text_encoder: Path | None
    tokenizer: Path | None
    vae: Path | None
    expert: str = "auto"
    boundary_ratio: float | None = None
    image_encoder: Path | None = None         # Wan 2.1 I2V's CLIP vision encoder and its processor
    image_processor: Path | None = None


@dataclass
class WanTextEncoders:
    """The umT5 tokenizer and UMT5EncoderModel, on the host; `device` is where encoding runs
    (wan/text.py streams the encoder's blocks there when it is not the host)."""

    tokenizer: object
    text_encoder: torch.nn.Module
    device: torch.device


def _boundary(root: Path) -> float | None:
    index = root / "model_index.json"
    if not root.is_dir() or not index.is_file():
        return None
    value = cl.read_json(index).get("boundary_ratio")
    if value is not None and not (isinstance(value, (int, float)) and 0.0 < float(value) < 1.0):
        raise LoadError(f"{index}: boundary_ratio = {value!r}; a two-expert Wan splits its timesteps at a "
                        f"fraction strictly between 0 and 1")
    return None if value is None else float(value)


def resolve_sources(model_cfg, base_dir: Path) -> WanSources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`)."""
    found = cl.resolve_components(model_cfg, base_dir, COMPONENTS, {})
    expert = getattr(model_cfg, "expert", "auto") or "auto"
    root = cl.config_path(model_cfg.path, base_dir)
    boundary = _boundary(root)
    if expert in ("high", "low") and root.is_dir() and found["transformer_2"] is None:
        # (a one-transformer folder denoises every level: an expert has no boundary to train within)
        which = "the low-noise expert" if expert == "low" else "the other expert: transformer/ is the high-noise one"
        raise LoadError(f"[model] expert = \"{expert}\": {root} has no transformer_2/ folder ({which}); "
                        f"it is a one-transformer Wan: remove [model] expert, or point [model] path at a "
                        f"two-expert folder or at the {expert}-noise expert's file")
    if expert == "both" and (found["transformer_2"] is None or not root.is_dir()):
        raise LoadError(f"[model] expert = \"both\": {root} is not a two-expert folder (a transformer_2/ folder, the "
                        f"low-noise expert, beside transformer/); a one-transformer model trains as it is: remove "
                        f"[model] expert, or point [model] path at a Wan 2.2 A14B folder")
    if found["transformer_2"] is not None and boundary is None and root.is_dir():
        raise LoadError(f"{root / 'model_index.json'}: a transformer_2/ folder but no boundary_ratio: the "
                        f"timestep at which WanPipeline switches experts is not known")
    return WanSources(**found, expert=expert, boundary_ratio=boundary)


def _require(source: Path | None, name: str) -> Path:
    return cl.require(source, name, _LABEL[name])


def expert_source(sources: WanSources, expert: str | None = None) -> Path:
    """The transformer folder or file of `expert` ("high" / "low"; None: the sources' own choice,
    "auto" meaning the high-noise expert, the one transformer of a one-transformer model)."""
    expert = expert or sources.expert
    if expert == "low" and sources.transformer_2 is not None:
        return sources.transformer_2
    return _require(sources.transformer, "transformer")


def boundary_ratio(sources: WanSources, config: dict | None = None) -> float | None:
    """The fraction of the 1000 training timesteps at which the experts switch: the folder's, else
    (a single expert file, which cannot say) the released value for its kind; None for a
    one-transformer folder (no switch)."""
    if sources.boundary_ratio is not None:
        return sources.boundary_ratio
    src = _require(sources.transformer, "transformer")
    if src.is_dir() and sources.transformer_2 is None:
        return None
    config = config or transformer_config(sources)
    return I2V_BOUNDARY if config.get("in_channels") == I2V_IN_CHANNELS else T2V_BOUNDARY


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
        raise LoadError(f"{path}: not a {_LABEL['transformer']} (no 'patch_embedding.weight' with Wan's "
                        f"'head.head' / 'blocks.0.self_attn.q'): {cf.describe(all_keys)}")
    outside = [k for k in all_keys if not k.startswith(prefix)]
    if outside:
        raise LoadError(f"{path}: unexpected key(s) {outside[:5]} outside {prefix!r}: not part of a "
                        f"{_LABEL['transformer']}")
    names = [k[len(prefix):] for k in all_keys]
    if keys.is_native(names):
        ops = copy_ops(all_keys, strip=prefix, rename=keys.diffusers_name)

        def source_name(target: str) -> str:
            return prefix + keys.native_name(target)
    else:
        ops = copy_ops(all_keys, strip=prefix)

        def source_name(target: str) -> str:
            return prefix + target
    target_shapes = {op.targets[0]: files.shape(op.source) for op in ops}
    meta = cf.metadata_config(files.metadata, str(path), "transformer")
    try:
        config = keys.config_from_shapes(target_shapes, _released(), meta)
    except KeyError as e:
        raise LoadError(f"{path}: missing key {source_name(e.args[0])!r} of a {_LABEL['transformer']}") from None
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from None
    return files, ops, config, source_name


def _layout(src: Path):
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, (TRANSFORMER_CLASS,), _LABEL["transformer"])
        return config, files, ops, None
    files, ops, config, source_name = read_layout(src)
    return config, files, ops, source_name


def transformer_config(sources: WanSources, expert: str | None = None) -> dict:
    """The expert's diffusers config: a folder's config.json, or read from a file's shapes."""
    return _layout(expert_source(sources, expert))[0]


def load_transformer(sources: WanSources, dtype: torch.dtype = torch.bfloat16, device="cpu", keep_fp8: bool = True,
                     fp8_modulation: bool = True, quantize_fp8: bool = False, quantize_modulation: bool = False,
                     trained=None, expert: str | None = None, ti2v: bool = False):
    """The WanTransformer3DModel of the run's expert ([model] expert; `expert` overrides it) from a
    diffusers folder or a single .safetensors file, in `dtype` on `device` (device "meta": shapes and
    dtypes only, for the planner). e4m3 block weights stay e4m3 with their scale (`keep_fp8`).
    `quantize_fp8` / `trained`: the block Linears a run stores in fp8 are quantized as they are read
    (family.fp8_load_options gives these). Wan has no modulation Linear: `fp8_modulation` and
    `quantize_modulation` change nothing. `ti2v`: the model must be a TI2V-5B (family
    "wan2.2-ti2v", wan/ti2v.py), else one of the 16-channel models."""
    from diffusers import WanTransformer3DModel

    if expert is None and sources.expert == "both":      # both experts, each call on the one owning its timestep
        from .experts import WanExperts

        options = dict(dtype=dtype, device=device, keep_fp8=keep_fp8, fp8_modulation=fp8_modulation,
                       quantize_fp8=quantize_fp8, quantize_modulation=quantize_modulation, trained=trained)
        return WanExperts(load_transformer(sources, expert="high", **options),
                          load_transformer(sources, expert="low", **options), boundary_ratio(sources))
    src = expert_source(sources, expert)
    config, files, ops, source_name = _layout(src)
    check_text_to_video(config, src, ti2v)
    if expert is None and sources.expert == "auto" and sources.transformer_2 is not None and str(device) != "meta":
        log.warning("%s: a two-expert Wan 2.2 folder; [model] expert = \"auto\" loads its high-noise expert "
                    "(transformer/) alone: a run trains it on its noise levels only, and samples drawn with it "
                    "alone (leantune sample, previews) are not WanPipeline's two-expert ones; set [model] "
                    "expert = \"high\" or \"low\" to say which expert a run trains", src.parent)
    try:
        model = build_empty(lambda: WanTransformer3DModel.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a {_LABEL['transformer']} from its config ({e})") from None
    from .block import split_blocks

    split_blocks(model)            # training's block, the same math (block.py), on every load, meta included
    fp8 = cl.fp8_hooks(model, WAN_SPEC, keep=keep_fp8, keep_modulation=fp8_modulation, quantize=quantize_fp8,
                       quantize_modulation=quantize_modulation, trained=trained)
    extra = {} if source_name is None else {"source_name": source_name}
    return load_into_empty(model, files, ops, what=f"a {_LABEL['transformer']} of this architecture", dtype=dtype,
                           device=device, **extra, **fp8)


def check_text_to_video(config: dict, src: Path, ti2v: bool = False) -> None:
    """Family "wan2.2" trains and samples Wan's 16-channel transformers: the text-to-video ones (Wan 2.2
    T2V-A14B's experts, Wan 2.1 T2V) and the image-to-video ones (Wan 2.2 I2V-A14B's experts: 36 input
    channels, the noisy latents and the first frame's condition, wan/i2v.py; Wan 2.1 I2V's, the same
    condition and its first frame's CLIP image embedding, which its cross-attention reads: `image_dim`);
    family "wan2.2-ti2v" (`ti2v`) TI2V-5B's 48 latent channels of the Wan 2.2 VAE, whose latents, VAE
    and per-token timesteps differ (wan/ti2v.py). Each refuses the other's by name. Wan 2.1 FLF2V (an image embedding of a first and
    a last frame, `pos_embed_seq_len`) is conditioning this family does not build: refused by name
    rather than trained as something it is not."""
    channels = (config.get("in_channels"), config.get("out_channels"))
    if ti2v and channels != (TI2V_CHANNELS, TI2V_CHANNELS):
        raise LoadError(f"{src}: a Wan transformer of {channels[0]} input / {channels[1]} output channels, not "
                        f"TI2V-5B's {TI2V_CHANNELS} (the Wan 2.2 VAE's latents): a Wan 2.2 A14B expert or Wan 2.1; "
                        f"set [model] family = \"wan2.2\"")
    if ti2v:
        return
    if channels == (TI2V_CHANNELS, TI2V_CHANNELS):
        raise LoadError(f"{src}: a Wan 2.2 TI2V-5B transformer ({TI2V_CHANNELS} latent channels of the Wan 2.2 VAE, "
                        f"per-token timesteps); set [model] family = \"wan2.2-ti2v\"")
    if config.get("image_dim") is not None and config.get("pos_embed_seq_len") is not None:
        raise LoadError(f"{src}: a Wan first-last-frame transformer (Wan 2.1 FLF2V: image_dim = {config.get('image_dim')} "
                        f"with pos_embed_seq_len = {config.get('pos_embed_seq_len')}, an image embedding of two frames); "
                        f"family \"wan2.2\" trains image-to-video from one first frame (Wan 2.1 I2V, Wan 2.2 I2V-A14B)")
    if config.get("image_dim") is not None and channels != (I2V_IN_CHANNELS, 16):
        raise LoadError(f"{src}: a Wan transformer with an image embedder (image_dim = {config.get('image_dim')}) of "
                        f"{channels[0]} input / {channels[1]} output channels, not Wan 2.1 I2V's {I2V_IN_CHANNELS} / 16")
    if channels not in ((16, 16), (I2V_IN_CHANNELS, 16)):
        raise LoadError(f"{src}: a Wan transformer of {channels[0]} input / {channels[1]} output channels, not the "
                        f"16 of the Wan 2.1 VAE's latents (or 36 of an image-to-video model's latents and condition)")


def describe(transformer) -> str:
    cfg = transformer.config
    width = cfg.num_attention_heads * cfg.attention_head_dim
    return f"Wan ({cfg.num_layers} blocks, width {width}, {cfg.in_channels} input channels)"


# -- VAE ---------------------------------------------------------------------------------------------

def load_raw_vae(sources: WanSources, dtype: torch.dtype = torch.bfloat16, device="cpu"):
    """The AutoencoderKLWan itself, from a diffusers vae/ folder or one file (Wan-AI's names, ComfyUI's
    wan_2.1_vae.safetensors; or diffusers' names)."""
    from diffusers import AutoencoderKLWan

    src = _require(sources.vae, "vae")
    if src.is_dir():
        config, files, ops = cl.diffusers_folder(src, (VAE_CLASS,), _LABEL["vae"])
    else:
        files, ops, config = read_vae_layout(src)
    try:
        model = build_empty(lambda: AutoencoderKLWan.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a {_LABEL['vae']} from its config ({e})") from None
    return load_into_empty(model, files, ops, what=f"a {_LABEL['vae']} of this architecture", dtype=dtype,
                           device=device)


def read_vae_layout(src: Path):
    """(files, ops, config) of a single VAE file, from its header: Wan-AI's names (wan/vae_keys.py) or
    diffusers', bare or under `vae.`."""
    from . import vae_keys

    cl.check_file(src, "vae")
    files = CheckpointFiles([src])
    names = list(files.keys())
    prefix = next((p for p in ("", "vae.") for a in (vae_keys.NATIVE_ANCHOR, "encoder.conv_in.weight")
                   if p + a in names), None)
    if prefix is None:
        raise LoadError(f"[model] vae: {src}: not a {_LABEL['vae']} (no 'encoder.conv1.weight' of Wan-AI's names nor "
                        f"'encoder.conv_in.weight' of diffusers'): {cf.describe(names)}")
    mine = [k for k in names if k.startswith(prefix)]
    if vae_keys.is_native(k[len(prefix):] for k in mine):
        try:
            per = vae_keys.residual_blocks_per_stage([k[len(prefix):] for k in mine])
        except KeyError as e:
            raise LoadError(f"[model] vae: {src}: missing key {prefix + e.args[0]!r} of a {_LABEL['vae']}") from None
        ops = copy_ops(mine, strip=prefix, rename=lambda k: vae_keys.diffusers_name(k, per))
    else:
        ops = copy_ops(mine, strip=prefix)
    shapes = {op.targets[0]: files.shape(op.source) for op in ops}
    try:
        config = vae_keys.config_from_shapes(shapes, cf.packaged_config("wan_vae"),
                                             cf.metadata_config(files.metadata, str(src), "vae"))
    except KeyError as e:
        raise LoadError(f"[model] vae: {src}: missing key {e.args[0]!r} (diffusers' name) of a "
                        f"{_LABEL['vae']}") from None
    except ValueError as e:
        raise LoadError(f"[model] vae: {src}: {e}") from None
    return files, ops, config


# -- text encoder ------------------------------------------------------------------------------------

def load_text_encoders(sources: WanSources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> WanTextEncoders:
    """The umT5 tokenizer (a folder) and UMT5EncoderModel (a transformers folder or a single file), on the host:
    loaded when it fits the host-RAM budget, else left in its files and read block by block when it
    runs (streamed_encoder.py)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    from ..streamed_encoder import load_text_model

    tokenizer = cl.load_tokenizer(sources.tokenizer, "tokenizer", _LABEL["tokenizer"], AutoTokenizer, _REPO)
    src = _require(sources.text_encoder, "text_encoder")
    if src.is_file():
        cl.check_file(src, "text_encoder")
        model = load_text_encoder_file(src, dtype)
        return WanTextEncoders(tokenizer=tokenizer, text_encoder=model.eval(), device=torch.device(device))
    config = cl.read_json(src / "config.json")
    declared = (config.get("architectures") or [None])[0] or config.get("model_type")
    if declared is not None and declared not in TEXT_ENCODER_CLASSES:
        raise LoadError(f"[model] text_encoder: {src / 'config.json'}: {declared!r}, but Wan's text encoder is "
                        f"umT5 ({'/'.join(TEXT_ENCODER_CLASSES)})")
    try:
        model = load_text_model(UMT5EncoderModel, src, dtype, label=_LABEL["text_encoder"],
                                blocks_path="encoder.block", module_path="")
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot load the {_LABEL['text_encoder']} ({e})") from None
    return WanTextEncoders(tokenizer=tokenizer, text_encoder=model.eval(), device=torch.device(device))


# -- the text encoder as a single file ------------------------------------------------------------------
#
# ComfyUI's text_encoders/umt5_xxl_fp16.safetensors / umt5_xxl_fp8_e4m3fn_scaled.safetensors hold umT5-XXL's
# encoder under transformers' own names (shared, encoder.block.N.layer.0.SelfAttention.q / k / v / o and
# its relative_attention_bias, layer.1.DenseReluDense.wi_0 / wi_1 / wo, the layer norms,
# encoder.final_layer_norm), bare. umT5 differs from T5 in a relative attention bias per block (T5 has
# it in block 0 only), which tells them apart. The architecture is read from the shapes
# (component_files.t5_config: umT5-XXL and T5-XXL share every width but the vocabulary); fp8 weights are
# upcast with their scale.


def load_text_encoder_file(src: Path, dtype: torch.dtype = torch.bfloat16):
    """UMT5EncoderModel from a single file, on the host: built on meta and filled tensor by tensor when
    it fits the host-RAM budget, else left in the file and read block by block when it runs."""
    from transformers import UMT5Config, UMT5EncoderModel

    from ..streamed_encoder import file_backed, fits_host

    files, prefix, shapes, meta = cl.single_file(src, "t5", _LABEL["text_encoder"])
    config = cf.t5_config(shapes, meta, f"[model] text_encoder: {src}")
    per_block_bias = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"
    if config["num_layers"] > 1 and per_block_bias not in shapes:
        raise LoadError(f"[model] text_encoder: {src}: a T5 encoder (one relative attention bias, in block 0), not "
                        f"Wan's umT5 (no 'encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight')")
    config.update(architectures=["UMT5EncoderModel"], model_type="umt5")
    try:
        cfg = UMT5Config(**config)
    except Exception as e:
        raise LoadError(f"[model] text_encoder: {src}: cannot build umT5 from its config ({e})") from None
    if not fits_host([src], dtype):
        return file_backed(lambda: UMT5EncoderModel(cfg), [src], "", "encoder.block", dtype,
                           _LABEL["text_encoder"]).eval()
    model = build_empty(lambda: UMT5EncoderModel(cfg))
    names = cl.component_keys(files, "t5", prefix)
    return load_into_empty(model, files, copy_ops(names, strip=prefix), what="a umT5 text encoder of this architecture",
                           dtype=dtype, device="cpu", unexpected_ok=cf.t5_ignorable).eval()


# -- image-to-video --------------------------------------------------------------------------------

def _pipeline_class(sources) -> str | None:
    """model_index.json's _class_name of the folder the transformer is in (None for a single file)."""
    src = sources.transformer
    if src is None or not Path(src).is_dir():
        return None
    index = Path(src).parent / "model_index.json"
    return cl.read_json(index).get("_class_name") if index.is_file() else None


@lru_cache(maxsize=16)
def takes_first_frame(sources) -> bool:
    """Whether the model of `sources` (wan/loading.WanSources) is conditioned on a first frame: its
    transformer's in_channels, or its folder's WanImageToVideoPipeline. Reads configs only."""
    if _pipeline_class(sources) == i2v.I2V_PIPELINE:
        return True
    return i2v.is_image_to_video(transformer_config(sources))


# -- Wan 2.1 I2V's image encoder ------------------------------------------------------------------------
#
# Wan 2.1 I2V's transformer reads its first frame twice: as the latent condition every image-to-video
# Wan takes (wan/i2v.py), and as a CLIP vision encoder's penultimate hidden states (257 rows of 1280 for
# the released ViT-H/14 at 224 px), which its image embedder maps to the width and its cross-attention
# attends to through its own keys and values (add_k_proj / add_v_proj). Its diffusers folders
# (Wan-AI/Wan2.1-I2V-14B-*-Diffusers) hold the encoder as image_encoder/ (transformers'
# CLIPVisionModel) and its preprocessing as image_processor/ (CLIPImageProcessor); [model]
# image_encoder / image_processor point elsewhere (a single transformer file has neither).


@dataclass
class WanImageEncoder:
    """CLIPImageProcessor and CLIPVisionModel, and the device the embedding runs on."""

    processor: object
    model: torch.nn.Module
    device: torch.device


def takes_image_embedding(sources: WanSources) -> bool:
    """Whether the model reads its first frame's CLIP image embedding (its transformer's image_dim:
    Wan 2.1 I2V). Reads configs only."""
    return transformer_config(sources).get("image_dim") is not None


CLIP_VISION_CONFIG = "wan21_clip_vision_h"    # Wan 2.1 I2V's ViT-H/14: what a single file's shapes cannot show
_CLIP_ANCHOR = "embeddings.patch_embedding.weight"
# transformers 4 saved CLIPVisionModel under `vision_model.` (the released folders, ComfyUI's file, with
# a CLIPVisionModelWithProjection's `visual_projection` beside it); transformers 5 saves it bare
_CLIP_PREFIXES = ("vision_model.", "")


def _clip_prefix(names) -> str | None:
    names = set(names)
    return next((p for p in _CLIP_PREFIXES if p + _CLIP_ANCHOR in names), None)


def _clip_ops(files: CheckpointFiles):
    """The copy ops of a CLIP vision encoder's file keys into CLIPVisionModel: its prefix stripped; a
    projection (unused: the embedding is a hidden state) and the position ids older transformers
    saved (a buffer the model computes) left out."""
    names = list(files.keys())
    prefix = _clip_prefix(names) or ""
    kept = [k for k in names if k.startswith(prefix) and not k.endswith("position_ids")]
    return copy_ops(kept, strip=prefix)


def _image_encoder_layout(sources: WanSources) -> tuple[Path, dict, CheckpointFiles | None]:
    """(source, CLIPVisionConfig kwargs, the single file's header or None for a folder) of the image
    encoder, from configs and headers only. A single file (ComfyUI's clip_vision_h.safetensors) holds
    transformers' CLIPVisionModel names, bare; its architecture is read from the shapes, the heads,
    activation and eps from the released config (models/configs/wan21_clip_vision_h.json) or its
    `leantune.config` metadata."""
    src = sources.image_encoder
    if src is None:
        raise LoadError(f"no {_LABEL['image_encoder']}: {sources.transformer} is Wan 2.1 I2V (its transformer reads "
                        f"the first frame's CLIP image embedding, image_dim), and [model] path has no image_encoder/ "
                        f"folder; set [model] image_encoder to the image_encoder/ folder of a "
                        f"Wan-AI/Wan2.1-I2V-14B-480P-Diffusers repository or to ComfyUI's clip_vision_h.safetensors")
    if src.is_file():
        cl.check_file(src, "image_encoder")
        files = CheckpointFiles([src])
        names = list(files.keys())
        prefix = _clip_prefix(names)
        if prefix is None:
            raise LoadError(f"[model] image_encoder: {src}: not a CLIP vision encoder in transformers' names (no "
                            f"'vision_model.{_CLIP_ANCHOR}'): {cf.describe(names)}")
        layer = re.compile(rf"^{re.escape(prefix)}encoder\.layers\.(\d+)\.")
        layers = {int(m.group(1)) for k in names if (m := layer.match(k))}
        if not layers or layers != set(range(max(layers) + 1)):
            raise LoadError(f"[model] image_encoder: {src}: {prefix}encoder.layers.N are not numbered 0..N "
                            f"({sorted(layers)[:8]})")
        try:
            width, _, patch, _ = files.shape(prefix + _CLIP_ANCHOR)
            positions = files.shape(prefix + "embeddings.position_embedding.weight")[0]
            ffn = files.shape(prefix + "encoder.layers.0.mlp.fc1.weight")[0]
        except KeyError as e:
            raise LoadError(f"[model] image_encoder: {src}: missing key {e.args[0]!r} of a CLIP vision encoder") from None
        side = round((positions - 1) ** 0.5) * patch
        config = {**cf.packaged_config(CLIP_VISION_CONFIG), "hidden_size": width, "patch_size": patch, "image_size": side,
                  "intermediate_size": ffn, "num_hidden_layers": len(layers)}
        meta = cf.metadata_config(files.metadata, f"[model] image_encoder: {src}", "image_encoder")
        config.update({k: meta[k] for k in ("num_attention_heads", "hidden_act", "layer_norm_eps") if k in meta})
        return src, config, files
    config = cl.read_json(src / "config.json")
    declared = (config.get("architectures") or [None])[0] or config.get("model_type")
    if declared is not None and declared not in IMAGE_ENCODER_CLASSES:
        raise LoadError(f"[model] image_encoder: {src / 'config.json'}: {declared!r}, but Wan 2.1 I2V's image encoder "
                        f"is a CLIP vision model ({'/'.join(IMAGE_ENCODER_CLASSES[:2])})")
    return src, config.get("vision_config", config), None     # a whole CLIPModel's config holds the vision part


def image_embedding_shape(sources: WanSources) -> tuple[int, int]:
    """(rows, width) of the embedding: the vision encoder's class token and patches, its hidden
    size, which must be the transformer's image_dim. Reads configs and headers only."""
    src, config, files = _image_encoder_layout(sources)
    where = src if files is not None else src / "config.json"
    try:
        side, patch, width = int(config["image_size"]), int(config["patch_size"]), int(config["hidden_size"])
    except KeyError as e:
        raise LoadError(f"[model] image_encoder: {where}: no {e.args[0]!r}") from None
    image_dim = transformer_config(sources).get("image_dim")
    if image_dim is not None and width != image_dim:
        raise LoadError(f"[model] image_encoder: {where}: hidden_size {width}, but the transformer's "
                        f"image embedder takes image_dim = {image_dim}: not this model's image encoder")
    return (side // patch) ** 2 + 1, width


def _image_processor(sources: WanSources, config: dict, single_file: bool):
    """The folder's CLIPImageProcessor; beside a single-file encoder without one, CLIP's own
    preprocessing at the encoder's image size (transformers' CLIPImageProcessor defaults: a bicubic
    resize of the short side, a centre crop, CLIP's mean and std, which Wan-AI's clip.py uses)."""
    from transformers import CLIPImageProcessor

    proc = sources.image_processor
    if proc is None and single_file:
        side = int(config["image_size"])
        return CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    if proc is None:
        raise LoadError(f"no {_LABEL['image_processor']}: [model] path has no image_processor/ folder; set [model] "
                        f"image_processor to the image_processor/ folder of a Wan-AI/Wan2.1-I2V-14B-480P-Diffusers "
                        f"repository (its preprocessor_config.json)")
    if not (proc / "preprocessor_config.json").is_file():
        raise LoadError(f"[model] image_processor: {proc}: no preprocessor_config.json (a CLIPImageProcessor folder)")
    try:
        return CLIPImageProcessor.from_pretrained(str(proc), local_files_only=True)
    except Exception as e:
        raise LoadError(f"[model] image_processor: {proc}: cannot load the {_LABEL['image_processor']} ({e})") from None


def load_image_encoder(sources: WanSources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> WanImageEncoder:
    """The CLIPImageProcessor and CLIPVisionModel (a transformers folder or a single file, safetensors
    only) on `device`, built on meta and filled tensor by tensor."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    src, config, files = _image_encoder_layout(sources)
    image_embedding_shape(sources)                       # its width is the transformer's image_dim
    processor = _image_processor(sources, config, files is not None)
    try:
        cfg = CLIPVisionConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    except Exception as e:
        raise LoadError(f"[model] image_encoder: {src}: cannot build a CLIP vision encoder from its config ({e})") from None
    files = files or cl.weight_files(src, "model")
    model = build_empty(lambda: CLIPVisionModel(cfg))
    model = load_into_empty(model, files, _clip_ops(files), what=f"a {_LABEL['image_encoder']} of this architecture",
                            dtype=dtype, device=device)
    return WanImageEncoder(processor=processor, model=model.eval(), device=torch.device(device))


def frame_embedding(sources: WanSources):
    """ReferenceConditioning.frame_embedding: Wan 2.1 I2V's first-frame CLIP embedding (wan/i2v.py),
    or None for a model that reads none."""
    if not takes_image_embedding(sources):
        return None
    from ..family import FrameEmbedding

    return FrameEmbedding(load=lambda dtype, device: load_image_encoder(sources, dtype, device),
                          embed=i2v.image_embedding, shape=image_embedding_shape(sources),
                          paths=(sources.image_encoder, sources.image_processor))
