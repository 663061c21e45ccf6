"""Key layout of Z-Image's original single files (Tongyi-MAI's checkpoint names, ComfyUI's repackaged
z_image_turbo_*.safetensors), both ways, and the architecture from shapes.

The original names differ from diffusers' ZImageTransformer2DModel in a handful of places only
(diffusers' `convert_z_image_transformer_checkpoint_to_diffusers`, ComfyUI's
`comfy.utils.z_image_to_diffusers` state the same table):

- in every block (`layers.N`, `noise_refiner.N`, `context_refiner.N`): one fused
  `attention.qkv` Linear for diffusers' `attention.to_q/to_k/to_v` (stacked rows, q first; no
  bias), `attention.out` for `attention.to_out.0`, `attention.q_norm` / `k_norm` for
  `attention.norm_q` / `norm_k`;
- at the top: `x_embedder` and `final_layer` for diffusers' per-patch-size dicts
  `all_x_embedder.2-1` and `all_final_layer.2-1` (the released models have the one patch size 2,
  frame patch 1).

Every other name (feed_forward.w1/w2/w3, adaLN_modulation.0, the norms, t_embedder, cap_embedder,
the pad tokens) is the same in both. ComfyUI's files carry the names under
`model.diffusion_model.` or bare. One table serves both directions: `to_diffusers_ops` (what the
loader applies lazily, tensor by tensor) and `diffusers_to_native` (what a full fine-tune's
export writes) are exact inverses.

The weights show the width, depths, heads, text width and latent channels; the rotary split,
its lengths and base, the norm eps and the time scale are not in the weights: they default to the
released models' (models/configs/z_image_turbo.json) and a file may state others in its
`leantune.config` metadata (what leantune writes for a model of another head size).
"""

from __future__ import annotations

import json
import re

from ..weights import KeyOp

COMFY_PREFIX = "model.diffusion_model."
PATCH = "2-1"                              # the released patch sizes: 2 x 2, one frame
BLOCK_LISTS = ("noise_refiner", "context_refiner", "layers")
_BLOCK_RE = re.compile(r"^(noise_refiner|context_refiner|layers)\.(\d+)\.(.+)$")

# in-block: native parameter -> diffusers parameter(s) (several: stacked along dim 0 in equal runs)
_IN_BLOCK = {
    "attention.qkv.weight": ("attention.to_q.weight", "attention.to_k.weight", "attention.to_v.weight"),
    "attention.out.weight": ("attention.to_out.0.weight",),
    "attention.q_norm.weight": ("attention.norm_q.weight",),
    "attention.k_norm.weight": ("attention.norm_k.weight",),
}
_TOP_PREFIXES = (("x_embedder.", f"all_x_embedder.{PATCH}."), ("final_layer.", f"all_final_layer.{PATCH}."))
_IN_BLOCK_BACK = {d: (n, i) for n, ds in _IN_BLOCK.items() for i, d in enumerate(ds)}

# Tensors only Z-Image's transformer has, in both namings (the pad tokens are Lumina-Next's too,
# the refiners with a context refiner and a `cap_pad_token` are Z-Image's): a file is claimed when
# both kinds are there.
MARKERS = ("cap_pad_token", "x_pad_token")
REFINER_MARKER = "context_refiner.0."


def recognizes_keys(keys) -> bool:
    """A Z-Image transformer file (original, ComfyUI or diffusers names, any prefix)."""
    keys = list(keys)
    tokens = any(k == m or k.endswith("." + m) for k in keys for m in MARKERS)
    return tokens and any(k.startswith(REFINER_MARKER) or ("." + REFINER_MARKER) in k for k in keys)


def find_prefix(keys) -> str | None:
    """The prefix the transformer's keys sit under ("", "model.diffusion_model.", ...), or None."""
    for k in keys:
        if k == "cap_pad_token" or k.endswith(".cap_pad_token"):
            return k[: len(k) - len("cap_pad_token")]
    return None


def is_native(shapes) -> bool:
    """True for the original (fused qkv) names, False for diffusers'."""
    return any(k.endswith(".attention.qkv.weight") or k.startswith("x_embedder.") for k in shapes)


# -- native -> diffusers --------------------------------------------------------------------------------

def diffusers_name(native: str) -> tuple[str, ...]:
    """The diffusers key(s) a native key holds (several: a fused qkv, q first)."""
    m = _BLOCK_RE.match(native)
    if m:
        block, rest = f"{m.group(1)}.{m.group(2)}.", m.group(3)
        return tuple(block + d for d in _IN_BLOCK.get(rest, (rest,)))
    for nat, diff in _TOP_PREFIXES:
        if native.startswith(nat):
            return (diff + native[len(nat):],)
    return (native,)


def native_name(diffusers: str) -> str:
    """The native key holding a diffusers key (for messages naming a file's missing key)."""
    m = _BLOCK_RE.match(diffusers)
    if m:
        block, rest = f"{m.group(1)}.{m.group(2)}.", m.group(3)
        return block + (_IN_BLOCK_BACK[rest][0] if rest in _IN_BLOCK_BACK else rest)
    for nat, diff in _TOP_PREFIXES:
        if diffusers.startswith(diff):
            return nat + diffusers[len(diff):]
    return diffusers


def to_diffusers_ops(shapes: dict[str, tuple[int, ...]], prefix: str = "") -> list[KeyOp]:
    """Ops turning native keys (given without `prefix`; the ops carry it) into diffusers keys; a
    fused qkv splits in three equal row runs (an uneven one fails the loader's shape check)."""
    ops = []
    for key, shape in shapes.items():
        targets = diffusers_name(key)
        split = None
        if len(targets) > 1:
            rows = shape[0] if shape else 0
            split = tuple([rows // len(targets)] * (len(targets) - 1) + [rows - (len(targets) - 1) * (rows // len(targets))])
        ops.append(KeyOp(prefix + key, targets, split))
    return ops


# -- diffusers -> native --------------------------------------------------------------------------------

def diffusers_to_native(state: dict) -> dict:
    """A diffusers state dict, or one group of it (the non-block modules, one block), in the
    original names; a fused qkv needs its three parts (KeyError names the missing ones)."""
    import torch

    out, fused = {}, {}
    for key, t in state.items():
        m = _BLOCK_RE.match(key)
        rest = m.group(3) if m else None
        if rest in _IN_BLOCK_BACK:
            native, part = _IN_BLOCK_BACK[rest]
            name = f"{m.group(1)}.{m.group(2)}.{native}"
            if len(_IN_BLOCK[native]) > 1:
                fused.setdefault(name, {})[part] = t
                continue
            out[name] = t
        else:
            out[native_name(key)] = t
    for name, parts in fused.items():
        native = name.split(".", 2)[2]
        if len(parts) != len(_IN_BLOCK[native]):
            block = name[: -len(native)]
            missing = [block + d for i, d in enumerate(_IN_BLOCK[native]) if i not in parts]
            raise KeyError(f"{name} fuses {[block + d for d in _IN_BLOCK[native]]}; missing {missing}")
        out[name] = torch.cat([parts[i] for i in range(len(parts))], dim=0)
    return out


def native_metadata(model) -> dict:
    """SingleFileLayout.metadata: the config the weights cannot show, so a model of any head size
    (or rotary split) loads back with its own config."""
    from ..component_files import METADATA_CONFIG_KEY

    cfg = model.config
    return {METADATA_CONFIG_KEY: json.dumps({k: _plain(cfg[k]) for k in UNSEEN})}


def _plain(v):
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


# -- architecture from shapes -------------------------------------------------------------------------

# What the weights cannot show (the released models' values: models/configs/z_image_turbo.json).
UNSEEN = ("norm_eps", "rope_theta", "t_scale", "axes_dims", "axes_lens")


def count_blocks(shapes, prefix: str) -> int:
    idx = {int(k[len(prefix):].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
    if idx and idx != set(range(max(idx) + 1)):
        raise ValueError(f"blocks {prefix}N are not numbered 0..{max(idx)}: {sorted(idx)}")
    return len(idx)


def config_from_shapes(shapes: dict[str, tuple[int, ...]], released: dict, meta: dict | None = None) -> dict:
    """A ZImageTransformer2DModel config from diffusers key shapes (native files: after
    `to_diffusers_ops`); `released` gives what the weights cannot show, `meta` (a file's
    leantune.config) overrides it.

    Raises KeyError naming the first anchor key that is missing, ValueError for shapes that fit
    no Z-Image transformer."""
    meta = dict(meta or {})

    def need(key):
        if key not in shapes:
            raise KeyError(key)
        return shapes[key]

    dim, patch_in = need(f"all_x_embedder.{PATCH}.weight")
    if patch_in % 4:
        raise ValueError(f"x_embedder takes {patch_in} inputs, not 2 x 2 patches of latent channels")
    layers = count_blocks(shapes, "layers.")
    refiners = count_blocks(shapes, "noise_refiner.")
    if count_blocks(shapes, "context_refiner.") != refiners:
        raise ValueError(f"{refiners} noise_refiner but {count_blocks(shapes, 'context_refiner.')} "
                         f"context_refiner blocks (Z-Image has as many of each)")
    where = "layers.0" if layers else "noise_refiner.0"
    qk_norm = f"{where}.attention.norm_q.weight" in shapes
    if qk_norm:
        head = need(f"{where}.attention.norm_q.weight")[0]
    else:
        head = int(meta.get("head_dim") or 0) or None
        if head is None:
            raise ValueError("no q/k norms to read the head size from; give it in the file's leantune.config")
    if dim % head:
        raise ValueError(f"width {dim} is not a multiple of the head size {head} (from {where}.attention.norm_q)")
    kv_rows = need(f"{where}.attention.to_k.weight")[0]
    config = dict(
        all_patch_size=[2], all_f_patch_size=[1], in_channels=patch_in // 4, dim=dim, n_layers=layers,
        n_refiner_layers=refiners, n_heads=dim // head, n_kv_heads=kv_rows // head, qk_norm=qk_norm,
        cap_feat_dim=need("cap_embedder.1.weight")[1],
    )
    config.update({k: released[k] for k in UNSEEN})
    config.update({k: v for k, v in meta.items() if k in UNSEEN})
    if sum(config["axes_dims"]) != head:
        raise ValueError(f"heads of {head} (the released models' are {sum(released['axes_dims'])}): the rotary "
                         f"axes cannot be read from the weights; give axes_dims in the file's leantune.config metadata")
    return config
