"""The meta build of QwenImage21Transformer2DModel (the planner's copy: shapes, no data), and the
same copy on the simulated device's fake tensors.

The transformer reads its token layout from the image-slot mask (`img_mask`): which rows are
image tokens, which image block each belongs to, which are the target's (nonzero,
repeat_interleave by counts, `.tolist()`), so the mask must hold values where everything else
has none. `QwenImage21Transformer2DModel` here is diffusers' class, same name and config, whose
forward, when its weights have no values, runs under `_HostLayout`: the layout (the mask and what
is computed from it alone) stays a real host tensor, and where it meets a tensor without values
it joins that one's kind:

- meta weights (the planner's probe): torch accepts host indices on meta tensors but for
  torch.where's condition, which is moved to meta;
- fake tensors (memory/simulated.py): an op on real tensors only runs for real (fake mode
  suspended); a host bool index becomes its real positions (a fake bool index would be
  data-dependent), repeat_interleave by real counts gets its output size, any other real tensor
  becomes a fake one on its partner's device.

The numbers selected are not computed either way, only shapes and bytes, which the layout
decides exactly as for real weights. The loader builds this class for device="meta" only; a
real load is diffusers' class itself. `host()` makes a layout tensor real inside the simulation
(forward.predict and the family's text layout build the mask under it).
"""

from __future__ import annotations

import torch
from diffusers import QwenImage21Transformer2DModel as _Diffusers
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from torch._subclasses.fake_tensor import is_fake

from .block import QwenImage21SplitBlock, split_blocks

_FACTORIES = {torch.tensor, torch.full, torch.zeros, torch.ones, torch.arange, torch.empty}


def _valueless(t) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_meta or is_fake(t))


def host():
    """A context in which tensors are real host tensors, even inside the simulated device's fake mode:
    every dispatch mode is suspended (the fake mode, and the simulated tracker, which reads a
    computed value as 0), so the layout's counts and positions are the real ones."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _mode(fake: torch.Tensor):
    """The FakeTensorMode a fake tensor (or a Parameter around one) belongs to."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([fake])


class _HostLayout(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        partner = next((t for t in leaves if _valueless(t)), None)
        if partner is None:
            device = kwargs.get("device")
            if leaves or (func in _FACTORIES and (device is None or torch.device(device).type == "cpu")):
                with host():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        if not any(isinstance(t, torch.Tensor) and not _valueless(t) for t in leaves):
            return func(*args, **kwargs)
        fake = is_fake(partner)
        if func in (torch.Tensor.__setitem__, torch.Tensor.__getitem__) and len(args) >= 2:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            with host():
                index = tuple(i.nonzero().squeeze(-1) if isinstance(i, torch.Tensor) and not _valueless(i)
                              and i.dtype == torch.bool else i for i in index)
            args = (args[0], index if isinstance(args[1], tuple) else index[0], *args[2:])
        if func in (torch.Tensor.repeat_interleave, torch.repeat_interleave) and len(args) >= 2 \
                and isinstance(args[1], torch.Tensor) and not _valueless(args[1]):
            with host():
                kwargs.setdefault("output_size", int(args[1].sum()))
        if func is torch.where or func is torch.Tensor.where:
            fake = True          # the condition joins the values' device (meta or fake alike)
        if not fake:
            return func(*args, **kwargs)

        def join(t):
            if not isinstance(t, torch.Tensor) or _valueless(t):
                return t
            if is_fake(partner):
                return _mode(partner).from_tensor(t).to(partner.device)
            return t.to(partner.device)
        return func(*tree_map(join, args), **tree_map(join, kwargs))


class _HostLayoutBlock(QwenImage21SplitBlock):
    """A block whose forward runs under _HostLayout when its weights have no values: a checkpointed
    block is recomputed in backward, outside the model's forward (a branch of a split block is
    recomputed under the modes of its forward: block.py)."""

    def forward(self, *args, **kwargs):
        if any(_valueless(p) for p in self.parameters()):
            with _HostLayout():
                return super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)


class QwenImage21Transformer2DModel(_Diffusers):
    @classmethod
    def from_config(cls, *args, **kwargs):
        """diffusers' from_config, the blocks made _HostLayoutBlocks (__init__ is left alone: the
        config machinery reads its signature)."""
        model = super().from_config(*args, **kwargs)
        split_blocks(model, _HostLayoutBlock)        # training's block (block.py), priced as it runs
        # The rotary table is a plain list of tensors (QwenImage21Rope.freqs), which the forward copies
        # to the device and keeps there; the planner counts a module's tensor attributes as such
        # device tables (planner/weight_bytes.device_tables) but not a list's: the same tensors named
        # as attributes too, so the plan prices them (the forward never reads these names)
        for i, table in enumerate(model.pos_embed.freqs):
            setattr(model.pos_embed, f"_device_table_{i}", table)
        return model

    def forward(self, *args, **kwargs):
        fake = next((p for p in self.parameters() if is_fake(p)), None)
        if fake is not None:
            # the rotary table is a plain list of tensors built on meta, which the simulated
            # device's fake_parameters does not reach (it fakes parameters, buffers and tensor attributes)
            rope = self.pos_embed
            rope.freqs = [f if is_fake(f) else _mode(fake).from_tensor(f) for f in rope.freqs]
        if any(_valueless(p) for p in self.parameters()):
            with _HostLayout():
                return super().forward(*args, **kwargs)
        return super().forward(*args, **kwargs)
