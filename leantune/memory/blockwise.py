"""Run a module on a device with its repeated blocks resident only during their own forward.

A text encoder runs once per request or per caching pass, so it does not need the training
engine's ring of prefetched slots: `blockwise_offload` keeps everything outside the blocks (the
embedding, the final norm) on the device and brings one block at a time, dropping it right after
its forward. That costs one pass over the weights and bounds the peak at one block plus
activations (T5-XXL for sampling; Qwen-Image's 7B Qwen2.5-VL in the caching phase as well).

`blockwise_from_source` does the same for a model that is not in host RAM at all (FLUX.2-dev's 24B
Mistral is 48 GB in bf16, more than a 64 GB machine can hold beside everything else): its
parameters are meta placeholders and every tensor is read from the checkpoint files just before
it is used, so host RAM holds one tensor in flight and the device one block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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


@contextmanager
def blockwise_from_source(model: nn.Module, blocks: nn.ModuleList, device,
                          read: Callable[[str, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Run `model`, whose weights live only in their files, on `device` one block at a time.

    `model` was built with its parameters on the meta device (no host copy at all; buffers that
    `__init__` computes, such as a rotary table, are real). `read(name, placeholder)` returns the
    tensor of the parameter or buffer `name` (its qualified name in `model`) on `device`: the
    caller reads it from the checkpoint files, so host RAM holds at most the tensor being read.
    Everything outside `blocks` is read once on entry and stays on `device`; a block's tensors are
    read by a forward pre-hook and dropped by a forward hook, so the device holds one block at a
    time and the host none. Real buffers move to `device` for the duration. On exit the model is
    back as it was (meta parameters), holding nothing.
    """
    device = torch.device(device)
    in_blocks = {id(t) for b in blocks for t in list(b.parameters()) + list(b.buffers())}
    # (owner module, attribute, original tensor, is-parameter, identity, qualified name); a tied
    # tensor appears under each owner with one identity and is read once.
    saved: list[tuple[nn.Module, str, torch.Tensor, bool, int, str]] = []
    for prefix, mod in model.named_modules(remove_duplicate=False):
        for name, p in list(mod._parameters.items()):
            if p is not None:
                saved.append((mod, name, p, True, id(p), f"{prefix}.{name}" if prefix else name))
        for name, b in list(mod._buffers.items()):
            if b is not None:
                saved.append((mod, name, b, False, id(b), f"{prefix}.{name}" if prefix else name))
    first_name: dict[int, str] = {}
    for *_, ident, qual in saved:
        first_name.setdefault(ident, qual)

    def _set(mod: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
        # a meta Parameter cannot take real data (set_data refuses): a new Parameter per tensor,
        # shared by the owners of a tied tensor; the original objects come back on exit
        if is_param and not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        (mod._parameters if is_param else mod._buffers)[name] = value

    def fetch(tensor: torch.Tensor, ident: int) -> torch.Tensor:
        if tensor.device.type == "meta":
            got = read(first_name[ident], tensor)
            if tuple(got.shape) != tuple(tensor.shape):
                raise ValueError(f"{first_name[ident]}: the source gave shape {tuple(got.shape)}, the model "
                                 f"expects {tuple(tensor.shape)}")
            return nn.Parameter(got, requires_grad=False) if isinstance(tensor, nn.Parameter) else got
        return tensor.to(device)

    block_slots: dict[int, list] = {}
    for block in blocks:
        mods = {id(m) for m in block.modules()}
        block_slots[id(block)] = [s for s in saved if id(s[0]) in mods]

    def onload(block, *_):
        fetched: dict[int, torch.Tensor] = {}
        for mod, name, orig, is_param, ident, _ in block_slots[id(block)]:
            if ident not in fetched:
                fetched[ident] = fetch(orig, ident)
            _set(mod, name, fetched[ident], is_param)

    def offload(block, *_):
        for mod, name, orig, is_param, _, _ in block_slots[id(block)]:
            _set(mod, name, torch.empty(0, dtype=orig.dtype, device=device), is_param)

    handles = []
    try:
        resident: dict[int, torch.Tensor] = {}
        for mod, name, orig, is_param, ident, _ in saved:
            if ident in in_blocks:
                continue
            if ident not in resident:
                resident[ident] = fetch(orig, ident)
            _set(mod, name, resident[ident], is_param)
        del resident
        for block in blocks:
            offload(block)
            handles.append(block.register_forward_pre_hook(onload))
            handles.append(block.register_forward_hook(offload))
        yield
    finally:
        for h in handles:
            h.remove()
        for mod, name, orig, is_param, _, _ in saved:
            (mod._parameters if is_param else mod._buffers)[name] = orig
