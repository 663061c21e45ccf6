"""The meta build of QwenImage21Transformer2DModel (the planner's copy: shapes, no data).

The transformer reads its token layout from the image-slot mask (`img_mask`): which rows are
image tokens, which image block each belongs to, which are the target's (nonzero, repeat_interleave
by counts), so the mask must hold values, and probe_inputs gives it as a host tensor while
everything else is on meta. Every such step works on meta with a host index but one:
`_select_modulation_rows`' torch.where(host mask, meta rows, meta rows), which torch refuses
for mixed devices. `QwenImage21Transformer2DModel` here is diffusers' class, same name and config,
whose forward moves such a condition onto the meta device for that call (`_HostConditions`): the
numbers it would select are not computed on meta anyway, only shapes. The loader builds it for
device="meta" only; a real load is diffusers' class itself.
"""

from __future__ import annotations

import torch
from diffusers import QwenImage21Transformer2DModel as _Diffusers
from torch.overrides import TorchFunctionMode


class _HostConditions(TorchFunctionMode):
    """torch.where with a host condition and meta values: the condition moved to meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.where, torch.Tensor.where) and len(args) == 3:
            cond, a, b = args
            if (isinstance(cond, torch.Tensor) and not cond.is_meta and cond.dim() > 0
                    and any(isinstance(t, torch.Tensor) and t.is_meta for t in (a, b))):
                args = (cond.to("meta"), a, b)
        return func(*args, **kwargs)


class QwenImage21Transformer2DModel(_Diffusers):
    def forward(self, *args, **kwargs):
        if any(p.is_meta for p in self.parameters()):
            with _HostConditions():
                return super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)
