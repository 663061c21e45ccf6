"""The planner's inputs: what runs (`Workload`) and what it may use (`Budget`).

Kept apart from the search so that every part of the planner (the memory model, calibration, the
out-of-memory guard) can speak of workloads and budgets without importing the search itself.
`InfeasibleBudget` lives here too: it is the answer "this budget is too small for this workload",
and both the search and the code that re-plans after a measurement raise or catch it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from ..host import host_ram
from .machine import GiB, Machine
from ..memory.monitor import host_rss
from ..memory.plan import Plan

MiB = 2**20
Mode = Literal["lora", "full", "inference"]


@dataclass(frozen=True)
class Workload:
    """What is trained (or sampled): everything besides the plan that decides memory and time."""

    mode: Mode = "lora"
    rank: int = 16
    targets: str = "attention_mlp"
    # [lora] type (train/adapter_types.py) and LoKr's [lora] factor / decompose_both: the adapter's
    # parameter shapes and the activations its layers keep
    adapter: Literal["lora", "dora", "lokr", "loha"] = "lora"
    lokr_factor: int = -1
    lokr_decompose_both: bool = False
    lora_blocks: dict[str, list[int]] | None = None
    optimizer: Literal["adamw", "adafactor", "adamw8bit", "prodigy", "schedulefree_adamw", "came", "sgd"] = "adamw"
    batch_size: int = 1
    buckets: tuple[tuple[int, int], ...] = ((1024, 1024),)   # (height, width) in pixels
    text_length: int = 512
    # Reference images every sample is conditioned on (an edit family whose probe prices them,
    # ModelFamily.probe_inputs' `references`), each at the family's reference size: their slots
    # lengthen the text and their latent tokens the image sequence. 0: text to image
    references: int = 0
    # Latent frames per sample (a video family, ModelFamily.video: Wan's 81 frames are 21); each
    # frame is a bucket's image tokens again, so tokens = latent frames x patches. 1: an image
    frames: int = 1
    gradient_accumulation: int = 1
    autocast: bool = True           # bf16 autocast, as the trainer's mixed_precision = "bf16"
    lora_dropout: float = 0.0
    dtype: torch.dtype = torch.bfloat16   # storage and compute dtype of the frozen weights
    allow_fp8: bool = True          # fp8 storage of frozen block weights is acceptable
    # fp8 storage of the modulation Linears too: None lets the planner use it only when no plan
    # without it fits; True: every plan; False: never ([memory] fp8_modulation "auto"/true/false).
    fp8_modulation: bool | None = None
    # Split blocks ([memory] split_blocks): None lets the search try both where the family has them;
    # True: only split plans (each checkpointed); False: none.
    split_blocks: bool | None = None
    # The formats quantized block Linears may take (planner/base_formats.py): "auto" prices fp8,
    # int8 and NF4 for a LoRA; the search chooses among those whose measured error against bf16 is
    # within `max_base_error` (percent; None: fp8 e4m3's own). `base_pinned`: [memory] base_format
    # names one (the only entry): every plan stores the block Linears so, whatever its error.
    base_formats: tuple[str, ...] = ("fp8",)
    max_base_error: float | None = None
    base_pinned: bool = False
    host_cache_bytes: int = 0       # caches held in host RAM during training
    # Frozen adapters under the trained one ([model] / [sample] base_adapters, train/base_adapters.py;
    # for `leantune sample`, its LoRAs too): the bytes of all their weights (fp32) ...
    frozen_adapter_bytes: int = 0
    # ... and, of those, the base adapters' weights as (module name, bytes) (base_adapters.unit_tensors):
    # a weight in a streamed block (or in the non-block group when it streams) travels in that unit,
    # as the engine packs it (memory/streaming_units.streams_with_unit); the rest of
    # frozen_adapter_bytes is resident on the device
    frozen_adapter_tensors: tuple[tuple[str, int], ...] = ()
    # Recipe options' extra work and holdings (train/ema.py, train/priors.py, train/validation.py):
    # [ema]: an fp32 shadow of every trained adapter parameter in host RAM during the steps
    ema: bool = False
    # [data] prior_loss = "dop": the share of steps that are prior steps, each one more forward of
    # the model without a graph (the base's prediction, trained adapter off) before the step's own
    dop_share: float = 0.0
    # [validation]: forwards without a graph per training step, averaged (held-out images x noise
    # levels / every); 0 when the held-out count is unknown at plan time (then not priced)
    validation_forwards_per_step: float = 0.0
    # Another base the previews sample on ([sample] base, infer/preview_base.py): the transformer's
    # bytes as loaded, in host RAM beside the training model while a preview runs (0: none)
    preview_base_bytes: int = 0
    # A model of parts that compute one at a time (memory/switched.py: [model] expert = "both", Wan 2.2
    # A14B's two experts): the parts besides the priced one, waiting on the host as stored through
    # the run, and the adapter sets besides its own that stay on the device with their optimizer
    # state (one per other part for [lora] experts = "each"; 0 when shared). Their gradients are
    # never alive with the priced part's: a step trains one part.
    other_parts: int = 0
    other_adapters: int = 0
    # The base adapters a preview on that other base attaches ([sample]'s stack), as
    # frozen_adapter_tensors: they stream in its units (every unit streams there)
    preview_adapter_tensors: tuple[tuple[str, int], ...] = ()
    # The trainer quantizes the block Linears a plan stores in fp8 as it reads them (models/weights.py,
    # `quantize_fp8`), so its loading phase holds what the plan stores plus the quantizing workers'
    # buffers, never the file's bf16. The sampler loads as stored and converts afterwards: False.
    quantizes_on_load: bool = False
    # A sampler's prefix cache on the device while it denoises (Sampling.prefix_cache: Qwen-Image-
    # 2.1's text and reference keys and values of every block, kept from the first step), bytes
    prefix_cache_bytes: int = 0
    # Full fine-tuning ([full] section; mode = "full" only): what trains and how its state is kept.
    full_train: tuple[str, ...] = ("*",)       # fnmatch patterns on diffusers parameter names
    full_exclude: tuple[str, ...] = ()
    state_dtype: Literal["fp32", "bf16"] = "fp32"   # AdamW moments
    # Where streamed blocks step ([full] streamed_step): "auto" lets the search try both.
    streamed_step: Literal["auto", "device", "host"] = "auto"
    # Where a LoRA's optimizer step runs ([lora] optimizer_step, train/lora_host_step.py): "auto" lets
    # the search try both. "device" here (a Workload built in code plans as before the host step);
    # a config's "auto" default comes in through from_config, `leantune plan --model` gives "auto".
    lora_step: Literal["auto", "device", "host"] = "device"
    master_weights: bool = False    # fp32 copies of bf16 weights in host RAM
    stochastic_rounding: bool = True
    clip_per_param: bool = True     # [train] max_grad_norm > 0 with [full] grad_clip = "parameter"

    @staticmethod
    def square(resolutions: list[int] | tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple((int(r), int(r)) for r in resolutions)

    def image_tokens(self, bucket: tuple[int, int]) -> int:
        """Packed latent tokens of a bucket: 8x VAE downsampling then 2x2 patches, per latent frame."""
        return (bucket[0] // 16) * (bucket[1] // 16) * self.frames

    def describe(self) -> str:
        kind = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa"}[self.adapter]
        what = {"lora": f"{kind} r{self.rank} ({self.targets})", "full": self._describe_full(),
                "inference": "inference"}[self.mode]
        sizes = ", ".join(f"{w}x{h}" for h, w in self.buckets)
        opt = "" if self.mode == "inference" else f", {self.optimizer}"
        accum = f", accumulation {self.gradient_accumulation}" if self.gradient_accumulation > 1 else ""
        refs = ""
        if self.references:
            refs = f", {self.references} reference{'s' if self.references > 1 else ''}"
        frames = f" x {self.frames} latent frames" if self.frames != 1 else ""
        return f"{what}{opt}, batch {self.batch_size}{accum}, {sizes}{frames}{refs}, text {self.text_length} tokens"

    def _describe_full(self) -> str:
        parts = []
        if tuple(self.full_train) != ("*",):
            parts.append(f"train {', '.join(self.full_train)}")
        if self.full_exclude:
            parts.append(f"frozen {', '.join(self.full_exclude)}")
        if self.optimizer == "adamw" and self.state_dtype != "fp32":
            parts.append(f"{self.state_dtype} moments")
        if self.master_weights:
            parts.append("fp32 masters on host")
        return "full fine-tune" + (f" ({'; '.join(parts)})" if parts else "")


UNLIMITED_RAM = 2**62   # a host-RAM budget that is never binding: host RAM reported, not limited


@dataclass(frozen=True)
class Budget:
    """VRAM and host RAM the run may use. The margin absorbs allocator fragmentation."""

    vram: int
    ram: int | None = None          # None: available host RAM minus a margin
    margin: float = 0.07
    min_margin: int = 256 * MiB

    @property
    def margin_bytes(self) -> int:
        return int(max(self.margin * self.vram, self.min_margin))

    @property
    def usable_vram(self) -> int:
        return self.vram - self.margin_bytes

    def ram_limit(self, machine: Machine) -> int:
        if self.ram is not None:
            return self.ram
        return default_ram_budget(machine)

    def needed_for(self, peak: int) -> int:
        """The smallest budget whose usable part holds `peak`."""
        return max(math.ceil(peak / (1.0 - self.margin)), peak + self.min_margin)


def default_ram_budget(machine: Machine | None = None) -> int:
    """What this process may use in total: its current RSS plus available RAM, minus a margin."""
    total, avail = (machine.host_ram_total, machine.host_ram_available) if machine else host_ram()
    return int(host_rss()[0] + avail - max(2 * GiB, 0.1 * total))


class InfeasibleBudget(ValueError):
    """No plan fits the budget. The message names the smallest budget that works and what to change."""

    def __init__(self, message: str, needed_vram: int | None = None, needed_ram: int | None = None,
                 best: Plan | None = None):
        super().__init__(message)
        self.needed_vram = needed_vram
        self.needed_ram = needed_ram
        self.best = best


def gib(n: float) -> str:
    """Bytes as the planner's messages print them: '7.25 GiB'."""
    return f"{n / GiB:.2f} GiB"
