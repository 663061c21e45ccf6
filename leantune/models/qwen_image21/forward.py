"""One Qwen-Image-2.1 transformer call, laid out as QwenImage21Pipeline lays it.

The joint sequence is the text rows (with the vision encoder's image slots), the references'
latent tokens and the target's: `hidden_states` is the references' packed latents then the
target's, `img_shapes` their (1, h, w) in that order, and `img_mask` the text's slot mask with one
more slot per 2x2 group of target tokens. The transformer substitutes each reference's tokens at
its slots and attends block-causally (text causal, each image block bidirectional). Only the
target's rows of the output are the prediction. With `causal_condition` the text and references
are modulated at t = 0, so their keys and values are the same at every step: `kv_cache` /
`kv_mode` ("extract" at the first step, "cached" after) reuse them, as the pipeline does.
"""

from __future__ import annotations

import torch

from .latents import pack_latents, slots


def predict(transformer, noisy_packed: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor,
            text_mask: torch.Tensor | None, image_slots: torch.Tensor, latent_hw: tuple[int, int],
            references: list[torch.Tensor] | None = None, kv_cache=None, kv_mode: str | None = None) -> torch.Tensor:
    """Packed noisy target latents (B, h*w, 64) at sigma (B,) -> the target's velocity (B, h*w, 64).

    `embeds` (B, L, D), `text_mask` (B, L) or None, `image_slots` (B, L) bool: the text encoding
    (text.pipeline_layout); `references`: normalized latents (B, 64, h_r, w_r), in the order the
    text encoder saw them."""
    dtype, device = noisy_packed.dtype, noisy_packed.device
    references = list(references or [])
    h, w = latent_hw
    hidden = torch.cat([*(pack_latents(r.to(device, dtype)) for r in references), noisy_packed], dim=1)
    shapes = [(1, r.shape[2], r.shape[3]) for r in references] + [(1, h, w)]
    if noisy_packed.is_meta or isinstance(noisy_packed, _fake()):
        # no values (the planner's meta copy, the simulated device): the layout stays a real host
        # tensor, which meta_model's forward reads (meta_model.py says why)
        from .meta_model import host

        with host():
            slot_mask = image_slots.cpu()
            img_mask = torch.cat([slot_mask, slot_mask.new_ones(slot_mask.shape[0], slots(h, w))], dim=1)
    else:
        slot_mask = image_slots.to(device)
        img_mask = torch.cat([slot_mask, slot_mask.new_ones(slot_mask.shape[0], slots(h, w))], dim=1)
    out = transformer(hidden_states=hidden, timestep=sigma.to(device=device, dtype=dtype),
                      encoder_hidden_states=embeds.to(device=device, dtype=dtype),
                      encoder_hidden_states_mask=None if text_mask is None else text_mask.to(device),
                      img_shapes=[shapes] * noisy_packed.shape[0], img_mask=img_mask,
                      kv_cache=kv_cache, kv_cache_mode=kv_mode, return_dict=False)[0]
    return out[:, -noisy_packed.shape[1]:]


def _fake():
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:          # pragma: no cover
        return ()
    return FakeTensor
