"""Loading pieces every family shares: where components come from, diffusers/transformers folders,
single-file components, tokenizers, CLIP and T5 encoders, fp8-kept block weights, file identity.

A family's loader (flux/loading.py, sd3/loading.py) names its components and their labels and
calls these; the tensor-by-tensor fill itself lives in weights.py. Errors name the [model] key,
the file and the tensor key. Only safetensors is read; pickle is refused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ..io import UnsafeFileError, refuse_pickle
from . import component_files as cf
from .weights import CheckpointFiles, LoadError, build_empty, copy_ops, load_into_empty, read_header

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "tokenizer_config.json")


def dtype_from_name(name: str) -> torch.dtype:
    """[model] dtype ("bf16", "fp16", "fp32") -> torch dtype."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# -- sources ----------------------------------------------------------------------------------------

def config_path(value: str, base_dir: Path) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def check_file(path: Path, key: str) -> None:
    try:
        refuse_pickle(path, what=f"[model] {key}")
    except UnsafeFileError as e:
        raise LoadError(str(e)) from None
    if path.suffix.lower() == ".gguf" and key in ("path", "transformer"):
        return                          # a GGUF transformer (models/gguf_file.py)
    if path.suffix.lower() != ".safetensors":
        raise LoadError(f"[model] {key}: {path}: only .safetensors files (or diffusers folders) can be loaded"
                        + (" (a .gguf file only as [model] path or transformer)" if path.suffix.lower() == ".gguf" else ""))


def override(name: str, value: str, base_dir: Path) -> Path:
    """A [model] component key: a file, a sub-folder, or a diffusers root holding that sub-folder."""
    p = config_path(value, base_dir)
    if not p.exists():
        raise LoadError(f"[model] {name}: {p}: no such file or folder")
    if p.is_file():
        if name.startswith("tokenizer"):
            raise LoadError(f"[model] {name}: {p}: a tokenizer must be a folder (e.g. a diffusers {name}/ folder)")
        check_file(p, name)
        return p
    if name.startswith("tokenizer"):
        own = any((p / f).exists() for f in TOKENIZER_FILES)
    else:
        own = (p / "config.json").exists()
    if not own and (p / name).is_dir():
        return p / name          # a whole diffusers folder given for one component
    return p


def resolve_components(model_cfg, base_dir: Path, components: tuple[str, ...],
                       embedded: dict[str, str]) -> dict[str, Path | None]:
    """Where every component comes from, for a [model] section (relative paths from `base_dir`).

    `components`: the diffusers sub-folder names ("transformer", "text_encoder", ...);
    `embedded`: component -> component_files kind ("clip", "t5", "vae") an all-in-one single file
    may carry under a prefix. A missing optional component resolves to None (its loader then says
    which key to set); a path that does not exist, a pickle file or a folder without a transformer
    is an error here, naming the key.
    """
    root = config_path(model_cfg.path, base_dir)
    if not root.exists():
        raise LoadError(f"[model] path: {root}: no such file or folder")
    check_family(root, getattr(model_cfg, "family", None))
    found: dict[str, Path | None] = dict.fromkeys(components)
    if root.is_file():
        check_file(root, "path")
        found["transformer"] = root
        keys = _file_keys(root)
        for name, component in embedded.items():     # all-in-one files carry the encoders and VAE
            if cf.find_prefix(keys, component) not in (None, ""):
                found[name] = root
    elif (root / "config.json").is_file() and not (root / "transformer").is_dir():
        found["transformer"] = root                     # a transformer sub-folder given as path
    else:
        for name in components:
            if (root / name).is_dir():
                found[name] = root / name
    for name in components:
        value = getattr(model_cfg, name, None)
        if value is not None:
            found[name] = override(name, value, base_dir)
    if found["transformer"] is None:
        raise LoadError(f"[model] path: {root}: no transformer/ sub-folder; set [model] transformer "
                        f"to a transformer folder or a .safetensors file")
    return found


# diffusers class names (pipeline or transformer) -> what it is, for the sentence that names a folder
# given under the wrong [model] family; a class not listed is named by its class name.
_CLASS_LABELS = {
    "FluxPipeline": "Flux.1", "FluxTransformer2DModel": "Flux.1",
    "StableDiffusion3Pipeline": "Stable Diffusion 3 / 3.5", "SD3Transformer2DModel": "Stable Diffusion 3 / 3.5",
    "QwenImagePipeline": "Qwen-Image", "QwenImageEditPlusPipeline": "Qwen-Image-Edit",
    "QwenImageEditPipeline": "Qwen-Image-Edit", "QwenImageTransformer2DModel": "Qwen-Image",
    "Flux2Pipeline": "FLUX.2 [dev]", "Flux2KleinPipeline": "FLUX.2 [klein]", "Flux2Transformer2DModel": "FLUX.2",
    "Krea2Pipeline": "Krea 2", "Krea2Transformer2DModel": "Krea 2",
    "ZImagePipeline": "Z-Image", "ZImageTransformer2DModel": "Z-Image",
}


def _declared_classes(root: Path) -> tuple[str | None, str | None, str | None]:
    """(pipeline class, transformer class, the file that said it) of a diffusers folder, from its
    model_index.json, else its transformer/config.json or config.json; Nones when nothing says."""
    index = root / "model_index.json"
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            entry = data.get("transformer")
            cls = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
            return data.get("_class_name"), cls, index.name
        except (OSError, ValueError, AttributeError):
            pass
    for config in (root / "transformer" / "config.json", root / "config.json"):
        if config.is_file():
            try:
                return None, json.loads(config.read_text(encoding="utf-8")).get("_class_name"), config.name
            except (OSError, ValueError, AttributeError):
                continue
    return None, None, None


def check_family(root: Path, family: str | None) -> None:
    """A diffusers folder whose model_index.json (or transformer config) names a transformer class
    that `family` does not load is refused before anything is read, saying which family it is
    (asked of every registered family: models/family.guess_family). Families that share a class
    (FLUX.2's three, Qwen-Image and its Edit) tell their folders apart in their own loaders."""
    if family is None or not root.is_dir():
        return
    from .family import get_family, guess_family

    try:
        wanted = get_family(family)
    except KeyError:
        return                         # an unknown family is the config's error, named there
    pipeline, cls, said_by = _declared_classes(root)
    if cls is None or cls in wanted.transformer_classes:
        return
    other = guess_family(root)
    if other is None or other == family:
        return
    declared = pipeline or cls
    label = _CLASS_LABELS.get(declared) or _CLASS_LABELS.get(cls) or declared
    raise LoadError(f"[model] path: {root} is a {label} model ({said_by}: {declared}), but "
                    f"[model] family = \"{family}\"; set [model] family = \"{other}\"")


def require(source: Path | None, name: str, label: str) -> Path:
    if source is None:
        raise LoadError(f"no {label}: [model] path has no {name}/ folder and [model] {name} is not set; "
                        f"set [model] {name} to a diffusers {name}/ folder or a .safetensors file")
    return source


# -- folders -----------------------------------------------------------------------------------------

def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoadError(f"{path}: missing (a diffusers component folder needs its config.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise LoadError(f"{path}: not a JSON object")
    return data


def weight_files(folder: Path, stem: str) -> CheckpointFiles:
    """The safetensors weights of a diffusers/transformers folder: one file, or the shards of an index."""
    index = folder / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
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


def check_class(config: dict, path: Path, expected: tuple[str, ...], label: str) -> None:
    declared = config.get("_class_name") or (config.get("architectures") or [None])[0] or config.get("model_type")
    if declared is not None and declared not in expected:
        raise LoadError(f"{path}: describes a {declared}, not a {label} ({'/'.join(expected)})")


def transformer_layout(src: Path, classes: tuple[str, ...], label: str, read_single_file):
    """(config, files, ops, source_name) of a transformer from headers only: a diffusers folder
    (names as they are), or a single .safetensors file read by the family's `read_single_file(src)`
    -> (files, ops, config, source_name), source_name mapping a model key to the file's own name."""
    if src.is_dir():
        config, files, ops = diffusers_folder(src, classes, label)
        return config, files, ops, (lambda target: target)
    if src.suffix.lower() not in (".safetensors", ".gguf"):
        raise LoadError(f"[model] transformer: {src}: only .safetensors (or .gguf) files are read")
    files, ops, config, source_name = read_single_file(src)
    return config, files, ops, source_name


def diffusers_folder(src: Path, classes: tuple[str, ...], what: str):
    """A diffusers model folder: its checked config, weight files and identity key mapping."""
    config = read_json(src / "config.json")
    check_class(config, src / "config.json", classes, what)
    files = weight_files(src, "diffusion_pytorch_model")
    return config, files, copy_ops(files.keys())


def component_keys(files: CheckpointFiles, component: str, prefix: str) -> list[str]:
    """The file keys of one component: those under its prefix; with no prefix, all but other components'."""
    if prefix:
        return [k for k in files.keys() if k.startswith(prefix)]
    others = tuple(p for c, ps in cf.PREFIXES.items() if c != component for p in ps if p)
    return [k for k in files.keys() if not k.startswith(others)]


def _file_keys(path: Path):
    """The tensor names of a single file (header only): safetensors, or GGUF (models/gguf_file.py)."""
    from .gguf_file import is_gguf_path, tensor_names

    return tensor_names(path) if is_gguf_path(path) else read_header(path)[0].keys()


def single_file(path: Path, component: str, label: str) -> tuple[CheckpointFiles, str, dict, dict]:
    """(files, prefix, shapes without prefix, metadata config) of one component in a single file
    (a .gguf transformer: its quantized Linear weights stay in their blocks, models/gguf_file.py)."""
    from .gguf_file import GgufFiles, is_gguf_path, open_single_file

    if component == "transformer":                   # GGUF, ComfyUI int8 ConvRot or plain safetensors
        files = open_single_file(path)
    else:
        files = GgufFiles(path) if is_gguf_path(path) else CheckpointFiles([path])
    prefix = cf.find_prefix(files.keys(), component)
    if prefix is None:
        raise LoadError(f"{path}: not a {label}: {cf.describe(files.keys())}")
    shapes = {k[len(prefix):]: files.shape(k) for k in component_keys(files, component, prefix)}
    return files, prefix, shapes, cf.metadata_config(files.metadata, str(path), component)


# -- fp8-kept block weights ---------------------------------------------------------------------------

def fp8_block_weights(transformer, spec, modulation: bool = True) -> set[str]:
    """Names of the weights that may stay e4m3 when a file stores them so: every nn.Linear inside the
    spec's blocks except the norm Linears of `spec.fp8_skip`, and except the modulation Linears
    (`spec.modulation`) unless `modulation` ('transformer_blocks.0.attn.to_q.weight')."""
    names = set()
    for block_name, block in spec.blocks(transformer):
        for rel, m in block.named_modules():
            if type(m) is torch.nn.Linear and not spec.keeps_compute_dtype(rel, fp8_modulation=modulation):
                names.add(f"{block_name}.{rel}.weight")
    return names


def keep_fp8_hooks(model, spec, modulation: bool = True) -> tuple:
    """(keep_fp8, on_fp8) for load_into_empty: which weights stay e4m3 (the modulation Linears only
    with `modulation`, [memory] fp8_modulation not false), and how their scale is attached."""
    from ..memory.fp8 import use_fp8_weight

    eligible = fp8_block_weights(model, spec, modulation)

    def attach(target: str, scale: torch.Tensor) -> None:
        use_fp8_weight(model.get_submodule(target[: -len(".weight")]), scale)   # scale: (out, 1) or (out, nb) fp32

    return eligible.__contains__, attach


def fp8_hooks(model, spec, *, keep: bool, keep_modulation: bool, quantize: bool, quantize_modulation: bool,
              trained=None) -> dict:
    """load_into_empty's fp8 keywords for a transformer load: `keep` a file's e4m3 block weights
    (`keep_modulation`: its modulation Linears too), and `quantize` the block Linears the run stores
    in fp8 as they are read (`quantize_modulation`: the modulation Linears too, Plan.fp8_modulation),
    except weights `trained(name)` names (a full fine-tune's trained weights keep their dtype).
    The quantized set is the one apply_fp8_storage would quantize, so the engine finds them done."""
    if not keep and not quantize:
        return {}
    keep_fp8, attach = keep_fp8_hooks(model, spec, keep_modulation)
    out = {"on_fp8": attach, "keep_fp8": keep_fp8 if keep else (lambda name: False)}
    if quantize:
        chosen = {n for n in fp8_block_weights(model, spec, quantize_modulation) if not (trained and trained(n))}
        out["quantize_fp8"] = chosen.__contains__
        if quantize == "nf4":             # [memory] base_format = "nf4": NF4 rows where a row holds whole blocks
            from ..memory.nf4_storage import nf4_block_weights
            nf4 = chosen & nf4_block_weights(model, spec, quantize_modulation)
            out["quantize_fp8"] = lambda name: "nf4" if name in nf4 else False
        elif quantize == "int8":          # [memory] base_format = "int8": ConvRot rows where a group divides the inputs
            from ..memory.int8_storage import int8_block_weights
            int8 = chosen & set(int8_block_weights(model, spec, quantize_modulation))
            out["quantize_fp8"] = lambda name: "int8" if name in int8 else False
    return out


# -- VAE -----------------------------------------------------------------------------------------------

def load_vae(src: Path, dtype: torch.dtype, device, base_config: str, what: str = "VAE"):
    """An AutoencoderKL from a diffusers vae/ folder or a single file (LDM or diffusers keys, alone or
    under an all-in-one prefix). `base_config`: the packaged config (models/configs/) a single file
    is completed from: its latent scaling and shift are the family's, and the weights cannot show them."""
    from diffusers import AutoencoderKL

    if src.is_dir():
        config, files, ops = diffusers_folder(src, ("AutoencoderKL",), "VAE")
    else:
        files, prefix, shapes, meta = single_file(src, "vae", "VAE")
        config = cf.vae_config(shapes, meta, str(src), base=base_config)
        if cf.vae_layout(shapes) == "ldm":
            ops, unused = cf.vae_ldm_ops(shapes, prefix, config)
            if unused:
                raise LoadError(f"{src}: unexpected key(s) {unused[:5]}: not part of a {what}")
        else:
            ops = copy_ops([prefix + k for k in shapes], strip=prefix)
    try:
        model = build_empty(lambda: AutoencoderKL.from_config(config))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a VAE from its config ({e})") from None
    return load_into_empty(model, files, ops, what="a VAE of this architecture", dtype=dtype, device=device)


# -- text encoders -------------------------------------------------------------------------------------

def load_tokenizer(source: Path | None, name: str, label: str, cls, repo: str):
    """A tokenizer from a folder; `repo` names the diffusers repository whose `name`/ folder would do."""
    if source is None:
        raise LoadError(f"no {label}: tokenizers cannot be derived from weights; set [model] {name} to a "
                        f"folder with the {label} (the {name}/ folder of a {repo} diffusers repository)")
    if not any((source / f).exists() for f in TOKENIZER_FILES):
        raise LoadError(f"[model] {name}: {source}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    try:
        return cls.from_pretrained(str(source), local_files_only=True)
    except Exception as e:
        raise LoadError(f"[model] {name}: {source}: cannot load the {label} ({e})") from None


def load_clip(src: Path, dtype, device, *, with_projection: bool = False, component: str = "clip",
              base_config: str = "clip_l", label: str = "CLIP text encoder", what: str = "CLIP-L text encoder"):
    """A transformers CLIP text encoder from a folder or a single file (alone or under an all-in-one
    prefix). `with_projection`: CLIPTextModelWithProjection (SD3's pooled output is the projected
    one), else CLIPTextModel, which ignores a file's `text_projection`. `component` is the
    component_files kind that finds its prefix; `base_config` the packaged config a single file is
    completed from (hidden_act and the like, which shapes cannot show). `label` names the component
    in "not a ..." messages, `what` the architecture in shape messages."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    if src.is_dir():
        config = read_json(src / "config.json")
        config = config.get("text_config", config)      # a full CLIPModel config holds the text part
        check_class(config, src / "config.json", ("CLIPTextModel", "CLIPTextModelWithProjection", "clip_text_model",
                                                  "CLIPModel", "clip"), label)
        files, prefix = weight_files(src, "model"), ""
        keys = files.keys()
    else:
        files, prefix, shapes, meta = single_file(src, component, label)
        bare = {k.removeprefix("text_model."): s for k, s in shapes.items()}
        config = cf.clip_config(bare, meta, str(src), base=base_config)
        keys = component_keys(files, component, prefix)
    try:
        model = build_empty(lambda: cls(CLIPTextConfig.from_dict(config)))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a {label} from its config ({e})") from None
    ops = copy_ops(keys, strip=prefix, rename=cf.clip_rename(model.state_dict().keys()))
    ignorable = cf.clip_ignorable if not with_projection else cf.clip_ignorable_with_projection
    return load_into_empty(model, files, ops, what=f"a {what} of this architecture", dtype=dtype,
                           device=device, unexpected_ok=ignorable)


def load_t5(src: Path, dtype, device):
    """The T5 encoder (transformers T5EncoderModel) from a folder or a single file."""
    from transformers import T5Config, T5EncoderModel

    if src.is_dir():
        config = read_json(src / "config.json")
        check_class(config, src / "config.json", ("T5EncoderModel", "T5ForConditionalGeneration", "t5"),
                    "T5 text encoder")
        files, prefix = weight_files(src, "model"), ""
        keys = files.keys()
    else:
        files, prefix, shapes, meta = single_file(src, "t5", "T5 text encoder")
        config = cf.t5_config(shapes, meta, str(src))
        keys = component_keys(files, "t5", prefix)
    try:
        model = build_empty(lambda: T5EncoderModel(T5Config.from_dict(config)))
    except Exception as e:
        raise LoadError(f"{src}: cannot build a T5 encoder from its config ({e})") from None
    ops = copy_ops(keys, strip=prefix)
    return load_into_empty(model, files, ops, what="a T5 text encoder of this architecture", dtype=dtype,
                           device=device, unexpected_ok=cf.t5_ignorable)


# -- writing single files ------------------------------------------------------------------------------

FP8_MAX = 448.0   # largest finite float8_e4m3fn


def dequantized_state(state: dict) -> dict:
    """A state dict with every e4m3 weight that has a `weight_scale` (an fp8-loaded model) turned into
    fp32 values and the scale key dropped: single-file layouts fuse several Linears (q, k, v), whose
    scales may differ."""
    from ..memory.fp8 import SCALE_ATTR, dequantize

    out = dict(state)
    for key in [k for k in state if k.endswith("." + SCALE_ATTR)]:
        wkey = key[: -len(SCALE_ATTR)] + "weight"
        if wkey in out and out[wkey].dtype == torch.float8_e4m3fn:
            out[wkey] = dequantize(out[wkey].detach().cpu(), out.pop(key).detach().cpu().float(), torch.float32)
    return out


def file_tensors(state: dict, *, dtype: torch.dtype | None, fp8: str | None, prefix: str, in_block) -> dict:
    """The tensors of a single file from a state dict already in the file's keys: cast to `dtype`
    (None: as they are) and, with `fp8`, every 2-D `.weight` whose key `in_block(key)` accepts stored
    as float8_e4m3fn — "e4m3": plain (ComfyUI fp8 files), "scaled": divided by a per-tensor
    `scale_weight` (ComfyUI "scaled fp8", with its `scaled_fp8` marker). Keys get `prefix`."""
    if fp8 not in (None, "e4m3", "scaled"):
        raise ValueError(f"fp8 must be None, 'e4m3' or 'scaled', not {fp8!r}")
    tensors = {}
    for key, t in state.items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if fp8 and in_block(key) and key.endswith(".weight") and t.dim() == 2:
            if fp8 == "scaled":
                scale = t.float().abs().max().clamp(min=1e-12) / FP8_MAX
                tensors[prefix + key[: -len("weight")] + "scale_weight"] = scale.reshape(())
                t = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            else:
                t = t.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        tensors[prefix + key] = t
    if fp8 == "scaled":
        tensors[prefix + "scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return tensors


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
