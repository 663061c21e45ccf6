"""LoRA files: read every common Flux and SD3.5 LoRA layout, write ComfyUI/kohya and diffusers files.

In memory a LoRA is a `LoraWeights`: one `LoraModule(down (r, in), up (out, r), alpha)` per
diffusers Linear, whose weight delta is `alpha / r * up @ down`. Files differ in three ways:

* names: kohya / ComfyUI use the reference implementation's module paths (Flux:
  `lora_unet_double_blocks_0_img_attn_qkv`; SD3.5: `lora_unet_joint_blocks_0_x_block_attn_qkv`),
  diffusers / ai-toolkit use diffusers paths with a `transformer.` prefix, some tools use native
  paths with a `diffusion_model.` prefix, musubi-tuner's Z-Image files kohya names of diffusers'
  paths (`lora_unet_layers_0_attention_to_q`). Which names exist is the family's data
  (`spec.lora_keys`, models/lora_keymap.py); this module never names a family's modules.
  DiffSynth-Studio's files (peft keys that keep the adapter name, its DiT's own names) are
  renamed to these first (lora_diffsynth.py);
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

Other adapter types (`[lora] type`, train/adapter_types.py) live beside LoRA:

* DoRA: a `LoraModule` with a `magnitude` (out,): kohya / LyCORIS `dora_scale` (written (out, 1),
  the output-axis decomposition peft trains), peft's `lora_magnitude_vector` in the diffusers
  layout. Its rows split and fuse like the LoRA's (each output row is normalised on its own); a
  per-input-column scale (LyCORIS' wd_on_out = false) is refused.
* LoKr and LoHa: a `LycorisModule` (delta = alpha / r * kron(w1, w2), each factor whole or a
  product a @ b; or alpha / r * (w1_a @ w1_b) * (w2_a @ w2_b)) in LyCORIS' key names (`lokr_w1`,
  `hada_w1_a`, ...; ComfyUI's and LyCORIS' scales: `_lokr_module`, `_loha_module`). A Kronecker or
  Hadamard delta of one part of a fused native Linear is no factor pair of the whole, so such a
  part is written under its LyCORIS name (`lycoris_transformer_blocks_0_attn_to_q`, which ComfyUI
  maps onto the part's rows) and the other modules under their kohya names. A file with LoKr on a
  fused Linear (ai-toolkit's BFL names) is read as the LoRA with that delta exactly (kron(U1 D1,
  U2 D2) = kron(U1, U2) @ kron(D1, D2): up = kron(U1, U2), down = kron(D1, D2); LoHa by the
  face-splitting product), and so is every module of a file whose types would otherwise mix.

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

from . import lora_diffsynth
from .lora_errors import LoraFormatError  # noqa: F401 (raised here, imported from here by callers)
from .lora_keys import FusedTarget, LoraKeyMap, all_key_maps

LoraFileFormat = Literal["comfyui", "diffusers"]
FORMATS = ("comfyui", "diffusers")
ADAPTER_METADATA_KEY = "lora_adapter_metadata"     # diffusers' header key for the LoraConfig JSON
TRAINED_ALPHAS_KEY = "leantune_trained_alphas"      # {module: alpha} folded into lora_B of a diffusers file
DIFFUSERS_PREFIX = "transformer."
# Header keys that describe one file layout; they are rewritten, never passed through a conversion.
_LAYOUT_KEYS = {ADAPTER_METADATA_KEY, "format", "leantune_format", TRAINED_ALPHAS_KEY, "leantune_adapter_type",
                "ss_network_args"}




class _ShapeMismatch(LoraFormatError):
    """A file whose names fit a family but whose shapes do not (Flux.1's and FLUX.2's share names)."""


class IgnoredKeysWarning(UserWarning):
    """Keys of a LoRA file that were skipped on purpose (text-encoder LoRA)."""


class LoraCompatibilityWarning(UserWarning):
    """A LoRA file another common loader reads only in part (it has no name for some modules)."""


@dataclass
class LoraModule:
    """One Linear's LoRA: delta W (out, in) = alpha / rank * up @ down.

    With a `magnitude` (out,) it is a DoRA module (peft's use_dora, LyCORIS' output-axis weight
    decomposition): the layer's weight becomes magnitude / ||W + delta||_row * (W + delta), per
    output row, so its effect depends on the base weight W (`effective_weight`)."""

    down: torch.Tensor        # (r, in)  lora_down / lora_A
    up: torch.Tensor          # (out, r) lora_up / lora_B
    alpha: float
    key: str = ""             # the file key it came from, for error messages
    magnitude: torch.Tensor | None = None    # DoRA: (out,) peft's lora_magnitude_vector, kohya's dora_scale

    @property
    def kind(self) -> str:
        return "lora" if self.magnitude is None else "dora"

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def in_features(self) -> int:
        return int(self.down.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.up.shape[0])

    def delta(self) -> torch.Tensor:
        """The low-rank weight delta (out, in) in fp32 (for DoRA: the update inside the normalisation)."""
        return self.scale * (self.up.float() @ self.down.float())

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"down": self.down, "up": self.up}
        if self.magnitude is not None:
            out["magnitude"] = self.magnitude
        return out


@dataclass
class LycorisModule:
    """One Linear's LoKr or LoHa adapter, in peft's and LyCORIS' factor names (without prefix):

    * lokr: delta = alpha / rank * kron(w1, w2), w1 = `w1` or `w1_a @ w1_b`, w2 = `w2` or `w2_a @ w2_b`;
    * loha: delta = alpha / rank * (w1_a @ w1_b) * (w2_a @ w2_b).

    `rank` is the r whose alpha / r scales the delta (peft's; in a LyCORIS file, the rank of the
    decomposed factor, see lora_formats._lokr_scale)."""

    kind: str                            # "lokr" | "loha"
    factors: dict[str, torch.Tensor]
    alpha: float
    rank: int
    key: str = ""

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def _factor(self, n: str) -> torch.Tensor:
        f = self.factors
        return f[f"w{n}"].float() if f"w{n}" in f else f[f"w{n}_a"].float() @ f[f"w{n}_b"].float()

    @property
    def out_features(self) -> int:
        f = self.factors
        if self.kind == "loha":
            return int(f["w1_a"].shape[0])
        rows = lambda n: int((f[f"w{n}"] if f"w{n}" in f else f[f"w{n}_a"]).shape[0])  # noqa: E731
        return rows("1") * rows("2")

    @property
    def in_features(self) -> int:
        f = self.factors
        if self.kind == "loha":
            return int(f["w1_b"].shape[1])
        cols = lambda n: int((f[f"w{n}"] if f"w{n}" in f else f[f"w{n}_b"]).shape[1])  # noqa: E731
        return cols("1") * cols("2")

    def delta(self) -> torch.Tensor:
        """The weight delta (out, in) in fp32."""
        if self.kind == "lokr":
            return self.scale * torch.kron(self._factor("1"), self._factor("2"))
        return self.scale * (self._factor("1") * self._factor("2"))

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.factors)

    def as_lora(self) -> LoraModule:
        """The LoRA with exactly this delta: LoKr as kron(U1, U2) @ kron(D1, D2) (a whole factor is
        itself times an identity on its shorter side), LoHa as the face-splitting product
        (sum_ij (a1_i * a2_j)(b1_i * b2_j)^T, rank r1 * r2)."""
        if self.kind == "lokr":
            (u1, d1), (u2, d2) = (_lokr_pair(self.factors, n) for n in "12")
            dtype = torch.promote_types(torch.promote_types(u1.dtype, u2.dtype), torch.promote_types(d1.dtype, d2.dtype))
            up = torch.kron(u1.to(dtype), u2.to(dtype))
            down = torch.kron(d1.to(dtype), d2.to(dtype))
        else:
            f = self.factors
            dtype = torch.promote_types(f["w1_a"].dtype, f["w2_a"].dtype)
            a1, b1, a2, b2 = (f[k].to(dtype) for k in ("w1_a", "w1_b", "w2_a", "w2_b"))
            up = (a1[:, :, None] * a2[:, None, :]).reshape(a1.shape[0], -1)          # (out, r1 r2)
            down = (b1[:, None, :] * b2[None, :, :]).reshape(-1, b1.shape[1])        # (r1 r2, in)
        return LoraModule(down, up, self.scale * down.shape[0], self.key)


def _lokr_pair(factors: dict[str, torch.Tensor], n: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, D) with LoKr factor w<n> = U @ D: its a / b matrices, or the whole matrix beside an
    identity on its shorter side (the rank of a Kronecker product is the product of the ranks)."""
    whole = factors.get(f"w{n}")
    if whole is None:
        return factors[f"w{n}_a"], factors[f"w{n}_b"]
    rows, cols = whole.shape
    if cols <= rows:
        return whole, torch.eye(cols, dtype=whole.dtype)
    return torch.eye(rows, dtype=whole.dtype), whole


AdapterModule = LoraModule | LycorisModule


def effective_weight(module: AdapterModule, base: torch.Tensor) -> torch.Tensor:
    """The weight (out, in, fp32) a Linear with base weight `base` computes with under `module`:
    base + delta, or DoRA's magnitude / ||base + delta||_row * (base + delta)."""
    merged = base.float() + module.delta()
    if isinstance(module, LoraModule) and module.magnitude is not None:
        norm = torch.linalg.norm(merged, dim=1)
        merged = merged * (module.magnitude.float() / norm)[:, None]
    return merged


def module_kinds(modules) -> set[str]:
    return {m.kind for m in modules.values()}


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

    @property
    def kind(self) -> str:
        """The adapter type of every module ("lora", "dora", "lokr", "loha"); reading makes a file's
        modules one type (lora_from_state_dict)."""
        kinds = module_kinds(self.modules)
        if len(kinds) != 1:
            raise LoraFormatError(f"{self.source}: its modules mix adapter types {sorted(kinds)}")
        return kinds.pop()


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
    swapped = target.swaps_halves(fused.up.shape[0], fused.down.shape[1])
    up = _swap_halves(fused.up, where) if swapped else fused.up
    mag = fused.magnitude
    if mag is not None:
        mag = _swap_halves(mag, where) if swapped else mag
    n = len(target.parts)
    if n == 1:
        return {target.parts[0]: LoraModule(fused.down, up, fused.alpha, fused.key, mag)}
    dims = _part_rows(target, up.shape[0], where)
    rank = fused.rank
    starts = [sum(dims[:j]) for j in range(n)]
    if mag is not None:
        # DoRA normalises each output row on its own, so the rows split as the LoRA's do; a part
        # without an update still has its magnitude, so no part is dropped.
        split = split_fused(target, LoraModule(fused.down, fused.up, fused.alpha, fused.key), where)
        like = next(iter(split.values()), LoraModule(fused.down, fused.up, fused.alpha))
        out = {}
        for j, name in enumerate(target.parts):
            m = split.get(name) or LoraModule(torch.zeros_like(like.down), like.up.new_zeros(dims[j], like.rank),
                                              like.alpha, fused.key)
            out[name] = LoraModule(m.down, m.up, m.alpha, fused.key, mag[starts[j]:starts[j] + dims[j]].clone())
        return out
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
    """The peft config's keyword arguments reproducing every module's rank and alpha (peft >= 0.14):
    LoraConfig's (use_dora for DoRA), LoKrConfig's or LoHaConfig's by `weights.kind`
    (`peft_config_class` names the class). A LoKr file's `decompose_factor` / `decompose_both` are
    the ones under which peft rebuilds its factor shapes (`lokr_options`)."""
    if not weights.modules:
        raise LoraFormatError(f"{weights.source}: the LoRA has no modules")
    kind = weights.kind
    names = sorted(weights.modules)
    ranks = {n: weights.modules[n].rank for n in names}
    alphas = {n: float(weights.modules[n].alpha) for n in names}
    r = int(_most_common(ranks.values()))
    alpha = float(_most_common(alphas.values()))
    out = {
        "r": r,
        "lora_alpha" if kind in ("lora", "dora") else "alpha": alpha,
        "rank_pattern": {_pattern(n): v for n, v in ranks.items() if v != r},
        "alpha_pattern": {_pattern(n): v for n, v in alphas.items() if v != alpha},
        # A full-match regex: a list would match by suffix and wrap the top-level proj_out too.
        "target_modules": "^(" + "|".join(re.escape(n) for n in names) + ")$",
    }
    if kind == "dora":
        out["use_dora"] = True
    if kind == "lokr":
        options = lokr_options(weights)
        if options is not None:
            out["decompose_factor"], out["decompose_both"] = options
    return out


def peft_config_class(kind: str) -> str:
    """The peft config class of an adapter type."""
    return {"lora": "LoraConfig", "dora": "LoraConfig", "lokr": "LoKrConfig", "loha": "LoHaConfig"}[kind]


def lokr_options(weights: LoraWeights) -> tuple[int, bool] | None:
    """(decompose_factor, decompose_both) under which peft's LoKrConfig, with each module's rank,
    creates exactly the factor shapes of `weights` (the factors leantune trained always qualify);
    None when no such pair exists (a file from a tool that splits the sides otherwise)."""
    from .adapter_types import lokr_layout

    modules = list(weights.modules.values())
    lefts = set()
    for m in modules:
        f = m.factors
        lefts.add(int((f["w1"] if "w1" in f else f["w1_a"]).shape[0]))
        lefts.add(int((f["w1"] if "w1" in f else f["w1_b"]).shape[1]))
    for factor in [-1, *sorted(lefts)]:
        for both in (False, True):
            if all({k: tuple(t.shape) for k, t in m.factors.items()}
                   == lokr_layout(m.in_features, m.out_features, m.rank, factor, both) for m in modules):
                return factor, both
    return None


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
        width = _most_common(m.in_features for m in modules.values())
        wide = [k for k in maps if k.has_width(width)]
        if len(wide) == 1:
            return wide
    return maps


def lycoris_name(name: str) -> str:
    """LyCORIS' name of a diffusers module ('lycoris_transformer_blocks_0_attn_to_q'), which
    ComfyUI maps onto that module's rows of the native weight for every family here."""
    return "lycoris_" + name.replace(".", "_")


def _lycoris_tensors(stem: str, m: AdapterModule, dtype, native_rows: bool) -> dict[str, torch.Tensor]:
    """LyCORIS / kohya keys of one unfused DoRA, LoKr or LoHa module under `stem`. ComfyUI's
    scales (comfy/weight_adapter/lokr.py, loha.py, lora.py): LoHa and DoRA alpha / rank of the b
    matrix, as peft's; LoKr alpha / rank of the decomposed factor (w2, else w1), and 1 when both
    are whole, where peft still applies alpha / r: that scale is then folded into w1 (and alpha
    written as the rank, fold_alphas records the trained one). A DoRA magnitude is written
    (out, 1), the output-axis layout, in the native weight's row order (`native_rows`: the rows
    of a final-layer modulation swap halves, and ComfyUI swaps only the update)."""
    out = {}
    if isinstance(m, LoraModule):
        out[f"{stem}.lora_down.weight"] = _cast(m.down, dtype)
        out[f"{stem}.lora_up.weight"] = _cast(m.up, dtype)
        mag = m.magnitude
        if native_rows:
            mag = _swap_halves(mag, stem)
        out[f"{stem}.dora_scale"] = _cast(mag.reshape(-1, 1), dtype)
    else:
        prefix = "lokr" if m.kind == "lokr" else "hada"
        for role, t in m.factors.items():
            out[f"{stem}.{prefix}_{role}"] = _cast(t, dtype)
    out[f"{stem}.alpha"] = torch.tensor(float(m.alpha), dtype=torch.float32)
    return out


def _lokr_comfyui_ready(m: LycorisModule) -> LycorisModule:
    """A LoKr module whose file scale ComfyUI and LyCORIS read back as peft's: with both factors
    whole they apply scale 1, so alpha / rank goes into w1."""
    f = m.factors
    if "w1" in f and "w2" in f and float(m.alpha) != float(m.rank):
        w1 = (f["w1"].float() * m.scale).to(f["w1"].dtype)
        return LycorisModule("lokr", {**f, "w1": w1}, float(m.rank), m.rank, m.key)
    return m


def _comfyui_tensors(weights: LoraWeights, keys: LoraKeyMap, dtype) -> dict[str, torch.Tensor]:
    """kohya names, LoRA modules fused into the native Linear (fuse_parts); a DoRA, LoKr or LoHa
    module of a fused Linear (or of a final-layer modulation, whose halves swap) under its LyCORIS
    name instead: a Kronecker or Hadamard delta of one part is no part of any factor pair of the
    whole, and ComfyUI maps those names onto the part's rows (its `lycoris_` key map entries)."""
    groups: dict[str, tuple[FusedTarget, dict[int, AdapterModule]]] = {}
    for name, module in weights.modules.items():
        target, part = keys.target_for_diffusers(name)
        groups.setdefault(target.native, (target, {}))[1][part] = module
    out = {}
    for native in sorted(groups):
        target, parts = groups[native]
        if all(m.kind == "lora" for m in parts.values()):
            fused = fuse_parts(target, parts)
            out[f"{target.kohya}.lora_down.weight"] = _cast(fused.down, dtype)
            out[f"{target.kohya}.lora_up.weight"] = _cast(fused.up, dtype)
            out[f"{target.kohya}.alpha"] = torch.tensor(fused.alpha, dtype=torch.float32)
            continue
        for j in sorted(parts):
            m = parts[j]
            swapped = target.swaps_halves(m.out_features, m.in_features)
            stem = target.kohya if len(target.parts) == 1 and not swapped else lycoris_name(target.parts[j])
            if m.kind == "lokr":
                m = _lokr_comfyui_ready(m)
            out.update(_lycoris_tensors(stem, m, dtype, native_rows=swapped))
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
    """diffusers / peft keys: transformer.<module>.lora_A.weight and .lora_B.weight (DoRA: and
    .lora_magnitude_vector); LoKr / LoHa: transformer.<module>.lokr_w1 ... / .hada_w1_a ... (peft's
    state-dict names, which diffusers' LoKr loader reads)."""
    out = {}
    for name in sorted(weights.modules):
        m = weights.modules[name]
        if isinstance(m, LycorisModule):
            prefix = "lokr" if m.kind == "lokr" else "hada"
            for role in sorted(m.factors):
                out[f"{DIFFUSERS_PREFIX}{name}.{prefix}_{role}"] = _cast(m.factors[role], dtype)
            continue
        out[f"{DIFFUSERS_PREFIX}{name}.lora_A.weight"] = _cast(m.down, dtype)
        out[f"{DIFFUSERS_PREFIX}{name}.lora_B.weight"] = _cast(m.up, dtype)
        if m.magnitude is not None:
            out[f"{DIFFUSERS_PREFIX}{name}.lora_magnitude_vector"] = _cast(m.magnitude, dtype)
    return _unshared(out)


def _scaled_by(m: AdapterModule, factor: float) -> AdapterModule:
    """`m` with its delta's scale multiplied into a factor (LoRA / DoRA: up; LoKr: w1 or w1_a;
    LoHa: w1_a), in fp32, and alpha set so that the scale becomes scale / factor."""
    if isinstance(m, LoraModule):
        return LoraModule(m.down, (m.up.float() * factor).to(m.up.dtype), m.alpha / factor, m.key, m.magnitude)
    role = "w1" if "w1" in m.factors else "w1_a"
    t = m.factors[role]
    return LycorisModule(m.kind, {**m.factors, role: (t.float() * factor).to(t.dtype)}, m.alpha / factor, m.rank, m.key)


def fold_alphas(weights: LoraWeights) -> tuple[LoraWeights, dict[str, float]]:
    """The same deltas with alpha = rank (alpha / rank multiplied into each up matrix, or LoKr's w1
    / LoHa's w1_a, in fp32), and the trained alphas that were folded, for the header."""
    modules, folded = {}, {}
    for name, m in weights.modules.items():
        if float(m.alpha) == float(m.rank):
            modules[name] = m
            continue
        f = _scaled_by(m, m.scale)
        f.alpha = float(m.rank)
        modules[name] = f
        folded[name] = float(m.alpha)
    return LoraWeights(modules=modules, metadata=weights.metadata, source=weights.source, format=weights.format,
                       ignored=weights.ignored, keys=weights.keys), folded


def _unfold_alphas(source: str, modules: dict[str, AdapterModule], metadata: dict[str, str]) -> None:
    """Undo fold_alphas for a leantune file (diffusers layout; LoKr with both factors whole in the
    comfyui layout too): the trained alpha, the same delta."""
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
        u = _scaled_by(m, m.rank / alpha)
        u.alpha = alpha
        modules[name] = u


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
    kind = weights.kind
    meta["leantune_adapter_type"] = kind
    if kind != "lora":
        # kohya's notes for a LyCORIS network (sd-scripts --network_module lycoris.kohya): its algo
        # and, for DoRA, the output-axis weight decomposition peft trains (wd_on_out)
        args = {"algo": "lora", "dora_wd": "True", "wd_on_out": "True"} if kind == "dora" else {"algo": kind}
        if kind == "lokr":
            options = lokr_options(weights)
            if options is not None:
                args["factor"] = str(options[0])
                args["decompose_both"] = str(options[1])
        meta["ss_network_module"] = "lycoris.kohya"
        meta["ss_network_args"] = json.dumps(args, sort_keys=True)
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


# diffusers' pipelines whose lora_state_dict accepts LoKr keys (0.42: Flux2LoraLoaderMixin and
# ZImageLoraLoaderMixin; the others refuse a key without "lora" in it, "Invalid LoRA checkpoint").
_DIFFUSERS_LOKR_FAMILIES = ("flux2", "z-image")
# Comfy-Org/ComfyUI comfy/weight_adapter/base.py weight_decompose (read at 9c0cf36c): a dora_scale of
# shape (out, 1) is divided by the row norms of the base weight W, not of W + delta (the
# input-axis branch, for a (1, in) scale, takes W + delta); open fix: Comfy-Org/ComfyUI#15458.
COMFYUI_DORA_NOTE = ("stock ComfyUI (comfy/weight_adapter/base.py weight_decompose) divides an output-axis "
                     "dora_scale by the row norms of the base weight rather than of the base weight plus the update "
                     "(Comfy-Org/ComfyUI#15458 fixes it), so there the LoRA acts a little differently from how it "
                     "trained (by the ratio of those norms, per row); LyCORIS, ComfyUI with that fix, leantune and "
                     "diffusers (its diffusers-layout file) apply the trained weights")

# Comfy-Org/ComfyUI comfy/lora.py load_lora (read at 17358c8f) takes a DoRA magnitude only as kohya's
# `<module>.dora_scale`; peft's `lora_magnitude_vector` keys are "lora key not loaded".
COMFYUI_DIFFUSERS_DORA_NOTE = ("ComfyUI's LoRA loader reads a DoRA magnitude only as kohya's dora_scale, so it skips "
                               "this file's lora_magnitude_vector keys ('lora key not loaded') and applies the update "
                               "as a plain LoRA's, not as trained; in ComfyUI use the comfyui-layout file ([output] "
                               "formats, or leantune convert --to comfyui). diffusers and peft load this file as "
                               "trained")


def _warn_layout_support(weights: LoraWeights, fmt: str, keys: LoraKeyMap | None) -> None:
    """Say where a DoRA, LoKr or LoHa file does not load as trained (LoraCompatibilityWarning)."""
    kind = weights.kind
    if fmt == "comfyui" and kind == "dora":
        warnings.warn(f"the comfyui-layout DoRA file: {COMFYUI_DORA_NOTE}", LoraCompatibilityWarning, stacklevel=3)
    if fmt == "diffusers" and kind == "dora":
        warnings.warn(f"the diffusers-layout DoRA file: {COMFYUI_DIFFUSERS_DORA_NOTE}", LoraCompatibilityWarning,
                      stacklevel=3)
    if fmt != "diffusers" or kind in ("lora", "dora"):
        return
    family = keys.family if keys is not None else ""
    if kind == "lokr" and family.startswith(_DIFFUSERS_LOKR_FAMILIES):
        return
    where = ("diffusers loads LoKr files only through its FLUX.2 and Z-Image pipelines" if kind == "lokr"
             else "diffusers loads no LoHa file (its pipelines accept LoRA and LoKr keys only)")
    warnings.warn(f"the diffusers-layout {'LoHa' if kind == 'loha' else 'LoKr'} file of this "
                  f"{keys.display if keys is not None else ''} LoRA: {where}; peft (set_peft_model_state_dict with the "
                  f"config in its {ADAPTER_METADATA_KEY!r} header) and leantune read it, and the comfyui layout "
                  f"loads in ComfyUI", LoraCompatibilityWarning, stacklevel=3)


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
    weights.kind                                      # one adapter type (raises naming the mix)
    if fmt == "comfyui":
        family_keys = writing_keys(weights, keys)[0]      # the family whose names are written
        _warn_layout_support(weights, fmt, family_keys)
        tensors = comfyui_state_dict(weights, dtype, family_keys)
        header = file_metadata(weights, fmt, path, metadata, family_keys)
        folded = {n: float(m.alpha) for n, m in weights.modules.items()
                  if m.kind == "lokr" and "w1" in m.factors and "w2" in m.factors and float(m.alpha) != float(m.rank)}
        if folded:                                    # _lokr_comfyui_ready put their scale into w1
            header[TRAINED_ALPHAS_KEY] = json.dumps(folded, sort_keys=True)
        return save_safetensors(tensors, path, header)
    else:
        try:            # diffusers names need no family; it only picks the header's notes
            maps = writing_keys(weights, keys)
        except LoraFormatError:
            maps = []
        family_keys = maps[0] if len(maps) == 1 else None
        _warn_comfyui_unnamed(weights, maps)
        _warn_layout_support(weights, fmt, family_keys)
        written, folded = fold_alphas(weights)        # ComfyUI reads no alpha from the header
        tensors = diffusers_state_dict(written, dtype)
        header = file_metadata(written, fmt, path, metadata, family_keys)     # ss_network_alpha: what it applies
        if folded:
            header[TRAINED_ALPHAS_KEY] = json.dumps(folded, sort_keys=True)
        return save_safetensors(tensors, path, header)


# -- reading ---------------------------------------------------------------------------------------

_ROLE_SUFFIXES = (
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".alpha", "alpha"),
    # LoKr (LyCORIS, ai-toolkit): delta = kron(w1, w2), each factor whole or as a product a @ b
    (".lokr_w1", "w1"), (".lokr_w1_a", "w1_a"), (".lokr_w1_b", "w1_b"),
    (".lokr_w2", "w2"), (".lokr_w2_a", "w2_a"), (".lokr_w2_b", "w2_b"),
    # LoHa (LyCORIS): delta = (w1_a @ w1_b) * (w2_a @ w2_b)
    (".hada_w1_a", "hada_w1_a"), (".hada_w1_b", "hada_w1_b"), (".hada_w2_a", "hada_w2_a"), (".hada_w2_b", "hada_w2_b"),
    # DoRA: kohya / LyCORIS dora_scale, peft's lora_magnitude_vector
    (".dora_scale", "magnitude"), (".lora_magnitude_vector.weight", "magnitude"), (".lora_magnitude_vector", "magnitude"),
)
_LOKR_ROLES = ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")
_LOHA_ROLES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
_TEXT_ENCODER_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "text_encoder.", "text_encoder_2.",
                          "text_encoder_3.")
_NATIVE_PREFIXES = ("diffusion_model.", "model.diffusion_model.")
_DIFFUSERS_PREFIXES = (DIFFUSERS_PREFIX, "base_model.model.", "")
_UNSUPPORTED_HINTS = (   # (regex searched in the key, what it is) for a helpful error
    (r"\.hada_t\d", "LoHa with a Tucker core"), (r"\.lokr_t\d", "LoKr with a Tucker core"),
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
    return config


def _config_alpha(config: dict, name: str) -> tuple[float | None, bool]:
    """(alpha, rslora) for a module under a peft LoraConfig dict (peft's pattern rules)."""
    alpha = config.get("lora_alpha", config.get("alpha"))     # LoraConfig's, LoKrConfig's / LoHaConfig's
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            alpha = value
            break
    return (None if alpha is None else float(alpha)), bool(config.get("use_rslora"))


def _float_matrix(source: str, key: str, t: torch.Tensor, what: str = "") -> None:
    if t.dim() != 2 or not t.is_floating_point():
        raise LoraFormatError(f"{source}: key {key!r} should be a 2-D float matrix, got {t.dtype} {tuple(t.shape)}{what}")
    if not torch.isfinite(t).all():
        raise LoraFormatError(f"{source}: key {key!r} contains NaN or infinite values")


def _file_alpha(source: str, entry: _Entry) -> float | None:
    if "alpha" not in entry.tensors:
        return None
    a = entry.tensors["alpha"]
    if a.numel() != 1 or not torch.isfinite(a.float()).all():
        raise LoraFormatError(f"{source}: key {entry.keys['alpha']!r} should be one finite number, got {tuple(a.shape)}")
    return float(a.float().item())


def _lokr_factor(source: str, entry: _Entry, n: str) -> dict[str, torch.Tensor]:
    """Factor w<n> as found: {'w<n>': whole} or {'w<n>_a': a, 'w<n>_b': b}."""
    whole, a, b = entry.tensors.get(f"w{n}"), entry.tensors.get(f"w{n}_a"), entry.tensors.get(f"w{n}_b")
    if whole is not None and (a is not None or b is not None):
        raise LoraFormatError(f"{source}: {entry.keys[f'w{n}']!r} and its _a/_b factors are both given")
    if whole is None and (a is None or b is None):
        have = ", ".join(sorted(entry.keys.values()))
        raise LoraFormatError(f"{source}: LoKr module has no lokr_w{n} (nor lokr_w{n}_a and _b): found only {have}")
    for t, role in ((whole, f"w{n}"), (a, f"w{n}_a"), (b, f"w{n}_b")):
        if t is not None:
            _float_matrix(source, entry.keys[role], t, " (convolution LoKr is not supported)")
    if whole is not None:
        return {f"w{n}": whole}
    if a.shape[1] != b.shape[0]:
        raise LoraFormatError(f"{source}: ranks disagree: {entry.keys[f'w{n}_a']!r} is {tuple(a.shape)} but "
                              f"{entry.keys[f'w{n}_b']!r} is {tuple(b.shape)}")
    return {f"w{n}_a": a, f"w{n}_b": b}


def _lokr_module(source: str, entry: _Entry) -> LycorisModule:
    """A LoKr module with the scale LyCORIS, ComfyUI (comfy/weight_adapter/lokr.py) and diffusers'
    _bake_lokr_alpha_ apply: alpha / r, r the rank of the decomposed w2 (else of w1); 1 when both
    factors are whole (or without alpha). Kept as rank = r, alpha (rank = alpha when the scale is
    1, so that a leantune file's folded alpha unfolds: _unfold_alphas)."""
    factors = {**_lokr_factor(source, entry, "1"), **_lokr_factor(source, entry, "2")}
    key = next(entry.keys[r] for r in _LOKR_ROLES if r in entry.keys).rsplit(".", 1)[0]
    alpha = _file_alpha(source, entry)
    rank_of = factors.get("w2_b", factors.get("w1_b"))
    if rank_of is not None:
        rank = int(rank_of.shape[0])
        return LycorisModule("lokr", factors, float(rank) if alpha is None else alpha, rank, key)
    rank = max(1, round(alpha)) if alpha is not None and alpha > 0 and float(alpha).is_integer() else 1
    return LycorisModule("lokr", factors, float(rank), rank, key)


def _loha_module(source: str, entry: _Entry) -> LycorisModule:
    """A LoHa module, scale alpha / rank of w1_b as ComfyUI (comfy/weight_adapter/loha.py) and
    peft apply it (1 without alpha)."""
    missing = [f".{r}" for r in _LOHA_ROLES if r not in entry.tensors]
    if missing:
        have = ", ".join(sorted(entry.keys.values()))
        raise LoraFormatError(f"{source}: LoHa module has no {missing[0]} (found only {have})")
    f = {r[len("hada_"):]: entry.tensors[r] for r in _LOHA_ROLES}
    for r in _LOHA_ROLES:
        _float_matrix(source, entry.keys[r], entry.tensors[r], " (convolution LoHa is not supported)")
    for n in "12":
        a, b = f[f"w{n}_a"], f[f"w{n}_b"]
        if a.shape[1] != b.shape[0]:
            raise LoraFormatError(f"{source}: ranks disagree: {entry.keys[f'hada_w{n}_a']!r} is {tuple(a.shape)} but "
                                  f"{entry.keys[f'hada_w{n}_b']!r} is {tuple(b.shape)}")
    if f["w1_a"].shape[0] != f["w2_a"].shape[0] or f["w1_b"].shape[1] != f["w2_b"].shape[1]:
        raise LoraFormatError(f"{source}: {entry.keys['hada_w1_a']!r} and {entry.keys['hada_w2_a']!r} give products "
                              f"of different shapes")
    rank = int(f["w1_b"].shape[0])
    alpha = _file_alpha(source, entry)
    return LycorisModule("loha", f, float(rank) if alpha is None else alpha, rank,
                         entry.keys["hada_w1_a"].rsplit(".", 1)[0])


def _checked_module(source: str, entry: _Entry, unit: str) -> AdapterModule:
    lycoris = [(kind, roles) for kind, roles in (("LoKr", _LOKR_ROLES), ("LoHa", _LOHA_ROLES))
               if any(role in entry.tensors for role in roles)]
    if lycoris:
        others = [entry.keys[r] for r in ("down", "up", "magnitude") if r in entry.tensors]
        if len(lycoris) > 1 or others:
            other = entry.keys[next(r for r in _LOHA_ROLES if r in entry.tensors)] if len(lycoris) > 1 else others[0]
            raise LoraFormatError(f"{source}: module {unit!r} has both {lycoris[0][0]} keys and {other!r}"
                                  + (" (DoRA over LoKr / LoHa is not supported)" if "magnitude" in entry.tensors else ""))
        return _lokr_module(source, entry) if lycoris[0][0] == "LoKr" else _loha_module(source, entry)
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
    alpha = _file_alpha(source, entry)
    magnitude = None
    if "magnitude" in entry.tensors:
        mag, km = entry.tensors["magnitude"], entry.keys["magnitude"]
        if not mag.is_floating_point() or not torch.isfinite(mag).all():
            raise LoraFormatError(f"{source}: key {km!r} should hold finite floats, got {mag.dtype}")
        out_rows, in_cols = up.shape[0], down.shape[1]
        if mag.dim() == 2 and mag.shape[0] == 1 and mag.shape[1] == in_cols and out_rows != 1:
            raise LoraFormatError(f"{source}: key {km!r} is a DoRA scale per input column {tuple(mag.shape)} (LyCORIS' "
                                  f"wd_on_out = false); leantune and peft apply DoRA per output row, (out,) or "
                                  f"(out, 1)")
        if mag.numel() != out_rows or not (mag.dim() == 1 or (mag.dim() == 2 and mag.shape[1] == 1)):
            raise LoraFormatError(f"{source}: key {km!r} has shape {tuple(mag.shape)}; a DoRA magnitude of this "
                                  f"module is ({out_rows},) or ({out_rows}, 1)")
        magnitude = mag.reshape(-1)
    return LoraModule(down, up, float(down.shape[0]) if alpha is None else alpha, kd.rsplit(".", 2)[0], magnitude)


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

    modules: dict[str, AdapterModule] = {}
    origin: dict[str, str] = {}
    kinds = set()
    for unit_id, entry in entries.items():
        unit = unit_id.split(":", 1)[1]
        module = _checked_module(source, entry, unit)
        kinds.add(entry.kind)
        if entry.target is not None:
            problem = keys.shape_problem(entry.target, module.out_features, module.in_features)
            if problem:
                raise _ShapeMismatch(f"{source}: module {module.key!r} is not a {keys.display} LoRA: {problem}")
        if entry.kind in ("lycoris", "kohya_diffusers"):
            if isinstance(module, LoraModule) and module.magnitude is not None:
                found_target = keys.target_for_diffusers(unit)
                if found_target and found_target[0].swaps_halves(module.out_features, module.in_features):
                    # the dora_scale of a final-layer modulation is in the native weight's row order
                    module.magnitude = _swap_halves(module.magnitude, f"{source}: {entry.keys['magnitude']!r}")
            split = {unit: module}
        elif entry.kind == "diffusers":
            if "alpha" not in entry.tensors and config is not None:
                alpha, rslora = _config_alpha(config, unit)
                if isinstance(module, LycorisModule):
                    # peft's LoKr / LoHa scale alpha / r with the config's r, whatever the factor shapes
                    rank = _config_rank(config, unit)
                    module.rank = module.rank if rank is None else rank
                    module.alpha = float(module.rank) if alpha is None else alpha
                elif alpha is not None:
                    # rsLoRA scales by alpha / sqrt(r); express it as our alpha / r.
                    module.alpha = alpha * math.sqrt(module.rank) if rslora else alpha
            split = {unit: module}
        elif isinstance(module, LycorisModule):
            target = entry.target
            if len(target.parts) == 1 and not target.swaps_halves(module.out_features, module.in_features):
                split = {target.parts[0]: module}
            else:     # a Kronecker / Hadamard delta on a fused Linear: its parts' rows as LoRAs, exactly
                key = next(iter(entry.keys.values()))
                split = split_fused(target, module.as_lora(), f"{source}: {key!r}")
        else:
            split = split_fused(entry.target, module, f"{source}: {entry.keys.get('down', module.key)!r}")
        for name, m in split.items():
            if name in modules:
                raise LoraFormatError(f"{source}: module {name!r} is given twice, by {origin[name]!r} and {m.key!r}")
            modules[name] = m
            origin[name] = m.key
    return modules, kinds


def _one_kind(source: str, modules: dict[str, AdapterModule]) -> None:
    """Make a file's modules one adapter type, as one peft adapter holds them: LoKr or LoHa modules
    beside LoRA ones (a LoKr file with fused attention, read as LoRAs there) become the LoRAs with
    their deltas (LycorisModule.as_lora, exact); DoRA beside another type is refused."""
    kinds = module_kinds(modules)
    if len(kinds) < 2:
        return
    if "dora" in kinds:
        other = next(n for n, m in modules.items() if m.kind != "dora")
        raise LoraFormatError(f"{source}: some modules are DoRA (a dora_scale / lora_magnitude_vector) and others "
                              f"are not, e.g. {other!r}; leantune applies one adapter type per file")
    for name, m in modules.items():
        if isinstance(m, LycorisModule):
            modules[name] = m.as_lora()


def _config_rank(config: dict, name: str) -> int | None:
    r = config.get("r")
    for pattern, value in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            r = value
            break
    return None if r is None else int(r)


def _same_modules(a: dict[str, AdapterModule], b: dict[str, AdapterModule]) -> bool:
    def same(x, y) -> bool:
        tx, ty = x.tensors(), y.tensors()
        return (type(x) is type(y) and x.kind == y.kind and x.alpha == y.alpha and tx.keys() == ty.keys()
                and all(torch.equal(tx[k], ty[k]) for k in tx))
    return a.keys() == b.keys() and all(same(a[n], b[n]) for n in a)


def lora_from_state_dict(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                         source: str = "<state dict>", keys: LoraKeyMap | None = None) -> LoraWeights:
    """Parse a LoRA state dict in any supported layout (see the module docstring).

    `keys` (a family's spec.lora_keys) reads it as that family's; by default the family is the one
    whose names fit every key (the header's hint decides between several that read it differently).
    """
    metadata = dict(metadata or {})
    config = _adapter_config(source, metadata)
    maps = [keys] if keys is not None else all_key_maps()
    diffsynth = lora_diffsynth.readable(source, tensors, lambda stem: any(_classify(stem, k)[0] != "unknown"
                                                                          for k in maps))
    tensors = tensors if diffsynth is None else diffsynth       # DiffSynth-Studio's names, renamed
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
    _one_kind(source, modules)
    if kinds == {"diffusers"} or metadata.get("leantune_format") == "comfyui":
        _unfold_alphas(source, modules, metadata)
    if ignored:
        warnings.warn(f"{source}: ignored {len(ignored)} text-encoder LoRA keys (only the transformer is "
                      f"supported), e.g. {ignored[0]!r}", IgnoredKeysWarning, stacklevel=3)
    if not modules:
        raise LoraFormatError(f"{source}: no {_displays(maps)} transformer LoRA keys found")
    fmt = "mixed" if len(kinds) > 1 else {"kohya": "comfyui", "native": "bfl", "diffusers": "diffusers",
                                                   "lycoris": "lycoris", "kohya_diffusers": "kohya (diffusers names)"}[kinds.pop()]
    fmt = fmt if diffsynth is None else "diffsynth"
    return LoraWeights(modules=modules, metadata=metadata, source=source, format=fmt, ignored=ignored,
                       keys=fitting[0] if len(fitting) == 1 else None)


def read_lora(path: str | Path, keys: LoraKeyMap | None = None) -> LoraWeights:
    """Read a LoRA file written by leantune, kohya sd-scripts, ai-toolkit, diffusers or ComfyUI tools;
    `keys` (a family's spec.lora_keys) when the caller knows the family (a loaded model's)."""
    tensors, metadata = load_safetensors(path)
    return lora_from_state_dict(tensors, metadata, source=str(path), keys=keys)
