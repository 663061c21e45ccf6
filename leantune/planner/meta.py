"""Architectures on the meta device: exact shapes and dtypes, no memory, built in milliseconds.

The planner never needs weight values, only shapes, so everything it measures is built here on the
meta device: the full-size Flux.1 and SD3.5 transformers (`leantune plan --model flux-dev` on a laptop), the
architecture a config's checkpoint declares, and the small copy (two blocks of each kind) whose
forward and backward the activation probe traces.
"""

from __future__ import annotations

import torch

from ..family_registry import FAMILIES

# Config keys holding the length of each block list, per family: the probe copy shortens them. And
# blocks at the end of a list built unlike the others (SD3's last joint block is "context pre-only":
# no text-stream output projection or MLP): the probe copy is built with them and then cut off, so
# the blocks it traces are the ones the rest of the stack is made of. Both from family_registry.py.
BLOCK_COUNT_KEYS = {name: dict(entry.block_counts) for name, entry in FAMILIES.items()}
TRAILING_SPECIAL = {name: dict(entry.trailing_special) for name, entry in FAMILIES.items() if entry.trailing_special}
# T5 tokens each Flux.1 variant is run with (schnell was distilled at 256).
TEXT_LENGTH = {"dev": 512, "schnell": 256}


def meta_from_config(cls, config: dict, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """`cls.from_config(config)` on the meta device, floating tensors in `dtype`."""
    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    with torch.device("meta"):
        model = cls.from_config(config)
    model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
    return model


def build_meta_flux(variant: str = "dev"):
    """The full-size Flux.1 transformer (dev: with the guidance embedder; schnell: without) on the
    meta device, from the architecture config shipped in the package (nothing is fetched)."""
    from diffusers import FluxTransformer2DModel

    from ..models.component_files import packaged_config

    if variant not in ("dev", "schnell"):
        raise ValueError(f"unknown Flux variant {variant!r}; choose 'dev' or 'schnell'")
    return meta_from_config(FluxTransformer2DModel, packaged_config(f"flux1_{variant}"))


def build_meta_packaged(family: str, config_name: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A full-size transformer of `family` on the meta device from a config shipped in
    models/configs/ ("flux1_dev", "sd35_large", ...), built with the family's diffusers class."""
    import diffusers

    from ..models.component_files import packaged_config
    from ..models.family import get_family

    spec = get_family(family)
    cls = spec.meta_transformer_class() if spec.meta_transformer_class else getattr(diffusers, spec.transformer_classes[0])
    return meta_from_config(cls, packaged_config(config_name), dtype)


def short_copy(spec, model: torch.nn.Module, dtype: torch.dtype, blocks_per_list: int = 2) -> torch.nn.Module:
    """`model`'s architecture on meta with at most `blocks_per_list` blocks of each kind in each list.

    Every block of a kind has the same shapes (but the trailing ones of TRAILING_SPECIAL, left out
    of the copy), so a short copy shows what each kind does; tracing it costs milliseconds where the
    full model would cost seconds. A list whose blocks come in variants (spec.block_variants: SD3.5
    Medium's 13 dual-attention joint blocks, then 11 plain ones) keeps up to `blocks_per_list` of
    each, in the order the kinds first appear, so each kind's last block in the copy takes its
    input from a block of its own kind, as almost every block of that kind in the full model does.
    A kind that only a trailing block is priced as (a tiny or pruned Medium whose plain joint block
    is the last, context-pre-only one) is given `blocks_per_list` plain blocks of its own after the
    others, so every kind the stack is priced with is traced.
    """
    keys = BLOCK_COUNT_KEYS.get(spec.family)
    if keys is None or not hasattr(model, "config"):
        raise ValueError(f"the planner cannot build a probe copy of a {spec.family} model")
    trailing = TRAILING_SPECIAL.get(spec.family, {})
    cfg = dict(model.config)
    for attr, key in keys.items():
        n = len(getattr(model, attr))
        extra = trailing.get(attr, 0)
        bl = next(b for b in spec.block_lists if b.attr == attr)
        kinds = spec.list_kinds(model, bl)
        body = kinds[:max(n - extra, 1)]
        layout: list[str] = []                      # the copy's kinds in order, `blocks_per_list` at most of each
        for kind in dict.fromkeys(body):
            layout += [kind] * min(blocks_per_list, body.count(kind))
        # A kind only the trailing blocks have (a pruned SD3.5 Medium: dual-attention blocks, then the
        # last, context-pre-only one): the stack still prices those blocks as that kind, so the copy
        # gets `blocks_per_list` plain blocks of it (the ones a longer stack of that kind would have).
        for kind in dict.fromkeys(kinds[len(body):]):
            if kind not in layout:
                layout += [kind] * blocks_per_list
        cfg[key] = len(layout) + extra
        for v in spec.block_variants:
            if v.attr == attr:
                cfg[v.config_key] = tuple(i for i, kind in enumerate(layout) if kind == v.kind)
    copy = meta_from_config(_probe_class(spec, model), cfg, dtype)
    for attr, extra in trailing.items():
        blocks = getattr(copy, attr)
        if extra and len(blocks) > extra:
            setattr(copy, attr, torch.nn.ModuleList(list(blocks)[:-extra]))
    _split_class(spec, copy)
    return copy


def _split_class(spec, copy: torch.nn.Module) -> None:
    """The copy's blocks get the family's split class (ModelFamily.split_blocks), as its loader
    gives them on every load: the probe runs the class training runs, switched by the probe."""
    from ..models.family import family_of_spec

    try:
        family = family_of_spec(spec)
    except KeyError:
        return
    if family.split_blocks is not None:
        family.split_blocks(copy)



def _probe_class(spec, model: torch.nn.Module) -> type:
    """The class the probe copy of `model` is built with: the family's meta class when it declares
    one for `model`'s class (models/family.py meta_transformer_class), else `model`'s own.

    A copy on meta has weights without values; a family whose forward reads values from its inputs
    (Qwen-Image-2.1 reads its token layout from a host slot mask: qwen_image21/meta_model.py) runs
    that forward only in its meta class. A loaded model is the library's class itself, so the copy
    of a loaded model is built with the meta class too, or the probe of a loaded model would run a
    forward that cannot run on meta while the meta-built one of `leantune plan --model` plans."""
    from ..models.family import family_of_spec

    cls = type(model)
    try:
        family = family_of_spec(spec)
    except KeyError:             # a spec of no registered family: its model's class is the only one known
        return cls
    meta_cls = family.meta_transformer_class() if family.meta_transformer_class else None
    return meta_cls if meta_cls is not None and issubclass(meta_cls, cls) else cls
