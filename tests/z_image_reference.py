"""Z-Image's transformer forward as Tongyi-MAI's published source computes it, modelled independently of
diffusers and of leantune: a function of a state dict in the official module names.

Written from reading Tongyi-MAI/Z-Image `src/zimage/transformer.py` and `src/config/model.py` (commit
c7ec135), not copied from it. What it models (basic text-to-image mode, patch 2 x 2, one frame):

* `ZImageTransformer2DModel.forward`: t * t_scale through `TimestepEmbedder` (256 sinusoid
  frequencies, cos then sin, max period 10000; Linear, SiLU, Linear) is every modulated block's
  adaLN input; `patchify_and_embed` pads each caption and each image's patch sequence to a multiple
  of 32 by repeating its last row; the caption's position ids are (1 + k, 0, 0), the image's
  (caption rows padded + 1, i, j), the image padding's (0, 0, 0); after the embedders the padded rows
  are replaced by `x_pad_token` / `cap_pad_token`; noise refiners over the image tokens, context
  refiners over the caption, then the main layers over [image, caption] per item; the final layer
  and the unpatchify (p_h, p_w, c) -> (c, h, w). Every attention is given a key mask (all True for
  an item of the batch's longest length).
* `ZImageTransformerBlock`: adaLN (scale_msa, gate_msa, scale_mlp, gate_mlp) = Linear(adaln), gates
  tanh'ed, scales 1 +; x += gate * norm2(attn(norm1(x) * scale)); x += gate * ffn_norm2(ffn(ffn_norm1(x)
  * scale)) (no modulation in the context refiner); `RMSNorm`: x * rsqrt(mean(x^2) + eps) * w.
* `ZImageAttention`: q, k, v Linears, heads split, RMSNorm on q and k per head, rotary embedding as
  complex products (`RopeEmbedder`: per axis 1 / theta^(2i / d) in float64, outer product with the
  positions, polar), scaled dot-product attention, `to_out.0`.
* `FinalLayer`: LayerNorm without affine (eps 1e-6) * (1 + Linear(SiLU(c))), then Linear.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SEQ_MULTI_OF = 32


def _linear(sd, name, x):
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _time_embedding(sd, t):
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    h = F.silu(_linear(sd, "t_embedder.mlp.0", emb.to(sd["t_embedder.mlp.0.weight"].dtype)))
    return _linear(sd, "t_embedder.mlp.2", h)


def _rope_tables(axes_dims, axes_lens, theta):
    tables = []
    for d, e in zip(axes_dims, axes_lens):
        freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        angles = torch.outer(torch.arange(e, dtype=torch.float64), freqs).float()
        tables.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
    return tables


def _rope(tables, ids):
    return torch.cat([tables[i][ids[:, i]] for i in range(len(tables))], dim=-1)


def _rotate(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.unsqueeze(2)).flatten(3).type_as(x)


def _attention(sd, p, x, mask, freqs, heads, eps):
    q, k, v = (_linear(sd, f"{p}.attention.{n}", x).unflatten(-1, (heads, -1)) for n in ("to_q", "to_k", "to_v"))
    if f"{p}.attention.norm_q.weight" in sd:
        q = _rms(q, sd[f"{p}.attention.norm_q.weight"], eps)
        k = _rms(k, sd[f"{p}.attention.norm_k.weight"], eps)
    q, k = _rotate(q, freqs), _rotate(k, freqs)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :])
    return _linear(sd, f"{p}.attention.to_out.0", out.transpose(1, 2).flatten(2))


def _block(sd, p, x, mask, freqs, adaln, heads, eps):
    def ffn(h):
        return _linear(sd, f"{p}.feed_forward.w2",
                       F.silu(_linear(sd, f"{p}.feed_forward.w1", h)) * _linear(sd, f"{p}.feed_forward.w3", h))

    n = {k: sd[f"{p}.{k}.weight"] for k in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")}
    if f"{p}.adaLN_modulation.0.weight" in sd:
        s_msa, g_msa, s_mlp, g_mlp = _linear(sd, f"{p}.adaLN_modulation.0", adaln).unsqueeze(1).chunk(4, dim=2)
        g_msa, g_mlp, s_msa, s_mlp = g_msa.tanh(), g_mlp.tanh(), 1.0 + s_msa, 1.0 + s_mlp
        x = x + g_msa * _rms(_attention(sd, p, _rms(x, n["attention_norm1"], eps) * s_msa, mask, freqs, heads, eps),
                             n["attention_norm2"], eps)
        return x + g_mlp * _rms(ffn(_rms(x, n["ffn_norm1"], eps) * s_mlp), n["ffn_norm2"], eps)
    x = x + _rms(_attention(sd, p, _rms(x, n["attention_norm1"], eps), mask, freqs, heads, eps), n["attention_norm2"], eps)
    return x + _rms(ffn(_rms(x, n["ffn_norm1"], eps)), n["ffn_norm2"], eps)


def _grid(size, start):
    axes = [torch.arange(s0, s0 + n, dtype=torch.int32) for s0, n in zip(start, size)]
    return torch.stack(torch.meshgrid(axes, indexing="ij"), dim=-1).flatten(0, 2)


def _batch(items):
    """Pad a list of (L_i, D) to (B, L, D) and the key mask (B, L)."""
    longest = max(len(i) for i in items)
    out = torch.stack([torch.cat([i, i.new_zeros(longest - len(i), *i.shape[1:])]) for i in items])
    mask = torch.stack([torch.arange(longest) < len(i) for i in items])
    return out, mask


def _count(sd, prefix):
    return len({k.split(".")[1] for k in sd if k.startswith(prefix + ".")})


@torch.no_grad()
def reference_forward(sd: dict, config: dict, images: list, t: torch.Tensor, caps: list) -> list:
    """The official forward on a state dict in the official module names: images (C, 1, H, W) each,
    t (B,), captions (n_i, cap_feat_dim) each -> one (C, 1, H, W) output per image."""
    dim, heads, eps = config["dim"], config["n_heads"], config["norm_eps"]
    tables = _rope_tables(config["axes_dims"], config["axes_lens"], config["rope_theta"])
    adaln = _time_embedding(sd, t * config["t_scale"])
    xs, x_ids, x_pad, cs, c_ids, c_pad, sizes = [], [], [], [], [], [], []
    for img, cap in zip(images, caps):
        c_len = len(cap)
        c_extra = (-c_len) % SEQ_MULTI_OF
        cs.append(torch.cat([cap, cap[-1:].repeat(c_extra, 1)]))
        c_ids.append(_grid((c_len + c_extra, 1, 1), (1, 0, 0)))
        c_pad.append(torch.arange(c_len + c_extra) >= c_len)
        c, f, h, w = img.shape
        sizes.append((f, h, w))
        patches = img.view(c, f, 1, h // 2, 2, w // 2, 2).permute(1, 3, 5, 2, 4, 6, 0).reshape(-1, 4 * c)
        n = len(patches)
        extra = (-n) % SEQ_MULTI_OF
        xs.append(torch.cat([patches, patches[-1:].repeat(extra, 1)]))
        x_ids.append(torch.cat([_grid((f, h // 2, w // 2), (c_len + c_extra + 1, 0, 0)), _grid((1, 1, 1), (0, 0, 0)).repeat(extra, 1)]))
        x_pad.append(torch.arange(n + extra) >= n)
    lens_x, lens_c = [len(x) for x in xs], [len(c) for c in cs]
    x = _linear(sd, "all_x_embedder.2-1", torch.cat(xs))
    x[torch.cat(x_pad)] = sd["x_pad_token"].to(x.dtype)
    x_freqs = [_rope(tables, i) for i in x_ids]
    x, x_mask = _batch(list(x.split(lens_x)))
    x_f, _ = _batch(x_freqs)
    for i in range(_count(sd, "noise_refiner")):
        x = _block(sd, f"noise_refiner.{i}", x, x_mask, x_f, adaln, heads, eps)
    c = _linear(sd, "cap_embedder.1", _rms(torch.cat(cs), sd["cap_embedder.0.weight"], eps))
    c[torch.cat(c_pad)] = sd["cap_pad_token"].to(c.dtype)
    c_freqs = [_rope(tables, i) for i in c_ids]
    c, c_mask = _batch(list(c.split(lens_c)))
    c_f, _ = _batch(c_freqs)
    for i in range(_count(sd, "context_refiner")):
        c = _block(sd, f"context_refiner.{i}", c, c_mask, c_f, None, heads, eps)
    u, u_mask = _batch([torch.cat([x[b, :lens_x[b]], c[b, :lens_c[b]]]) for b in range(len(xs))])
    u_f, _ = _batch([torch.cat([x_f[b, :lens_x[b]], c_f[b, :lens_c[b]]]) for b in range(len(xs))])
    for i in range(_count(sd, "layers")):
        u = _block(sd, f"layers.{i}", u, u_mask, u_f, adaln, heads, eps)
    scale = 1.0 + _linear(sd, "all_final_layer.2-1.adaLN_modulation.1", F.silu(adaln))
    u = _linear(sd, "all_final_layer.2-1.linear", F.layer_norm(u, (dim,), eps=1e-6) * scale.unsqueeze(1))
    outs = []
    for b, (f, h, w) in enumerate(sizes):
        n = f * (h // 2) * (w // 2)
        ch = u.shape[-1] // 4
        outs.append(u[b, :n].view(f, h // 2, w // 2, 1, 2, 2, ch).permute(6, 0, 3, 1, 4, 2, 5).reshape(ch, f, h, w))
    return outs
