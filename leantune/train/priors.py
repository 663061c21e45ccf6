"""Prior batches: regularisation images ([[data.datasets]] role = "prior") and their loss.

A LoRA trained on a handful of images of one subject drifts the whole class toward it ("a dog"
becomes the user's dog). Two remedies, chosen with [data] prior_loss, on the prior batches the
batch order mixes in at [data] prior_ratio (data/buckets.py MixedOrder):

- "plain": the prior images' own flow-matching loss (DreamBooth's prior preservation; kohya's
  reg images), so the class keeps looking like its images.
- "dop" (differential output preservation): the target is the base model's own prediction for
  the same noisy latents and the prior caption (the class prompt), computed in the same step with
  the trained adapter switched off and no gradient; the loss pulls the adapter's effect on the
  class prompt toward zero without needing the prior images to be good. With the adapter at zero
  the loss is zero.

Both are weighted by [data] prior_weight. Frozen base adapters ([model] base_adapters) stay on
for the base prediction: they are part of the model the LoRA is trained over.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

TRAINED = "default"       # the peft adapter name of the trained LoRA (train/lora.py)


@contextmanager
def trained_adapter_off(model: torch.nn.Module, name: str = TRAINED):
    """The model without the trained adapter for the duration: each tuner layer's active adapters
    lose `name` (its weights and requires_grad are untouched, unlike peft's set_adapter), and get
    it back after. Works alike for every adapter type peft layers hold (LoRA, DoRA, LoKr, LoHa)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    saved = []
    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            active = m.active_adapters
            if name in active:
                saved.append((m, m._active_adapter))
                m._active_adapter = [a for a in active if a != name]
    if not saved:
        raise RuntimeError(f"the model has no active adapter {name!r} to switch off for [data] prior_loss = \"dop\"")
    try:
        yield
    finally:
        for m, active in saved:
            m._active_adapter = active


def base_prediction(predict, model: torch.nn.Module) -> torch.Tensor:
    """`predict()` of the model with the trained adapter off, without a graph: the DOP target."""
    with torch.no_grad(), trained_adapter_off(model):
        return predict().detach()
