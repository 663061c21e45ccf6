"""What `leantune sample` is asked to do: a strict schema shared by the TOML form and the flags.

`leantune sample request.toml` and `leantune sample --model PATH --prompt ...` build the same
`SampleRequest`: flags are applied to the raw TOML data before validation, so both are checked by
one schema. Unknown keys are errors that name the file and the key.

    prompts = ["a photo of sks dog on a beach"]
    seed = 42
    steps = 28                 # default: 28 for dev and SD3.5, 4 for schnell
    guidance = 3.5             # Flux dev: distilled guidance (schnell ignores it); SD3.5: CFG scale, default 7.0
    negative_prompt = ""       # SD3.5 (classifier-free guidance) only
    width = 1024
    height = 1024
    out = "samples"
    references = ["before.png"]  # an edit family (qwen-image-edit): reference images every prompt sees
    frames = 81                # a video family (wan2.2): one .mp4 + .webp + .json per prompt and seed

    [model]
    path = "/models/FLUX.1-dev"

    [[model.base_adapters]]      # frozen LoRAs under the [[lora]] ones (a turbo base's adapter)
    path = "turbo-lora.safetensors"
    strength = 1.0

    [[lora]]
    path = "output/my-lora.safetensors"
    strength = 0.8

    [memory]
    vram_budget = "6GiB"       # the planner streams / stores fp8 to fit; omit for fully resident
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from ..config import (
    STRICT,
    ConfigError,
    MemoryConfig,
    ModelConfig,
    apply_overrides,
    check_side,
    read_toml,
    validate_model,
)


class _Strict(BaseModel):
    model_config = STRICT          # the run config's rules: unknown keys and inf / NaN refused


# LoRAs are trained for strengths around 1; beyond this the outputs overflow to black or noise.
MAX_LORA_STRENGTH = 10.0


class LoraRef(_Strict):
    path: str
    strength: float = Field(1.0, allow_inf_nan=True)    # refused below, in words about LoRA strengths

    @field_validator("strength")
    @classmethod
    def _sane_strength(cls, v: float) -> float:
        import math

        if not math.isfinite(v):
            raise ValueError(f"LoRA strength must be a finite number (got {v})")
        if abs(v) > MAX_LORA_STRENGTH:
            raise ValueError(f"LoRA strength {v:g} is outside -{MAX_LORA_STRENGTH:g}..{MAX_LORA_STRENGTH:g}; "
                             f"LoRAs are made for strengths around 1")
        return v


class SampleRequest(_Strict):
    model: ModelConfig
    prompts: list[str] = Field(min_length=1)
    seed: int = 0                              # image i of the request uses seed + i
    images_per_prompt: int = Field(1, ge=1)
    steps: int | None = Field(None, ge=1)      # None: the variant's default
    guidance: float | None = Field(None, ge=0, le=100)  # None: the family's default (Flux dev 3.5, SD3.5 CFG 7.0)
    negative_prompt: str = ""                   # classifier-free guidance (SD3.5); one for every image
    width: int = 1024
    height: int = 1024
    lora: list[LoraRef] = []
    # Another transformer checkpoint of [model]'s family to sample on, with [model]'s text encoders
    # and VAE (as [sample] base in a training run: models/other_base.py)
    base: str | None = None
    # Reference images (paths) every image is conditioned on, for an edit family (infer/references.py)
    references: list[str] = []
    # Frames per sample: 1 writes PNG images; more, for a video family only, one video per prompt
    # and seed (a length its VAE decodes: 4k+1 for Wan), written as .mp4 with a .webp preview
    frames: int = Field(1, ge=1)
    memory: MemoryConfig = MemoryConfig()
    max_text_length: int = Field(512, ge=1, le=512)
    batch_size: int | None = Field(None, ge=1)  # images per transformer forward; None: all at once
    vae_tiling: Literal["auto", "on", "off"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    out: str = "samples"

    # Where relative paths are resolved from (the TOML file's folder, or the working directory).
    base_dir: str = Field(".", exclude=True)

    @field_validator("prompts")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        for i, p in enumerate(v):
            if not p.strip():
                raise ValueError(f"prompt #{i + 1} is empty")
        return v

    @field_validator("width", "height")
    @classmethod
    def _size(cls, v: int, info) -> int:
        if v < 16 or v % 16:
            raise ValueError(f"{info.field_name} = {v} must be a positive multiple of 16")
        return check_side(v)      # 100000 overflowed the schedule's shift (math.exp) before any model loaded

    @field_validator("frames")
    @classmethod
    def _frames(cls, v: int, info) -> int:
        """Checked against [model]'s family here, so a bad length is refused before any model is read."""
        model = info.data.get("model")
        if v == 1 or model is None:            # [model] itself invalid: its own error says why
            return v
        from ..models.family import get_family

        family = get_family(model.family)
        if family.video is None:
            raise ValueError(f"frames = {v}: family \"{family.name}\" samples images, not videos; "
                             f"remove frames (or set it to 1)")
        try:
            family.video.latent_frames(v)
        except ValueError as e:
            raise ValueError(f"frames = {v}: {e}") from None
        return v

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def expanded_prompts(self) -> list[str]:
        """Every image's prompt, in output order: each prompt `images_per_prompt` times."""
        return [p for p in self.prompts for _ in range(self.images_per_prompt)]

    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(len(self.prompts) * self.images_per_prompt)]


def validate_request(data: dict, source: str = "<request>", base_dir: str | Path = ".") -> SampleRequest:
    return validate_model(SampleRequest, data, source, base_dir, "sample request")


def read_request_file(path: str | Path) -> dict:
    """Raw TOML data of a request file; errors name the file."""
    return read_toml(path, "sample request")


def load_request(path: str | Path, overrides: list[str] | None = None) -> SampleRequest:
    """Read and validate a request TOML; `overrides` are `key=value` strings applied first."""
    path = Path(path)
    data = apply_overrides(read_request_file(path), overrides or [])
    return validate_request(data, str(path), path.parent.resolve())


def parse_lora_arg(text: str) -> dict:
    """'file.safetensors:0.8' -> {'path': 'file.safetensors', 'strength': 0.8}; no suffix means 1.0.

    Only a trailing number counts as a strength, so 'C:\\loras\\a.safetensors' stays a path. A
    strength after another ('a.safetensors:1:2') is a ConfigError, unless that path is a file.
    """
    path, sep, tail = text.rpartition(":")
    if sep:
        try:
            strength = float(tail)
        except ValueError:
            return {"path": text, "strength": 1.0}
        head, inner, middle = path.rpartition(":")
        if inner and _is_number(middle) and not Path(path).expanduser().is_file():
            raise ConfigError(f"--lora {text!r}: too many ':' parts; give FILE or FILE:STRENGTH (e.g. {head}:0.8)")
        return {"path": path, "strength": strength}
    return {"path": text, "strength": 1.0}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
