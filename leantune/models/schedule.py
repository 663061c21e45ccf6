"""Flow-matching Euler sampling schedule, as Flux and SD3.5 checkpoints expect it.

Both families are rectified-flow models: x_sigma = (1 - sigma) * x0 + sigma * noise, and the transformer
predicts the velocity (noise - x0). Sampling walks sigma from 1 down to 0 with Euler steps
x <- x + (sigma_next - sigma) * v.

Which sigmas are visited is what makes dev and schnell differ:
- dev (`use_dynamic_shifting`): sigmas = linspace(1, 1/steps, steps), then the resolution-dependent
  time shift exp(mu) / (exp(mu) + (1/sigma - 1)) with mu linear in the packed image sequence length
  (0.5 at 256 tokens, 1.15 at 4096 tokens = 1024x1024). Larger images spend more steps at high noise.
- schnell: the same linspace with a fixed shift of 1.0 (no shift), 4 steps.
- SD3.5 (StableDiffusion3Pipeline passes no sigmas): the scheduler's own spacing, a float64
  linspace of timesteps between its largest and smallest *training* sigma (those already shifted:
  the smallest is shift(1/1000)), divided by 1000, then the fixed shift 3.0 applied (a second time
  for the end point, exactly as diffusers does). Families hand their schedule to the sampler
  (`ModelFamily.sampling`); nothing here asks which family it serves.

The numbers are computed exactly as diffusers' FlowMatchEulerDiscreteScheduler does (float32 numpy,
timesteps = sigma * 1000, the transformer fed timestep / 1000 in the model dtype), so an image made
here equals FluxPipeline's for the same weights and seed, not merely looks like it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

NUM_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class FlowSchedule:
    """The scheduler settings that decide the sigma sequence (a subset of diffusers' scheduler config)."""

    use_dynamic_shifting: bool = True
    shift: float = 3.0                 # fixed shift, used only without dynamic shifting
    base_shift: float = 0.5            # mu at base_image_seq_len tokens
    max_shift: float = 1.15            # mu at max_image_seq_len tokens
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    default_steps: int = 28
    default_guidance: float = 3.5
    # True: linspace(1, 1/steps) as FluxPipeline passes it; False: the scheduler's own timesteps over
    # its training sigma range, as StableDiffusion3Pipeline (which passes none) gets them.
    pipeline_sigmas: bool = True
    # Qwen-Image: after the shift, the sigmas are stretched so the last one equals this (the
    # scheduler's `shift_terminal`, 0.02 there); 0: no stretch.
    shift_terminal: float = 0.0
    # FLUX.2: mu is BFL's empirical fit in the image tokens *and the step count* (empirical_mu below,
    # the pipelines' compute_empirical_mu) instead of the line through base/max_shift.
    empirical_mu: bool = False

    @classmethod
    def for_variant(cls, variant: str) -> FlowSchedule:
        """The published scheduler settings of FLUX.1-dev / FLUX.1-schnell."""
        if variant == "schnell":
            return cls(use_dynamic_shifting=False, shift=1.0, default_steps=4, default_guidance=0.0)
        if variant == "dev":
            return cls()
        raise ValueError(f"unknown Flux variant {variant!r}; expected 'dev' or 'schnell'")

    @classmethod
    def sd3(cls) -> FlowSchedule:
        """SD3.5 Large / Medium: fixed shift 3.0 (their scheduler_config.json), the scheduler's own
        spacing, and StableDiffusion3Pipeline's defaults of 28 steps at CFG scale 7.0."""
        return cls(use_dynamic_shifting=False, shift=3.0, default_steps=28, default_guidance=7.0,
                   pipeline_sigmas=False)

    @classmethod
    def qwen_image(cls) -> FlowSchedule:
        """Qwen-Image's scheduler_config.json (dynamic shift 0.5 at 256 tokens to 0.9 at 8192,
        stretched to end at 0.02) and QwenImagePipeline's defaults: 50 steps, true CFG 4.0."""
        return cls(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                   max_image_seq_len=8192, shift_terminal=0.02, default_steps=50, default_guidance=4.0)

    @classmethod
    def from_scheduler_config(cls, config: dict, variant: str | FlowSchedule) -> FlowSchedule:
        """Read a diffusers scheduler_config.json dict; values it lacks come from `variant`: a Flux
        variant name or a family's published schedule."""
        base = variant if isinstance(variant, FlowSchedule) else cls.for_variant(variant)
        unsupported = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                                   "invert_sigmas", "stochastic_sampling") if config.get(k)]
        if config.get("time_shift_type", "exponential") != "exponential":
            unsupported.append("time_shift_type")
        if unsupported:
            raise ValueError(f"scheduler settings {unsupported} are not supported by the flow-matching Euler sampler")
        return cls(
            use_dynamic_shifting=bool(config.get("use_dynamic_shifting", base.use_dynamic_shifting)),
            shift=float(config.get("shift", base.shift)),
            base_shift=float(config.get("base_shift", base.base_shift)),
            max_shift=float(config.get("max_shift", base.max_shift)),
            base_image_seq_len=int(config.get("base_image_seq_len", base.base_image_seq_len)),
            max_image_seq_len=int(config.get("max_image_seq_len", base.max_image_seq_len)),
            default_steps=base.default_steps,
            default_guidance=base.default_guidance,
            pipeline_sigmas=base.pipeline_sigmas,
            shift_terminal=float(config.get("shift_terminal") or base.shift_terminal),
            empirical_mu=base.empirical_mu,
        )

    @classmethod
    def from_model_folder(cls, folder: str | Path | None, variant: str | FlowSchedule) -> FlowSchedule:
        """The schedule of a diffusers model folder (scheduler/scheduler_config.json), else `variant`'s
        (a Flux variant name or a family's published schedule)."""
        if folder is not None:
            path = Path(folder) / "scheduler" / "scheduler_config.json"
            if path.is_file():
                try:
                    config = json.loads(path.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError) as e:
                    raise ValueError(f"{path}: not a readable scheduler config ({e})") from None
                try:
                    return cls.from_scheduler_config(config, variant)
                except ValueError as e:
                    raise ValueError(f"{path}: {e}") from None
        return variant if isinstance(variant, FlowSchedule) else cls.for_variant(variant)

    def mu(self, image_seq_len: int) -> float:
        """Resolution-dependent shift: linear in the packed token count (h/2 * w/2)."""
        m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        b = self.base_shift - m * self.base_image_seq_len
        return image_seq_len * m + b

    def sigmas(self, steps: int, image_seq_len: int) -> torch.Tensor:
        """The sigmas visited, float32 (steps + 1,), from 1 down to a final 0."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if self.pipeline_sigmas:
            s = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
        else:
            hi, lo = self._training_sigma_range()
            s = np.linspace(hi * NUM_TRAIN_TIMESTEPS, lo * NUM_TRAIN_TIMESTEPS, steps) / NUM_TRAIN_TIMESTEPS  # float64
        if self.use_dynamic_shifting:
            e = math.exp(empirical_mu(image_seq_len, steps) if self.empirical_mu else self.mu(image_seq_len))
            s = e / (e + (1.0 / s - 1.0))
        else:
            s = self.shift * s / (1 + (self.shift - 1) * s)
        if self.shift_terminal:      # FlowMatchEulerDiscreteScheduler.stretch_shift_to_terminal
            one_minus_z = 1 - s
            s = 1 - (one_minus_z / (one_minus_z[-1] / (1 - self.shift_terminal)))
        out = torch.from_numpy(np.asarray(s)).to(torch.float32)
        return torch.cat([out, torch.zeros(1)])

    def _training_sigma_range(self) -> tuple[float, float]:
        """The largest and smallest of the scheduler's 1000 training sigmas, computed as
        FlowMatchEulerDiscreteScheduler.__init__ does (float32; shifted unless dynamic shifting)."""
        t = torch.tensor([float(NUM_TRAIN_TIMESTEPS), 1.0], dtype=torch.float32)
        s = t / NUM_TRAIN_TIMESTEPS
        if not self.use_dynamic_shifting:
            s = self.shift * s / (1 + (self.shift - 1) * s)
        return s[0].item(), s[1].item()


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """BFL's FLUX.2 shift exponent for `image_seq_len` tokens sampled in `num_steps` steps (diffusers'
    compute_empirical_mu, the same arithmetic): linear in the tokens, and below 4300 tokens also in the
    steps, between fits made at 10 and 200 steps."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def model_timestep(sigma: torch.Tensor, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The transformer's timestep input (B,) for a float32 sigma, rounded as diffusers rounds it.

    FluxPipeline keeps timesteps in [0, 1000] (sigma * 1000), casts to the latent dtype and divides by
    1000; in bf16 that is not the same number as sigma cast to bf16, so it is reproduced here.
    """
    # A fill from a host number, not a copy: a (pageable) host tensor copied to the GPU makes the
    # host wait for every queued kernel, once per denoising step. float32 either way, same value.
    t = torch.full((batch,), float(sigma * NUM_TRAIN_TIMESTEPS), dtype=torch.float32, device=device)
    return t.to(dtype) / NUM_TRAIN_TIMESTEPS


def euler_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> torch.Tensor:
    """x <- x + (sigma_next - sigma) * v, accumulated in float32 and returned in the velocity's dtype.

    dt stays a 0-dim host tensor, as FlowMatchEulerDiscreteScheduler keeps its sigmas on the CPU: a
    GPU kernel takes it as a float32 scalar. Moved to the GPU it would be rounded to the velocity's
    dtype (bf16) before the product, unlike the pipelines and the CPU, and the copy would make the
    host wait for the device once per step."""
    dt = sigma_next - sigma
    return (latents.to(torch.float32) + dt * velocity).to(velocity.dtype)
