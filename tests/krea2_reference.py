"""Krea 2's transformer forward as krea-ai's own code computes it, modelled independently of
diffusers and of leantune: a function of the official state dict (krea-ai names, the block
modulation flattened) and the official forward's inputs.

Written from reading krea-ai/krea-2 at db3984f, `mmdit.py` (`SingleStreamDiT.forward` and the
modules it calls: `temb`, `rope` / `ropeapply`, `_mask`, `RMSNorm`, `Attention`, `SwiGLU`,
`TextFusionTransformer`, `SingleStreamBlock`, `DoubleSharedModulation`, `LastLayer`,
`SimpleModulation`), not copied from it:

* the image tokens go through `first`; the time t in [0, 1] becomes a cos-first sinusoid of
  t * 1000 (period 1e4, `tdim` wide), `tmlp` (Linear, tanh-GELU, Linear) makes the vector `t`
  (B, 1, F) and `tproj` (tanh-GELU, Linear) the shared modulation (B, 1, 6F);
* the text (B, L, n_layers, D) runs the text fusion: 2 layerwise blocks over the layer axis of each
  token (no mask), `projector` collapses the layer axis, 2 refiner blocks over the tokens with the
  text mask as a (B, 1, L, L) query-and-key mask (`_mask`); then `txtmlp` (RMSNorm, Linear,
  tanh-GELU, Linear);
* [text, image] is one sequence, padded with masked zero rows to a multiple of 256 (the official
  code's compile-friendly padding), masked as (B, 1, S, S) from the (B, S) key mask;
* rotary: per axis of the (t, h, w) positions, angles pos * theta^(-2i/dim) as 2 x 2 rotations of
  consecutive channel pairs, the head split `head - 12 (head // 16), 6 (head // 16), 6 (head // 16)`;
* a block: its `mod.lin` (6F,) added to the shared modulation, chunked into prescale, preshift,
  pregate, postscale, postshift, postgate; x + pregate * attn((1 + prescale) * prenorm(x) +
  preshift), x + postgate * mlp((1 + postscale) * postnorm(x) + postshift); attention: q, k, v and a
  gate from the input, per-head RMSNorm of q and k, rotary, scaled dot product attention (grouped
  key/value heads), times sigmoid(gate), `wo`;
* every RMSNorm scale is zero-centred (multiplier 1 + scale) and computed in float32;
* the last layer: (scale, shift) = t + `last.modulation.lin` (from the time vector t, not the shared
  modulation), (1 + scale) * norm(x) + shift, `last.linear`; the output is the image rows.

What is not modelled: torch.compile and the cuDNN attention kernel the official code selects (the
math is the same; on CPU the math kernel runs, and a fully masked padding row attends to nothing
and gives zeros there).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KREA2_SOURCE = "krea-ai/krea-2 mmdit.py db3984f"


def _linear(sd: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def _rms(sd: dict, name: str, x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    scale = sd[f"{name}.scale"]
    return F.rms_norm(x.float(), (scale.shape[0],), eps=eps, weight=scale.float() + 1.0).to(x.dtype)


def _time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(1e4) * torch.arange(half, dtype=torch.float32) / half)
    angles = (t.float() * 1e3)[:, None, None] * freqs                       # (B, 1, half)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def _rotations(pos: torch.Tensor, head: int, theta: float) -> torch.Tensor:
    """(B, S, 3) positions -> (B, S, head / 2, 2, 2) rotation matrices, axis by axis."""
    six = 6 * (head // 16)
    parts = []
    for axis, dim in enumerate((head - 2 * six, six, six)):
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angle = pos[..., axis].double()[..., None] * inv                       # (B, S, dim / 2)
        cos, sin = torch.cos(angle), torch.sin(angle)
        parts.append(torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2))
    return torch.cat(parts, dim=-3).float()


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, head): each channel pair (x0, x1) -> R @ (x0, x1)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)                           # (B, H, S, head/2, 2)
    out = torch.einsum("bsdij,bhsdj->bhsdi", rot, pairs)
    return out.reshape(x.shape).to(x.dtype)


def _attention(sd: dict, name: str, x: torch.Tensor, heads: int, kv_heads: int, rot, mask) -> torch.Tensor:
    b, s, width = x.shape
    head = width // heads
    q = _linear(sd, f"{name}.wq", x).view(b, s, heads, head).transpose(1, 2)
    k = _linear(sd, f"{name}.wk", x).view(b, s, kv_heads, head).transpose(1, 2)
    v = _linear(sd, f"{name}.wv", x).view(b, s, kv_heads, head).transpose(1, 2)
    gate = _linear(sd, f"{name}.gate", x)
    q, k = _rms(sd, f"{name}.qknorm.qnorm", q), _rms(sd, f"{name}.qknorm.knorm", k)
    if rot is not None:
        q, k = _rotate(q, rot), _rotate(k, rot)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    out = out.transpose(1, 2).reshape(b, s, width)
    return _linear(sd, f"{name}.wo", out * torch.sigmoid(gate))


def _mlp(sd: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    return _linear(sd, f"{name}.down", F.silu(_linear(sd, f"{name}.gate", x)) * _linear(sd, f"{name}.up", x))


def _fusion_block(sd: dict, name: str, x: torch.Tensor, heads: int, kv_heads: int, mask) -> torch.Tensor:
    x = x + _attention(sd, f"{name}.attn", _rms(sd, f"{name}.prenorm", x), heads, kv_heads, None, mask)
    return x + _mlp(sd, f"{name}.mlp", _rms(sd, f"{name}.postnorm", x))


def _pair_mask(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) key padding -> (B, 1, L, L): a pair attends when query and key are both real."""
    return mask[:, None, :, None] & mask[:, None, None, :]


def reference_forward(sd: dict, img: torch.Tensor, context: torch.Tensor, t: torch.Tensor, pos: torch.Tensor,
                      mask: torch.Tensor, *, heads: int, kv_heads: int, text_heads: int, text_kv_heads: int,
                      theta: float = 1e3) -> torch.Tensor:
    """The official forward: img (B, N, C*4), context (B, L, n_layers, D), t (B,), pos (B, L + N, 3),
    mask (B, L + N) bool -> the image rows' output (B, N, C*4)."""
    width = sd["first.weight"].shape[0]
    tdim = sd["tmlp.0.weight"].shape[1]
    x_img = _linear(sd, "first", img)
    tv = _linear(sd, "tmlp.2", F.gelu(_linear(sd, "tmlp.0", _time_embedding(t, tdim).to(img.dtype)), approximate="tanh"))
    shared = _linear(sd, "tproj.1", F.gelu(tv, approximate="tanh"))            # (B, 1, 6F)
    b, length, n_layers, d = context.shape
    txt = context.reshape(b * length, n_layers, d)
    for i in range(2):
        txt = _fusion_block(sd, f"txtfusion.layerwise_blocks.{i}", txt, text_heads, text_kv_heads, None)
    txt = txt.reshape(b, length, n_layers, d).permute(0, 1, 3, 2)
    txt = F.linear(txt, sd["txtfusion.projector.weight"]).squeeze(-1)          # (B, L, D)
    text_mask = _pair_mask(mask[:, :length])
    for i in range(2):
        txt = _fusion_block(sd, f"txtfusion.refiner_blocks.{i}", txt, text_heads, text_kv_heads, text_mask)
    txt = _linear(sd, "txtmlp.3", F.gelu(_linear(sd, "txtmlp.1", _rms(sd, "txtmlp.0", txt)), approximate="tanh"))
    x = torch.cat([txt, x_img], dim=1)
    pad = (-x.shape[1]) % 256
    x = F.pad(x, (0, 0, 0, pad))
    full_mask = _pair_mask(F.pad(mask, (0, pad), value=False))
    rot = _rotations(F.pad(pos, (0, 0, 0, pad)), width // heads, theta)
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    for i in range(depth):
        name = f"blocks.{i}"
        m = (shared + sd[f"{name}.mod.lin"]).chunk(6, dim=-1)
        h = _attention(sd, f"{name}.attn", (1 + m[0]) * _rms(sd, f"{name}.prenorm", x) + m[1], heads, kv_heads, rot,
                       full_mask)
        x = x + m[2] * h
        x = x + m[5] * _mlp(sd, f"{name}.mlp", (1 + m[3]) * _rms(sd, f"{name}.postnorm", x) + m[4])
    scale, shift = (tv + sd["last.modulation.lin"][None]).chunk(2, dim=1)
    out = _linear(sd, "last.linear", (1 + scale) * _rms(sd, "last.norm", x) + shift)
    return out[:, length:length + img.shape[1]]
