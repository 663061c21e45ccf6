"""A loaded transformer cut down to a few of its own blocks, for `leantune check` when the whole
model does not fit the device.

Why: the check compares each memory technique of a plan against the same run without it. On the
machines the techniques are for, the run without them (the whole model on the device) is exactly
what does not fit. The techniques act block by block (a streamed block, a checkpointed block, an
fp8 block Linear), so the check can prove them on a model of a few of the user's own blocks, with
their real weights, shapes and recipe: the blocks the plan streams and one it keeps resident, in
their order, each list's trailing special blocks kept last (SD3.5's context-pre-only block). The
model is cut in place after loading, before adapters are added, and its config's block counts
(and variant index lists) follow, so the family's forward runs it as a shorter model.
"""

from __future__ import annotations

import torch

from ..family_registry import FAMILIES
from ..spec import ModelSpec


def choose(spec: ModelSpec, model: torch.nn.Module, streamed: tuple[str, ...], ring_slots: int = 2,
           ) -> dict[str, tuple[int, ...]]:
    """{list attr: kept indices}: the first `ring_slots + 1` blocks `streamed` names, in execution
    order (so that a slot of the ring is reused, in forward and in backward, as it is in the whole
    model), one block per list it does not name (resident), and each list's trailing special
    blocks."""
    trailing = FAMILIES[spec.family].trailing_special if spec.family in FAMILIES else {}
    streamed = set(streamed)
    keep, wanted = {}, ring_slots + 1
    for bl in spec.block_lists:
        n = len(getattr(model, bl.attr))
        extra = trailing.get(bl.attr, 0)
        body = range(n - extra)
        moved = [i for i in body if f"{bl.attr}.{i}" in streamed][:wanted]
        wanted -= len(moved)
        resident = [i for i in body if f"{bl.attr}.{i}" not in streamed][:1]
        chosen = sorted(set(moved + resident)) or list(body)[:1]
        keep[bl.attr] = tuple(chosen) + tuple(range(n - extra, n))
    return keep


def renamed(keep: dict[str, tuple[int, ...]], names) -> tuple[str, ...]:
    """Block names of the whole model ("transformer_blocks.7") as the cut model names them, for
    the names it keeps (others dropped)."""
    out = []
    for name in names:
        attr, _, index = name.rpartition(".")
        if attr in keep and index.isdigit() and int(index) in keep[attr]:
            out.append(f"{attr}.{keep[attr].index(int(index))}")
    return tuple(out)


def keep_blocks(model: torch.nn.Module, spec: ModelSpec, keep: dict[str, tuple[int, ...]]) -> None:
    """Cut `model` in place to the blocks `keep` lists; its config's counts and variant index lists
    follow (register_to_config), so the model is what a config with those blocks would build."""
    counts = FAMILIES[spec.family].block_counts if spec.family in FAMILIES else {}
    config = dict(getattr(model, "config", {}) or {})
    updates = {}
    for bl in spec.block_lists:
        if bl.attr not in keep:
            continue
        blocks = getattr(model, bl.attr)
        indices = keep[bl.attr]
        if not indices or any(not 0 <= i < len(blocks) for i in indices) or list(indices) != sorted(set(indices)):
            raise ValueError(f"block subset of {bl.attr}: {indices} are not increasing indices of its "
                             f"{len(blocks)} blocks")
        setattr(model, bl.attr, torch.nn.ModuleList([blocks[i] for i in indices]))
        if bl.attr in counts:
            updates[counts[bl.attr]] = len(indices)
        for v in spec.block_variants:
            if v.attr == bl.attr and v.config_key in config:
                was = {int(i) for i in (config[v.config_key] or ())}
                updates[v.config_key] = tuple(pos for pos, i in enumerate(indices) if i in was)
    if updates and hasattr(model, "register_to_config"):
        model.register_to_config(**updates)
