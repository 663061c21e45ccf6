"""The Linears of a model's blocks that frozen-weight storage formats replace, and the adapter
modules they must leave alone: what fp8, NF4 and int8 storage (memory/fp8.py, nf4_storage.py,
int8_storage.py) and the engine's packing (streaming_units.py) all walk, kept apart so the
formats do not import each other."""

from __future__ import annotations

from torch import nn

from ..spec import ModelSpec


def adapter_module_ids(module: nn.Module) -> set[int]:
    """ids of every module that belongs to a peft adapter (lora_A/lora_B/... containers) under
    `module`; their weights are never quantized, and streamed only for a frozen base adapter
    (streaming_units.streams_with_unit)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # peft is a dependency, but a model without adapters needs nothing from it
        return set()
    ids: set[int] = set()
    for m in module.modules():
        if isinstance(m, BaseTunerLayer):
            for name in tuple(m.adapter_layer_names) + tuple(getattr(m, "other_param_names", ())):
                container = getattr(m, name, None)
                if isinstance(container, nn.Module):
                    ids.update(id(x) for x in container.modules())
    return ids


def dora_bases(model: nn.Module) -> set[int]:
    """ids of the base Linears of peft layers with a DoRA adapter (their weight must stay readable)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return set()
    return {id(m.get_base_layer()) for m in model.modules()
            if isinstance(m, LoraLayer) and any(m.use_dora.values())}


def block_linears(spec: ModelSpec, model: nn.Module) -> list[tuple[str, str, nn.Linear]]:
    """Every base nn.Linear inside the spec's blocks as (qualified name, name relative to the block,
    module). peft's wrapper names are folded: 'attn.to_q.base_layer' is reported as 'attn.to_q'."""
    out = []
    for block_name, block in spec.blocks(model):
        skip = adapter_module_ids(block)
        for rel, m in block.named_modules():
            if id(m) in skip or type(m) is not nn.Linear:
                continue
            rel = rel.replace(".base_layer", "")     # every wrapper level (two adapter types nest)
            out.append((f"{block_name}.{rel}", rel, m))
    return out
