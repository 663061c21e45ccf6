"""Strict TOML configuration: one pydantic model per section, unknown keys are errors.

Every error names the file, the section and the key, and suggests the closest valid key for a
misspelling (`learning_rat` -> `learning_rate`). `--set section.key=value` overrides are applied
to the raw TOML data before validation, so they are checked exactly like the file. The validated
config is never mutated; derived values (the memory plan) live elsewhere.
"""

from __future__ import annotations

import difflib
from pathlib import Path, PureWindowsPath
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

# Every [model] family leantune trains and samples, and the block lists each may name in [lora]
# blocks (family_registry.py: torch-free, one entry per family; the CLI's --family choices read it too).
from .family_registry import FAMILIES, FAMILY_NAMES


class ConfigError(ValueError):
    """A configuration problem, with the file and key it concerns in the message."""


# Every schema of a leantune file: unknown keys are errors, and no float key takes inf or NaN (one
# rule for every float, tuples and lists included: inf or NaN anywhere ends a run in "loss is nan").
STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Section(BaseModel):
    model_config = STRICT


def file_name_part(value: str, what: str) -> str:
    """`value` if it is one non-empty path component: a name joined to a folder must stay in it
    (`../victim` or `/etc/x` would write outside the output folder, "" a file named `_comfyui...`)."""
    if not value.strip():
        raise ValueError(f"{what} is empty; give a file name such as \"lora\"")
    if "/" in value or "\\" in value or "\0" in value or value in (".", "..") or PureWindowsPath(value).drive:
        raise ValueError(f"{what} {value!r} is not a plain file name: no '/', '\\', NUL, drive, '.' or '..'")
    return value


# LoRAs are trained for strengths around 1; beyond this the outputs overflow to black or noise.
MAX_ADAPTER_STRENGTH = 10.0


class AdapterRef(Section):
    """A frozen LoRA file applied to the base at a strength ([model] / [sample] base_adapters):
    a training adapter that de-distills a turbo base, or a turbo LoRA for previews
    (train/base_adapters.py). Any LoRA layout leantune reads for the family."""

    path: str
    strength: float = 1.0

    @field_validator("strength")
    @classmethod
    def _sane_strength(cls, v: float) -> float:
        if abs(v) > MAX_ADAPTER_STRENGTH:
            raise ValueError(f"strength {v:g} is outside -{MAX_ADAPTER_STRENGTH:g}..{MAX_ADAPTER_STRENGTH:g}; "
                             f"LoRAs are made for strengths around 1")
        return v


def check_variant(said: str, value: str, family: str) -> None:
    """A [model] variant / [sample] base_variant value is "auto" or a kind of checkpoint the family
    has (family_registry's `variants`); the error starts with `said` (the key and its value) and
    names the family's kinds."""
    allowed = FAMILIES[family].variants
    if value != "auto" and value not in allowed:
        raise ValueError(f"{said} is not a {family} checkpoint: "
                         + ("one of " + ", ".join(f'"{v}"' for v in ("auto", *allowed))
                            if allowed else f"family = {family!r} has one kind of checkpoint; remove the key"))


class ModelConfig(Section):
    family: Literal[FAMILY_NAMES] = "flux"
    # A diffusers folder (FLUX.1-dev / stable-diffusion-3.5 layout) or a single transformer file
    # (.safetensors: BFL / ComfyUI for Flux, Stability's sd3.5_*.safetensors for SD3).
    path: str
    # Which checkpoint of the family's architecture, where a single file cannot say (family_registry's
    # `variants`: Flux dev / schnell, Z-Image turbo / base, Krea 2 raw / turbo); it picks the
    # published sampling schedule of previews and `leantune sample`. A diffusers folder's own
    # scheduler config still decides the shift.
    variant: Literal["auto", "dev", "schnell", "turbo", "base", "raw"] = "auto"
    # Wan 2.2 A14B's two experts: the one a run trains, on the noise levels it denoises in WanPipeline
    # (model_index.json's boundary_ratio): "high" the high-noise transformer/, "low" the low-noise
    # transformer_2/ (or, for a single file, the expert it holds); "auto": a one-transformer model's
    # transformer, the high-noise expert of two; "both": both experts in one run, each step on the
    # expert that owns its noise levels ([lora] experts: a LoRA per expert or one for both).
    expert: Literal["auto", "high", "low", "both"] = "auto"
    # Wan 2.2 TI2V-5B (family "wan2.2-ti2v") trains text-to-video by default; true trains image-to-
    # video: each clip's first latent frame stays clean as its condition and the previews start from
    # [sample] references' first frame (models/wan/ti2v.py). Other families are one or the other.
    image_to_video: bool = False
    # Per-component overrides: a diffusers sub-folder or a single .safetensors file each, named as
    # in the family's diffusers repository.
    transformer: str | None = None
    text_encoder: str | None = None      # CLIP-L
    text_encoder_2: str | None = None    # Flux: T5-XXL; SD3: CLIP-G
    text_encoder_3: str | None = None    # SD3: T5-XXL
    tokenizer: str | None = None
    tokenizer_2: str | None = None
    tokenizer_3: str | None = None       # SD3: T5 tokenizer
    vae: str | None = None
    # Qwen-Image-2.1: its diffusers repository's processor/ folder (Qwen3-VL's tokenizer, chat
    # template and image processor in one, as QwenImage21Pipeline names the component), so it is
    # overridden by the name a user sees there; another family has no processor and refuses it.
    processor: str | None = None
    # Wan 2.1 I2V: its CLIP vision encoder (a transformers CLIPVisionModel folder) and its
    # CLIPImageProcessor folder, the diffusers repository's image_encoder/ and image_processor/
    # (a single transformer file has neither); another family has no image encoder and refuses them.
    image_encoder: str | None = None
    image_processor: str | None = None
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16"
    # SD3: false leaves T5-XXL out (zeros in its place, as StableDiffusion3Pipeline without
    # text_encoder_3). Flux cannot run without T5: false is refused there.
    t5: bool = True
    # Frozen LoRAs applied to the base before training, kept out of the trained LoRA's files
    # (a turbo base's training adapter); train/base_adapters.py.
    base_adapters: list[AdapterRef] = []

    @model_validator(mode="after")
    def _family_keys(self):
        check_variant(f"[model] variant = {self.variant!r}", self.variant, self.family)
        if self.expert != "auto" and self.family != "wan2.2":
            raise ValueError(f"[model] expert = {self.expert!r}: family = {self.family!r} has one transformer; only "
                             f"family = \"wan2.2\" has experts (Wan 2.2 A14B's high- and low-noise); remove the key")
        if self.image_to_video and self.family != "wan2.2-ti2v":
            raise ValueError(f"[model] image_to_video = true: family = {self.family!r} does not choose; only family = "
                             f"\"wan2.2-ti2v\" (TI2V-5B) trains either way (an image-to-video Wan's first frame comes "
                             f"with its model); remove the key")
        for key in ("image_encoder", "image_processor"):
            if getattr(self, key) is not None and self.family != "wan2.2":
                raise ValueError(f"[model] {key}: family = {self.family!r} has no image encoder (only \"wan2.2\" "
                                 f"does, for Wan 2.1 I2V); remove the key")
        if self.processor is not None and self.family != "qwen-image-2.1":
            raise ValueError(f"[model] processor: family = {self.family!r} has no processor component (only "
                             f"\"qwen-image-2.1\" does); its tokenizer is [model] tokenizer")
        if self.family == "flux":
            if not self.t5:
                raise ValueError("[model] t5 = false: Flux cannot run without its T5 text encoder (only "
                                 "family = \"sd3\" can); remove the key")
            for key in ("text_encoder_3", "tokenizer_3"):
                if getattr(self, key) is not None:
                    raise ValueError(f"[model] {key}: Flux has no third text encoder (its T5 is text_encoder_2)")
        else:
            if not self.t5:
                for key in ("text_encoder_3", "tokenizer_3"):
                    if getattr(self, key) is not None:
                        raise ValueError(f"[model] {key}: set, but [model] t5 = false leaves T5 out")
        return self


class DatasetConfig(Section):
    path: str
    repeats: int = Field(1, ge=1)
    caption_extension: str = ".txt"
    trigger_word: str = ""
    caption_dropout: float = Field(0.0, ge=0.0, le=1.0)
    recursive: bool = True
    default_caption: str = ""
    require_captions: bool = False       # an image without its own caption file (or an empty one) is an error
    # Skip (with a warning) images smaller than this fraction of their bucket's side; 0 keeps all.
    min_size: float = Field(0.5, ge=0.0, le=1.0)
    # An edit dataset: a folder of reference images matched to the targets by file stem (`cat.png`
    # -> `cat.*` there, or `cat_0.*`, `cat_1.*`, ... for several); families with reference
    # conditioning only (qwen-image-edit, flux2-dev, flux2-klein-4b/9b). See docs/reference-images.md.
    reference_path: str | None = None
    # Masked loss (data/masks.py): a grayscale mask per image, white where the loss counts, black
    # where it does not; `mask_path` a folder of masks matched by file stem (`cat.png` -> `cat.*`),
    # or `mask_suffix` a mask beside each image (`cat.png` -> `cat_mask.png` for "_mask"; such files
    # are masks, not training images). `mask_floor`: the loss weight where a mask is black.
    mask_path: str | None = None
    mask_suffix: str | None = None
    mask_floor: float = Field(0.0, ge=0.0, lt=1.0)
    # "prior": a regularisation dataset (class images), mixed in at [data] prior_ratio and trained
    # with [data] prior_loss (train/priors.py)
    role: Literal["train", "prior"] = "train"

    @field_validator("mask_suffix")
    @classmethod
    def _mask_suffix(cls, v: str | None) -> str | None:
        """Part of a file name joined to the image's stem: it must stay one name in the folder."""
        return None if v is None else file_name_part(v, "the mask suffix")

    @model_validator(mode="after")
    def _one_mask_source(self):
        if self.mask_path is not None and self.mask_suffix is not None:
            raise ValueError("mask_path and mask_suffix: set both, but a dataset's masks come from one place; "
                             "keep mask_path (a folder of masks) or mask_suffix (a mask beside each image)")
        if "mask_floor" in self.model_fields_set and self.mask_path is None and self.mask_suffix is None:
            raise ValueError("mask_floor: set, but the dataset has no masks; set mask_path or mask_suffix "
                             "(or remove mask_floor)")
        return self

    @field_validator("caption_extension")
    @classmethod
    def _suffix(cls, v: str) -> str:
        """A suffix the image's name takes (`cat.png` -> `cat.txt`): checked here, not at caching time."""
        if not v.startswith(".") or len(v) < 2:
            raise ValueError(f"{v!r} is not a file suffix: it starts with '.', as \".txt\" or \".caption\"")
        return file_name_part(v, "the suffix")


# The largest side leantune trains or samples at (every family publishes sizes up to 2048): a typo like
# 100000 would allocate its buckets' latents until MemoryError, or overflow the sampling schedule.
MAX_RESOLUTION = 4096


def check_side(v: int) -> int:
    """An image side (px) at most MAX_RESOLUTION: the one upper bound of [sample] and `leantune sample`."""
    if v > MAX_RESOLUTION:
        raise ValueError(f"{v} is too large: image sides are at most {MAX_RESOLUTION} px")
    return v


# Bounds of the video keys of [data]: a typo (1600 fps, 100001 frames) would otherwise show only as a
# clip set where every clip is too short, or a frame bucket whose latents do not fit any GPU.
MAX_TARGET_FPS = 240
MAX_CLIP_FRAMES = 1025


class DataConfig(Section):
    datasets: list[DatasetConfig] = Field(min_length=1)
    resolutions: list[int] = [512]
    batch_size: int = Field(1, ge=1)
    cache_dir: str = "cache"
    max_text_length: int = Field(512, ge=1, le=512)
    shuffle: bool = True
    # --resume after images were added or removed: continue at the start of the next epoch (the
    # saved batch order cannot continue); without it such a resume is refused with this advice.
    allow_dataset_change: bool = False
    # Regularisation ([[data.datasets]] role = "prior"; train/priors.py): the share of steps that
    # train on a prior batch, and its loss: "plain" (the images' own flow-matching loss, DreamBooth's
    # prior preservation) or "dop" (differential output preservation: the target is the base
    # model's own prediction with the trained adapter off), weighted by prior_weight.
    prior_ratio: float = Field(0.25, gt=0.0, lt=1.0)
    prior_loss: Literal["plain", "dop"] = "plain"
    prior_weight: float = Field(1.0, gt=0.0, le=100.0)
    # Video clips (data/video.py): the rate clips are resampled to (nearest source frame per output
    # time; Wan 2.1 and 2.2 A14B train at 16 fps, Wan 2.2 TI2V-5B at 24), and the most frames a clip
    # trains with: a 4k+1 length, as Wan's VAE encodes the first frame alone and then 4 per latent
    # frame. Each clip trains at the longest 4k+1 window it holds at target_fps, up to max_frames.
    target_fps: float = 16.0
    max_frames: int = 81

    @field_validator("target_fps")
    @classmethod
    def _target_fps(cls, v: float) -> float:
        if not 0 < v <= MAX_TARGET_FPS:
            raise ValueError(f"target_fps = {v:g} is not a frame rate: clips are resampled to a rate above 0 and at "
                             f"most {MAX_TARGET_FPS} fps (Wan trains at 16 or 24)")
        return v

    @field_validator("max_frames")
    @classmethod
    def _max_frames(cls, v: int) -> int:
        if v < 5 or (v - 1) % 4:
            lower = max(5, (v - 1) // 4 * 4 + 1)
            hint = f"use {lower} or {lower + 4}" if v >= 5 else "the shortest clip is 5 frames"
            raise ValueError(f"max_frames = {v} is not a clip length Wan's VAE encodes: 4k+1 frames of at least 5 "
                             f"(5, 9, ..., 81); {hint}")
        if v > MAX_CLIP_FRAMES:
            raise ValueError(f"max_frames = {v} is too long: clips train at most {MAX_CLIP_FRAMES} frames "
                             f"(Wan 2.2 generates 81 or 121)")
        return v

    @model_validator(mode="after")
    def _prior_keys(self):
        roles = [d.role for d in self.datasets]
        if "prior" in roles and "train" not in roles:
            raise ValueError("every [[data.datasets]] has role = \"prior\": a run needs at least one dataset to train "
                             "on (role = \"train\", the default) beside its prior images")
        if "prior" not in roles:
            for key in ("prior_ratio", "prior_loss", "prior_weight"):
                if key in self.model_fields_set:
                    raise ValueError(f"{key}: set, but no [[data.datasets]] has role = \"prior\"; add a dataset of "
                                     f"prior (class) images with role = \"prior\", or remove {key}")
        return self

    @field_validator("resolutions")
    @classmethod
    def _resolutions(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("needs at least one resolution")
        for r in v:
            if r < 64 or r % 16:
                raise ValueError(f"{r} is not a multiple of 16 of at least 64")
            if r > MAX_RESOLUTION:
                raise ValueError(f"{r} is too large: resolutions are at most {MAX_RESOLUTION} (Flux.1 and SD3.5 "
                                 f"train at 512 to 2048)")
        return v


class LoraConfig(Section):
    # The adapter (train/adapter_types.py), each through peft's own implementation: "lora" (A, B),
    # "dora" (LoRA with a learned magnitude per output row), "lokr" (Kronecker product of two
    # factors), "loha" (Hadamard product of two low-rank pairs). rank and alpha mean each type's r
    # and alpha (scale alpha / rank).
    type: Literal["lora", "lokr", "loha", "dora"] = "lora"
    rank: int = Field(16, ge=1)
    # default: equal to rank; 0 would train nothing, inf/NaN would make every weight NaN
    alpha: float | None = Field(None, gt=0)
    # all_linear: "all" plus the Linears outside the blocks (embedders, final layer)
    targets: Literal["attention", "attention_mlp", "all", "all_linear"] = "attention_mlp"
    # Optional block selection per block list, e.g. {double = [0, 1, 2], single = []} (Flux) or
    # {joint = [0, 1]} (SD3); absent = all.
    blocks: dict[Literal["double", "single", "joint"], list[int]] | None = None
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    init_from: str | None = None         # continue from an existing LoRA file
    # LoKr only: how each side of a Linear is split into the two Kronecker factors (peft's
    # decompose_factor; -1: the split nearest the square root, e.g. 3072 = 48 x 64), and whether the
    # first factor is also a low-rank product (peft's decompose_both; the second is one whenever
    # rank < half its larger side).
    factor: int = -1
    decompose_both: bool = False
    # [model] expert = "both" (Wan 2.2 A14B): "each" trains one LoRA per expert (two files,
    # <name>_high_noise / <name>_low_noise), "shared" one LoRA both experts apply (one file, loaded
    # into both).
    experts: Literal["each", "shared"] = "each"
    # Where the adapters' optimizer step runs (train/lora_host_step.py): "device" (the GPU holds the
    # optimizer state), "host" (the state and an fp32 copy of the adapters live in host RAM; after
    # backward the gradients go to the host, the CPU steps, the updated adapters come back), or
    # "auto": the planner chooses the host step only where no device-step plan fits the budget or
    # where it is faster (without a budget: the device). "adamw" and "adafactor" only.
    optimizer_step: Literal["auto", "device", "host"] = "auto"

    @property
    def effective_alpha(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha)

    @field_validator("factor")
    @classmethod
    def _factor(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"must be -1 (the split nearest the square root) or a positive integer, got {v}")
        return v

    @model_validator(mode="after")
    def _type_options(self):
        if self.type != "lokr":
            for key in ("factor", "decompose_both"):
                if key in self.model_fields_set:
                    raise ValueError(f"[lora] {key} is a LoKr option; it needs [lora] type = \"lokr\" (type is "
                                     f"{self.type!r})")
        if self.type in ("lokr", "loha") and self.dropout > 0:
            raise ValueError(f"[lora] dropout = {self.dropout:g} with [lora] type = {self.type!r}: peft's LoKr and "
                             f"LoHa have no input dropout; set dropout = 0 (or type \"lora\" / \"dora\")")
        return self


# Optimizers taken from their packages that only LoRA training steps (train/optim_packages.py).
PACKAGE_ONLY_LORA = ("prodigy", "schedulefree_adamw", "came")
# Optimizers whose LoRA step may run on the host ([lora] optimizer_step, train/lora_host_step.py).
LORA_HOST_STEP_OPTIMIZERS = ("adamw", "adafactor")


class TrainConfig(Section):
    mode: Literal["lora", "full"] = "lora"     # "full": every (not excluded) transformer weight trains
    steps: int = Field(1000, ge=1)
    learning_rate: float = Field(1e-4, gt=0)    # inf would save a LoRA of NaN (STRICT refuses it)
    # adamw / adafactor: torch's; prodigy, schedulefree_adamw, came: their packages' (LoRA only:
    # train/optim_packages.py); adamw8bit: bitsandbytes' (LoRA on CPU or CUDA; full mode: CUDA)
    optimizer: Literal["adamw", "adafactor", "adamw8bit", "prodigy", "schedulefree_adamw", "came"] = "adamw"
    # Prodigy only (prodigyopt's own names): the coefficient of its step-size estimate d, Adam's
    # bias correction, and d's denominator without lr during warmup
    prodigy_d_coef: float = Field(1.0, gt=0, le=1e6)
    prodigy_use_bias_correction: bool = False
    prodigy_safeguard_warmup: bool = False
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)     # each in [0, 1), as the optimizers require
    eps: float = Field(1e-8, gt=0)
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    gradient_accumulation: int = Field(1, ge=1)
    max_grad_norm: float = Field(1.0, ge=0)   # 0 disables clipping
    seed: int = 42
    mixed_precision: Literal["bf16", "no"] = "bf16"
    # "auto": the family's default (Flux: sigmoid; SD3: shift, with `shift` = 3.0); see flow_matching.py
    timestep_sampling: Literal["auto", "sigmoid", "shift", "flux_shift", "krea2_shift", "uniform"] = "auto"
    # Bounds no recipe reaches (scale 1, shift 3, guidance 1-3.5), far below where the noise levels or
    # the guidance embedding overflow (sigmoid_scale = 1e308 trained on NaN from step 1).
    sigmoid_scale: float = Field(1.0, gt=0, le=100)
    shift: float = Field(3.0, gt=0, le=100)
    guidance: float = Field(1.0, ge=0, le=100)  # distilled guidance input for dev; unused for schnell
    save_every: int = Field(250, ge=0)         # 0: only at the end
    keep_last: int = Field(3, ge=1)
    log_every: int = Field(1, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        """Checked here: the optimizers raise a bare ValueError only once the model is loaded."""
        for b in v:
            if not (0.0 <= b < 1.0):       # false for NaN too
                raise ValueError(f"each beta must be in [0, 1); got {list(v)}")
        return v


class FullConfig(Section):
    """[full]: full fine-tuning ([train] mode = "full"). See train/modes.py and train/fused_optim.py."""

    # fnmatch patterns on diffusers parameter names ("transformer_blocks.3.attn.to_q.weight"):
    # a parameter trains if it matches a `train` pattern and no `exclude` pattern.
    train: list[str] = ["*"]
    exclude: list[str] = []
    state_dtype: Literal["fp32", "bf16"] = "fp32"     # AdamW moments (bf16: stochastically rounded)
    stochastic_rounding: bool = True                  # bf16 weights: round updates stochastically
    master_weights: bool = False                      # fp32 copies of bf16 weights on the host
    grad_clip: Literal["parameter", "none"] = "parameter"   # max_grad_norm per parameter, not global
    save_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"    # dtype of the exported model files
    # Where a streamed block's optimizer step runs: "device" (its state comes with the weights and
    # is written back with them), "host" (its state stays in host RAM, its gradients come to the
    # host and the CPU steps), "auto" (the planner chooses with [memory] vram_budget; else device).
    streamed_step: Literal["auto", "device", "host"] = "auto"

    @field_validator("train")
    @classmethod
    def _some_pattern(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one pattern (\"*\" trains every weight)")
        return v


class MemoryConfig(Section):
    """[memory]: explicit engine choices, or a budget for the planner to decide from."""

    streamed_blocks: int | list[str] | Literal["all"] = 0
    stream_non_blocks: bool = False
    fp8: bool = False
    # fp8 for the modulation/adaLN Linears too. "auto": an fp8 checkpoint's e4m3 modulation weights
    # stay e4m3; a bf16 one is quantized only when the planner finds nothing else fits the budget.
    # true: always (with fp8 = true when no vram_budget is set); false: never, and the loader
    # upcasts a checkpoint's e4m3 modulation weights.
    fp8_modulation: StrictBool | Literal["auto"] = "auto"
    # How the frozen base's block Linears are stored. "auto": as fp8 and the planner decide (without
    # a vram_budget: e4m3 or the load dtype; under one the plan search also prices int8 ConvRot and,
    # where bitsandbytes imports, NF4 for a LoRA, and chooses among the formats within max_base_error);
    # "bf16": the load dtype, pinned; "fp8": e4m3 (fp8 = true); "nf4": bitsandbytes NF4 as the file
    # is read (memory/nf4_storage.py, 4.5 bits per weight; LoRA only); "int8": int8 ConvRot rows as
    # the file is read (memory/int8_storage.py, ComfyUI's int8_convrot layout, 8 bits and a row
    # scale; LoRA only).
    base_format: Literal["bf16", "fp8", "nf4", "int8", "auto"] = "auto"
    # The output error against bf16 (percent, docs/benchmarks.md's tables) a format "auto" chooses
    # may have; None: fp8 e4m3's own (2.52 %), so int8 (0.98 %) is a choice and NF4 (9.23 %) is not.
    max_base_error: float | None = Field(None, gt=0)
    checkpointing: Literal["none", "blocks", "offload"] = "none"
    # Split blocks (memory/split_parts.py; Flux, Wan, Qwen-Image-2.1): each checkpointed block keeps
    # its parts' inputs only and recomputes one part at a time in backward, bitwise the plain block.
    # "auto": the planner's call under a vram_budget (off without one); true: always (needs
    # checkpointing); false: never.
    split_blocks: StrictBool | Literal["auto"] = "auto"
    ring_slots: int = Field(2, ge=2)
    pin_memory: bool = True
    debug_poison: bool = False
    # "auto" (free VRAM), a size ("8GiB", "6 GB"), or None: use the explicit choices above.
    vram_budget: str | None = None
    ram_budget: str | None = None        # default: available host RAM minus a margin
    # The disk tier (memory/disk_tier.py): a folder on a fast disk (NVMe) where the streamed frozen
    # blocks that do not fit ram_budget are kept and read from at each use, instead of host RAM
    # (LoRA training runs and their previews; relative to the config file). None: every streamed block in RAM.
    disk_dir: str | None = None

    @field_validator("vram_budget", "ram_budget")
    @classmethod
    def _size(cls, v, info):
        """Checked with the config, not after caching and model loading."""
        if v is None or (info.field_name == "vram_budget" and v.strip().lower() == "auto"):
            return v
        try:
            size = parse_size(v)
        except ValueError:
            also = ' or "auto"' if info.field_name == "vram_budget" else ""
            raise ValueError(f'{v!r} is not a size like "8GiB" or "512MiB"{also}') from None
        if size <= 0:
            raise ValueError(f"{v!r} is not a positive size")
        return v

    @field_validator("streamed_blocks")
    @classmethod
    def _non_negative(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError("must be >= 0, a list of block names, or \"all\"")
        return v

    @model_validator(mode="after")
    def _split_needs_checkpointing(self):
        if self.split_blocks is True and self.vram_budget is None and self.checkpointing == "none":
            raise ValueError('split_blocks = true recomputes each block part by part in backward, which needs '
                             'checkpointing = "blocks" or "offload" (or a vram_budget for the planner to choose)')
        return self

    @model_validator(mode="before")
    @classmethod
    def _base_format(cls, data):
        """base_format = "fp8" is fp8 = true; a pinned format and an fp8 key that contradicts it, or
        "nf4" without bitsandbytes, are errors that name both keys."""
        if not isinstance(data, dict) or data.get("base_format") not in ("bf16", "fp8", "nf4", "int8"):
            return data                                   # "auto", or a value the Literal names
        fmt, fp8 = data["base_format"], data.get("fp8")
        if fmt == "fp8":
            if fp8 is False:
                raise ValueError('base_format = "fp8" stores the block Linears in e4m3, but fp8 = false: remove one')
            return {**data, "fp8": True}
        if fp8 is True:
            raise ValueError(f'base_format = "{fmt}" and fp8 = true: both say how the block Linears are stored; '
                             f'remove fp8 (or use base_format = "fp8")')
        if fmt == "bf16" and data.get("vram_budget") is not None:
            raise ValueError('base_format = "bf16" with a vram_budget: the planner chooses fp8 storage under a '
                             'budget; use base_format = "auto", or set the [memory] choices without a budget')
        if fmt == "nf4":
            import importlib.util

            if importlib.util.find_spec("bitsandbytes") is None:
                raise ValueError('base_format = "nf4" quantizes with bitsandbytes, which is not installed '
                                 '(pip install "leantune[bnb]")')
        return data


class DistributedConfig(Section):
    """[distributed]: how several processes (GPUs) share a run. See leantune/distributed.py."""

    # auto: "ddp" for LoRA, "fsdp2" for [train] mode = "full"
    strategy: Literal["auto", "ddp", "deepspeed", "fsdp2"] = "auto"
    zero_stage: Literal[2, 3] = 2                  # DeepSpeed ZeRO stage
    offload_optimizer: bool = False                # DeepSpeed: optimizer states in host RAM
    fsdp_cpu_offload: bool = False                 # FSDP2: parameters and gradients in host RAM
    deepspeed_config: str | None = None            # a DeepSpeed JSON file used as written (overrides the keys above)
    backend: Literal["auto", "nccl", "gloo"] = "auto"   # auto: nccl on CUDA, gloo on CPU
    timeout_minutes: int = Field(60, ge=1)         # a collective waits this long for a silent rank
    share_host_weights: bool = True                # ranks of one machine share one host copy of streamed weights
    load_in_turns: bool = True                     # LoRA and FSDP2: ranks of one machine load the model one after another
    allow_world_size_change: bool = False          # resume a checkpoint saved with another process count


class SampleConfig(Section):
    every: int = Field(0, ge=0)          # 0: never during training
    prompts: list[str] = []
    seed: int = 0
    steps: int = Field(20, ge=1)
    guidance: float = Field(3.5, ge=0, le=100)   # Flux dev: distilled guidance; SD3.5: classifier-free guidance scale
    negative_prompt: str = ""            # SD3.5 (classifier-free guidance) only
    # An edit family (qwen-image-edit): reference images every sample is conditioned on; none given:
    # the first dataset target's references
    references: list[str] = []
    width: int = Field(512, ge=16)
    height: int = Field(512, ge=16)
    # A video family (wan2.2): frames of each sampled video, a length its VAE decodes (Wan: 4k+1; 1:
    # a still image); unset: [data] max_frames. An image family samples one frame.
    frames: int | None = Field(None, ge=1, le=1001)
    # The frozen LoRAs previews use instead of [model] base_adapters (None: the same; []: none, e.g.
    # train Z-Image Turbo through its training adapter and preview without it)
    base_adapters: list[AdapterRef] | None = None
    # Another base checkpoint of the same family to preview with (train on Krea 2 Raw, preview with
    # Turbo): a diffusers folder or a single transformer file, loaded for each preview
    base: str | None = None
    # Which checkpoint [sample] base is, where its file cannot say ([model] variant's values): its
    # published schedule samples the previews ("turbo": Krea 2 Turbo's fixed mu)
    base_variant: Literal["auto", "dev", "schnell", "turbo", "base", "raw"] = "auto"

    @field_validator("width", "height")
    @classmethod
    def _multiple_of_16(cls, v: int) -> int:
        if v % 16:
            raise ValueError(f"{v} must be a multiple of 16")
        return check_side(v)


# A run's files are `<name>-step000123_diffusers.safetensors`: the name leaves room for that suffix
# within the 255 bytes a file name may have, so the last save cannot fail on a long name.
MAX_NAME_BYTES = 200


class OutputConfig(Section):
    dir: str = "output"
    name: str = "lora"          # the first part of every file name the run writes in `dir`
    formats: list[Literal["comfyui", "diffusers"]] = ["comfyui", "diffusers"]

    @field_validator("name")
    @classmethod
    def _one_file_name(cls, v: str) -> str:
        file_name_part(v, "the name")
        if len(v.encode()) > MAX_NAME_BYTES:
            raise ValueError(f"the name is {len(v.encode())} bytes long; at most {MAX_NAME_BYTES} (the files add "
                             f"'-step000123_diffusers.safetensors' to it, and file names have at most 255 bytes)")
        return v


class EmaConfig(Section):
    """[ema]: an average of the trained adapter weights in host RAM, written beside the live LoRA
    (train/ema.py)."""

    enabled: StrictBool = False
    decay: float = Field(0.999, gt=0.0, lt=1.0)   # per update; 0.999 averages over ~1000 updates
    every: int = Field(1, ge=1)                     # optimizer steps between updates
    sample: StrictBool = False                      # draw the training samples from the average


class ValidationConfig(Section):
    """[validation]: a held-out set whose loss is measured every `every` steps at fixed noise levels
    and fixed noise (train/validation.py), so its curve compares across runs and recipes."""

    path: str | None = None        # a folder of images with same-stem captions, never trained on
    fraction: float | None = Field(None, gt=0.0, le=0.5)   # or this share of the training images, held out
    every: int = Field(100, ge=1)
    # the noise levels each held-out image is measured at (the mean over them is the loss)
    sigmas: list[float] = Field([0.1, 0.3, 0.5, 0.7, 0.9], min_length=1, max_length=32)
    seed: int = 0                  # the noise drawn for each image and level

    @field_validator("sigmas")
    @classmethod
    def _levels(cls, v: list[float]) -> list[float]:
        for s in v:
            if not (0.0 < s < 1.0):          # false for NaN too
                raise ValueError(f"each noise level is in (0, 1); got {s}")
        return v

    @model_validator(mode="after")
    def _one_source(self):
        if self.path is not None and self.fraction is not None:
            raise ValueError("path and fraction: set both; the held-out images are a folder (path) or a share of "
                             "the training images (fraction), not both")
        if self.model_fields_set and self.path is None and self.fraction is None:
            raise ValueError("needs path (a folder of held-out images) or fraction (a share of the training "
                             "images, e.g. 0.1)")
        return self

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.fraction is not None


class RunConfig(Section):
    model: ModelConfig
    data: DataConfig
    lora: LoraConfig = LoraConfig()
    full: FullConfig = FullConfig()
    train: TrainConfig = TrainConfig()
    memory: MemoryConfig = MemoryConfig()
    distributed: DistributedConfig = DistributedConfig()
    sample: SampleConfig = SampleConfig()
    validation: ValidationConfig = ValidationConfig()
    ema: EmaConfig = EmaConfig()
    output: OutputConfig = OutputConfig()

    # Where relative paths in the file are resolved from (the TOML file's folder).
    base_dir: str = Field(".", exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _full_mode_formats(cls, data):
        """Full mode writes the BFL / ComfyUI single file unless [output] formats asks for more: a
        diffusers folder is a second copy of the whole model on disk."""
        if isinstance(data, dict) and isinstance(data.get("train"), dict) and data["train"].get("mode") == "full":
            out = data.get("output")
            if isinstance(out, dict) and "formats" not in out:
                data = {**data, "output": {**out, "formats": ["comfyui"]}}
            elif out is None:
                data = {**data, "output": {"formats": ["comfyui"]}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _family_defaults(cls, data):
        """SD3: [data] max_text_length defaults to 256 T5 tokens (StableDiffusion3Pipeline's
        max_sequence_length); SD3 keeps every token (no trimming), so the default is what it trains on."""
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and data["model"].get("family") == "sd3":
            d = data.get("data")
            if isinstance(d, dict) and "max_text_length" not in d:
                data = {**data, "data": {**d, "max_text_length": 256}}
        return data

    @model_validator(mode="after")
    def _negative_prompt_family(self):
        if self.sample.negative_prompt and self.model.family in ("flux", "flux2-dev"):
            raise ValueError("[sample] negative_prompt: Flux samples with distilled guidance (no classifier-free "
                             "guidance), so a negative prompt would have no effect; remove it")
        return self

    @model_validator(mode="after")
    def _sample_base_variant(self):
        """[sample] base_variant names a kind of [sample] base the family has (as [model] variant)."""
        v = self.sample.base_variant
        if v == "auto":
            return self
        if self.sample.base is None:
            raise ValueError(f"[sample] base_variant = \"{v}\": set, but [sample] base is not; it says which "
                             f"checkpoint that other base is (the trained base's is [model] variant)")
        check_variant(f'[sample] base_variant = "{v}"', v, self.model.family)
        return self

    @model_validator(mode="after")
    def _lora_block_kinds(self):
        """[lora] blocks names the family's block lists (Flux: double, single; SD3: joint)."""
        kinds = FAMILIES[self.model.family].lora_blocks
        for kind in (self.lora.blocks or {}):
            if kind not in kinds:
                raise ValueError(f"[lora] blocks: {kind!r} is not a block list of family = \"{self.model.family}\"; "
                                 f"it has {', '.join(kinds)}")
        return self

    @model_validator(mode="after")
    def _two_experts(self):
        """[lora] experts says how [model] expert = "both" trains; what that run cannot do yet is named."""
        if "experts" in self.lora.model_fields_set and self.model.expert != "both":
            raise ValueError(f"[lora] experts = {self.lora.experts!r}: set, but [model] expert = "
                             f"{self.model.expert!r} trains one transformer; it says how [model] expert = \"both\" "
                             f"(Wan 2.2 A14B's two experts in one run) trains them: remove it or set expert = \"both\"")
        if self.model.expert != "both":
            return self
        refused = (("[train] mode = \"full\"", self.train.mode == "full", "full fine-tuning trains one expert: set "
                    "[model] expert = \"high\" or \"low\""),
                   ("[ema] enabled = true", self.ema.enabled, "remove [ema]"),
                   ("[model] base_adapters", bool(self.model.base_adapters), "remove the key"),
                   ("[sample] base", self.sample.base is not None, "remove the key"),
                   ("[sample] base_adapters", self.sample.base_adapters is not None, "remove the key"),
                   ("[data] prior_loss = \"dop\"", self.data.prior_loss == "dop", "use prior_loss = \"plain\""))
        for key, found, fix in refused:
            if found:
                raise ValueError(f"{key} with [model] expert = \"both\": a two-expert run trains LoRAs on both "
                                 f"experts without it; {fix}")
        return self

    @model_validator(mode="after")
    def _disk_dir(self):
        """[memory] disk_dir names an existing folder this user can write, of a run that streams
        frozen blocks: checked now, not when the engine packs the first block."""
        d = self.memory.disk_dir
        if d is None:
            return self
        if self.train.mode == "full":
            raise ValueError(f"[memory] disk_dir = {d!r}: the disk tier holds frozen streamed blocks, but [train] "
                             f"mode = \"full\" trains (and writes back) every streamed block; remove disk_dir")
        check_disk_dir(self.resolve(d), f"[memory] disk_dir = {d!r}")
        return self

    @model_validator(mode="after")
    def _mode_sections(self):
        """A [lora] key in full mode, a [full] key in LoRA mode, fp8 over trainable weights, an
        optimizer the mode lacks: each is an error that names the key (they would be ignored or fail
        late otherwise)."""
        mem = self.memory
        if mem.fp8_modulation is True and not mem.fp8 and mem.vram_budget is None:
            raise ValueError("[memory] fp8_modulation = true stores the modulation Linears in fp8 on top of the other "
                             "block Linears: set [memory] fp8 = true as well (or a vram_budget, and the planner "
                             "decides fp8)")
        mode = self.train.mode
        if mode == "full":
            if self.data.prior_loss == "dop":
                raise ValueError("[data] prior_loss = \"dop\": its target is the model with the trained adapter off, "
                                 "but [train] mode = \"full\" trains no adapter; use prior_loss = \"plain\" or train "
                                 "a LoRA")
            if self.ema.enabled:
                raise ValueError("[ema] enabled = true: an average is kept of adapter weights, but [train] mode = "
                                 "\"full\" trains the whole model (a host copy of it in fp32 would be the largest "
                                 "thing in the run); remove [ema] or train a LoRA")
            if self.model.base_adapters:
                raise ValueError("[model] base_adapters: set, but [train] mode = \"full\" trains the base weights "
                                 "themselves; base adapters are frozen LoRAs under a trained LoRA ([train] mode = "
                                 "\"lora\"), or merge the LoRA into the checkpoint first")
            for key in ("base_adapters", "base"):
                if getattr(self.sample, key) is not None:
                    raise ValueError(f"[sample] {key}: set, but [train] mode = \"full\" previews the weights it "
                                     f"trains; another base or adapter stack for previews is for [train] mode = "
                                     f"\"lora\"; remove the key")
            if self.distributed.strategy == "ddp":
                raise ValueError("[distributed] strategy = \"ddp\" with [train] mode = \"full\": a full fine-tune "
                                 "steps each weight inside backward, before gradients could be summed across "
                                 "processes; use \"deepspeed\" (ZeRO-2) or \"fsdp2\" (or \"auto\")")
            if self.lora.model_fields_set:
                key = sorted(self.lora.model_fields_set)[0]
                raise ValueError(f"[lora] {key}: set, but [train] mode = \"full\" trains the weights themselves, "
                                 f"not an adapter; remove the [lora] section (or set [train] mode = \"lora\")")
            if self.memory.fp8 and not self.full.exclude:
                raise ValueError("[memory] fp8 = true with [train] mode = \"full\": fp8 storage holds frozen weights "
                                 "only and every weight trains; set [memory] fp8 = false, or freeze a part with "
                                 "[full] exclude (only frozen block Linears are stored in fp8)")
            if self.full.streamed_step == "host" and self.train.optimizer == "adamw8bit":
                raise ValueError("[full] streamed_step = \"host\" with [train] optimizer = \"adamw8bit\": "
                                 "bitsandbytes keeps its 8-bit state on the GPU and steps there; use \"adamw\" "
                                 "(fp32 or bf16 moments) or \"adafactor\" for a host step, or streamed_step = "
                                 "\"device\"")
        else:
            if self.lora.optimizer_step == "host" and self.train.optimizer not in LORA_HOST_STEP_OPTIMIZERS:
                raise ValueError(f"[lora] optimizer_step = \"host\" with [train] optimizer = {self.train.optimizer!r}: "
                                 f"the host step runs {' and '.join(LORA_HOST_STEP_OPTIMIZERS)} (bitsandbytes keeps "
                                 f"8-bit state on the GPU; schedule-free AdamW's averaged weights would live on the "
                                 f"host); use one of those or [lora] optimizer_step = \"device\"")
            if self.full.model_fields_set:
                key = sorted(self.full.model_fields_set)[0]
                raise ValueError(f"[full] {key}: set, but [train] mode = \"lora\"; set [train] mode = \"full\" "
                                 f"or remove the [full] section")
            if self.distributed.strategy in ("deepspeed", "fsdp2"):
                raise ValueError(f"[distributed] strategy = {self.distributed.strategy!r} shards a full fine-tune; "
                                 f"LoRA training uses \"ddp\" (or \"auto\"): set [train] mode = \"full\" or "
                                 f"[distributed] strategy = \"ddp\"")
            if self.lora.type == "dora" and (self.memory.fp8 or self.memory.fp8_modulation is True):
                key = "fp8" if self.memory.fp8 else "fp8_modulation"
                raise ValueError(f"[lora] type = \"dora\" with [memory] {key} = true: DoRA normalises every row of the "
                                 "base weight plus its update, and peft reads the base weight as stored, so an fp8 "
                                 f"weight would be taken without its scale; set [memory] {key} = false (the planner "
                                 f"never stores a DoRA base in fp8), or use [lora] type \"lora\", \"lokr\" or \"loha\"")
        self._distributed_storage()
        return self

    @model_validator(mode="after")
    def _optimizer_keys(self):
        """The optimizer's own keys and the combinations that make no sense, each named (they would
        be ignored or fail once the model is loaded otherwise). See train/optim_packages.py."""
        tc = self.train
        if self.train.mode == "full" and tc.optimizer in PACKAGE_ONLY_LORA:
            raise ValueError(f"[train] optimizer = {tc.optimizer!r} is for [train] mode = \"lora\": a full fine-tune "
                             f"steps each weight inside backward with its own update (train/fused_optim.py), which "
                             f"has \"adamw\", \"adafactor\" and \"adamw8bit\"")
        if tc.optimizer != "prodigy":
            for key in sorted(k for k in tc.model_fields_set if k.startswith("prodigy_")):
                raise ValueError(f"[train] {key}: set, but [train] optimizer = {tc.optimizer!r}; it is a Prodigy "
                                 f"setting (optimizer = \"prodigy\"): remove it")
        if tc.optimizer == "schedulefree_adamw" and tc.lr_scheduler != "constant":
            raise ValueError(f"[train] lr_scheduler = {tc.lr_scheduler!r} with [train] optimizer = "
                             f"\"schedulefree_adamw\": schedule-free AdamW replaces the schedule (it averages its "
                             f"iterates instead of decaying the rate); use lr_scheduler = \"constant\" (warmup_steps "
                             f"is its own warmup)")
        if tc.optimizer == "came" and "eps" in tc.model_fields_set:
            raise ValueError("[train] eps: set, but [train] optimizer = \"came\" uses its own two regularisation "
                             "constants (1e-30 for the squared gradient, 1e-16 for the instability); remove it")
        return self

    def _distributed_storage(self) -> None:
        """Streaming and FSDP / ZeRO-3 both own where parameters live: refuse the combination by key."""
        d, m = self.distributed, self.memory
        full = self.train.mode == "full"
        shards_params = d.strategy == "fsdp2" or (full and d.strategy == "deepspeed" and d.zero_stage == 3)
        if shards_params and (m.streamed_blocks not in (0, [], "none") or m.stream_non_blocks):
            what = "zero_stage = 3" if d.strategy == "deepspeed" else f"strategy = \"{d.strategy}\""
            raise ValueError(f"[distributed] {what} with [memory] streamed_blocks / stream_non_blocks: both would own "
                             f"where the weights live; use [distributed] strategy = \"deepspeed\" with zero_stage = 2 "
                             f"(resident weights, sharded optimizer), or stream without sharding")

    def resolve(self, path: str | None) -> Path | None:
        """A path from the config, relative to the TOML file's folder."""
        return resolve_path(self.base_dir, path)


# -- loading ---------------------------------------------------------------------------------------

def _section_model(loc: tuple, root: type[BaseModel] | None = None) -> type[BaseModel] | None:
    """The pydantic model that owns the key at `loc` (to suggest valid keys)."""
    model: Any = root or RunConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        candidates = [ann, *(inner or ())]
        nxt = None
        for c in candidates:
            if isinstance(c, type) and issubclass(c, BaseModel):
                nxt = c
        if nxt is None:
            return None
        model = nxt
    return model


def _format_loc(loc: tuple) -> tuple[str, str]:
    """('data', 'datasets', 0, 'path') -> section '[[data.datasets]] #1', key 'path'."""
    parts = [p for p in loc]
    key = str(parts[-1]) if parts else ""
    sect_parts = parts[:-1]
    if len(sect_parts) >= 2 and isinstance(sect_parts[-1], int):
        name = ".".join(str(p) for p in sect_parts[:-1])
        return f"[[{name}]] #{sect_parts[-1] + 1}", key
    if not sect_parts:
        return "top level", key
    return "[" + ".".join(str(p) for p in sect_parts if not isinstance(p, int)) + "]", key


def error_messages(err: ValidationError, source: str, root: type[BaseModel] | None = None) -> list[str]:
    """One line per problem: file, section, key, what is wrong, and a spelling hint for unknown keys."""
    out = []
    for e in err.errors():
        loc = tuple(e["loc"])
        # Drop pydantic's union branch tags ("int", "list[str]", "literal[...]") from locations.
        loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in ("int", "str", "float", "bool"))))
        item = ""
        if len(loc) >= 2 and isinstance(loc[-1], int):        # ('train', 'betas', 1): the key, its item 2
            item, loc = f" item {loc[-1] + 1}", loc[:-1]
        section, key = _format_loc(loc)
        if e["type"] == "extra_forbidden":
            owner = _section_model(loc, root)
            hint = ""
            if owner is not None:
                valid = [k for k in owner.model_fields if k != "base_dir"]
                close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
                hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid)}"
            out.append(f"{source}: {section}: unknown key '{key}'{hint}")
        elif not loc and e["type"] == "value_error":      # a cross-section check: its message names the keys
            out.append(f"{source}: {e['msg'].removeprefix('Value error, ')}")
        elif e["type"] == "missing":
            out.append(f"{source}: {section}: missing required key '{key}'")
        else:
            where = f"{section}: key '{key}'{item}" if key else section
            out.append(f"{source}: {where}: {e['msg']} (got {e.get('input')!r})")
    return sorted(set(out), key=out.index)


def _parse_value(text: str) -> Any:
    """A `--set` value as TOML would read it; bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str], source: str = "--set") -> dict:
    """Apply `section.key=value` overrides to raw TOML data (a new dict is returned)."""
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source} {item!r}: expected section.key=value")
        dotted, value = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = data
        for i, p in enumerate(parts[:-1]):
            node = _override_step(node, p, parts[:i], item, source, last=False)
        _override_step(node, parts[-1], parts[:-1], item, source, last=True, value=_parse_value(value.strip()))
    return data


def _override_step(node, part: str, before: list[str], item: str, source: str, last: bool, value: Any = None):
    """One dotted part of a `--set` key: a list takes an index (0-based, within its length), a
    table a key; anything else is a `ConfigError` naming the override."""
    where = ".".join(before) or "top level"
    if isinstance(node, list):
        if not part.isdigit() or int(part) >= len(node):
            table = f"[[{where}]]"
            raise ConfigError(f"{source} {item!r}: {where} is a list of {len(node)} {table} table(s); "
                              f"use an index from 0 to {len(node) - 1} (got {part!r})")
        if last:
            node[int(part)] = value
            return None
        return node[int(part)]
    if not isinstance(node, dict):
        raise ConfigError(f"{source} {item!r}: {where} is a value ({node!r}), not a table with keys")
    if last:
        node[part] = value
        return None
    return node.setdefault(part, {})


def check_disk_dir(path: Path, key: str) -> None:
    """The disk tier's folder (`key`: where it was given, "[memory] disk_dir = ..." or a flag) must
    be an existing folder this user can create files in."""
    import os

    if not path.exists():
        raise ValueError(f"{key}: {path} does not exist; create the folder (on a fast disk) or remove the key")
    if not path.is_dir():
        raise ValueError(f"{key}: {path} is not a folder")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: {path} is not writable by this user; the disk tier writes its file of streamed "
                         f"blocks there")


def resolve_path(base_dir: str | Path, path: str | None) -> Path | None:
    """A path from a config file, relative to the file's folder `base_dir` (`~` expanded)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def validate_model(model: type[BaseModel], data: dict, source: str, base_dir: str | Path, title: str):
    """Validate raw TOML data against a strict model whose `base_dir` field is set from the file."""
    if "base_dir" in data:
        raise ConfigError(f"{source}: top level: unknown key 'base_dir'")
    try:
        return model.model_validate({**data, "base_dir": str(base_dir)})
    except ValidationError as err:
        raise ConfigError(f"invalid {title}:\n  " + "\n  ".join(error_messages(err, source, model))) from None


def validate(data: dict, source: str = "<config>", base_dir: str | Path = ".") -> RunConfig:
    return validate_model(RunConfig, data, source, base_dir, "configuration")


def read_toml(path: str | Path, what: str = "config file") -> dict:
    """Raw TOML data of a file; errors name the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {what}: {e.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read and validate a run's TOML file; errors name the file, the section and the key."""
    path = Path(path)
    data = apply_overrides(read_toml(path), overrides or [])
    return validate(data, source=str(path), base_dir=path.parent.resolve())


def parse_size(text: str) -> int:
    """'8GiB' / '6 GB' / '512MiB' / '1.5g' / '8' -> bytes. GB and GiB both mean 2**30: cards are sold so.

    A bare number is GiB ("--vram 8" is an 8 GiB card, never 8 bytes); bytes need an explicit "B".
    """
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a size like '8GiB' or '512MiB'")
    unit = m.group(2).lower()
    if not unit and not m.group(3):
        unit = "g"
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[unit]
    return int(float(m.group(1)) * scale)
