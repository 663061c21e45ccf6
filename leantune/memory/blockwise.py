"""Run a module on a device with its repeated blocks resident only during their own forward.

A text encoder runs once per request or per caching pass, so it does not need the training
engine's ring of prefetched slots: `blockwise_offload` keeps everything outside the blocks (the
embedding, the final norm) on the device and brings one block at a time, dropping it right after
its forward. That costs one pass over the weights and bounds the peak at one block plus
activations (T5-XXL for sampling; Qwen-Image's 7B Qwen2.5-VL in the caching phase as well).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def blockwise_offload(model: nn.Module, blocks: nn.ModuleList, device) -> Iterator[None]:
    """Run `model` on `device` with its `blocks` resident only during their own forward.

    Everything outside `blocks` moves to `device` for the duration. Each block's host tensors are
    kept aside; a forward pre-hook copies them to `device`, a forward hook swaps in empty
    placeholders again. On exit every tensor is back on the host, as it was.
    """
    device = torch.device(device)
    in_blocks = {id(t) for b in blocks for t in list(b.parameters()) + list(b.buffers())}
    # Host copies of every tensor we touch, restored on exit: (owner module, attribute, host tensor,
    # is-parameter, identity). Tied weights (T5's shared embedding) appear twice with one identity.
    saved: list[tuple[nn.Module, str, torch.Tensor, bool, int]] = []
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                saved.append((mod, name, p.data, True, id(p)))
        for name, b in list(mod._buffers.items()):
            if b is not None:
                saved.append((mod, name, b, False, id(b)))

    def _set(mod: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
        if is_param:
            mod._parameters[name].data = value
        else:
            mod._buffers[name] = value

    block_slots: dict[int, list[tuple[nn.Module, str, torch.Tensor, bool, int]]] = {}
    for block in blocks:
        mods = {id(m) for m in block.modules()}
        block_slots[id(block)] = [s for s in saved if id(s[0]) in mods]

    def _empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=t.dtype, device=device)

    def onload(block, *_):
        for mod, name, host, is_param, _ in block_slots[id(block)]:
            _set(mod, name, host.to(device), is_param)

    def offload(block, *_):
        for mod, name, host, is_param, _ in block_slots[id(block)]:
            _set(mod, name, _empty(host), is_param)

    handles = []
    try:
        # Outside the blocks: resident on the device (tied weights are moved once: same tensor id).
        moved: dict[int, torch.Tensor] = {}
        for mod, name, host, is_param, ident in saved:
            if ident in in_blocks:
                continue
            if ident not in moved:
                moved[ident] = host.to(device)
            _set(mod, name, moved[ident], is_param)
        for block in blocks:
            offload(block)
            handles.append(block.register_forward_pre_hook(onload))
            handles.append(block.register_forward_hook(offload))
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, name, host, is_param, _ in saved:
            _set(mod, name, host, is_param)
