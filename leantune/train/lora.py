"""LoRA adapters on a diffusers transformer (Flux, SD3.5), through peft.

Training adds one peft adapter ("default") on the Linears a [lora] preset names (spec regexes,
optionally restricted to some blocks), with standard init (A random, B zero, so the model starts
unchanged) and its parameters in fp32 while the frozen base stays bf16 (or fp8 under the memory
engine): peft casts the input to the adapter's dtype and the sum back to the base output's dtype.
`[lora] type` picks peft's LoRA, DoRA (use_dora), LoKr or LoHa on the same Linears
(train/adapter_types.py); every function here takes any of them (`adapter_parameters` names each
type's tensors by role). DoRA reads its base weight, so it is refused over an fp8 one. A second
adapter type on a Linear wraps the first peft layer (peft nests them); names are the Linear's.

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
from . import quantized_adapters as quantized

from .lora_formats import (  # noqa: F401  (re-exported: the trainer and sampler import from here)
    IgnoredKeysWarning,
    LoraCompatibilityWarning,
    LoraFormatError,
    LoraModule,
    LoraWeights,
    LycorisModule,
    lora_from_state_dict,
    peft_config_kwargs,
    read_lora,
    save_lora,
)

# peft's parameter containers of each adapter type, by the role names of lora_formats' modules
_LORA_ROLES = {"down": "lora_A", "up": "lora_B", "magnitude": "lora_magnitude_vector"}
_LOKR_ROLES = {r: f"lokr_{r}" for r in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")}
_LOHA_ROLES = {r: f"hada_{r}" for r in ("w1_a", "w1_b", "w2_a", "w2_b")}


def _tuner_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def layer_adapters(layer: torch.nn.Module) -> set[str]:
    """The adapter names a peft tuner layer (LoRA, DoRA, LoKr, LoHa) holds."""
    names: set[str] = set()
    for attr in layer.adapter_layer_names:
        container = getattr(layer, attr, None)
        if isinstance(container, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
            names.update(container.keys())
    return names


def layer_kind(layer: torch.nn.Module, adapter_name: str) -> str:
    """The adapter type `adapter_name` has on a peft layer: "lora", "dora", "lokr" or "loha"."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer

    if isinstance(layer, LoKrLayer):
        return "lokr"
    if isinstance(layer, LoHaLayer):
        return "loha"
    return "dora" if layer.use_dora.get(adapter_name, False) else "lora"


def adapter_parameters(layer: torch.nn.Module, adapter_name: str) -> dict[str, torch.nn.Parameter]:
    """The parameters of one adapter on one peft layer, by role (LoRA / DoRA: down, up, magnitude;
    LoKr: w1 or w1_a / w1_b, w2 or w2_a / w2_b; LoHa: w1_a, w1_b, w2_a, w2_b), in that order."""
    kind = layer_kind(layer, adapter_name)
    roles = {"lokr": _LOKR_ROLES, "loha": _LOHA_ROLES}.get(kind, _LORA_ROLES)
    out = {}
    for role, attr in roles.items():
        container = getattr(layer, attr, None)
        if container is None or adapter_name not in container:
            continue
        item = container[adapter_name]
        out[role] = item if isinstance(item, torch.nn.Parameter) else item.weight
    return out


def _wrapped_name(name: str) -> str:
    """A tuner layer's module name without peft's wrapper levels: a second adapter type on a Linear
    wraps the first layer ('attn.to_q.base_layer' is then the inner one, for 'attn.to_q')."""
    return name.replace(".base_layer", "")


def lora_layers(model: torch.nn.Module, adapter_name: str) -> dict[str, torch.nn.Module]:
    """peft layers (any adapter type) holding `adapter_name`, by the wrapped Linear's module name
    relative to `model`."""
    return {_wrapped_name(n): m for n, m in model.named_modules()
            if _is_tuner_layer(m) and adapter_name in layer_adapters(m)}


def _is_tuner_layer(m: torch.nn.Module) -> bool:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(m, BaseTunerLayer)


def _adapter_names(model: torch.nn.Module) -> set[str]:
    names = set(getattr(model, "peft_config", {}) or {})
    for layer in _tuner_layers(model):
        names.update(layer_adapters(layer))
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


def _peft_config(kind: str, lora_cfg, regex: str):
    """The peft config of a [lora] section's adapter type (train/adapter_types.py)."""
    from peft import LoHaConfig, LoKrConfig
    from peft import LoraConfig as PeftLoraConfig

    if kind in ("lora", "dora"):
        return PeftLoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.effective_alpha, lora_dropout=lora_cfg.dropout,
                              target_modules=regex, init_lora_weights=True, use_dora=kind == "dora")
    if kind == "lokr":
        return LoKrConfig(r=lora_cfg.rank, alpha=lora_cfg.effective_alpha, target_modules=regex, init_weights=True,
                          decompose_factor=lora_cfg.factor, decompose_both=lora_cfg.decompose_both)
    if kind == "loha":
        return LoHaConfig(r=lora_cfg.rank, alpha=lora_cfg.effective_alpha, target_modules=regex, init_weights=True)
    raise ValueError(f"[lora] type = {kind!r} is not one of lora, dora, lokr, loha")


def _refuse_fp8_base_for_dora(transformer: torch.nn.Module, names: list[str], what: str) -> None:
    """DoRA reads the base weight itself (its row norms): an e4m3 weight would be read without its
    scale. (A GGUF / NF4 / int8 base is read through its own decoder: train/quantized_adapters.py.)"""
    for name in names:
        m = transformer.get_submodule(name)
        linear = m.get_base_layer() if _is_tuner_layer(m) else m
        if linear.weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{what}: DoRA normalises each row of the base weight plus its update, but "
                             f"{name}.weight is stored in {linear.weight.dtype} (an fp8 checkpoint), which peft would "
                             f"read without its scale; use a bf16 checkpoint, or [lora] type \"lora\", \"lokr\" or "
                             f"\"loha\"")


def _to_fp32(layer: torch.nn.Module, adapter_name: str, kind: str) -> None:
    """Adapter parameters in fp32 (peft may create them in the base dtype, bf16 or even fp8), with
    the standard init redone in fp32 where they were not (an fp8-rounded draw is mostly zeros and
    steps); DoRA's magnitude recomputed in fp32 as the base rows' norms (B = 0 at init)."""
    params = adapter_parameters(layer, adapter_name)
    created = {p.dtype for p in params.values()}
    with torch.no_grad():
        for p in params.values():
            p.data = p.data.float()
        if created == {torch.float32}:
            return
        if kind in ("lora", "dora"):
            torch.nn.init.kaiming_uniform_(params["down"], a=math.sqrt(5))
            params["up"].zero_()
            if kind == "dora":
                base = layer.get_base_layer()
                weight = quantized.decoded_weight(base) if quantized.is_quantized(base) else base.weight.float()
                params["magnitude"].copy_(torch.linalg.norm(weight, dim=1))
        else:
            layer.reset_adapter_parameters(adapter_name)


_SAME_WIDTH_INTEGER = {1: torch.uint8, 2: torch.int16}


@contextmanager
def _base_weights_as_integers(transformer: torch.nn.Module, names: list[str]):
    """The targeted Linears' bf16 / fp16 / fp8 weights viewed as integers of the same width while
    peft adds the adapter, and their own dtype again after.

    Why: peft draws the adapter's init in fp32, then casts the factors to the base weight's dtype
    when that dtype is floating point (`_move_adapter_to_device_of_base_layer`). An fp8 or bf16
    cast destroys the draw, and drawing again in fp32 afterwards (`_to_fp32`) consumed more of the
    random stream for those Linears only, so the same seed gave another LoRA with fp8 storage than
    without (34 of the tiny Flux's 80 factors), and an fp32 model another than a bf16 one. Seen as
    integers the weights are not cast to, so every Linear keeps peft's first fp32 draw whatever its
    storage. Shapes are unchanged (same element width), which is all peft reads of the weight for
    LoRA, LoKr and LoHa; DoRA reads its values (the magnitude's row norms), so add_lora leaves a
    DoRA's bases as they are (never fp8: refused above) and `_to_fp32` redoes its init."""
    swapped = []
    try:
        for name in names:
            m = transformer.get_submodule(name)
            linear = m.get_base_layer() if _is_tuner_layer(m) else m
            w = linear.weight
            if w.dtype.is_floating_point and w.dtype != torch.float32 and w.element_size() in _SAME_WIDTH_INTEGER:
                swapped.append((w, w.dtype))
                w.data = w.data.view(_SAME_WIDTH_INTEGER[w.element_size()])
        yield
    finally:
        for w, dtype in swapped:
            w.data = w.data.view(dtype)


def add_lora(transformer: torch.nn.Module, spec: ModelSpec, lora_cfg, adapter_name: str = "default",
             ) -> list[torch.nn.Parameter]:
    """Add the trainable adapter described by a [lora] section; return its parameters (fp32).

    The adapter type is `[lora] type` (peft's LoRA, DoRA, LoKr or LoHa: train/adapter_types.py),
    on the same Linears whatever the type. The base model is frozen. Targets come from
    `spec.lora_target_regex(lora_cfg.targets, lora_cfg.blocks)`, a full-match regex, so a preset's
    "proj_out" never wraps the top-level final projection.
    """
    kind = getattr(lora_cfg, "type", "lora")
    if adapter_name in _adapter_names(transformer):
        raise ValueError(f"the transformer already has an adapter named {adapter_name!r}")
    _check_block_selection(transformer, spec, lora_cfg.blocks)
    regex = spec.lora_target_regex(lora_cfg.targets, lora_cfg.blocks)
    matched = [(n, m) for n, m in transformer.named_modules()
               if re.fullmatch(regex, n) and not re.search(r"\.(base_layer|lora_\w+|lokr_\w+|hada_\w+)(\.|$)", n)]
    targets = [n for n, m in matched if isinstance(getattr(m, "base_layer", m), torch.nn.Linear)]   # peft wraps
    if not targets:
        raise ValueError(f"[lora] targets = {lora_cfg.targets!r} with blocks = {lora_cfg.blocks} selects no module")
    if kind != "lokr":        # a LoKr rank bounds its factors' sides, not the Linear's
        _warn_rank_beyond_layers(transformer, targets, lora_cfg.rank)
    if kind == "dora":
        _refuse_fp8_base_for_dora(transformer, targets, '[lora] type = "dora"')
    if len(targets) < len(matched):            # all_linear names whole top-level children: keep their Linears
        regex = "^(" + "|".join(re.escape(n) for n in targets) + ")$"
    config = _peft_config(kind, lora_cfg, regex)
    transformer.requires_grad_(False)
    with _adapter_state_kept(transformer, add=adapter_name), _base_weights_as_integers(transformer, targets if kind != "dora" else []):
        _add_on_quantized_bases(transformer, config, adapter_name, targets, kind)
    params = []
    for layer in lora_layers(transformer, adapter_name).values():
        _to_fp32(layer, adapter_name, kind)
        for p in adapter_parameters(layer, adapter_name).values():
            p.requires_grad_(True)
            params.append(p)
    return params


def _add_on_quantized_bases(transformer: torch.nn.Module, config, adapter_name: str, names: list[str],
                            kind: str) -> None:
    """peft's add_adapter, with the quantized bases among `names` readable by the adapter type
    (train/quantized_adapters.py): DoRA decodes their rows through their decoder; LoKr and LoHa see
    their (out, in) shape while they are made, and shape their delta as it at every forward."""
    bases = []
    for name in names:
        m = transformer.get_submodule(name)
        linear = m.get_base_layer() if _is_tuner_layer(m) else m
        if quantized.is_quantized(linear):
            bases.append(linear)
    if kind == "dora":
        for linear in bases:
            quantized.expose_decoder(linear)
    with quantized.logical_weight(bases if kind in ("lokr", "loha") else []):
        transformer.add_adapter(config, adapter_name)
    if kind in ("lokr", "loha"):
        for layer in lora_layers(transformer, adapter_name).values():
            quantized.shape_deltas_as_the_linear(layer)


def model_lora_keys(transformer: torch.nn.Module):
    """The LoRA names of a loaded transformer's family (spec.lora_keys), or None for a class no
    family claims."""
    from leantune.models.family import family_for_model

    try:
        return family_for_model(transformer).spec.lora_keys
    except TypeError:
        return None


def lora_weights_from_model(transformer: torch.nn.Module, adapter_name: str = "default") -> LoraWeights:
    """A CPU copy of an adapter's weights (any type), keyed by module name
    ('transformer_blocks.0.attn.to_q'), knowing the model's family (so its kohya names are the family's)."""
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter named {adapter_name!r}")
    modules = {}
    for name, layer in layers.items():
        kind = layer_kind(layer, adapter_name)
        params = {role: p.detach().to("cpu", copy=True) for role, p in adapter_parameters(layer, adapter_name).items()}
        if kind in ("lokr", "loha"):
            modules[name] = LycorisModule(kind, params, float(layer.alpha[adapter_name]), int(layer.r[adapter_name]),
                                          key=name)
            continue
        alpha = float(layer.lora_alpha[adapter_name])
        if layer.use_rslora.get(adapter_name, False):
            alpha *= math.sqrt(layer.r[adapter_name])   # rsLoRA's alpha / sqrt(r) as alpha' / r
        modules[name] = LoraModule(params["down"], params["up"], alpha, key=name, magnitude=params.get("magnitude"))
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
        if m.in_features != linear.in_features or m.out_features != linear.out_features:
            shapes = " / ".join(f"{role} {tuple(t.shape)}" for role, t in m.tensors().items())
            raise LoraFormatError(
                f"{weights.source}: LoRA key {m.key or name!r} has {shapes} (a {m.out_features} x {m.in_features} "
                f"delta) but the model's {name} is Linear(in={linear.in_features}, "
                f"out={linear.out_features}); the LoRA was trained for a different model")


def _applied_config(weights: LoraWeights):
    """A peft config creating one frozen adapter of `weights`' type on its modules."""
    from peft import LoHaConfig, LoKrConfig
    from peft import LoraConfig as PeftLoraConfig

    kind = weights.kind
    kwargs = peft_config_kwargs(weights)
    if kind in ("lora", "dora"):
        return PeftLoraConfig(**kwargs, init_lora_weights=False)
    # LoKr / LoHa: peft builds its own factors (of the shapes its options give), replaced below by the file's
    return (LoKrConfig if kind == "lokr" else LoHaConfig)(**kwargs, init_weights=False)


def _set_lycoris(layer: torch.nn.Module, adapter_name: str, m: LycorisModule, dtype: torch.dtype) -> None:
    """Give a peft LoKr / LoHa layer's adapter exactly the module's factors and scale (whatever
    factor shapes peft derived itself: its forward uses whichever of w1 / w1_a @ w1_b is there)."""
    roles = _LOKR_ROLES if m.kind == "lokr" else _LOHA_ROLES
    device = layer.get_base_layer().weight.device
    for attr in roles.values():
        container = getattr(layer, attr)
        if adapter_name in container:
            del container[adapter_name]
    for role, t in m.factors.items():
        getattr(layer, roles[role])[adapter_name] = torch.nn.Parameter(t.to(device, dtype), requires_grad=False)
    layer.r[adapter_name] = m.rank
    layer.alpha[adapter_name] = float(m.alpha)


def apply_lora(transformer: torch.nn.Module, weights: LoraWeights, strength: float = 1.0,
               adapter_name: str = "lora", dtype: torch.dtype = torch.float32) -> list[str]:
    """Attach `weights` as a frozen, unmerged adapter at `strength`; other adapters stay active.

    LoRA: each module's output gains strength * alpha / r * up @ down @ x; LoKr / LoHa: the same
    scale on their delta; DoRA (peft's use_dora): its magnitude and update at strength times the
    update's scale (peft's set_scale: at 1.0 the trained weights, elsewhere the update scaled inside
    DoRA's normalisation, not ComfyUI's blend of the two weights). Returns the wrapped module names.
    Call before the memory engine is applied (it streams what exists at that time).
    """
    if adapter_name in _adapter_names(transformer):
        raise ValueError(f"the transformer already has an adapter named {adapter_name!r}")
    check_fits(transformer, weights)
    kind = weights.kind
    if kind == "dora":
        _refuse_fp8_base_for_dora(transformer, sorted(weights.modules), f"{weights.source} (a DoRA LoRA)")
    config = _applied_config(weights)
    with _adapter_state_kept(transformer, add=adapter_name):
        _add_on_quantized_bases(transformer, config, adapter_name, sorted(weights.modules), kind)
    layers = lora_layers(transformer, adapter_name)
    if set(layers) != set(weights.modules):
        raise RuntimeError(f"peft wrapped {sorted(set(layers) ^ set(weights.modules))[:5]} unlike the LoRA's modules")
    with torch.no_grad():
        for name, layer in layers.items():
            m = weights.modules[name]
            if isinstance(m, LycorisModule):
                _set_lycoris(layer, adapter_name, m, dtype)
                layer.set_scale(adapter_name, strength)
                continue
            if layer.r[adapter_name] != m.rank or not math.isclose(layer.lora_alpha[adapter_name], m.alpha):
                raise RuntimeError(f"{name}: peft gave rank {layer.r[adapter_name]} alpha "
                                   f"{layer.lora_alpha[adapter_name]}, the LoRA has {m.rank} / {m.alpha}")
            layer.lora_A[adapter_name].to(dtype)
            layer.lora_B[adapter_name].to(dtype)
            a, b = layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight
            a.copy_(m.down)
            b.copy_(m.up)
            params = [a, b]
            if m.magnitude is not None:
                mag_layer = layer.lora_magnitude_vector[adapter_name]
                mag_layer.to(dtype)
                mag_layer.weight.copy_(m.magnitude)
                params.append(mag_layer.weight)
            for p in params:
                p.requires_grad_(False)
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

    The file's scale is folded into B (LoKr: w1, LoHa: w1_a) where the adapter's alpha differs, so
    the model's delta equals the file's exactly. Modules the adapter has but the file lacks keep
    their values (no change after init). The file's adapter type must be the adapter's, its ranks
    (LoKr / LoHa: its factor shapes) the same, and every file module a target of the adapter.
    Returns the names set.
    """
    layers = lora_layers(transformer, adapter_name)
    if not layers:
        raise ValueError(f"the transformer has no LoRA adapter named {adapter_name!r}")
    check_fits(transformer, weights)
    kind = weights.kind
    for name, m in weights.modules.items():
        key = m.key or name
        if name not in layers:
            raise LoraFormatError(f"{weights.source}: LoRA key {key!r} trains {name!r}, which the [lora] targets "
                                  f"do not include; widen [lora] targets or blocks")
        layer = layers[name]
        have = layer_kind(layer, adapter_name)
        if have != kind:
            raise LoraFormatError(f"{weights.source}: a {kind} file, but [lora] type = {have!r} trains another adapter "
                                  f"type; set [lora] type = {kind!r} to continue it")
        if isinstance(m, LycorisModule):
            params = adapter_parameters(layer, adapter_name)
            mine = {role: tuple(p.shape) for role, p in params.items()}
            theirs = {role: tuple(t.shape) for role, t in m.factors.items()}
            if mine != theirs:
                raise LoraFormatError(f"{weights.source}: LoRA key {key!r} has {kind} factors {theirs} but [lora] "
                                      f"rank / factor / decompose_both give {mine}")
        elif layer.r[adapter_name] != m.rank:
            raise LoraFormatError(f"{weights.source}: LoRA key {key!r} has rank {m.rank} but [lora] rank is "
                                  f"{layer.r[adapter_name]}")
    with torch.no_grad():
        for name, m in weights.modules.items():
            layer = layers[name]
            params = adapter_parameters(layer, adapter_name)
            if isinstance(m, LycorisModule):
                adapter_scale = layer.alpha[adapter_name] / layer.r[adapter_name]
                first = "w1" if "w1" in m.factors else "w1_a"
                for role, t in m.factors.items():
                    fold = m.scale / adapter_scale if role == first and m.scale != adapter_scale else None
                    params[role].copy_(t.float() * fold if fold is not None else t)
                continue
            adapter_scale = layer.lora_alpha[adapter_name] / layer.r[adapter_name]
            if layer.use_rslora.get(adapter_name, False):
                adapter_scale = layer.lora_alpha[adapter_name] / math.sqrt(layer.r[adapter_name])
            params["down"].copy_(m.down)
            params["up"].copy_(m.up.float() * (m.scale / adapter_scale) if m.scale != adapter_scale else m.up)
            if kind == "dora":
                params["magnitude"].copy_(m.magnitude)
    return sorted(weights.modules)
