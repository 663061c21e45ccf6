"""Wan 2.2 A14B's two experts: which timesteps each owns, and both as one model for sampling.

WanPipeline splits the 1000 training timesteps at `boundary_ratio * num_train_timesteps`
(model_index.json's boundary_ratio: 0.875 for T2V-A14B, 0.9 for I2V-A14B): `transformer` (the
high-noise expert) denoises every step whose timestep t >= that boundary, `transformer_2` (the
low-noise expert) every step below it. A flow-matching timestep is sigma * 1000, so in sigma the
high-noise expert owns [boundary_ratio, 1] and the low-noise one [0, boundary_ratio).

- Training one expert ([model] expert = "high" | "low") draws its noise levels inside the expert's
  range: `restrict_sigmas` maps the trainer's draw there through the inverse of the drawing
  distribution's CDF, so the levels follow the configured distribution conditioned on the range (the
  same one draw per sample: a resumed run stays exact).
- Training both ([model] expert = "both") draws one expert per forward call: `one_expert_sigmas`
  (why there, not a split batch).
- Sampling runs `WanExperts`, which hands each call to the expert WanPipeline would pick for its
  timestep, so leantune's staged sampler (infer/sampler.py, which calls the family's `predict`)
  switches experts at the same step as the pipeline.
"""

from __future__ import annotations

import math

import torch
from torch import nn

NUM_TRAIN_TIMESTEPS = 1000
EXPERTS = ("high", "low")


def boundary_timestep(boundary_ratio: float) -> float:
    """WanPipeline's `boundary_timestep`: the first timestep the high-noise expert owns."""
    return boundary_ratio * NUM_TRAIN_TIMESTEPS


def sigma_range(expert: str, boundary_ratio: float) -> tuple[float, float]:
    """The noise levels [lo, hi] `expert` denoises in WanPipeline (its timesteps / 1000)."""
    if expert not in EXPERTS:
        raise ValueError(f"expert must be one of {EXPERTS}, got {expert!r}")
    if not 0.0 < boundary_ratio < 1.0:
        raise ValueError(f"boundary_ratio must be strictly between 0 and 1, got {boundary_ratio}")
    return (boundary_ratio, 1.0) if expert == "high" else (0.0, boundary_ratio)


def owns(expert: str, timestep: torch.Tensor, boundary_ratio: float) -> torch.Tensor:
    """Whether `expert` denoises at `timestep` (sigma * 1000), as WanPipeline decides: t >= boundary."""
    high = timestep >= boundary_timestep(boundary_ratio)
    return high if expert == "high" else ~high


# -- training one expert ---------------------------------------------------------------------------

def _shift(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def _unshift(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    return sigma / (shift - (shift - 1.0) * sigma)


def _cdf(sigma: torch.Tensor, method: str, sigmoid_scale: float, shift: float) -> torch.Tensor:
    """P(drawn <= sigma) under the trainer's sampling (train/flow_matching.sample_sigmas)."""
    s = sigma.double().clamp(0.0, 1.0)
    if method == "uniform":
        return s
    if method == "shift":
        s = _unshift(s, shift)
    elif method != "sigmoid":
        raise ValueError(f"a Wan expert's timestep range supports the uniform, sigmoid and shift samplings, "
                         f"not {method!r}")
    logit = torch.log(s) - torch.log1p(-s)                      # +-inf at the ends
    return 0.5 * (1.0 + torch.erf(logit / (sigmoid_scale * math.sqrt(2.0))))


def _inverse_cdf(u: torch.Tensor, method: str, sigmoid_scale: float, shift: float) -> torch.Tensor:
    if method == "uniform":
        return u
    z = math.sqrt(2.0) * torch.erfinv(2.0 * u - 1.0)
    s = torch.sigmoid(sigmoid_scale * z)
    return _shift(s, shift) if method == "shift" else s


def restrict_sigmas(sigma: torch.Tensor, expert: str, boundary_ratio: float, method: str, *,
                    sigmoid_scale: float = 1.0, shift: float = 3.0) -> torch.Tensor:
    """Noise levels drawn by `method` (sample_sigmas' draw, one per sample) moved into `expert`'s
    range: sigma -> F^-1(F(lo) + F(sigma) (F(hi) - F(lo))), F the method's CDF. The result follows
    the method's distribution conditioned on [lo, hi], keeps the draw's order, and stays off the
    range's ends (the trainer's clamp, and the boundary itself for the low-noise expert, which
    WanPipeline never hands a timestep of exactly the boundary)."""
    lo, hi = sigma_range(expert, boundary_ratio)
    f_lo = _cdf(torch.tensor(lo), method, sigmoid_scale, shift)
    f_hi = _cdf(torch.tensor(hi), method, sigmoid_scale, shift)
    u = f_lo + _cdf(sigma, method, sigmoid_scale, shift) * (f_hi - f_lo)
    out = _inverse_cdf(u, method, sigmoid_scale, shift).to(torch.float32)
    eps = 1e-4               # the trainer's distance from the ends; the high-noise expert owns the boundary itself
    return out.clamp(lo if expert == "high" else lo + eps, hi - eps)


def one_expert_sigmas(sigma: torch.Tensor, boundary_ratio: float, method: str, *, sigmoid_scale: float = 1.0,
                      shift: float = 3.0) -> torch.Tensor:
    """A two-expert run's noise levels for one forward call ([model] expert = "both"): the expert
    that owns the first drawn level (WanPipeline's rule, `owns`, on the transformer's float32
    timestep) takes the call, the first level stays as drawn and the others move into that expert's
    range (`restrict_sigmas`).

    Why one expert per call rather than splitting a batch whose levels fall on both sides: a call
    then runs one expert's blocks, so a step streams one expert through the engine's one ring (a
    split batch would stream both every step, and hold both experts' activations), and a batch
    keeps its size. The rule changes no distribution: the first level picks the high-noise expert
    with probability equal to its share of the configured distribution's mass and is then
    distributed as that distribution conditioned on the expert's range, which is what
    restrict_sigmas gives every other sample, independently of the choice; so each sample's level
    follows the configured distribution exactly, as in a one-transformer run. No random number is
    drawn besides the trainer's own, so a resumed run draws the same levels and experts. A batch of
    one is the plain draw, whatever the sampling method."""
    timestep = sigma[:1].to(torch.float32) * NUM_TRAIN_TIMESTEPS      # the transformer's (wan.model_time)
    expert = "high" if bool(owns("high", timestep, boundary_ratio).all()) else "low"
    if sigma.numel() == 1:
        return sigma
    out = restrict_sigmas(sigma, expert, boundary_ratio, method, sigmoid_scale=sigmoid_scale, shift=shift)
    out[0] = sigma[0]
    # float32 rounding of the range's clamp may land a level on the other side of the boundary
    edge = torch.tensor(boundary_ratio, dtype=torch.float32)
    while not bool(owns("high", edge * NUM_TRAIN_TIMESTEPS, boundary_ratio)):
        edge = torch.nextafter(edge, torch.tensor(2.0))
    below = torch.nextafter(edge, torch.tensor(0.0))
    while bool(owns("high", below * NUM_TRAIN_TIMESTEPS, boundary_ratio)):     # edge: the least level it owns
        edge, below = below, torch.nextafter(below, torch.tensor(0.0))
    side = owns(expert, out.to(torch.float32) * NUM_TRAIN_TIMESTEPS, boundary_ratio)
    return torch.where(side, out, (edge if expert == "high" else below).to(out.dtype))


# -- sampling with both --------------------------------------------------------------------------------

class WanExperts(nn.Module):
    """Both experts as one transformer for sampling: each forward call goes to the expert that
    owns its timestep (WanPipeline's rule, `owns`). A call's timesteps must all fall on one side of
    the boundary (a sampling step's do: every image is at the same step). The config, the blocks
    and the non-block modules seen from outside are the high-noise expert's (the two share the
    architecture); both experts' weights are parameters of this module."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary_ratio: float):
        super().__init__()
        sigma_range("high", boundary_ratio)                      # validates the ratio
        if dict(high.config) != dict(low.config):
            differ = sorted(k for k in high.config if high.config.get(k) != low.config.get(k))
            raise ValueError(f"the two Wan experts differ in architecture ({differ}); they must share one")
        self.high, self.low = high, low
        self.boundary_ratio = float(boundary_ratio)

    @property
    def config(self):
        return self.high.config

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("high", "low"):
                raise
            return getattr(super().__getattr__("high"), name)     # patch_embedding, blocks, dtype, ...

    def alternating_parts(self) -> dict[str, nn.Module]:
        """The sub-models that compute one at a time, by the name their files take: the memory
        engine keeps the one not in use on the host (memory/switched.py), a two-expert LoRA run
        adds an adapter to each (train/parts_lora.py)."""
        return {"high_noise": self.high, "low_noise": self.low}

    def expert_for(self, timestep: torch.Tensor) -> nn.Module:
        high = owns("high", timestep.reshape(-1), self.boundary_ratio)
        if bool(high.all()):
            return self.high
        if not bool(high.any()):
            return self.low
        raise ValueError("one call's timesteps fall on both sides of the Wan experts' boundary; "
                         "run each expert's samples in calls of their own")

    def forward(self, hidden_states, timestep, encoder_hidden_states, **kwargs):
        return self.expert_for(timestep)(hidden_states=hidden_states, timestep=timestep,
                                         encoder_hidden_states=encoder_hidden_states, **kwargs)
