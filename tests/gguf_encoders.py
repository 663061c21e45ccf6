"""Plain encoders for the GGUF block types the gguf package decodes but cannot encode (gguf 0.19:
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS raise NotImplementedError in gguf.quants.quantize).

Why they exist: the tests need files of these types and bench/gguf_accuracy.py needs their error,
and llama.cpp's C quantizer (which writes the community's files) is not at hand. Each packs blocks
in the byte layout gguf's decoder reads, with round-to-nearest on a plain per-sub-block scale (min /
max for the types with mins, the largest magnitude otherwise); llama.cpp's reference quantizers
search the scales, so these encoders err a little more than published files do. The reference the
tests compare with is always the package's decoder; each encoder is checked against its input.

`encode(rows, qtype)` takes (n, k * block_values) fp32 and returns (n, k * block_bytes) uint8.
"""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)   # the 4-bit non-linear grid


def _fp16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, dtype=np.float32), where=b != 0)


def _bytes(a: np.ndarray) -> np.ndarray:
    """(blocks, k) of fp16 / uint16 -> (blocks, 2k) uint8, little-endian as GGUF stores them."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1)


def _min_max(x: np.ndarray, qmax: int, scale_max: int):
    """Sub-blocks (blocks, s, v) with a scale and a min each, both quantized against a block fp16
    (d, dmin) to 0..scale_max: value = d * sc * q - dmin * m, q in 0..qmax."""
    lo = np.minimum(x.min(-1), 0.0)
    step = (x.max(-1) - lo) / qmax                                    # (blocks, s)
    d, dmin = _fp16(step.max(-1) / scale_max), _fp16((-lo).max(-1) / scale_max)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(_safe_div(step, df)), 0, scale_max).astype(np.uint8)
    mn = np.clip(np.round(_safe_div(-lo, dminf)), 0, scale_max).astype(np.uint8)
    q = _safe_div(x + (dminf * mn)[..., None], (df * sc)[..., None])
    return d, dmin, sc, mn, np.clip(np.round(q), 0, qmax).astype(np.uint8)


def _symmetric(x: np.ndarray, qlo: int, qhi: int, scale_lo: int, scale_hi: int):
    """Sub-blocks (blocks, s, v) with a signed scale each against a block fp16 d: the sub-block's
    largest-magnitude value maps to qlo (as llama.cpp's quantizers do), value = d * sc * q."""
    idx = np.abs(x).argmax(-1)[..., None]
    step = np.take_along_axis(x, idx, -1)[..., 0] / qlo                # signed (blocks, s)
    big = np.take_along_axis(step, np.abs(step).argmax(-1)[:, None], -1)[:, 0]
    d = _fp16(big / scale_lo)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(_safe_div(step, df)), scale_lo, scale_hi)
    q = np.clip(np.round(_safe_div(x, (df * sc)[..., None])), qlo, qhi)
    return d, sc.astype(np.int8), q.astype(np.int8)


def _pack_2bit_halves(q: np.ndarray) -> np.ndarray:
    """(blocks, 256) values of 2 bits -> 64 bytes: byte h*32 + j holds values h*128 + k*32 + j at bits 2k."""
    v = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (v << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2, dtype=np.uint8).reshape(-1, 64)


def _q4_5_k(x: np.ndarray, qtype: Q) -> np.ndarray:
    d, dmin, sc, mn, q = _min_max(x.reshape(-1, 8, 32), 15 if qtype == Q.Q4_K else 31, 63)
    packed = np.zeros((q.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)       # pairs of sub-blocks share 32 bytes
    parts = [_bytes(d[:, None]), _bytes(dmin[:, None]), packed]
    if qtype == Q.Q5_K:
        high = (q >> 4) & 1                                           # bit j of byte i: sub-block j, value i
        parts.append((high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8))
    return np.concatenate(parts + [qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """ql 128 | qh 64 | int8 scales 16 | fp16 d; q in -32..31 per sub-block of 16."""
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), -32, 31, -128, 127)
    v = (q.reshape(-1, 2, 128).astype(np.int16) + 32).astype(np.uint8)     # 0..63, two halves of 128
    low, high = v & 0x0F, v >> 4
    ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(-1, 128)
    qh = (high.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None])
    qh = qh.sum(2, dtype=np.uint8).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _bytes(d[:, None])], axis=1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    """hmask 32 | qs 64 | 6-bit scales 12 | fp16 d; q in -4..3 per sub-block of 16, scale - 32 stored."""
    d, sc, q = _symmetric(x.reshape(-1, 16, 16), -4, 3, -32, 31)
    u = (q.reshape(-1, 256).astype(np.int16) + 4).astype(np.uint8)      # 0..7: low 2 bits, high bit
    hmask = ((u >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
    s = (sc.astype(np.int16) + 32).astype(np.uint8)                      # (blocks, 16), 0..63
    scales = np.zeros((s.shape[0], 12), dtype=np.uint8)
    scales[:, :8] = (s[:, :8] & 0x0F) | ((s[:, 8:] & 0x0F) << 4)
    hi = (s >> 4).reshape(-1, 4, 4)                                     # sub-block k*4 + b: byte b, bits 2k
    scales[:, 8:] = (hi << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(1, dtype=np.uint8)
    return np.concatenate([hmask, _pack_2bit_halves(u & 3), scales, _bytes(d[:, None])], axis=1)


def _q2_k(x: np.ndarray) -> np.ndarray:
    """4-bit scale | 4-bit min bytes 16 | qs 64 | fp16 d | fp16 dmin; q in 0..3 per sub-block of 16."""
    d, dmin, sc, mn, q = _min_max(x.reshape(-1, 16, 16), 3, 15)
    return np.concatenate([sc | (mn << 4), _pack_2bit_halves(q.reshape(-1, 256)),
                           _bytes(d[:, None]), _bytes(dmin[:, None])], axis=1)


def _nearest_iq4(y: np.ndarray) -> np.ndarray:
    return np.abs(y[..., None] - IQ4_VALUES).argmin(-1).astype(np.uint8)


def _pack_nibbles_16(idx: np.ndarray) -> np.ndarray:
    """(..., 32) 4-bit indices -> (..., 16) bytes: value j low nibble, value 16 + j high nibble."""
    return idx[..., :16] | (idx[..., 16:] << 4)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    """fp16 d | 16 bytes of indices into the non-linear grid; value = d * grid[q] per 32 values."""
    b = x.reshape(-1, 32)
    d = _fp16(np.take_along_axis(b, np.abs(b).argmax(-1)[:, None], -1)[:, 0] / IQ4_VALUES[0])
    idx = _nearest_iq4(_safe_div(b, d.astype(np.float32)[:, None]))
    return np.concatenate([_bytes(d[:, None]), _pack_nibbles_16(idx)], axis=1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    """fp16 d | uint16 high scale bits | 4 bytes low scale bits | 128 bytes of grid indices; 8
    sub-blocks of 32 with a 6-bit signed scale each (stored + 32)."""
    b = x.reshape(-1, 8, 32)
    peak = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0] / IQ4_VALUES[0]   # (blocks, 8)
    big = np.take_along_axis(peak, np.abs(peak).argmax(-1)[:, None], -1)[:, 0]
    d = _fp16(-big / 32)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(_safe_div(peak, df)), -32, 31)
    idx = _nearest_iq4(_safe_div(b, (df * sc)[..., None]))
    s = (sc + 32).astype(np.uint8)
    scales_l = (s[:, 0::2] & 0x0F) | ((s[:, 1::2] & 0x0F) << 4)
    scales_h = ((s >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
    return np.concatenate([_bytes(d[:, None]), _bytes(scales_h[:, None]), scales_l,
                           _pack_nibbles_16(idx).reshape(-1, 128)], axis=1)


_ENCODERS = {Q.Q4_K: lambda x: _q4_5_k(x, Q.Q4_K), Q.Q5_K: lambda x: _q4_5_k(x, Q.Q5_K), Q.Q6_K: _q6_k,
             Q.Q3_K: _q3_k, Q.Q2_K: _q2_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}
PLAIN_ENCODED = tuple(_ENCODERS)


def encode(rows: np.ndarray, qtype: Q) -> np.ndarray:
    """(n, width) fp32 -> (n, row_bytes) uint8 of `qtype`: the gguf package's own encoder where it
    has one, else this module's plain one."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if qtype not in _ENCODERS:
        return gguf.quants.quantize(rows, qtype)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    n, width = rows.shape
    out = _ENCODERS[qtype](rows.reshape(-1, values))
    assert out.shape == (n * width // values, nbytes), (qtype.name, out.shape)
    return out.reshape(n, width // values * nbytes)
