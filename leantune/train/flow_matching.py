"""Rectified-flow training objective as Flux is trained.

noisy = (1 - sigma) * x0 + sigma * eps, target = eps - x0 (the velocity from data to noise),
prediction taken raw from the transformer, plain MSE. sigma in [0, 1] is also the transformer's
timestep input (diffusers' Flux scales it by 1000 inside).

Timestep (sigma) sampling decides which noise levels the LoRA sees most:
- `uniform`: sigma ~ U(0, 1).
- `sigmoid`: sigma = sigmoid(scale * n), n ~ N(0, 1) — the logit-normal of SD3/Flux training,
  concentrating on mid noise levels.
- `shift`: logit-normal, then the time shift sigma' = s*sigma / (1 + (s-1)*sigma) with a fixed s,
  pushing toward high noise (s > 1), which matters more at high resolution.
- `flux_shift`: as `shift`, with the resolution-dependent shift BFL's schedule uses:
  mu linear in the image token count (256 -> 0.5, 4096 -> 1.15), sigma' = e^mu / (e^mu + 1/sigma - 1).
- `krea2_shift`: as `flux_shift` on Krea 2's line, which its sampler follows (krea-ai/krea-2
  sampling.py `timesteps`: 256 -> 0.5, 6400 -> 1.15 tokens, i.e. 256 to 1280 px at 16 px a token);
  musubi-tuner's `--timestep_sampling krea2_shift` draws the same.
- `auto` (the default): the model family's choice (`sampling_method`): `sigmoid` for Flux, `shift`
  with s = 3.0 for SD3.5 — SD3's scheduler shift, which diffusers' SD3 training script applies to its
  logit-normal draws the same way.
"""

from __future__ import annotations

import math

import torch

BASE_SEQ_LEN, MAX_SEQ_LEN = 256, 4096
KREA2_MAX_SEQ_LEN = 6400
BASE_SHIFT, MAX_SHIFT = 0.5, 1.15


def flux_mu(image_seq_len: int, max_seq_len: int = MAX_SEQ_LEN) -> float:
    """BFL's resolution-dependent shift exponent (same line as diffusers' calculate_shift); Krea 2's
    line ends at `max_seq_len` = 6400 instead."""
    m = (MAX_SHIFT - BASE_SHIFT) / (max_seq_len - BASE_SEQ_LEN)
    return image_seq_len * m + (BASE_SHIFT - m * BASE_SEQ_LEN)


def time_shift(mu: float, sigma: torch.Tensor) -> torch.Tensor:
    """sigma' = e^mu / (e^mu + (1/sigma - 1)); equals shift(s=e^mu) applied to sigma."""
    return math.exp(mu) / (math.exp(mu) + (1.0 / sigma - 1.0))


def sampling_method(configured: str, family) -> str:
    """The sampling `[train] timestep_sampling` names: itself, or for "auto" the family's default."""
    return family.timestep_sampling if configured == "auto" else configured


def sample_sigmas(batch: int, method: str, generator: torch.Generator, *, sigmoid_scale: float = 1.0,
                  shift: float = 3.0, image_seq_len: int = 4096) -> torch.Tensor:
    """Noise levels (batch,) in (0, 1) drawn with `generator` (CPU) so runs and resumes are exact."""
    if method == "uniform":
        sigma = torch.rand(batch, generator=generator)
    else:
        sigma = torch.sigmoid(sigmoid_scale * torch.randn(batch, generator=generator))
        if method == "shift":
            sigma = shift * sigma / (1.0 + (shift - 1.0) * sigma)
        elif method == "flux_shift":
            sigma = time_shift(flux_mu(image_seq_len), sigma)
        elif method == "krea2_shift":
            sigma = time_shift(flux_mu(image_seq_len, KREA2_MAX_SEQ_LEN), sigma)
        elif method != "sigmoid":
            raise ValueError(f"unknown timestep sampling {method!r}")
    # Keep away from the exact ends, where the target is pure data or pure noise.
    return sigma.clamp(1e-4, 1.0 - 1e-4)


def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """(1 - sigma) * x0 + sigma * noise, sigma (B,) broadcast over the other dims.

    sigma is drawn on the host (a CPU generator, for exact resumes) and moved to x0's device here: a
    (B, 1, 1, 1) CPU tensor cannot meet a CUDA tensor in one op (only 0-dim CPU tensors can)."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(device=x0.device, dtype=x0.dtype)
    return (1.0 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def flow_matching_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error in fp32 whatever the compute dtype."""
    return torch.mean((pred.float() - target.float()) ** 2)


def masked_flow_matching_loss(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The weighted mean squared error of each sample (`weights` as `pred`, one weight per element:
    a mask's, data/masks.py), averaged over the batch, in fp32.

    Each sample is normalised by its own weight sum, so a masked image pulls as hard as an unmasked
    one (a mask over a tenth of the image does not train at a tenth of the learning rate), and the
    loss of a row does not depend on the other rows (a batch split over processes gives the same
    loss). Weights of ones give the plain loss."""
    err = (pred.float() - target.float()) ** 2 * weights
    dims = tuple(range(1, err.dim()))
    per_sample = err.sum(dim=dims) / weights.sum(dim=dims).clamp_min(torch.finfo(torch.float32).tiny)
    return per_sample.mean()
