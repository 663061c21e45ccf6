"""LoRA files: read every common Flux and SD3.5 LoRA layout, write ComfyUI/kohya and diffusers files.

In memory a LoRA is a `LoraWeights`: one `LoraModule(down (r, in), up (out, r), alpha)` per
diffusers Linear, whose weight delta is `alpha / r * up @ down`. Files differ in three ways:

* names: kohya / ComfyUI use the reference implementation's module paths (Flux:
  `lora_unet_double_blocks_0_img_attn_qkv`; SD3.5: `lora_unet_joint_blocks_0_x_block_attn_qkv`),
  diffusers / ai-toolkit use diffusers paths with a `transformer.` prefix, some tools use native
  paths with a `diffusion_model.` prefix, musubi-tuner's Z-Image files kohya names of diffusers'
  paths (`lora_unet_layers_0_attention_to_q`). Which names exist is the family's data
  (`spec.lora_keys`, models/lora_keymap.py); this module never names a family's modules;
* fusing: the native q, k, v (and, in Flux single blocks, the MLP input) are one Linear, so a
  kohya file holds one LoRA for what diffusers trains as three or four. We fuse exactly: down =
  cat(A_q, A_k, A_v) (3r, in), up = block_diag(B_q, B_k, B_v) (3d, 3r), alpha = 3 * alpha, so
  that the fused scale alpha / 3r equals each part's alpha / r and the delta of every row block is
  unchanged. Missing parts are zero blocks. On import a block-diagonal fused LoRA is split back the
  same way diffusers' `_convert_kohya_flux_lora_to_diffusers` and sd-scripts' split-qkv loader do
  (equal rank chunks), and a dense one is split by rows with the down matrix shared, which is
  exact too;
* alpha: kohya stores `<module>.alpha`; diffusers stores the LoraConfig (r, lora_alpha,
  rank_pattern, alpha_pattern) as JSON in the `lora_adapter_metadata` header; ai-toolkit stores
  none, meaning alpha = rank. ComfyUI reads alpha only from `.alpha` tensors, so a diffusers file
  relying on its header loads there at rank / alpha of its strength: leantune's diffusers files
  fold alpha / rank into lora_B and say alpha = rank (every consumer applies the trained delta),
  and keep the trained alphas in the `leantune_trained_alphas` header, from which leantune reads
  them back (an `init_from` continues with the same scale).

LoKr files (LyCORIS' `lycoris_<diffusers path>` names, ai-toolkit's BFL names) hold delta =
alpha / r * kron(w1, w2) per module, each factor whole or as a product a @ b; they are read as the
LoRA with that delta exactly (kron(U1 D1, U2 D2) = kron(U1, U2) @ kron(D1, D2): up = kron(U1, U2),
down = kron(D1, D2)), scaled as LyCORIS and diffusers' `_bake_lokr_alpha_` scale them.

The family of a file is read from its keys (Flux `double_blocks` vs SD3 `joint_blocks`, ...) and,
where names are shared (FLUX.2 uses Flux.1's BFL names), their shapes (`LoraKeyMap.ratios`). Some
files fit several families (diffusers names such as `transformer_blocks.0.attn.to_q` exist in both):
their modules are the same either way, and only writing kohya names needs the family; the file's
header (`ss_base_model_version`), its width (3072: Flux.1; 2432 / 1536: SD3.5 Large / Medium) or
the caller (`keys=`, `leantune convert --family`) then says it.

Only safetensors are read or written (io.py refuses pickle); saves are atomic. Any key we do not
understand is an error naming the file and the key, except text-encoder LoRA keys, which LoRA
training here does not use: those are reported in a warning and skipped.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from leantune.io import load_safetensors, save_safetensors

from .lora_keys import FusedTarget, LoraKeyMap, all_key_maps

LoraFileFormat = Literal["comfyui", "diffusers"]
FORMATS = ("comfyui", "diffusers")
ADAPTER_METADATA_KEY = "lora_adapter_metadata"     # diffusers' header key for the LoraConfig JSON
TRAINED_ALPHAS_KEY = "leantune_trained_alphas"      # {module: alpha} folded into lora_B of a diffusers file
DIFFUSERS_PREFIX = "transformer."
# Header keys that describe one file layout; they are rewritten, never passed through a conversion.
_LAYOUT_KEYS = {ADAPTER_METADATA_KEY, "format", "leantune_format", TRAINED_ALPHAS_KEY}


class LoraFormatError(ValueError):
    """A LoRA file (or LoraWeights) that cannot be read, written or applied; names file and key."""


class _ShapeMismatch(LoraFormatError):
    """A file whose names fit a family but whose shapes do not (Flux.1's and FLUX.2's share names)."""


class IgnoredKeysWarning(UserWarning):
    """Keys of a LoRA file that were skipped on purpose (text-encoder LoRA)."""


class LoraCompatibilityWarning(UserWarning):
    """A LoRA file another common loader reads only in part (it has no name for some modules)."""


@dataclass
class LoraModule:
    """One Linear's LoRA: delta W (out, in) = alpha / rank * up @ down."""

    down: torch.Tensor        # (r, in)  lora_down / lora_A
    up: torch.Tensor          # (out, r) lora_up / lora_B
    alpha: float
    key: str = ""             # the file key it came from, for error messages

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self) -> torch.Tensor:
        """The weight delta (out, in) in fp32."""
        return self.scale * (self.up.float() @ self.down.float())


@dataclass
class LoraWeights:
    """A LoRA for a transformer, keyed by diffusers module names relative to the transformer."""

    modules: dict[str, LoraModule]
    metadata: dict[str, str] = field(default_factory=dict)   # file header (ss_* training notes ...)
    source: str = "<memory>"                                   # file it was read from
    format: str = ""                                           # layout it was read from
    ignored: list[str] = field(default_factory=list)           # keys skipped (text-encoder LoRA)
    # The family's LoRA names (spec.lora_keys); None when unknown: the modules' names then fit
    # several families and writing kohya names asks the header or the caller.
    keys: LoraKeyMap | None = None

    @property
    def family(self) -> str | None:
        return None if self.keys is None else self.keys.family


# -- fusing and splitting --------------------------------------------------------------------------

def _swap_halves(up: torch.Tensor, where: str) -> torch.Tensor:
    if up.shape[0] % 2:
        raise LoraFormatError(f"{where}: the final-layer modulation LoRA needs an even number of output rows, "
                              f"got {tuple(up.shape)}")
    half = up.shape[0] // 2
    return torch.cat([up[half:], up[:half]], dim=0)


def _part_rows(target: FusedTarget, rows: int, where: str) -> list[int]:
    total = sum(target.widths)
    if rows % total:
        raise LoraFormatError(f"{where}: {rows} output rows cannot be split into {target.parts} "
                              f"in proportions {target.widths}")
    unit = rows // total
    return [w * unit for w in target.widths]


def split_fused(target: FusedTarget, fused: LoraModule, where: str) -> dict[str, LoraModule]:
    """Split a LoRA on a native Linear into LoRAs on its diffusers parts, exactly.

    A block-diagonal fused LoRA (equal rank chunks, as kohya split-qkv and our exports write) gives
    each part its own chunk at the same scale; all-zero parts (absent when fused) are dropped. A
    dense one gives every part the whole down matrix and its rows of the up matrix.
    """
    up = _swap_halves(fused.up, where) if target.swaps_halves(fused.up.shape[0], fused.down.shape[1]) else fused.up
    n = len(target.parts)
    if n == 1:
        return {target.parts[0]: LoraModule(fused.down, up, fused.alpha, fused.key)}
    dims = _part_rows(target, up.shape[0], where)
    rank = fused.rank
    starts = [sum(dims[:j]) for j in range(n)]
    if rank % n == 0:
        r = rank // n
        block_diagonal = all(
            not torch.any(up[starts[j]:starts[j] + dims[j], k * r:(k + 1) * r])
            for j in range(n) for k in range(n) if j != k
        )
        if block_diagonal:
            out = {}
            for j, name in enumerate(target.parts):
                down_j = fused.down[j * r:(j + 1) * r]
                up_j = up[starts[j]:starts[j] + dims[j], j * r:(j + 1) * r]
                if torch.any(down_j) or torch.any(up_j):
                    # Same scale as the fused LoRA: alpha_j / r = alpha / (n r). Clones: each part
                    # owns its storage, as safetensors refuses tensors that share memory.
                    out[name] = LoraModule(down_j.clone(), up_j.clone(), fused.alpha / n, fused.key)
            return out
    return {
        name: LoraModule(fused.down.clone(), up[starts[j]:starts[j] + dims[j]].clone(), fused.alpha, fused.key)
        for j, name in enumerate(target.parts)
    }


def fuse_parts(target: FusedTarget, parts: dict[int, LoraModule]) -> LoraModule:
    """The LoRA on a native Linear equivalent to LoRAs on some of its diffusers parts (others zero).

    With equal ranks and scales (what training produces) the weights are copied untouched and
    alpha becomes n * alpha; otherwise each part's scale is folded into its up matrix relative to
    the first part's scale, so the delta stays exact either way.
    """
    where = target.native
    present = sorted(parts)
    first = parts[present[0]]
    if len(target.parts) == 1:
        up = _swap_halves(first.up, where) if target.swaps_halves(first.up.shape[0], first.down.shape[1]) else first.up
        return LoraModule(first.down, up, first.alpha, target.kohya)
    in_features = first.down.shape[1]
    units = set()
    for j in present:
        m = parts[j]
        if m.down.shape[1] != in_features:
            raise LoraFormatError(f"{target.parts[j]}: LoRA input width {m.down.shape[1]} differs from "
                                  f"{target.parts[present[0]]}'s {in_features}; they share one input in {where}")
        if m.up.shape[0] % target.widths[j]:
            raise LoraFormatError(f"{target.parts[j]}: {m.up.shape[0]} output rows do not fit {where}")
        units.add(m.up.shape[0] // target.widths[j])
    if len(units) != 1:
        raise LoraFormatError(f"{where}: the parts' output widths {[tuple(parts[j].up.shape) for j in present]} "
                              f"are not in the proportions {target.widths}")
    unit = units.pop()
    dtype = torch.promote_types(first.down.dtype, first.up.dtype)
    for j in present:
        dtype = torch.promote_types(dtype, torch.promote_types(parts[j].down.dtype, parts[j].up.dtype))
    uniform = all(parts[j].rank == first.rank and parts[j].scale == first.scale for j in present)
    downs, ups = [], []
    for j in range(len(target.parts)):
        m = parts.get(j)
        if m is None:
            downs.append(torch.zeros(first.rank, in_features, dtype=dtype, device=first.down.device))
            ups.append(torch.zeros(target.widths[j] * unit, first.rank, dtype=dtype, device=first.up.device))
            continue
        downs.append(m.down.to(dtype))
        # Fold a differing scale into up, relative to the fused scale (the first part's).
        ups.append(m.up.to(dtype) if m.scale == first.scale else (m.up.float() * (m.scale / first.scale)).to(dtype))
    down = torch.cat(downs, dim=0)                  # (sum r_j, in)
    up = torch.block_diag(*ups)                     # (sum out_j, sum r_j)
    if target.swaps_halves(up.shape[0], in_features):
        up = _swap_halves(up, where)
    n_rank = down.shape[0]
    alpha = first.alpha * len(target.parts) if uniform else first.scale * n_rank
    return LoraModule(down, up, float(alpha), target.kohya)


# -- writing ---------------------------------------------------------------------------------------

def _most_common(values) -> float | int:
    return Counter(values).most_common(1)[0][0]


def _pattern(name: str) -> str:
    # peft matches rank/alpha patterns as r"(.*\.)?(pattern)$"; the anchor keeps "proj_out" from
    # also matching "single_transformer_blocks.0.proj_out".
    return "^" + re.escape(name)


def peft_config_kwargs(weights: LoraWeights) -> dict:
    """LoraConfig keyword arguments reproducing every module's rank and alpha (peft >= 0.14)."""
    if not weights.modules:
        raise LoraFormatError(f"{weights.source}: the LoRA has no modules")
    names = sorted(weights.modules)
    ranks = {n: weights.modules[n].rank for n in names}
    alphas = {n: float(weights.modules[n].alpha) for n in names}
    r = int(_most_common(ranks.values()))
    alpha = float(_most_common(alphas.values()))
    return {
        "r": r,
        "lora_alpha": alpha,
        "rank_pattern": {_pattern(n): v for n, v in ranks.items() if v != r},
        "alpha_pattern": {_pattern(n): v for n, v in alphas.items() if v != alpha},
        # A full-match regex: a list would match by suffix and wrap the top-level proj_out too.
        "target_modules": "^(" + "|".join(re.escape(n) for n in names) + ")$",
    }


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of tensors whose storage an earlier one uses: safetensors refuses shared memory."""
    seen, out = set(), {}
    for k, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _displays(maps: list[LoraKeyMap]) -> str:
    return " or ".join(m.display for m in maps) or "known"


def _maps_for_names(names) -> list[LoraKeyMap]:
    """The families whose transformers have every one of these diffusers Linear names."""
    return [k for k in all_key_maps() if all(k.target_for_diffusers(n) is not None for n in names)]


def writing_keys(weights: LoraWeights, keys: LoraKeyMap | None = None) -> list[LoraKeyMap]:
    """The family names to write `weights` with: the caller's, the LoRA's own, else every family
    whose transformer has all its modules (narrowed by the header's hint or the LoRA's width).
    Several means nothing told them apart; families_in_doubt says whether that matters."""
    if keys is None:
        keys = weights.keys
    if keys is not None:
        for name in weights.modules:
            if keys.target_for_diffusers(name) is None:
                raise LoraFormatError(f"{weights.source}: module {name!r} is not a {keys.display} transformer "
                                      f"Linear with a kohya/ComfyUI name")
        return [keys]
    maps = _maps_for_names(weights.modules)
    if not maps:
        every = all_key_maps()
        name = next(n for n in sorted(weights.modules) if not _maps_for_names([n]))
        raise LoraFormatError(f"{weights.source}: module {name!r} is not a {_displays(every)} transformer Linear "
                              f"with a kohya/ComfyUI name")
    return _narrowed(maps, weights.metadata, weights.modules)


def _best_hinted(maps: list[LoraKeyMap], metadata: dict[str, str]) -> list[LoraKeyMap]:
    """The families the header names most specifically ("flux2" names FLUX.2 and, by its prefix
    "flux", Flux.1: FLUX.2's longer hint wins); empty when it names none."""
    strength = {id(k): k.hint_strength(metadata) for k in maps}
    best = max(strength.values(), default=0)
    return [k for k in maps if best and strength[id(k)] == best]


def _narrowed(maps: list[LoraKeyMap], metadata: dict[str, str], modules: dict[str, LoraModule]) -> list[LoraKeyMap]:
    """Of several families whose names fit, the one the header names, else the one whose released
    checkpoints have the LoRA's most common input width (3072: Flux.1); else all of them."""
    if len(maps) < 2:
        return maps
    hinted = _best_hinted(maps, metadata)
    if len(hinted) == 1:
        return hinted
    if modules:
        width = _most_common(m.down.shape[1] for m in modules.values())
        wide = [k for k in maps if k.has_width(width)]
        if len(wide) == 1:
            return wide
    return maps


def _comfyui_tensors(weights: LoraWeights, keys: LoraKeyMap, dtype) -> dict[str, torch.Tensor]:
    groups: dict[str, tuple[FusedTarget, dict[int, LoraModule]]] = {}
    for name, module in weights.modules.items():
        target, part = keys.target_for_diffusers(name)
        groups.setdefault(target.native, (target, {}))[1][part] = module
    out = {}
    for native in sorted(groups):
        target, parts = groups[native]
        fused = fuse_parts(target, parts)
        out[f"{target.kohya}.lora_down.weight"] = _cast(fused.down, dtype)
        out[f"{target.kohya}.lora_up.weight"] = _cast(fused.up, dtype)
        out[f"{target.kohya}.alpha"] = torch.tensor(fused.alpha, dtype=torch.float32)
    return out


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def families_in_doubt(weights: LoraWeights) -> list[LoraKeyMap]:
    """The families whose kohya/ComfyUI files of `weights` would differ, when its family is not
    known and its module names fit several ('transformer_blocks.0.attn.to_q' is a Flux double
    block's and an SD3 joint block's); empty when the kohya file is the same whichever is meant.
    `leantune convert` asks for --family then."""
    maps = writing_keys(weights)
    first = _comfyui_tensors(weights, maps[0], None)
    differing = [k for k in maps[1:] if not _same_tensors(first, _comfyui_tensors(weights, k, None))]
    return [maps[0], *differing] if differing else []


def comfyui_state_dict(weights: LoraWeights, dtype: torch.dtype | None = None,
                       keys: LoraKeyMap | None = None) -> dict[str, torch.Tensor]:
    """kohya / ComfyUI keys: fused native modules with lora_down, lora_up and a scalar alpha each.

    `keys` (a family's spec.lora_keys) defaults to the LoRA's own family, else the one family its
    module names fit; names that fit several (a LoRA built by hand, or a diffusers file without a
    header) are written with the first family's names in the families' order (Flux, as before
    other families existed): `families_in_doubt` tells whether that choice matters."""
    return _unshared(_comfyui_tensors(weights, writing_keys(weights, keys)[0], dtype))


def diffusers_state_dict(weights: LoraWeights, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """diffusers / peft keys: transformer.<module>.lora_A.weight and .lora_B.weight."""
    out = {}
    for name in sorted(weights.modules):
        m = weights.modules[name]
        out[f"{DIFFUSERS_PREFIX}{name}.lora_A.weight"] = _cast(m.down, dtype)
        out[f"{DIFFUSERS_PREFIX}{name}.lora_B.weight"] = _cast(m.up, dtype)
    return _unshared(out)


def fold_alphas(weights: LoraWeights) -> tuple[LoraWeights, dict[str, float]]:
    """The same deltas with alpha = rank (alpha / rank multiplied into each up matrix, in fp32),
    and the trained alphas that were folded, for the header."""
    modules, folded = {}, {}
    for name, m in weights.modules.items():
        if float(m.alpha) == float(m.rank):
            modules[name] = m
            continue
        up = (m.up.float() * m.scale).to(m.up.dtype)
        modules[name] = LoraModule(m.down, up, float(m.rank), m.key)
        folded[name] = float(m.alpha)
    return LoraWeights(modules=modules, metadata=weights.metadata, source=weights.source, format=weights.format,
                       ignored=weights.ignored, keys=weights.keys), folded


def _unfold_alphas(source: str, modules: dict[str, LoraModule], metadata: dict[str, str]) -> None:
    """Undo fold_alphas for a leantune diffusers file: the trained alpha, the same delta."""
    raw = metadata.get(TRAINED_ALPHAS_KEY)
    if not raw:
        return
    try:
        alphas = {str(k): float(v) for k, v in json.loads(raw).items()}
    except (ValueError, TypeError, AttributeError):
        raise LoraFormatError(f"{source}: header key {TRAINED_ALPHAS_KEY!r} is not a JSON object of numbers") from None
    for name, alpha in alphas.items():
        m = modules.get(name)
        if m is None or not math.isfinite(alpha) or alpha == 0 or float(m.alpha) != float(m.rank):
            continue             # a module renamed, or a file edited since: keep what the file applies
        m.up = (m.up.float() * (m.rank / alpha)).to(m.up.dtype)
        m.alpha = alpha


def _header_value(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def file_metadata(weights: LoraWeights, fmt: LoraFileFormat, path: Path, extra: dict | None,
                  keys: LoraKeyMap | None = None) -> dict[str, str]:
    """The header of a saved LoRA: kohya-style ss_* notes (defaults, the family's, then the source
    file's, then the caller's) plus the layout keys of `fmt`. `keys`: the family written for; its
    notes are left out when the family is unknown."""
    ranks = [m.rank for m in weights.modules.values()]
    alphas = [float(m.alpha) for m in weights.modules.values()]
    meta = {}
    if keys is not None:
        meta["ss_network_module"] = keys.header["ss_network_module"]
    meta["ss_network_dim"] = str(_most_common(ranks))
    meta["ss_network_alpha"] = _header_value(_most_common(alphas))
    if keys is not None:
        meta["ss_base_model_version"] = keys.header["ss_base_model_version"]
    meta["ss_output_name"] = path.stem
    meta.update({k: v for k, v in weights.metadata.items() if k not in _LAYOUT_KEYS})
    meta.update({k: _header_value(v) for k, v in (extra or {}).items()})
    # What the tensors apply, whatever the caller or the source file's header said (kohya's scale
    # is ss_network_alpha / ss_network_dim): a diffusers file's alphas are folded into lora_B, so
    # it says alpha = rank, not the trained alpha (that is in leantune_trained_alphas).
    meta["ss_network_dim"] = str(_most_common(ranks))
    meta["ss_network_alpha"] = _header_value(_most_common(alphas))
    meta["leantune_format"] = fmt
    if fmt == "diffusers":
        meta["format"] = "pt"
        config = peft_config_kwargs(weights)
        # The pipelines' save_lora_weights prefix the config keys with the component name.
        meta[ADAPTER_METADATA_KEY] = json.dumps({f"transformer.{k}": v for k, v in config.items()}, sort_keys=True)
    return meta


def _warn_comfyui_unnamed(weights: LoraWeights, maps: list[LoraKeyMap]) -> None:
    """Say which modules of a diffusers-layout file ComfyUI cannot load (LoraKeyMap.comfyui_unnamed:
    FLUX.2's time/guidance embedders and shared modulation). No name in such a file loads them in
    both ComfyUI and diffusers, so the file stays right for diffusers and the warning points
    ComfyUI users at the comfyui layout, which names every module."""
    for keys in maps:
        missing = sorted(n for n in weights.modules if n in keys.comfyui_unnamed)
        if not missing:
            continue
        warnings.warn(
            f"the diffusers-layout file of this {keys.display} LoRA has {len(missing)} module(s) ComfyUI's LoRA "
            f"loader has no diffusers name for ({', '.join(missing)}): ComfyUI skips their keys ('lora key not "
            f"loaded') and applies the rest, so the LoRA acts there only in part. No naming in a diffusers-layout "
            f"file loads them in both ComfyUI and diffusers; in ComfyUI use the comfyui-layout file ([output] "
            f"formats, or leantune convert --to comfyui), which names every module. diffusers and peft load "
            f"this file whole.", LoraCompatibilityWarning, stacklevel=3)
        return


def save_lora(weights: LoraWeights, path: str | Path, fmt: LoraFileFormat,
              metadata: dict | None = None, dtype: torch.dtype | None = None,
              keys: LoraKeyMap | None = None) -> Path:
    """Write `weights` as a ComfyUI/kohya or diffusers LoRA file (atomic); `dtype` None keeps theirs.

    `keys` is the family's LoRA names (spec.lora_keys); by default the LoRA's own family, else the
    one its module names fit (see comfyui_state_dict and families_in_doubt). Both layouts load in ComfyUI and in
    diffusers' pipelines (FluxPipeline / StableDiffusion3Pipeline.load_lora_weights, from the path
    so the header's alpha is read). Limits lie in diffusers, not in the files: its kohya Flux
    converter drops top-level layers (embedders, final layer) and splits single-block linear1 only
    at width 3072, and it has no kohya SD3 converter (0.42 loads a kohya SD3 file as no LoRA at
    all, with only a warning); use the diffusers format there. ComfyUI in turn has no diffusers
    name for FLUX.2's time/guidance embedders and shared modulation: a diffusers file that has them
    warns (LoraCompatibilityWarning), as no naming of a diffusers file loads them in both tools.
    """
    if fmt not in FORMATS:
        raise LoraFormatError(f"{path}: unknown LoRA file format {fmt!r}; choose one of {FORMATS}")
    if not weights.modules:
        raise LoraFormatError(f"{path}: refusing to write a LoRA with no modules")
    path = Path(path)
    if fmt == "comfyui":
        family_keys = writing_keys(weights, keys)[0]      # the family whose names are written
        tensors = comfyui_state_dict(weights, dtype, family_keys)
    else:
        try:            # diffusers names need no family; it only picks the header's notes
            maps = writing_keys(weights, keys)
        except LoraFormatError:
            maps = []
        family_keys = maps[0] if len(maps) == 1 else None
        _warn_comfyui_unnamed(weights, maps)
        written, folded = fold_alphas(weights)        # ComfyUI reads no alpha from the header
        tensors = diffusers_state_dict(written, dtype)
        header = file_metadata(written, fmt, path, metadata, family_keys)     # ss_network_alpha: what it applies
        if folded:
            header[TRAINED_ALPHAS_KEY] = json.dumps(folded, sort_keys=True)
        return save_safetensors(tensors, path, header)
    return save_safetensors(tensors, path, file_metadata(weights, fmt, path, metadata, family_keys))


# -- reading ---------------------------------------------------------------------------------------

_ROLE_SUFFIXES = (
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".alpha", "alpha"),
    # LoKr (LyCORIS, ai-toolkit): delta = kron(w1, w2), each factor whole or as a product a @ b
    (".lokr_w1", "w1"), (".lokr_w1_a", "w1_a"), (".lokr_w1_b", "w1_b"),
    (".lokr_w2", "w2"), (".lokr_w2_a", "w2_a"), (".lokr_w2_b", "w2_b"),
)
_LOKR_ROLES = ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")
_TEXT_ENCODER_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "text_encoder.", "text_encoder_2.",
                          "text_encoder_3.")
_NATIVE_PREFIXES = ("diffusion_model.", "model.diffusion_model.")
_DIFFUSERS_PREFIXES = (DIFFUSERS_PREFIX, "base_model.model.", "")
_UNSUPPORTED_HINTS = (   # (regex searched in the key, what it is) for a helpful error
    (r"\.dora_scale$|lora_magnitude_vector", "DoRA"), (r"\.hada_", "LoHa"), (r"\.lokr_t\d", "LoKr with a Tucker core"),
    (r"\.diff(_b)?$", "a full weight difference"), (r"\.lora_(B|up)\.bias$", "a LoRA bias"),
    (r"\.lora_mid\.", "LoCon"),
)


@dataclass
class _Entry:
    """down / up / alpha tensors of one module as found in the file, and their keys."""

    kind: str                               # "kohya" | "native" | "diffusers"
    target: FusedTarget | None = None       # for kohya / native: the fused native Linear
    name: str = ""                          # for diffusers: the module name
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: dict[str, str] = field(default_factory=dict)


def _classify(stem: str, keys: LoraKeyMap) -> tuple[str, str, FusedTarget | None]:
    """(kind, unit id, target) of a key without its role suffix under one family's names; kind
    'unknown' if that family has no such module."""
    if stem.startswith("lora_unet_"):
        t = keys.target_for_kohya(stem)
        if t:
            return "kohya", t.native, t
        # kohya names of diffusers' module paths: musubi-tuner's Z-Image model keeps diffusers' names
        # (lora_unet_layers_0_attention_to_q, where the native name is the fused attention_qkv)
        found = keys.target_for_lycoris("lycoris_" + stem[len("lora_unet_"):])
        return ("kohya_diffusers", found[0].parts[found[1]], None) if found else ("unknown", stem, None)
    if stem.startswith("lycoris_"):       # LyCORIS: diffusers' module path with '_' for '.'
        found = keys.target_for_lycoris(stem)
        return ("lycoris", found[0].parts[found[1]], None) if found else ("unknown", stem, None)
    for prefix in _NATIVE_PREFIXES:
        if stem.startswith(prefix):
            t = keys.target_for_native(stem[len(prefix):])
            if t is None and keys.target_for_diffusers(stem[len(prefix):]) is not None:
                return "diffusers", stem[len(prefix):], None     # ai-toolkit's expanded diffusers names
            return ("native", t.native, t) if t else ("unknown", stem, None)
    for prefix in _DIFFUSERS_PREFIXES:
        if stem.startswith(prefix) and keys.target_for_diffusers(stem[len(prefix):]) is not None:
            return "diffusers", stem[len(prefix):], None
    t = keys.target_for_native(stem)   # native names without a prefix
    return ("native", t.native, t) if t else ("unknown", stem, None)


def _unknown(source: str, key: str, maps: list[LoraKeyMap], why: str = "") -> LoraFormatError:
    hint = next((f" ({what} is not supported)" for pat, what in _UNSUPPORTED_HINTS if re.search(pat, key)), "")
    return LoraFormatError(f"{source}: key {key!r} is not a {_displays(maps)} transformer LoRA key leantune "
                           f"understands{hint}{why}")


def _adapter_config(source: str, metadata: dict[str, str]) -> dict | None:
    """The LoraConfig dict of a diffusers file, unprefixed; None when the header has none."""
    raw = metadata.get(ADAPTER_METADATA_KEY)
    if not raw:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LoraFormatError(f"{source}: header key {ADAPTER_METADATA_KEY!r} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraFormatError(f"{source}: header key {ADAPTER_METADATA_KEY!r} is not a JSON object")
    if any(k.startswith("transformer.") for k in config):
        config = {k[len("transformer."):]: v for k, v in config.items() if k.startswith("transformer.")}
    if config.get("use_dora"):
        raise LoraFormatError(f"{source}: header key {ADAPTER_METADATA_KEY!r} says use_dora; DoRA is not supported")
    return config


def _config_alpha(config: dict, name: str) -> tuple[float | None, bool]:
    """(alpha, rslora) for a module under a peft LoraConfig dict (peft's pattern rules)."""
    alpha = config.get("lora_alpha")
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            alpha = value
            break
    return (None if alpha is None else float(alpha)), bool(config.get("use_rslora"))


def _lokr_factor(source: str, entry: _Entry, n: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(U, D, key) with factor w<n> = U @ D: its a / b matrices, or the whole matrix beside an
    identity on its shorter side (the rank of a Kronecker product is the product of the ranks)."""
    whole, a, b = entry.tensors.get(f"w{n}"), entry.tensors.get(f"w{n}_a"), entry.tensors.get(f"w{n}_b")
    if whole is not None and (a is not None or b is not None):
        raise LoraFormatError(f"{source}: {entry.keys[f'w{n}']!r} and its _a/_b factors are both given")
    if whole is None and (a is None or b is None):
        have = ", ".join(sorted(entry.keys.values()))
        raise LoraFormatError(f"{source}: LoKr module has no lokr_w{n} (nor lokr_w{n}_a and _b): found only {have}")
    for t, role in ((whole, f"w{n}"), (a, f"w{n}_a"), (b, f"w{n}_b")):
        if t is None:
            continue
        if t.dim() != 2 or not t.is_floating_point():
            raise LoraFormatError(f"{source}: key {entry.keys[role]!r} should be a 2-D float matrix, got "
                                  f"{t.dtype} {tuple(t.shape)} (convolution LoKr is not supported)")
        if not torch.isfinite(t).all():
            raise LoraFormatError(f"{source}: key {entry.keys[role]!r} contains NaN or infinite values")
    if whole is not None:
        rows, cols = whole.shape
        eye = lambda n_: torch.eye(n_, dtype=whole.dtype)  # noqa: E731
        return (whole, eye(cols), entry.keys[f"w{n}"]) if cols <= rows else (eye(rows), whole, entry.keys[f"w{n}"])
    if a.shape[1] != b.shape[0]:
        raise LoraFormatError(f"{source}: ranks disagree: {entry.keys[f'w{n}_a']!r} is {tuple(a.shape)} but "
                              f"{entry.keys[f'w{n}_b']!r} is {tuple(b.shape)}")
    return a, b, entry.keys[f"w{n}_a"]


def _lokr_module(source: str, entry: _Entry) -> LoraModule:
    """A LoKr module as the LoRA with the same delta, exactly: kron(U1 D1, U2 D2) =
    kron(U1, U2) @ kron(D1, D2), so up = kron(U1, U2) and down = kron(D1, D2). The scale is
    LyCORIS' (and diffusers' _bake_lokr_alpha_): alpha / r, r the rank of the decomposed w2 (else
    w1), and 1 when both factors are whole matrices."""
    u1, d1, k1 = _lokr_factor(source, entry, "1")
    u2, d2, _ = _lokr_factor(source, entry, "2")
    scale = 1.0
    rank_of = entry.tensors.get("w2_b", entry.tensors.get("w1_b"))
    if "alpha" in entry.tensors and rank_of is not None:
        a = entry.tensors["alpha"]
        if a.numel() != 1 or not torch.isfinite(a.float()).all():
            raise LoraFormatError(f"{source}: key {entry.keys['alpha']!r} should be one finite number, got {tuple(a.shape)}")
        scale = float(a.float().item()) / rank_of.shape[0]
    dtype = torch.promote_types(torch.promote_types(u1.dtype, u2.dtype), torch.promote_types(d1.dtype, d2.dtype))
    up = torch.kron(u1.to(dtype), u2.to(dtype))
    down = torch.kron(d1.to(dtype), d2.to(dtype))
    return LoraModule(down, up, scale * down.shape[0], k1.rsplit(".", 1)[0])


def _checked_module(source: str, entry: _Entry, unit: str) -> LoraModule:
    if any(role in entry.tensors for role in _LOKR_ROLES):
        lora_roles = [entry.keys[r] for r in ("down", "up") if r in entry.tensors]
        if lora_roles:
            raise LoraFormatError(f"{source}: module {unit!r} has both LoKr and LoRA keys ({lora_roles[0]!r})")
        return _lokr_module(source, entry)
    for role in ("down", "up"):
        if role not in entry.tensors:
            have = ", ".join(sorted(entry.keys.values()))
            peft_name = "lora_A" if role == "down" else "lora_B"
            raise LoraFormatError(f"{source}: module {unit!r} has no lora_{role} / {peft_name} weight "
                                  f"(found only {have})")
    down, up = entry.tensors["down"], entry.tensors["up"]
    kd, ku = entry.keys["down"], entry.keys["up"]
    for key, t in ((kd, down), (ku, up)):
        if t.dim() != 2 or not t.is_floating_point():
            raise LoraFormatError(f"{source}: key {key!r} should be a 2-D float matrix, got {t.dtype} {tuple(t.shape)}")
        if not torch.isfinite(t).all():
            raise LoraFormatError(f"{source}: key {key!r} contains NaN or infinite values")
    if up.shape[1] != down.shape[0]:
        raise LoraFormatError(f"{source}: ranks disagree: {kd!r} is {tuple(down.shape)} (rank, in) but {ku!r} is "
                              f"{tuple(up.shape)} (out, rank)")
    alpha = float(down.shape[0])
    if "alpha" in entry.tensors:
        a = entry.tensors["alpha"]
        if a.numel() != 1 or not torch.isfinite(a.float()).all():
            raise LoraFormatError(f"{source}: key {entry.keys['alpha']!r} should be one finite number, "
                                  f"got {tuple(a.shape)}")
        alpha = float(a.float().item())
    return LoraModule(down, up, alpha, kd.rsplit(".", 2)[0])


def _roles(source: str, tensors: dict[str, torch.Tensor], maps: list[LoraKeyMap]):
    """(key, role, stem) of every transformer key, and the text-encoder keys skipped."""
    found, ignored = [], []
    for key in sorted(tensors):
        role = stem = None
        for suffix, r in _ROLE_SUFFIXES:
            if key.endswith(suffix):
                role, stem = r, key[: -len(suffix)]
                break
        if key.startswith(_TEXT_ENCODER_PREFIXES):
            ignored.append(key)
            continue
        if role is None:
            raise _unknown(source, key, maps)
        found.append((key, role, stem))
    return found, ignored


def _modules(source: str, tensors, found, keys: LoraKeyMap, config: dict | None):
    """The LoraModules of a file under one family's names, and the layouts its keys used."""
    entries: dict[str, _Entry] = {}
    for key, role, stem in found:
        kind, unit, target = _classify(stem, keys)
        entry = entries.setdefault(f"{kind}:{unit}", _Entry(kind, target, unit if target is None else ""))
        if role in entry.tensors:
            raise LoraFormatError(f"{source}: keys {entry.keys[role]!r} and {key!r} give the same tensor twice")
        entry.tensors[role] = tensors[key]
        entry.keys[role] = key

    modules: dict[str, LoraModule] = {}
    origin: dict[str, str] = {}
    kinds = set()
    for unit_id, entry in entries.items():
        unit = unit_id.split(":", 1)[1]
        module = _checked_module(source, entry, unit)
        kinds.add(entry.kind)
        if entry.target is not None:
            problem = keys.shape_problem(entry.target, module.up.shape[0], module.down.shape[1])
            if problem:
                raise _ShapeMismatch(f"{source}: module {module.key!r} is not a {keys.display} LoRA: {problem}")
        if entry.kind in ("lycoris", "kohya_diffusers"):
            split = {unit: module}
        elif entry.kind == "diffusers":
            if "alpha" not in entry.tensors and config is not None:
                alpha, rslora = _config_alpha(config, unit)
                if alpha is not None:
                    # rsLoRA scales by alpha / sqrt(r); express it as our alpha / r.
                    module.alpha = alpha * math.sqrt(module.rank) if rslora else alpha
            split = {unit: module}
        else:
            split = split_fused(entry.target, module, f"{source}: {entry.keys.get('down', module.key)!r}")
        for name, m in split.items():
            if name in modules:
                raise LoraFormatError(f"{source}: module {name!r} is given twice, by {origin[name]!r} and {m.key!r}")
            modules[name] = m
            origin[name] = m.key
    return modules, kinds


def _same_modules(a: dict[str, LoraModule], b: dict[str, LoraModule]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].down, b[n].down) and torch.equal(a[n].up, b[n].up) and a[n].alpha == b[n].alpha for n in a)


def lora_from_state_dict(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                         source: str = "<state dict>", keys: LoraKeyMap | None = None) -> LoraWeights:
    """Parse a LoRA state dict in any supported layout (see the module docstring).

    `keys` (a family's spec.lora_keys) reads it as that family's; by default the family is the one
    whose names fit every key (the header's hint decides between several that read it differently).
    """
    metadata = dict(metadata or {})
    config = _adapter_config(source, metadata)
    maps = [keys] if keys is not None else all_key_maps()
    found, ignored = _roles(source, tensors, maps)
    unknown = {k: [key for key, _, stem in found if _classify(stem, k)[0] == "unknown"] for k in maps}
    fitting = [k for k in maps if not unknown[k]]
    if not fitting:
        closest = min(maps, key=lambda k: len(unknown[k]))
        raise _unknown(source, unknown[closest][0], maps)
    hinted = _best_hinted(fitting, metadata)
    if len(hinted) == 1:
        fitting = hinted
    read, mismatch = {}, None
    for k in fitting:            # names fit; shapes may not (Flux.1 and FLUX.2 share names)
        try:
            read[id(k)] = _modules(source, tensors, found, k, config)
        except _ShapeMismatch as e:
            mismatch = mismatch or e
    if not read:
        raise mismatch
    fitting = [k for k in fitting if id(k) in read]
    modules, kinds = read[id(fitting[0])]
    for other in fitting[1:]:
        if not _same_modules(modules, read[id(other)][0]):
            raise LoraFormatError(f"{source}: its keys read as a {fitting[0].display} LoRA and as a {other.display} "
                                  f"LoRA with different meanings; say which family it is for (leantune convert "
                                  f"--family)")
    fitting = _narrowed(fitting, metadata, modules)
    if len(fitting) > 1 and kinds & {"kohya", "native"}:
        # Native names several families share (FLUX.2 kept Flux.1's), read the same by each (checked
        # above), so written the same: the first family in the fixed order, as before they shared them.
        fitting = fitting[:1]
    if kinds == {"diffusers"}:
        _unfold_alphas(source, modules, metadata)
    if ignored:
        warnings.warn(f"{source}: ignored {len(ignored)} text-encoder LoRA keys (only the transformer is "
                      f"supported), e.g. {ignored[0]!r}", IgnoredKeysWarning, stacklevel=3)
    if not modules:
        raise LoraFormatError(f"{source}: no {_displays(maps)} transformer LoRA keys found")
    fmt = "mixed" if len(kinds) > 1 else {"kohya": "comfyui", "native": "bfl", "diffusers": "diffusers",
                                                   "lycoris": "lycoris", "kohya_diffusers": "kohya (diffusers names)"}[kinds.pop()]
    return LoraWeights(modules=modules, metadata=metadata, source=source, format=fmt, ignored=ignored,
                       keys=fitting[0] if len(fitting) == 1 else None)


def read_lora(path: str | Path, keys: LoraKeyMap | None = None) -> LoraWeights:
    """Read a LoRA file written by leantune, kohya sd-scripts, ai-toolkit, diffusers or ComfyUI tools;
    `keys` (a family's spec.lora_keys) when the caller knows the family (a loaded model's)."""
    tensors, metadata = load_safetensors(path)
    return lora_from_state_dict(tensors, metadata, source=str(path), keys=keys)
