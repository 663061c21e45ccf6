"""The validation loss: the held-out images' flow-matching loss at fixed noise levels and fixed noise.

Training losses are drawn at random noise levels, so their curve is noisy and two runs' curves do
not compare point by point. The validation loss measures each held-out image at every level of
[validation] sigmas with noise drawn from a generator seeded by ([validation] seed, batch, level):
the same numbers at every evaluation, in every run and after a resume, so a change in the curve is
a change in the model. It never touches the training generator (a resumed run draws what it
would have), runs without gradients, and uses the training loss itself (masks included).

With several processes every rank measures the whole held-out set (the model's forward may hold
collectives: every rank must run the same forwards) and the ranks agree on the number.
"""

from __future__ import annotations

import torch

from . import flow_matching as fm


def _noise(shape, seed: int, batch: int, level: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + batch * 1_009 + level) % (2 ** 63))
    return torch.randn(shape, generator=g)


@torch.no_grad()
def validation_loss(t, cfg, batches: list, loss_fn, autocast) -> float:
    """The mean loss over the held-out `batches` (data/cache.py validation_batches) and levels,
    each sample weighted alike. `loss_fn(family, pred, target, weights, x0)` and `autocast(cfg,
    device)` are the trainer's own, so validation measures exactly what training optimises."""
    from ..models.family import get_family

    family = get_family(cfg.model.family)
    v = cfg.validation
    total, count = 0.0, 0
    was_training = t.transformer.training
    t.transformer.eval()                      # adapter dropout off: the same model at every evaluation
    try:
        for i, batch in enumerate(batches):
            x0 = batch.latents.to(t.device, torch.float32)
            b, _, h, w = x0.shape
            refs = getattr(batch, "references", None)
            for j, level in enumerate(v.sigmas):
                noise = _noise(x0.shape, v.seed, i, j).to(t.device)
                sigma = torch.full((b,), float(level))
                noisy = fm.add_noise(x0, noise, sigma)
                target = family.pack_latents(fm.velocity_target(x0, noise))
                with autocast(cfg, t.device):
                    pred = family.predict(t.transformer, family.pack_latents(noisy).to(t.dtype), sigma.to(t.device),
                                          batch.embeds, (h, w), cfg.train.guidance,
                                          **({"references": [r.to(t.device) for r in refs]} if refs else {}))
                loss = loss_fn(family, pred, target, getattr(batch, "loss_weights", None), x0)
                total += float(loss) * b
                count += b
    finally:
        t.transformer.train(was_training)
    return total / max(count, 1)
