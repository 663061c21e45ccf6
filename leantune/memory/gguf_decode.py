"""GGUF blocks decoded with torch ops, on the device that holds them.

What it trades: gguf_storage.py decodes a GGUF Linear's weight in every forward and backward. The
package's numpy decoder runs on the host only, so on a GPU each use was a device->host copy of the
blocks, a decode of the whole weight on the CPU and a host->device copy of the decoded rows (for
Q4_K 3.6-7x the blocks' bytes, as bf16 or fp32). This module decodes where the bytes are: the same block layouts, read
with torch's integer and fp32 elementwise ops, so a CUDA weight never leaves the device and a CPU
weight decodes with torch's threads.

Why bitwise equal: the weights a GGUF base computes with are defined as the format's decoder's
(fp32, then one rounding to the compute dtype). Every integer field (4/5/6-bit codes, packed 6-bit
sub-block scales and mins) is exact however it is unpacked, so what must match is the fp32
arithmetic: the fp16 scales widen exactly, and each type's products and differences are formed in
the format's own order with one rounding per operation (for Q4_K: (d * sc) * q - (dmin * m), never
d * (sc * q) or a fused multiply-add); in-place ops round as their out-of-place forms do. On the
CPU every value equals the reference to the bit, NaNs included, with one exception no format
defines: where a value's last a - b meets two NaNs of different bits (a block whose d and min are
both inf or NaN), which NaN comes out is the machine loop's choice (tests/test_gguf_decode.py). On
CUDA every non-NaN value has the reference's bits and a NaN is a NaN (the GPU writes its own
canonical NaN). Poison mode's 0xFF bytes make every type's d a NaN, so a poisoned slot decodes to
NaN everywhere, on every device.

No fp32 temporaries: each type writes its codes as fp32 straight into the output (the int -> fp32
conversion is the copy) and scales them there in place, so what a decode holds beside its output is
uint8 work (the unpacked codes, at most 3 bytes per value; IQ4's int32 grid indices, 4 more) and
the per-sub-block scales. An output in another dtype (bf16 under autocast) is decoded through one
fp32 tile and rounded into it.

Tiles: rows decode in tiles of at most TILE_VALUES (2^24) values, which bounds that work whatever
the weight: at most 9 bytes per value of a tile (the fp32 tile, the codes, IQ4's indices), 144 MiB,
where a Flux single block's 3072 x 21504 linear1 decoded whole would hold 594 MiB beside its 132
MiB bf16 output, a transient an 8 GB card cannot spare. A tile of 2^24 values (>= 780 rows of the
widest rows, 21504) is still large against the ~20 kernel launches it takes, so tiling costs the
decode little (not yet measured on a GPU: bench/gguf_decode_rate.py --device cuda).

Types: the ones gguf_storage.taken_types() keeps: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (32-value
blocks), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (256-value super-blocks). `supported(qtype)` says
which; gguf_storage keeps the host path for any other.
"""

from __future__ import annotations

import torch

TILE_VALUES = 1 << 24         # values per decoded tile: <= 9 bytes of work each beside the output, see above

# GGML type ids (gguf.GGMLQuantizationType values, fixed by the file format)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ4_NL, IQ4_XS = 20, 23

# (values, bytes) per block, as the format lays them out
SIZES = {Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
         Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
         IQ4_NL: (32, 18), IQ4_XS: (256, 136)}

# IQ4's non-linear 4-bit grid (the format's constant table)
_IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
_grids: dict[torch.device, torch.Tensor] = {}


def supported(qtype: int) -> bool:
    return int(qtype) in _DECODERS


# -- fields ----------------------------------------------------------------------------------------

def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 at byte `off` of each block, widened to fp32: (n, 1). Read through an int16 view
    of the blocks where their storage allows one (even offset), else from a copy of the 2 bytes."""
    if b.storage_offset() % 2 == 0 and b.stride(1) == 1 and b.stride(0) % 2 == 0:
        h = b.view(torch.int16)[:, off // 2:off // 2 + 1]
    else:
        h = b[:, off:off + 2].clone().view(torch.int16)
    return h.view(torch.float16).float()


def _nibbles(b: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """(n, groups * width) bytes -> (n, groups, 2, width) uint8: each group's low nibbles, then its
    high nibbles (the order the 4-bit codes of every type are packed in)."""
    g = b.reshape(b.shape[0], groups, 1, width)
    q = torch.empty((b.shape[0], groups, 2, width), dtype=torch.uint8, device=b.device)
    torch.bitwise_and(g, 0x0F, out=q[:, :, 0:1])
    torch.bitwise_right_shift(g, 4, out=q[:, :, 1:2])
    return q


def _fields(b: torch.Tensor, groups: int, width: int, bits: int) -> torch.Tensor:
    """(n, groups * width) bytes -> (n, groups, 8 // bits, width) uint8 of `bits`-wide fields,
    the lowest bits first: 2-bit fields (bits 0-1, 2-3, ...) or single bits (8 rows of bit k)."""
    g = b.reshape(b.shape[0], groups, 1, width)
    k = 8 // bits
    q = torch.empty((b.shape[0], groups, k, width), dtype=torch.uint8, device=b.device)
    for i in range(k):
        torch.bitwise_and(g >> (bits * i) if i else g, (1 << bits) - 1, out=q[:, :, i:i + 1])
    return q


def _signed(q: torch.Tensor, offset: int) -> torch.Tensor:
    """Unsigned codes minus `offset`, as int8: the uint8 difference wraps, and its int8 view is the
    signed value for every code the formats store (0..63 less 32 at most)."""
    return q.sub_(offset).view(torch.int8)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> 8 six-bit sub-block scales and 8 mins, (n, 8) uint8 each. Bytes 0-3
    hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for the mins;
    bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    lo_s, lo_m, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_s & 0x3F, (mixed & 0x0F) | ((lo_s >> 6) << 4)), dim=1)
    mn = torch.cat((lo_m & 0x3F, (mixed >> 4) | ((lo_m >> 6) << 4)), dim=1)
    return sc, mn


def _grid(device: torch.device) -> torch.Tensor:
    g = _grids.get(device)
    if g is None:
        g = _grids[device] = torch.tensor(_IQ4_GRID, dtype=torch.float32, device=device)
    return g


def _put(out: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The codes widened to fp32 into `out` (the tile being decoded), shaped as the codes."""
    return out.view(codes.shape).copy_(codes)


def _put_iq4(out: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> the IQ4 grid's values, written into `out`, shaped as the codes."""
    flat = out.view(-1)
    torch.index_select(_grid(codes.device), 0, codes.reshape(-1).to(torch.int32), out=flat)
    return flat.view(codes.shape)


# -- block types: (n, bytes) uint8 blocks -> `out`, (n, values) fp32 ---------------------------------
# Each writes the codes into `out` as fp32, then scales them there in place: no fp32 temporary.

def _q8_0(b, out):
    _put(out, b[:, 2:34].view(torch.int8)).mul_(_f16(b, 0))                        # x * d


def _q4_0(b, out):
    _put(out, _signed(_nibbles(b[:, 2:18], 1, 16), 8).reshape(-1, 32)).mul_(_f16(b, 0))             # d * (q - 8)


def _q4_1(b, out):
    _put(out, _nibbles(b[:, 4:20], 1, 16).reshape(-1, 32)).mul_(_f16(b, 0)).add_(_f16(b, 2))       # d * q + m


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: value j's 5th bit is bit j of the little-endian 32-bit qh, i.e. bit j % 8 of
    byte j // 8; its low 4 bits are Q4_0's nibbles. (n, 32) uint8."""
    high = _fields(qh, 1, 4, 1).reshape(-1, 8, 4).transpose(1, 2).reshape(-1, 32)   # value 8 * byte + bit
    return _nibbles(qs, 1, 16).reshape(-1, 32).bitwise_or_(high << 4)


def _q5_0(b, out):
    _put(out, _signed(_q5_codes(b[:, 2:6], b[:, 6:22]), 16)).mul_(_f16(b, 0))      # d * (q - 16)


def _q5_1(b, out):
    _put(out, _q5_codes(b[:, 4:8], b[:, 8:24])).mul_(_f16(b, 0)).add_(_f16(b, 2))  # d * q + m


def _iq4_nl(b, out):
    _put_iq4(out, _nibbles(b[:, 2:18], 1, 16).reshape(-1, 32)).mul_(_f16(b, 0))                      # d * grid[q]


def _q2_k(b, out):
    n = b.shape[0]
    sc = b[:, 0:16]                                                   # low nibble scale, high nibble min
    dl = (_f16(b, 80) * (sc & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).reshape(n, 16, 1)
    q = _fields(b[:, 16:80], 2, 32, 2).reshape(n, 16, 16)            # value 128 h + 32 s + j
    _put(out, q).mul_(dl).sub_(ml)                                    # dl * q - ml


def _q3_k(b, out):
    n = b.shape[0]
    s = b[:, 96:108]
    low = torch.cat((s[:, 0:8] & 0x0F, s[:, 0:8] >> 4), dim=1)                         # (n, 16)
    high = torch.cat([(s[:, 8:12] >> k) & 0x03 for k in (0, 2, 4, 6)], dim=1)          # (n, 16)
    dl = (_f16(b, 108) * _signed(low | (high << 4), 32).float()).reshape(n, 16, 1)
    q = _fields(b[:, 32:96], 2, 32, 2)                                # 2 low bits of value 128 h + 32 s + j
    mask = _fields(b[:, 0:32], 1, 32, 1).reshape(n, 2, 4, 32)         # bit k of byte j: value 32 k + j
    q = _signed(q.bitwise_or_(mask << 2), 4)                          # low bits - 4 where the mask bit is clear
    _put(out, q.reshape(n, 16, 16)).mul_(dl)                          # dl * q


def _q45_k(b, out, qh):
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    ds = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    qs = b[:, 16:144] if qh is None else b[:, 48:176]
    q = _nibbles(qs, 4, 32).reshape(n, 8, 32)                         # sub-block 2 c + nibble
    if qh is not None:
        q.bitwise_or_(_fields(qh, 1, 32, 1).reshape(n, 8, 32) << 4)   # bit k of byte j: sub-block k
    _put(out, q).mul_(ds).sub_(dm)                                    # (d * sc) * q - dmin * m


def _q4_k(b, out):
    _q45_k(b, out, None)


def _q5_k(b, out):
    _q45_k(b, out, b[:, 16:48])


def _q6_k(b, out):
    n = b.shape[0]
    ds = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    low = _nibbles(b[:, 0:128], 2, 64).reshape(n, 8, 32)              # value 128 h + 64 nibble + j
    high = _fields(b[:, 128:192], 2, 32, 2).reshape(n, 8, 32)         # value 128 h + 32 s + j
    q = _signed(low.bitwise_or_(high << 4), 32)
    _put(out, q.reshape(n, 16, 16)).mul_(ds)                          # (d * scale) * (q - 32)


def _iq4_xs(b, out):
    n = b.shape[0]
    hi = b[:, 2:4].clone().view(torch.int16).to(torch.int32)          # (n, 1): 2 bits per sub-block
    lo = b[:, 4:8]
    low = torch.stack((lo & 0x0F, lo >> 4), dim=2).reshape(n, 8)      # sub-block 2 i + nibble
    high = torch.cat([(hi >> (2 * k)) & 0x03 for k in range(8)], dim=1)
    scale = (low.to(torch.int32) | (high << 4)) - 32
    dl = (_f16(b, 0) * scale.float()).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:136], 8, 16).reshape(n, 8, 32)                # sub-block k: 16 low, 16 high
    _put_iq4(out, q).mul_(dl)                                         # (d * scale) * grid[q]


_DECODERS = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, IQ4_NL: _iq4_nl,
             Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, IQ4_XS: _iq4_xs}


def _decode_rows(rows: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """(r, row_bytes) blocks -> `out`, an (r, in) fp32 tensor with contiguous rows."""
    nbytes = SIZES[qtype][1]
    _DECODERS[qtype](rows.contiguous().reshape(-1, nbytes), out.view(-1, SIZES[qtype][0]))


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32,
               tile_values: int = TILE_VALUES) -> torch.Tensor:
    """(out, row_bytes) uint8 blocks -> (out, in) weight in `dtype` on the blocks' device: the
    format's fp32 values, then one rounding to `dtype`. An fp32 weight is decoded in place in its
    output; another dtype through one fp32 tile of at most `tile_values` (module docstring)."""
    qtype = int(qtype)
    if qtype not in _DECODERS:
        raise ValueError(f"gguf_decode: no decoder for GGML type {qtype}")
    values, nbytes = SIZES[qtype]
    raw = raw.detach()
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"gguf_decode: blocks of {raw.dtype} {tuple(raw.shape)} are not (out, k * {nbytes}) uint8")
    out_rows, in_features = raw.shape[0], raw.shape[1] // nbytes * values
    out = torch.empty((out_rows, in_features), dtype=dtype, device=raw.device)
    step = max(1, tile_values // max(1, in_features))
    tile = None if dtype == torch.float32 else torch.empty((min(step, out_rows), in_features), device=raw.device)
    for r in range(0, out_rows, step):
        rows = raw[r:r + step]
        if tile is None:
            _decode_rows(rows, qtype, out[r:r + step])
        else:
            t = tile[:rows.shape[0]]
            _decode_rows(rows, qtype, t)
            out[r:r + step].copy_(t)
    return out
