"""ModelFamily: everything that differs between model families, in one object per family.

The trainer, the cache, the planner's probe, `leantune plan` and the sampler never import a
family's module: they ask `get_family(cfg.model.family)` and call what it holds. A family module
(models/flux/__init__.py, ...) builds one `ModelFamily` and registers it; adding a family means writing
that module, not editing the callers.

What a family provides, and the shapes callers rely on:
- `spec`: the `ModelSpec` the memory engine, LoRA targeting and the planner read (block lists,
  fp8 exceptions, LoRA presets).
- loading: `resolve_sources(model_cfg, base_dir) -> sources` (an object with one path attribute per
  component, `transformer` and `vae` at least), `load_transformer(sources, dtype, device)` (device
  "meta" builds the architecture with the loader's dtypes and reads nothing: the planner uses it;
  block weights a file stores in e4m3 stay e4m3, the spec's modulation Linears included; a loader
  that takes `fp8_modulation=False` upcasts those: callers pass `loader_options(memory_cfg)`),
  `load_text_encoders(sources, dtype, device)`, `load_vae(sources, dtype, device)`,
  `text_sources`: the attributes of `sources` whose files identify the cached text embeddings.
- text: `encode_prompts(prompts, encoders, max_length, device) -> (PromptEmbeds, lengths)`;
  `PromptEmbeds` (below, shared by the families) holds a text sequence `t5` (B, L, D) — the family
  decides what the sequence is — and a pooled vector `pooled` (B, D_pooled). `lengths` (B,) are the sequence rows worth keeping
  per prompt (the cache trims the rest; batches pad with zeros); `padding_side(encoders)` says
  which end holds the padding. `text_rows(max_length)`: the most sequence rows `max_length` text
  tokens give ([data] max_text_length; SD3 puts 77 CLIP rows before the T5 ones): the cache's
  bound on an entry and the planner's text length.
- latents: `latent_channels`, `vae_scale_factor` (pixels per latent), `pack_latents`
  (B, C, h, w) -> the transformer's input layout, `unpack_latents(packed, h, w)` back, and
  `image_tokens(h, w)` the number of image tokens for latent size h x w.
- the forward call: `predict(transformer, packed_noisy, sigma, embeds, (h, w), guidance)` -> the
  packed velocity; `guidance` is the distilled guidance input where the family has one (Flux dev),
  else ignored. `probe_inputs(config, batch, (h, w), text_length, dtype)` are the forward
  kwargs on the meta device for the planner's activation probe; an edit family whose probe prices
  reference images takes `references=N` too (N references at the family's reference size).
- `describe(transformer)`: a short name for logs ("Flux.1-dev").
- `sampling` (`Sampling`, below): how the family samples: which guidance (Flux dev: the distilled
  guidance input; SD3.5: real classifier-free guidance with a negative prompt), its published
  schedule, and what `predict` is fed as the time of a sigma.
- `text_modules(encoders) -> (whole, streamable)`: the text encoder modules sampling moves to the
  device whole (CLIP) and the one it may run block by block (the T5, or None when left out).
- `timestep_sampling`: the training noise-level sampling `[train] timestep_sampling = "auto"` means
  (flow_matching.py): Flux "sigmoid" (logit-normal), SD3 "shift" (logit-normal shifted by
  `[train] shift`, 3.0, as SD3's scheduler and diffusers' SD3 training script).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..spec import ModelSpec
from ..family_registry import FAMILIES


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch: a text sequence `t5` (B, L, D) and a pooled vector `pooled`
    (B, D_pooled). Flux: the T5 sequence and CLIP-L pooled; each family says what its sequence is."""

    t5: torch.Tensor
    pooled: torch.Tensor

    def to(self, device=None, dtype=None) -> "PromptEmbeds":
        return PromptEmbeds(self.t5.to(device=device, dtype=dtype), self.pooled.to(device=device, dtype=dtype))


@dataclass(frozen=True)
class Sampling:
    """How a family samples, for infer/ (which never asks which family it holds).

    - `guidance`: "distilled" — the scale is a transformer input (`predict`'s `guidance`; Flux dev;
      a model without the embedder ignores it); "cfg" — classifier-free guidance: every step runs the
      prompt and the negative prompt and mixes v_neg + scale * (v_pos - v_neg), as
      StableDiffusion3Pipeline does (no guidance when scale <= 1, as there).
    - `variant(transformer) -> str`: a short name of the checkpoint kind ("dev", "large") for the
      PNG metadata and for `schedule`.
    - `schedule(variant, folder) -> FlowSchedule`: the published schedule with its default steps and
      guidance, read from `folder`/scheduler/scheduler_config.json when the model is a diffusers
      folder (folder None: the published one).
    - `timestep(sigma, batch, dtype, device) -> (B,)`: what `predict` gets as `sigma` for the float32
      sigma of a step, rounded the way the family's pipeline rounds its timesteps.
    """

    guidance: str
    variant: Callable
    schedule: Callable
    timestep: Callable
    # cfg only: (v_neg, v_pos, scale) -> the guided velocity, where a family's pipeline mixes them
    # otherwise than v_neg + scale * (v_pos - v_neg) (Qwen-Image rescales the mix to v_pos's norm)
    combine: Callable | None = None
    # cfg only: guidance runs for scales above this (1: the pipelines whose mix at 1 is v_pos
    # itself; Z-Image's pipeline guides for any scale above 0, its mix being v_pos + s (v_pos - v_neg))
    cfg_above: float = 1.0
    # cfg only: the two halves of a batched step may hold texts of different lengths, the shorter
    # zero-padded (the family's predict reads each prompt's rows back from the zero rows, as
    # ZImagePipeline batches its per-prompt lists); False: halves of different lengths run apart
    pads_text: bool = False
    # cfg only: False where the family's pipeline runs the negative and the positive half as two
    # calls (WanPipeline): the sampler does too, whatever its caller's cfg_batched, so that its
    # samples are the pipeline's bit for bit (a doubled batch reassociates the floats)
    cfg_batched: bool = True
    # (transformer) -> a fresh prefix cache for one denoising run of one batch (or None where the
    # model has none): the keys and values of a prefix that is the same at every step (Qwen-Image-
    # 2.1's text and references, modulated at t = 0), computed at the first step and reused after,
    # as the family's pipeline does; predict then takes `prefix_cache=(cache, first_step)`.
    # prefix_cache_bytes(config, batch, prefix_tokens, dtype) prices what one cache holds
    prefix_cache: Callable | None = None
    prefix_cache_bytes: Callable | None = None
    # (denoised latents, references) -> the latents decoded, where a family's pipeline replaces part of
    # them after its last step (Wan 2.2 TI2V-5B's image-to-video: the first latent frame is the clean
    # condition again); None: the denoised latents as they are
    finish: Callable | None = None

    def guides(self, scale) -> bool:
        """Whether sampling at `scale` runs classifier-free guidance (both halves per step)."""
        return self.guidance == "cfg" and scale is not None and scale > self.cfg_above

    def mix(self, v_neg, v_pos, scale: float):
        """The classifier-free guided velocity of the family's pipeline."""
        return v_neg + scale * (v_pos - v_neg) if self.combine is None else self.combine(v_neg, v_pos, scale)

    def __post_init__(self):
        if self.guidance not in ("distilled", "cfg"):
            raise ValueError(f"Sampling.guidance must be 'distilled' or 'cfg', got {self.guidance!r}")


@dataclass(frozen=True)
class ReferenceConditioning:
    """How a family is conditioned on reference images (an edit model: Qwen-Image-Edit; FLUX.2's
    multi-reference). docs/reference-images.md describes the seam; in short:

    - `size(ref_width, ref_height, bucket) -> (width, height)`: the pixel size a reference is
      VAE-encoded at for training in `bucket` (width, height); the cache stores its latents like
      a target's, keyed by the reference's content, size and the VAE;
    - `text_sees_images`: the text encoder reads the references too (a VLM: its text entry is keyed
      by the references' content, and `encode_prompts` gets `images=`, per prompt a list of PIL
      images), else the caption alone is encoded;
    - `most`: how many references one target may have;
    - `sampling_latents(vae, images) -> [(1, C, h, w), ...]`: each reference (PIL) resized and
      VAE-encoded as the family's pipeline does when it samples (`leantune sample --reference`, the
      samples drawn during training); `vae` is what the family's `load_vae` returns.

    The family's `predict` takes `references=`: a list of (B, C, h_r, w_r) latents, one tensor per
    reference slot, and returns the target's prediction only."""

    size: Callable
    text_sees_images: bool = False
    most: int = 1
    sampling_latents: Callable | None = None
    # A video's first frame as the reference (Wan image-to-video, models/wan/i2v.py): `first_frame(sources)`
    # says whether the model takes it (one that does samples only with it, one that does not refuses
    # it); `sampling_latents(vae, images, width=, height=, frames=)` then builds the condition at the
    # sample's size and length, datasets name no reference_path, and the caching phase stores each
    # clip's condition as its one reference entry: `clip_condition(video vae, first frame (3, H, W)
    # in [-1, 1], frames) -> (C', T', h, w)`. None: references are images of their own (an edit model)
    first_frame: Callable | None = None
    clip_condition: Callable | None = None
    # the model samples with a first frame or without one (Wan 2.2 TI2V-5B): `first_frame(sources)`
    # is False (its clips train text-to-video), and a first frame given to a sample is taken
    first_frame_optional: bool = False
    # A first-frame model that also reads an image embedding of that frame (Wan 2.1 I2V's CLIP vision
    # encoder, which its cross-attention attends to beside the text): `frame_embedding(sources)` is a
    # FrameEmbedding, or None for a model without one. The caching phase stores each clip's as a
    # second reference entry after its condition, and a sample's first frame gets one beside its
    # condition: `predict(references=[condition, embedding])`
    frame_embedding: Callable | None = None

    def takes_first_frame(self, sources) -> bool:
        """Whether the model of `sources` is conditioned on a video's first frame."""
        return self.first_frame is not None and sources is not None and bool(self.first_frame(sources))


@dataclass(frozen=True)
class FrameEmbedding:
    """An image encoder's embedding of a video's first frame (ReferenceConditioning.frame_embedding).

    - `load(dtype, device)`: the encoder (loaded only when an entry is missing);
    - `embed(encoder, image)`: (1, L, D) float32 on the host of one PIL image, as the family's
      pipeline embeds its first-frame image;
    - `shape`: (L, D), what a cached entry must hold;
    - `paths`: the encoder's files or folders, which key its entries (a changed encoder re-encodes)."""

    load: Callable
    embed: Callable
    shape: tuple[int, int]
    paths: tuple


@dataclass(frozen=True)
class VideoLatents:
    """How a video family's clips become latents and back (Wan: AutoencoderKLWan's causal VAE).

    - `temporal_factor`: frames per latent frame after the first (4k+1 frames -> k+1 latent frames);
    - `load_vae(sources, dtype, device)`: the causal video VAE itself, which data/video_vae.py drives
      a chunk at a time (the family's `load_vae` is its one-frame image view: a still image of a
      video run is a one-frame clip, its latents (C, h, w) packed to (C, 1, h, w) by `pack_latents`);
    - `fps`: the rate sampled videos are written at (the model's training rate; Wan 2.2 A14B: 16).
    """

    temporal_factor: int
    load_vae: Callable
    fps: float = 16.0

    def latent_frames(self, frames: int) -> int:
        """Latent frames of `frames` pixel frames (a valid length: 1 + k * temporal_factor)."""
        if frames < 1 or (frames - 1) % self.temporal_factor:
            raise ValueError(f"{frames} frames is not a length this VAE encodes: 1 + {self.temporal_factor}k "
                             f"(e.g. {1 + self.temporal_factor * max(1, (frames - 1) // self.temporal_factor)})")
        return 1 + (frames - 1) // self.temporal_factor


@dataclass(frozen=True)
class ModelFamily:
    name: str
    spec: ModelSpec
    # loading
    resolve_sources: Callable
    load_transformer: Callable
    load_text_encoders: Callable
    load_vae: Callable
    text_sources: tuple[str, ...]
    # text
    encode_prompts: Callable
    padding_side: Callable
    # latents
    latent_channels: int
    vae_scale_factor: int
    pack_latents: Callable
    unpack_latents: Callable
    image_tokens: Callable
    # the forward call
    predict: Callable
    probe_inputs: Callable
    describe: Callable
    # sampling (see Sampling) and the text encoder modules sampling places
    sampling: Sampling
    text_modules: Callable
    # diffusers transformer classes of this family (family_for_model tells a loaded model's family)
    transformer_classes: tuple[str, ...] = ()
    # () -> the class a full-size architecture is built with on meta (the planner's `--model` copy and
    # the simulated device's), where the diffusers class's forward cannot run without values
    # (Qwen-Image-2.1 reads its token layout from a mask); None: transformer_classes[0] from diffusers
    meta_transformer_class: Callable | None = None
    # diffusers pipeline classes (model_index.json's _class_name) that tell this family from another
    # with the same transformer class (Qwen-Image-Edit's folder holds Qwen-Image's transformer)
    pipeline_classes: tuple[str, ...] = ()
    # True for the tensor names of a single transformer file of this family, any prefix kept
    # (guess_family: `leantune sample --model FILE` without a family)
    recognizes_keys: Callable = lambda keys: False
    # (tensor name -> shape, of a single file) -> whether the file is this family's, for families whose
    # files share every tensor name (Wan 2.2 A14B's and TI2V-5B's: the channels tell them apart):
    # guess_family reads a file's shapes (its header) where several families claim its names; None:
    # the names decide
    recognizes_shapes: Callable | None = None
    # (transformer config mapping or None, model_index.json dict or None) -> whether a model of a
    # class several families share is this family's (FLUX.2's three share Flux2Transformer2DModel);
    # None: every model of the class is (family_for_model, guess_family)
    recognizes_config: Callable | None = None
    # sequence rows for [data] max_text_length tokens (the cache's bound, the planner's text length)
    text_rows: Callable[[int], int] = lambda max_length: max_length
    # (tokenizer, captions) -> each caption's count of the tokens encode_prompts holds against
    # max_length (a count over it is cut there), from the tokenizer alone: a family that wraps a caption
    # in a template counts what its encode limits (the page's token counts, ui/tokens.py); None: the
    # tokenizer's own tokens, its special tokens added (Flux's and SD3's T5, Wan's umT5)
    caption_tokens: Callable | None = None
    # False where encode_prompts applies no max_length at all (Qwen-Image-Edit's and -2.1's pipelines
    # keep every row): caption_tokens then counts the rows a caption gives, none of them cut
    cuts_text: bool = True
    # training schedule: what [train] timestep_sampling = "auto" means
    timestep_sampling: str = "sigmoid"
    # reference-image conditioning (ReferenceConditioning), None for a family without it
    references: ReferenceConditioning | None = None
    # (text rows) -> {"device": bytes, "host": bytes, ...}: the caching phase's text encoding, priced,
    # for a family whose text encoder is large enough to need a plan of its own (Qwen-Image's 7B)
    text_phase: Callable | None = None
    # (transformer config) -> the width of one row of PromptEmbeds.t5 that `predict` takes, for code
    # that makes embeddings without an encoder (the simulated device, tests); None: the config's
    # joint_attention_dim (Flux, SD3, Qwen-Image, FLUX.2 name it so; Krea 2 stacks layers per row)
    text_width: Callable | None = None
    # (what the transformer returns for probe_inputs) -> the prediction tensor (B, ...), which the
    # planner's activation probe backpropagates a loss through; None: the output's first element
    # (every diffusers transformer with return_dict=False but Z-Image's, which returns one tensor
    # per image: its family stacks them, as its predict does)
    probe_output: Callable | None = None
    # (sigma (B,) as [train] timestep_sampling drew them, sources, that sampling's name, [train]) -> the
    # noise levels a step trains on, for a model that denoises only part of the range (a Wan 2.2 expert);
    # None: as drawn
    training_sigmas: Callable | None = None
    # a video family (VideoLatents): its datasets' clips are cached and trained as 5-D latents
    # (B, C, T', h, w) and its samples during training are videos; None: an image family
    video: "VideoLatents | None" = None
    # the VAE encodes RGBA (Qwen-Image-2.1): training targets and references keep their alpha into
    # the latent cache (data/reading.load_rgba; the entries' keys say so) and the vision encoder
    # gets them as the family's encode_prompts flattens them; False: transparency is composited
    # over white before anything reads the image (data/reading.load_rgb)
    rgba: bool = False
    # pixels a training bucket's sides are multiples of (data/buckets.bucket_sizes): the VAE's factor
    # times the transformer's patch, 16 for the 8x VAEs with 2 x 2 patches; Wan 2.2 TI2V-5B's 16x VAE, 32
    side_multiple: int = 16
    # (transformer) -> None: swaps the transformer's blocks' classes in place to the family's split
    # class (memory/split_parts.py: parts kept as their inputs and recomputed one at a time, switched
    # on by Plan.split_blocks); its loader calls it on every load, meta included, so the planner's
    # probe runs the class training runs. None: the family has no split blocks (the planner never
    # prices nor chooses them)
    split_blocks: Callable | None = None


def text_width(family: ModelFamily, config) -> int:
    """The width of one text row `family.predict` takes for a transformer of `config`."""
    return int(family.text_width(config)) if family.text_width is not None else int(config.joint_attention_dim)


def probe_output(family: ModelFamily, out):
    """The prediction tensor of a forward call on `family.probe_inputs` (ModelFamily.probe_output)."""
    return family.probe_output(out) if family.probe_output is not None else out[0]


_FAMILIES: dict[str, ModelFamily] = {}
# Family name -> module that registers it on import (imported lazily: loading diffusers is slow).
# (family_registry.py: one entry per family, the only table a new family adds itself to.)
_MODULES = {name: entry.module for name, entry in FAMILIES.items()}


def loader_options(memory_cfg) -> dict:
    """Keyword arguments of `load_transformer` that follow a [memory] section: `fp8_modulation=False`
    when it asks for the modulation Linears upcast (fp8_modulation = false), else none (every
    loader keeps a file's e4m3 modulation weights e4m3 by default)."""
    return {"fp8_modulation": False} if getattr(memory_cfg, "fp8_modulation", "auto") is False else {}


def fp8_load_options(memory_cfg, trained: Callable[[str], bool] | None = None, plan=None) -> dict:
    """Keyword arguments of `load_transformer` that quantize while loading: when the run's plan
    stores the block Linears in fp8, they become block-scaled e4m3 as they are read (the modulation
    Linears too when the plan quantizes them), so a bf16 file never sits in host RAM in bf16.
    Without a vram_budget the plan is the explicit [memory] one (fp8, fp8_modulation = true); under
    a vram_budget it is `plan` (memory.plan.Plan), which the planner chose on the meta-built model
    before loading (none given: nothing is quantized while loading). `trained`: a full fine-tune's
    trained weights (they keep their dtype)."""
    if getattr(memory_cfg, "vram_budget", None) is not None:
        fp8, modulation = (plan.fp8, plan.fp8_modulation) if plan is not None else (False, False)
    else:
        fp8, modulation = getattr(memory_cfg, "fp8", False), getattr(memory_cfg, "fp8_modulation", "auto") is True
    if not fp8:
        return {}
    out = {"quantize_fp8": True}
    fmt = getattr(plan, "base_format", "fp8") if getattr(memory_cfg, "vram_budget", None) is not None else "fp8"
    if fmt != "fp8":                # the plan's int8 / NF4 rows, read as such (memory/*_storage.py)
        out["quantize_fp8"] = fmt
    if modulation:
        out["quantize_modulation"] = True
    if trained is not None:
        out["trained"] = trained
    return out


def register(family: ModelFamily) -> ModelFamily:
    _FAMILIES[family.name] = family
    return family


def prices_references(family: "ModelFamily") -> bool:
    """Whether the planner prices the family's reference images: its probe_inputs takes `references`."""
    import inspect

    return "references" in inspect.signature(family.probe_inputs).parameters


def get_family(name: str) -> ModelFamily:
    """The registered family called `name` ([model] family), importing its module on first use."""
    if name not in _FAMILIES:
        module = _MODULES.get(name)
        if module is None:
            raise KeyError(f"unknown model family {name!r}; known: {sorted(_MODULES)}")
        import importlib

        importlib.import_module(module)
    return _FAMILIES[name]


def known_families() -> list[str]:
    """Names of every family leantune has, registered or not yet imported, in a fixed order."""
    return list(_MODULES)


def _claims(family: ModelFamily, cls: str, config, index=None) -> bool:
    """Whether `family` claims a model of class `cls` with this config (and folder model_index)."""
    if cls not in family.transformer_classes:
        return False
    return family.recognizes_config is None or bool(family.recognizes_config(config, index))


def family_for_model(transformer) -> ModelFamily:
    """The family of a loaded transformer, from its class and, where families share a class, its
    config (for code handed only the model, such as the sampler called directly with a diffusers
    model)."""
    cls = type(transformer).__name__
    config = getattr(transformer, "config", None)
    for name in _MODULES:
        family = get_family(name)
        if _claims(family, cls, config):
            return family
    raise TypeError(f"{cls} belongs to no known model family ({sorted(_MODULES)})")


def guess_family(path) -> str | None:
    """The family of a model path from its metadata alone, or None when nothing says.

    A diffusers folder names its transformer class (model_index.json, else transformer/config.json),
    and where families share the class its transformer config or model_index.json
    (ModelFamily.recognizes_config: FLUX.2's three) or its pipeline class (pipeline_classes:
    Qwen-Image and its Edit) tell them apart; a single .safetensors file is matched by its tensor
    names (header only, nothing loaded).
    """
    import json
    from pathlib import Path

    path = Path(path)
    cls = pipeline = None
    try:
        if path.is_dir():
            index_file, config_file = path / "model_index.json", path / "transformer" / "config.json"
            index = json.loads(index_file.read_text(encoding="utf-8")) if index_file.is_file() else None
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else None
            if index is not None:
                entry, pipeline = index.get("transformer"), index.get("_class_name")
                cls = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
            if cls is None and config is not None:
                cls = config.get("_class_name")
            if cls is None:
                return None
            matches = [n for n in _MODULES if _claims(get_family(n), cls, config, index)]
            # several families share a transformer class: the pipeline class tells them apart
            by_pipeline = [n for n in matches if pipeline in get_family(n).pipeline_classes]
            return (by_pipeline or matches or [None])[0]
        if path.is_file() and path.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), "pt") as f:
                    keys = list(f.keys())
                    shapes = ({k: tuple(f.get_slice(k).get_shape()) for k in keys}
                              if len(families_of_keys(keys)) > 1 else None)
            except SafetensorError:
                return None
            return family_of_keys(keys, shapes)
        if path.is_file() and path.suffix.lower() == ".gguf":          # ComfyUI-GGUF files: the same names
            from .gguf_file import tensor_names
            from .weights import LoadError

            try:
                return family_of_keys(tensor_names(path))
            except LoadError:
                return None
    except (OSError, ValueError, AttributeError, TypeError):
        return None     # unreadable: the family's loader reports it with the file's name
    return None


def families_of_keys(keys) -> list[str]:
    """Every registered family (in known_families' order) whose recognizes_keys claims a file's
    tensor names."""
    keys = list(keys)
    out = []
    for name in _MODULES:
        try:
            if get_family(name).recognizes_keys(keys):
                out.append(name)
        except (TypeError, ValueError, KeyError):
            continue
    return out


def family_of_keys(keys, shapes: dict | None = None) -> str | None:
    """The first registered family (in known_families' order) whose recognizes_keys claims a file's
    tensor names, or None. Where several claim them and `shapes` (name -> shape) are given, the
    first whose recognizes_shapes also claims the shapes (Wan 2.2 A14B / TI2V-5B); without shapes
    the first: its loader tells the others apart by shapes and names the family to set."""
    names = families_of_keys(keys)
    if shapes is not None and len(names) > 1:
        for name in names:
            check = get_family(name).recognizes_shapes
            try:
                if check is None or check(shapes):
                    return name
            except (TypeError, ValueError, KeyError):
                continue
    return names[0] if names else None


def family_of_spec(spec: ModelSpec) -> ModelFamily:
    """The family a spec belongs to (for code handed a spec, such as the planner's probe)."""
    return get_family(spec.family)
