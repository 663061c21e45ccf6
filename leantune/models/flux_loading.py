"""Loading Flux.1 (dev, schnell) components from a diffusers folder or single safetensors files.

Sources: a diffusers folder in the FLUX.1-dev repository layout (transformer/, text_encoder/ (CLIP-L),
text_encoder_2/ (T5-XXL), tokenizer/, tokenizer_2/, vae/), with any component overridden by a
[model] key pointing at a diffusers sub-folder or a single .safetensors file; or a single BFL /
ComfyUI transformer file (bf16, fp8 e4m3, ComfyUI "scaled fp8"), possibly an all-in-one file that
also carries CLIP-L, T5 and the VAE under ComfyUI prefixes.

Every model is built on the meta device and filled tensor by tensor in its target dtype (see
weights.py), so a 12B transformer never exists twice in host RAM.

fp8 files stay fp8 (`load_transformer(keep_fp8=True)`, the default): a block Linear weight that
the file stores as float8_e4m3fn, other than the modulation/norm Linears the spec keeps in the
compute dtype, is loaded as the stored e4m3 bytes, and its scale (ComfyUI's per-tensor
`scale_weight`, or 1 for plain e4m3 files) becomes an fp32 `weight_scale` buffer of shape (out, 1)
on the Linear, which dequantizes in its forward (memory/fp8.py `use_fp8_weight`). That Linear is
the contract with the memory engine, which keeps such weights in e4m3 whatever memory.fp8 says.
Everything else (non-block modules, modulation/norm Linears, biases) is upcast to the compute
dtype one tensor at a time.

Architectures come from the checkpoint itself (diffusers config.json, or the keys and shapes of a
single file; bfl_keys.py / component_files.py), never from a hub. Only safetensors is read;
pickle checkpoints are refused. Every error names the file and the key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..io import UnsafeFileError, refuse_pickle, save_safetensors
from . import bfl_keys
from . import component_files as cf
from .flux import FLUX_SPEC
from .weights import CheckpointFiles, LoadError, build_empty, copy_ops, load_into_empty, read_header

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
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "tokenizer_config.json")


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


def dtype_from_name(name: str) -> torch.dtype:
    """[model] dtype ("bf16", "fp16", "fp32") -> torch dtype."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# -- sources ----------------------------------------------------------------------------------------

def _config_path(value: str, base_dir: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def _check_file(path: Path, key: str) -> None:
    try:
        refuse_pickle(path, what=f"[model] {key}")
    except UnsafeFileError as e:
        raise LoadError(str(e)) from None
    if path.suffix.lower() != ".safetensors":
        raise LoadError(f"[model] {key}: {path}: only .safetensors files (or diffusers folders) can be loaded")


def _override(name: str, value: str, base_dir: Path) -> Path:
    """A [model] component key: a file, a sub-folder, or a diffusers root holding that sub-folder."""
    p = _config_path(value, base_dir)
    if not p.exists():
        raise LoadError(f"[model] {name}: {p}: no such file or folder")
    if p.is_file():
        if name.startswith("tokenizer"):
            raise LoadError(f"[model] {name}: {p}: a tokenizer must be a folder (e.g. a diffusers {name}/ folder)")
        _check_file(p, name)
        return p
    if name.startswith("tokenizer"):
        own = any((p / f).exists() for f in _TOKENIZER_FILES)
    else:
        own = (p / "config.json").exists()
    if not own and (p / name).is_dir():
        return p / name          # a whole diffusers folder given for one component
    return p


def resolve_sources(model_cfg, base_dir: Path) -> FluxSources:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`).

    A missing optional component resolves to None (the loader for it then says which key to
    set); a path that does not exist, a pickle file or a folder without a transformer is an error
    here, naming the key.
    """
    root = _config_path(model_cfg.path, base_dir)
    if not root.exists():
        raise LoadError(f"[model] path: {root}: no such file or folder")
    found: dict[str, Path | None] = dict.fromkeys(COMPONENTS)
    if root.is_file():
        _check_file(root, "path")
        found["transformer"] = root
        keys = read_header(root)[0].keys()
        for name, component in _EMBEDDED.items():     # all-in-one files carry the encoders and VAE
            if cf.find_prefix(keys, component) not in (None, ""):
                found[name] = root
    elif (root / "config.json").is_file() and not (root / "transformer").is_dir():
        found["transformer"] = root                     # a transformer sub-folder given as path
    else:
        for name in COMPONENTS:
            if (root / name).is_dir():
                found[name] = root / name
    for name in COMPONENTS:
        value = getattr(model_cfg, name, None)
        if value is not None:
            found[name] = _override(name, value, base_dir)
    if found["transformer"] is None:
        raise LoadError(f"[model] path: {root}: no transformer/ sub-folder; set [model] transformer "
                        f"to a transformer folder or a .safetensors file")
    return FluxSources(**found, variant=getattr(model_cfg, "variant", "auto"))


# -- folders -----------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoadError(f"{path}: missing (a diffusers component folder needs its config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: not a JSON object")
    return data


def _weight_files(folder: Path, stem: str) -> CheckpointFiles:
    """The safetensors weights of a diffusers/transformers folder: one file, or the shards of an index."""
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoadError(f"{index}: no weight_map")
        return CheckpointFiles(sorted({folder / f for f in weight_map.values()}))
    if (folder / f"{stem}.safetensors").is_file():
        return CheckpointFiles([folder / f"{stem}.safetensors"])
    candidates = sorted(folder.glob("*.safetensors"))
    if len(candidates) == 1:
        return CheckpointFiles(candidates)
    if candidates:
        raise LoadError(f"{folder}: several .safetensors files ({', '.join(c.name for c in candidates)}) "
                        f"and no {index.name}; point the [model] key at one file")
    pickles = [p.name for p in folder.iterdir() if p.suffix.lower() in (".bin", ".pt", ".ckpt", ".pth")]
    if pickles:
        raise LoadError(f"{folder}: only pickle weights ({', '.join(pickles)}); leantune reads only .safetensors")
    raise LoadError(f"{folder}: no .safetensors weights")


def _check_class(config: dict, path: Path, expected: tuple[str, ...], label: str) -> None:
    declared = config.get("_class_name") or (config.get("architectures") or [None])[0] or config.get("model_type")
    if declared is not None and declared not in expected:
        raise LoadError(f"{path}: describes a {declared}, not a {label} ({'/'.join(expected)})")


def _require(source: Path | None, name: str) -> Path:
    if source is None:
        raise LoadError(f"no {_LABEL[name]}: [model] path has no {name}/ folder and [model] {name} is not set; "
                        f"set [model] {name} to a diffusers {name}/ folder or a .safetensors file")
    return source


def _component_keys(files: CheckpointFiles, component: str, prefix: str) -> list[str]:
    """The file keys of one component: those under its prefix; with no prefix, all but other components'."""
    if prefix:
        return [k for k in files.keys() if k.startswith(prefix)]
    others = tuple(p for c, ps in cf.PREFIXES.items() if c != component for p in ps if p)
    return [k for k in files.keys() if not k.startswith(others)]


def _single_file(path: Path, component: str, label: str) -> tuple[CheckpointFiles, str, dict, dict]:
    """(files, prefix, shapes without prefix, metadata config) of one component in a single file."""
    files = CheckpointFiles([path])
    prefix = cf.find_prefix(files.keys(), component)
    if prefix is None:
        raise LoadError(f"{path}: not a {label}: {cf.describe(files.keys())}")
    shapes = {k[len(prefix):]: files.shape(k) for k in _component_keys(files, component, prefix)}
    return files, prefix, shapes, cf.metadata_config(files.metadata, str(path), component)


# -- transformer ---------------------------------------------------------------------------------------

def fp8_block_weights(transformer) -> set[str]:
    """Names of the weights that fp8 storage applies to: every nn.Linear inside the spec's blocks
    except the modulation/norm Linears of `FLUX_SPEC.fp8_skip` ('transformer_blocks.0.attn.to_q.weight')."""
    names = set()
    for block_name, block in FLUX_SPEC.blocks(transformer):
        for rel, m in block.named_modules():
            if type(m) is torch.nn.Linear and not FLUX_SPEC.keeps_compute_dtype(rel):
                names.add(f"{block_name}.{rel}.weight")
    return names


def _keep_fp8_hooks(model) -> tuple:
    """(keep_fp8, on_fp8) for load_into_empty: which weights stay e4m3, and how their scale is attached."""
    from ..memory.fp8 import use_fp8_weight

    eligible = fp8_block_weights(model)

    def attach(target: str, scale: torch.Tensor) -> None:
        use_fp8_weight(model.get_submodule(target[: -len(".weight")]), scale)   # scale: (out, 1) fp32

    return eligible.__contains__, attach


def load_transformer(sources: FluxSources, dtype: torch.dtype = torch.bfloat16, device="cpu", keep_fp8: bool = True):
    """The FluxTransformer2DModel, built on meta and loaded straight into `dtype` on `device`.

    `keep_fp8`: block Linear weights stored as float8_e4m3fn stay e4m3 with a `weight_scale`
    buffer (module docstring); False upcasts them to `dtype` like every other tensor.
    """
    from diffusers import FluxTransformer2DModel

    src = _require(sources.transformer, "transformer")
    bfl_prefix = None      # set for BFL files: missing keys are then reported by their BFL names

    def source_name(target: str) -> str:
        return target if bfl_prefix is None else bfl_prefix + bfl_keys.bfl_name(target)

    if src.is_dir():
        config, files, ops = _diffusers_folder(src, ("FluxTransformer2DModel",), "Flux transformer")
    else:
        files, prefix, shapes, meta = _single_file(src, "transformer", "Flux transformer")
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
    detect_variant(model, sources.variant, source=src)      # from the structure, before reading weights
    keep, attach = _keep_fp8_hooks(model) if keep_fp8 else (None, None)
    return load_into_empty(model, files, ops, what="a Flux transformer of this architecture", dtype=dtype,
                           device=device, source_name=source_name, keep_fp8=keep, on_fp8=attach)


def _diffusers_folder(src: Path, classes: tuple[str, ...], what: str):
    """A diffusers model folder: its checked config, weight files and identity key mapping."""
    config = _read_json(src / "config.json")
    _check_class(config, src / "config.json", classes, what)
    files = _weight_files(src, "diffusion_pytorch_model")
    return config, files, copy_ops(files.keys())


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
    from diffusers import AutoencoderKL

    src = _require(sources.vae, "vae")
    if src.is_dir():
        config, files, ops = _diffusers_folder(src, ("AutoencoderKL",), "VAE")
    else:
        files, prefix, shapes, meta = _single_file(src, "vae", "VAE")
        config = cf.vae_config(shapes, meta, str(src))
        if cf.vae_layout(shapes) == "ldm":
            ops, unused = cf.vae_ldm_ops(shapes, prefix, config)
            if unused:
                raise LoadError(f"{src}: unexpected key(s) {unused[:5]}: not part of a Flux VAE")
        else:
            ops = copy_ops([prefix + k for k in shapes], strip=prefix)
    try:
        model = build_empty(lambda: AutoencoderKL.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a VAE from its config ({e})") from None
    return load_into_empty(model, files, ops, what="a VAE of this architecture", dtype=dtype, device=device)


# -- text encoders -------------------------------------------------------------------------------------------

def _load_tokenizer(source: Path | None, name: str, cls):
    if source is None:
        raise LoadError(f"no {_LABEL[name]}: tokenizers cannot be derived from weights; set [model] {name} to a "
                        f"folder with the {_LABEL[name]} (the {name}/ folder of a FLUX.1 diffusers repository)")
    if not any((source / f).exists() for f in _TOKENIZER_FILES):
        raise LoadError(f"[model] {name}: {source}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    try:
        return cls.from_pretrained(str(source), local_files_only=True)
    except Exception as e:
        raise LoadError(f"[model] {name}: {source}: cannot load the {_LABEL[name]} ({e})") from None


def load_text_encoders(sources: FluxSources, dtype: torch.dtype = torch.bfloat16, device="cpu") -> TextEncoders:
    """CLIP-L and T5-XXL with their tokenizers; tokenizers first, so a missing one fails before any load."""
    from transformers import CLIPTokenizer, T5Tokenizer

    tokenizer = _load_tokenizer(sources.tokenizer, "tokenizer", CLIPTokenizer)
    tokenizer_2 = _load_tokenizer(sources.tokenizer_2, "tokenizer_2", T5Tokenizer)
    clip = _load_clip(_require(sources.text_encoder, "text_encoder"), dtype, device)
    t5 = _load_t5(_require(sources.text_encoder_2, "text_encoder_2"), dtype, device)
    return TextEncoders(tokenizer=tokenizer, text_encoder=clip, tokenizer_2=tokenizer_2, text_encoder_2=t5)


def _load_clip(src: Path, dtype, device):
    from transformers import CLIPTextConfig, CLIPTextModel

    if src.is_dir():
        config = _read_json(src / "config.json")
        config = config.get("text_config", config)      # a full CLIPModel config holds the text part
        _check_class(config, src / "config.json", ("CLIPTextModel", "CLIPTextModelWithProjection", "clip_text_model",
                                                   "CLIPModel", "clip"), "CLIP text encoder")
        files, prefix = _weight_files(src, "model"), ""
        keys = files.keys()
    else:
        files, prefix, shapes, meta = _single_file(src, "clip", "CLIP text encoder")
        bare = {k.removeprefix("text_model."): s for k, s in shapes.items()}
        config = cf.clip_config(bare, meta, str(src))
        keys = _component_keys(files, "clip", prefix)
    try:
        model = build_empty(lambda: CLIPTextModel(CLIPTextConfig.from_dict(config)))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a CLIP text encoder from its config ({e})") from None
    ops = copy_ops(keys, strip=prefix, rename=cf.clip_rename(model.state_dict().keys()))
    return load_into_empty(model, files, ops, what="a CLIP-L text encoder of this architecture", dtype=dtype,
                           device=device, unexpected_ok=cf.clip_ignorable)


def _load_t5(src: Path, dtype, device):
    from transformers import T5Config, T5EncoderModel

    if src.is_dir():
        config = _read_json(src / "config.json")
        _check_class(config, src / "config.json", ("T5EncoderModel", "T5ForConditionalGeneration", "t5"),
                     "T5 text encoder")
        files, prefix = _weight_files(src, "model"), ""
        keys = files.keys()
    else:
        files, prefix, shapes, meta = _single_file(src, "t5", "T5 text encoder")
        config = cf.t5_config(shapes, meta, str(src))
        keys = _component_keys(files, "t5", prefix)
    try:
        model = build_empty(lambda: T5EncoderModel(T5Config.from_dict(config)))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a T5 encoder from its config ({e})") from None
    ops = copy_ops(keys, strip=prefix)
    return load_into_empty(model, files, ops, what="a T5 text encoder of this architecture", dtype=dtype,
                           device=device, unexpected_ok=cf.t5_ignorable)


# -- identity ------------------------------------------------------------------------------------------

_SLICE = 64 * 1024      # bytes sampled at the start, middle and end of a file's data


def _file_digest(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{size}:".encode())
    with open(path, "rb") as f:
        start = 0
        if path.suffix == ".safetensors":
            header_len = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            if 0 < header_len <= size - 8:
                f.seek(0)
                h.update(f.read(8 + header_len))    # names, dtypes, shapes, offsets, metadata
                start = 8 + header_len
        if size - start <= 3 * _SLICE:
            f.seek(start)
            h.update(f.read())
            return
        for offset in (start, start + (size - start) // 2, size - _SLICE):
            f.seek(offset)
            h.update(f.read(_SLICE))


def fingerprint(path: str | Path) -> str:
    """A content-derived identity of a component file or folder, cheap enough for every cache lookup.

    Hashes the size, the safetensors header and three 64 KiB slices of each file (every small file
    whole), not paths or times: a copied or moved checkpoint keeps its fingerprint, a retrained
    one with the same shapes still differs in its data slices.
    """
    path = Path(path)
    h = hashlib.sha256()
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")):
            h.update(str(f.relative_to(path)).encode() + b"\0")
            _file_digest(f, h)
    elif path.is_file():
        _file_digest(path, h)
    else:
        raise LoadError(f"{path}: no such file or folder")
    return h.hexdigest()[:32]


# -- writing BFL files -----------------------------------------------------------------------------------

_FP8_MAX = 448.0   # largest finite float8_e4m3fn


def _dequantized(state: dict) -> dict:
    """A state dict with every e4m3 weight that has a `weight_scale` (an fp8-loaded model) turned into
    fp32 values and the scale key dropped: BFL keys fuse several Linears, whose scales may differ."""
    from ..memory.fp8 import SCALE_ATTR, dequantize

    out = dict(state)
    for key in [k for k in state if k.endswith("." + SCALE_ATTR)]:
        wkey = key[: -len(SCALE_ATTR)] + "weight"
        if wkey in out and out[wkey].dtype == torch.float8_e4m3fn:
            out[wkey] = dequantize(out[wkey].detach().cpu(), out.pop(key).detach().cpu().float(), torch.float32)
    return out


def save_bfl_transformer(transformer, path: str | Path, dtype: torch.dtype | None = None, fp8: str | None = None,
                         prefix: str = "", metadata: dict | None = None) -> Path:
    """Write a diffusers Flux transformer (model or state dict) as a BFL single file, atomically.

    fp8=None keeps `dtype` (default: the tensors' own); "e4m3" stores the Linear weights inside the
    blocks as plain float8_e4m3fn (as ComfyUI fp8 files); "scaled" stores them as e4m3 divided by
    a per-tensor `scale_weight` (ComfyUI "scaled fp8"). The rotary axes go into the metadata so
    widths other than Flux's load with the right positional split.
    """
    if fp8 not in (None, "e4m3", "scaled"):
        raise ValueError(f"fp8 must be None, 'e4m3' or 'scaled', not {fp8!r}")
    meta = dict(metadata or {})
    if isinstance(transformer, torch.nn.Module):
        state = transformer.state_dict()
        meta.setdefault(cf.METADATA_CONFIG_KEY, json.dumps({"axes_dims_rope": list(transformer.config.axes_dims_rope)}))
    else:
        state = dict(transformer)
    state = _dequantized(state)
    tensors = {}
    for key, t in bfl_keys.diffusers_to_bfl(state).items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        in_block = key.startswith(("double_blocks.", "single_blocks.")) and key.endswith(".weight") and t.dim() == 2
        if fp8 and in_block:
            if fp8 == "scaled":
                scale = t.float().abs().max().clamp(min=1e-12) / _FP8_MAX
                tensors[prefix + key[: -len("weight")] + "scale_weight"] = scale.reshape(())
                t = (t.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
            else:
                t = t.float().clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        tensors[prefix + key] = t
    if fp8 == "scaled":
        tensors[prefix + "scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return save_safetensors(tensors, path, metadata=meta)
