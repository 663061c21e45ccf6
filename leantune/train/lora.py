"""LoRA adapters on a diffusers transformer (Flux, SD3.5), through peft.

Training adds one peft adapter ("default") on the Linears a [lora] preset names (spec regexes,
optionally restricted to some blocks), with standard init (A random, B zero, so the model starts
unchanged) and its parameters in fp32 while the frozen base stays bf16 (or fp8 under the memory
engine): peft casts the input to the adapter's dtype and the sum back to the base output's dtype.

Sampling may stack more LoRAs read from files (`apply_lora`): each becomes its own unmerged,
frozen peft adapter with its own strength, so base weights (fp8 included) are never rewritten
and the training adapter keeps training beside them. Merging into the weights, as kohya's
inference does, would need a bf16 copy of every fp8 weight and loses exactness.

diffusers' own `add_adapter` activates only the newest adapter and peft's `set_adapter` toggles
requires_grad; `_adapter_state_kept` undoes both so adding or removing one adapter never
silences or unfreezes another. File formats live in lora_formats.py.
"""

from __future__ import annotations

import math
import re
import warnings
from contextlib import contextmanager

import torch

from ..spec import ModelSpec

from .lora_formats import (  # noqa: F401  (re-exported: the trainer and sampler import from here)
    IgnoredKeysWarning,
    LoraCompatibilityWarning,
    LoraFormatError,
    LoraModule,
    LoraWeights,
    lora_from_state_dict,
    peft_config_kwargs,
    read_lora,
    save_lora,
)


def _tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def lora_layers(model: torch.nn.Module, adapter_name: str) -> dict[str, torch.nn.Module]:
    """peft LoRA layers holding `adapter_name`, by module name relative to `model`."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer) and adapter_name in m.lora_A}


def _adapter_names(model: torch.nn.Module) -> set[str]:
    names = set(getattr(model, "peft_config", {}) or {})
    for layer in _tuner_layers(model):
        names.update(layer.lora_A.keys())
    return names


@contextmanager
def _adapter_state_kept(model: torch.nn.Module, add: str | None = None, drop: str | None = None):
    """Keep every other adapter active and every parameter's requires_grad across an add/delete."""
    active: list[str] = []
    for layer in _tuner_layers(model):
        for name in layer.active_adapters:
            if name not in active:
                active.append(name)
    grads = {p: p.requires_grad for p in model.parameters()}
    try:
        with warnings.catch_warnings():
            # peft warns whenever a second adapter is injected; several adapters are intended here.
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            yield
    finally:
        present = _adapter_names(model)
        wanted = [a for a in active if a != drop and a in present]
        if add and add in present and add not in wanted:
            wanted.append(add)
        for layer in _tuner_layers(model):
            layer.set_adapter(wanted)
        for p in model.parameters():
            p.requires_grad_(grads.get(p, False))   # parameters the operation created start frozen


def _check_block_selection(model: torch.nn.Module, spec: ModelSpec, blocks: dict[str, list[int]] | None) -> None:
    for kind, indices in (blocks or {}).items():
        bl = spec.block_list(kind)
        count = len(getattr(model, bl.attr))
        bad = [i for i in indices if not 0 <= i < count]
        if bad:
            raise ValueError(f"[lora] blocks.{kind}: indices {bad} are out of range; the model has {count} "
                             f"{kind} blocks (0..{count - 1})")


class LoraRankWarning(UserWarning):
    """[lora] rank exceeds the smaller side of adapted layers: the extra rank adds nothing there."""


def _warn_rank_beyond_layers(transformer: torch.nn.Module, targets: list[str], rank: int) -> None:
    """A LoRA of a Linear (out, in) has rank at most min(out, in); beyond it the extra rank only
    costs memory and steps. One warning with the count and the smallest layer."""
    over = []
    for name in targets:
        m = transformer.get_submodule(name)
        linear = getattr(m, "base_layer", m)
        side = min(linear.in_features, linear.out_features)
        if rank > side:
            over.append((side, name, linear.out_features, linear.in_features))
    if over:
        side, name, out, inn = min(over)
        warnings.warn(f"[lora] rank {rank} is larger than the smaller side of {len(over)} of {len(targets)} adapted "
                      f"layer(s) (e.g. {name}, {out} x {inn}: at most rank {side}); the extra rank adds nothing "
                      f"there but memory and compute", LoraRankWarning, stacklevel=3)


def add_lora(transformer: torch.nn.Module, spec: ModelSpec, lora_cfg, adapter_name: str = "default",
             ) -> list[torch.nn.Parameter]:
    """Add the trainable adapter described by a [lora] section; return its parameters (fp32).

    The base model is frozen. Targets come from `spec.lora_target_regex(lora_cfg.targets,
    lora_cfg.blocks)`, a full-match regex, so a preset's "proj_out" never wraps the top-level
    final projection.
    """
    from peft import LoraConfig as PeftLoraConfig

    if adapter_name in _adapter_names(transformer):
        raise ValueError(f"the transformer already has an adapter named {adapter_name!r}")
    _check_block_selection(transformer, spec, lora_cfg.blocks)
    regex = spec.lora_target_regex(lora_cfg.targets, lora_cfg.blocks)
    matched = [(n, m) for n, m in transformer.named_modules()
               if re.fullmatch(regex, n) and not re.search(r"\.(base_layer|lora_\w+)(\.|$)", n)]
    targets = [n for n, m in matched if isinstance(getattr(m, "base_layer", m), torch.nn.Linear)]   # peft wraps
    if not targets:
        raise ValueError(f"[lora] targets = {lora_cfg.targets!r} with blocks = {lora_cfg.blocks} selects no module")
    _warn_rank_beyond_layers(transformer, targets, lora_cfg.rank)
    if len(targets) < len(matched):            # all_linear names whole top-level children: keep their Linears
        regex = "^(" + "|".join(re.escape(n) for n in targets) + ")$"
    config = PeftLoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.effective_alpha, lora_dropout=lora_cfg.dropout,
                            target_modules=regex, init_lora_weights=True)
    transformer.requires_grad_(False)
    with _adapter_state_kept(transformer, add=adapter_name):
        transformer.add_adapter(config, adapter_name)
    params = []
    for layer in lora_layers(transformer, adapter_name).values():
        a, b = layer.lora_A[adapter_name], layer.lora_B[adapter_name]
        created = a.weight.dtype
        a.float()                           # peft may create them in the base dtype (bf16, even fp8)
        b.float()
        if created != torch.float32:
            # Redo the standard init in fp32: an fp8-rounded kaiming draw is mostly zeros and steps.
            with torch.no_grad():
                torch.nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
                b.weight.zero_()
        for p in (a.weight, b.weight):
            p.requires_grad_(True)
            params.append(p)
    return params


def model_lora_keys(transformer: torch.nn.Module):
    """The LoRA names of a loaded transformer's family (spec.lora_keys), or None for a class no
    family claims."""
    from leantune.models.family import family_for_model

    try:
        return family_for_model(transformer).spec.lora_keys
    except TypeError:
        return None


def lora_weights_from_model(transformer: torch.nn.Module, adapter_name: str = "default") -> LoraWeights:
    """A CPU copy of an adapter's weights, keyed by module name ('transformer_blocks.0.attn.to_q'),
    knowing the model's family (so its kohya names are the family's)."""
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter named {adapter_name!r}")
    modules = {}
    for name, layer in layers.items():
        if layer.use_dora.get(adapter_name, False):
            raise LoraFormatError(f"{name}: DoRA adapters cannot be exported")
        down = layer.lora_A[adapter_name].weight.detach().to("cpu", copy=True)   # (r, in)
        up = layer.lora_B[adapter_name].weight.detach().to("cpu", copy=True)     # (out, r)
        alpha = float(layer.lora_alpha[adapter_name])
        if layer.use_rslora.get(adapter_name, False):
            alpha *= math.sqrt(layer.r[adapter_name])   # rsLoRA's alpha / sqrt(r) as alpha' / r
        modules[name] = LoraModule(down, up, alpha, key=name)
    return LoraWeights(modules=modules, source=f"adapter {adapter_name!r}", keys=model_lora_keys(transformer))


def _base_linear(model: torch.nn.Module, name: str, weights: LoraWeights, key: str) -> torch.nn.Module:
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise LoraFormatError(f"{weights.source}: LoRA key {key!r} targets {name!r}, which this model does not "
                              f"have (a LoRA for another architecture?)") from None
    if isinstance(module, BaseTunerLayer):
        module = module.get_base_layer()
    if not (hasattr(module, "in_features") and hasattr(module, "out_features")):
        raise LoraFormatError(f"{weights.source}: LoRA key {key!r} targets {name!r}, which is a "
                              f"{type(module).__name__}, not a Linear")
    return module


def check_fits(model: torch.nn.Module, weights: LoraWeights) -> None:
    """Raise naming the file and key if a LoRA module does not match the model's Linear shapes."""
    for name, m in weights.modules.items():
        linear = _base_linear(model, name, weights, m.key or name)
        if m.down.shape[1] != linear.in_features or m.up.shape[0] != linear.out_features:
            raise LoraFormatError(
                f"{weights.source}: LoRA key {m.key or name!r} has down {tuple(m.down.shape)} / up "
                f"{tuple(m.up.shape)} but the model's {name} is Linear(in={linear.in_features}, "
                f"out={linear.out_features}); the LoRA was trained for a different model")


def apply_lora(transformer: torch.nn.Module, weights: LoraWeights, strength: float = 1.0,
               adapter_name: str = "lora", dtype: torch.dtype = torch.float32) -> list[str]:
    """Attach `weights` as a frozen, unmerged adapter at `strength`; other adapters stay active.

    Each module's output gains strength * alpha / r * up @ down @ x. Returns the wrapped module
    names. Call before the memory engine is applied (it streams what exists at that time).
    """
    from peft import LoraConfig as PeftLoraConfig

    if adapter_name in _adapter_names(transformer):
        raise ValueError(f"the transformer already has an adapter named {adapter_name!r}")
    check_fits(transformer, weights)
    config = PeftLoraConfig(**peft_config_kwargs(weights), init_lora_weights=False)
    with _adapter_state_kept(transformer, add=adapter_name):
        transformer.add_adapter(config, adapter_name)
    layers = lora_layers(transformer, adapter_name)
    if set(layers) != set(weights.modules):
        raise RuntimeError(f"peft wrapped {sorted(set(layers) ^ set(weights.modules))[:5]} unlike the LoRA's modules")
    with torch.no_grad():
        for name, layer in layers.items():
            m = weights.modules[name]
            if layer.r[adapter_name] != m.rank or not math.isclose(layer.lora_alpha[adapter_name], m.alpha):
                raise RuntimeError(f"{name}: peft gave rank {layer.r[adapter_name]} alpha "
                                   f"{layer.lora_alpha[adapter_name]}, the LoRA has {m.rank} / {m.alpha}")
            layer.lora_A[adapter_name].to(dtype)
            layer.lora_B[adapter_name].to(dtype)
            a, b = layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight
            a.copy_(m.down)
            b.copy_(m.up)
            a.requires_grad_(False)
            b.requires_grad_(False)
            layer.set_scale(adapter_name, strength)
    return sorted(layers)


def set_lora_strength(transformer: torch.nn.Module, adapter_name: str, strength: float) -> None:
    """Change an applied adapter's strength (scale = strength * alpha / r) without reloading it."""
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter named {adapter_name!r}")
    for layer in layers.values():
        layer.set_scale(adapter_name, strength)


def remove_lora(transformer: torch.nn.Module, adapter_name: str) -> None:
    """Delete an adapter; the others keep their active state and requires_grad."""
    if adapter_name not in _adapter_names(transformer):
        raise ValueError(f"the transformer has no adapter named {adapter_name!r}")
    with _adapter_state_kept(transformer, drop=adapter_name):
        transformer.delete_adapters(adapter_name)


def load_lora_into_model(transformer: torch.nn.Module, weights: LoraWeights, adapter_name: str = "default",
                         ) -> list[str]:
    """Set an existing (trainable) adapter to a LoRA file's values, e.g. for [lora] init_from.

    The file's scale is folded into B where the adapter's alpha differs, so the model's delta
    equals the file's exactly. Modules the adapter has but the file lacks keep their values (B = 0
    after init: no change). Ranks must match, and every file module must be a target of the
    adapter. Returns the names set.
    """
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter named {adapter_name!r}")
    check_fits(transformer, weights)
    for name, m in weights.modules.items():
        key = m.key or name
        if name not in layers:
            raise LoraFormatError(f"{weights.source}: LoRA key {key!r} trains {name!r}, which the [lora] targets "
                                  f"do not include; widen [lora] targets or blocks")
        if layers[name].r[adapter_name] != m.rank:
            raise LoraFormatError(f"{weights.source}: LoRA key {key!r} has rank {m.rank} but [lora] rank is "
                                  f"{layers[name].r[adapter_name]}")
    with torch.no_grad():
        for name, m in weights.modules.items():
            layer = layers[name]
            adapter_scale = layer.lora_alpha[adapter_name] / layer.r[adapter_name]
            if layer.use_rslora.get(adapter_name, False):
                adapter_scale = layer.lora_alpha[adapter_name] / math.sqrt(layer.r[adapter_name])
            a, b = layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight
            a.copy_(m.down)
            b.copy_(m.up.float() * (m.scale / adapter_scale) if m.scale != adapter_scale else m.up)
    return sorted(weights.modules)
