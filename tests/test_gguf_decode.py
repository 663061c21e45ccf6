"""memory/gguf_decode.py: GGUF blocks decoded with torch ops equal the gguf package's decoder
(gguf.quants.dequantize, the reference) to the bit, for every type leantune keeps.

The blocks are random bytes, so every fp16 scale pattern occurs (normal, subnormal, +-0, +-inf,
NaN with random payloads, as a poisoned slot's 0xFF bytes make), and rows with chosen edge scales
are added: the largest and smallest fp16s, the subnormals, inf and NaN in each fp16 field. The one
difference allowed is the NaN payload where a value's last operation meets two different NaNs:
which of two NaNs an a - b or a + b returns is not fixed by IEEE 754, and numpy's loops and
torch's compiled ones pick differently. Such a pair also comes from inf * 0 beside a NaN
min, so the blocks let off are those whose two fields are both inf or NaN, and only their NaNs:
every value there that the reference does not make NaN has its bits, and every NaN is a NaN.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from leantune.memory import gguf_decode, gguf_storage

Q = gguf.GGMLQuantizationType
TYPES = [Q(t) for t in sorted(gguf_decode.SIZES)]
# byte offsets of each type's fp16 fields: the scale d first, then the min where the type has one
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,),
              Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,)}
EDGE_F16 = (0x7BFF, 0xFBFF, 0x0001, 0x8001, 0x03FF, 0x0400, 0x0000, 0x8000, 0x7C00, 0xFC00,
            0x7E00, 0x7C01, 0xFFFF, 0x3C00)      # max, -max, subnormals, min normal, +-0, +-inf, NaNs, 1


def _reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # inf * 0 and NaN scales: expected here
        return gguf.quants.dequantize(raw, qtype)


def _blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random blocks, then rows whose fp16 fields take each edge value (codes stay random), then a
    row of 0xFF (a poisoned slot) and one of zeros."""
    _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows + len(EDGE_F16) + 2, blocks_per_row * nbytes), dtype=np.uint8)
    blocks = raw.reshape(raw.shape[0], blocks_per_row, nbytes)
    for i, v in enumerate(EDGE_F16):
        for k, off in enumerate(F16_FIELDS[qtype]):
            # the first field takes the edge value, a min field the one after it (inf beside NaN, ...)
            val = EDGE_F16[(i + k) % len(EDGE_F16)]
            blocks[rows + i, :, off:off + 2] = np.frombuffer(np.uint16(val).tobytes(), np.uint8)
    raw[-2] = 0xFF
    raw[-1] = 0
    return raw


def _finite_blocks(qtype: Q, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random codes with finite positive fp16 fields (2^-7 .. 2^-3): weights a Linear computes with."""
    _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * nbytes), dtype=np.uint8)
    blocks = raw.reshape(rows, blocks_per_row, nbytes)
    for off in F16_FIELDS[qtype]:
        h = rng.integers(0x2000, 0x3000, size=(rows, blocks_per_row), dtype=np.uint16)
        blocks[:, :, off:off + 2] = h[..., None].view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw


def _nan_pair_blocks(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """(rows, in) bool: values of blocks whose d and min fields are both inf or NaN, where the last
    a - b (or a + b) of a value may meet two NaNs of different bits (a NaN field, or inf * 0)."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(raw.shape[0], -1, nbytes)
    fields = F16_FIELDS[qtype]
    if len(fields) < 2:
        return np.zeros((raw.shape[0], blocks.shape[1] * values), dtype=bool)
    d, m = (blocks[:, :, o:o + 2].copy().view(np.uint16)[..., 0] for o in fields)
    both = ((d & 0x7C00) == 0x7C00) & ((m & 0x7C00) == 0x7C00)
    return np.repeat(both, values, axis=1)


def assert_bitwise(got: torch.Tensor, want: np.ndarray, raw: np.ndarray, qtype: Q) -> None:
    """Every bit equal, but for the NaN payloads of the blocks of two non-finite fields (module
    docstring): there a NaN is a NaN, and every other value's bits are equal."""
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    nan = np.isnan(want)
    assert np.array_equal(torch.isnan(got).numpy(), nan)
    free = _nan_pair_blocks(raw, qtype) & nan
    diff = (got.view(torch.int32).numpy() != want.view(np.int32)) & ~free
    assert not diff.any(), f"{qtype.name}: {int(diff.sum())} values differ, first at {np.argwhere(diff)[0]}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_equals_the_package_bitwise(qtype):
    """Random and edge-scale blocks of each type decode to the reference's fp32 bits; the edge
    rows are there (NaN, inf and subnormal scales reach the output) and a poisoned row is NaN."""
    raw = _blocks(qtype, rows=48, blocks_per_row=6)
    want = _reference(raw, qtype)
    got = gguf_decode.dequantize(torch.from_numpy(raw), int(qtype))
    assert_bitwise(got, want, raw, qtype)
    assert np.isnan(want[-2]).all() and np.isinf(want).any()
    assert (want[-1] == 0).all()
    assert len(np.unique(want.view(np.int32)[np.isnan(want)])) > 1      # NaN payloads are compared


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_real_width_rows_decode_bitwise_in_tiles(qtype):
    """A 3072 x 3072 weight in tiles of 100 rows (the tile bound lowered, a last tile shorter), to
    fp32 (decoded in its output) and to bf16 (through the fp32 tile; the reference's fp32 rounded
    once): the same bits."""
    raw = _blocks(qtype, rows=3072 - len(EDGE_F16) - 2, blocks_per_row=3072 // gguf.GGML_QUANT_SIZES[qtype][0], seed=1)
    want = _reference(raw, qtype)
    t = torch.from_numpy(raw)
    assert_bitwise(gguf_decode.dequantize(t, int(qtype), tile_values=100 * 3072), want, raw, qtype)
    bf16 = gguf_decode.dequantize(t, int(qtype), torch.bfloat16, tile_values=100 * 3072)
    ref16 = torch.from_numpy(want).to(torch.bfloat16)
    keep = ~torch.from_numpy(_nan_pair_blocks(raw, qtype) & np.isnan(want))
    assert torch.equal(bf16.view(torch.int16)[keep], ref16.view(torch.int16)[keep])
    assert torch.equal(bf16.isnan(), ref16.isnan())


def test_decode_reads_blocks_at_any_storage_offset():
    """Blocks that are a view at an odd byte offset of a larger buffer (as a row range of a packed
    streaming slot can be) decode as the same blocks copied out."""
    raw = _blocks(Q.Q4_K, rows=8, blocks_per_row=2)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw).reshape(-1)
    view = buf[1:].view(raw.shape)
    assert view.storage_offset() == 1
    assert_bitwise(gguf_decode.dequantize(view, int(Q.Q4_K)), _reference(raw, Q.Q4_K), raw, Q.Q4_K)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_poisoned_slot_shows_as_nan_through_the_linear(qtype):
    """A GGUF Linear whose blocks are a released slot's 0xFF bytes: its output and its input's
    gradient are NaN (the storage decodes them through gguf_decode), so a use shows in the loss."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    lin = torch.nn.Linear(values, 4)
    lin.weight = torch.nn.Parameter(torch.full((4, nbytes), 0xFF, dtype=torch.uint8), requires_grad=False)
    gguf_storage.use_gguf_weight(lin, int(qtype))
    x = torch.randn(2, values, requires_grad=True)
    loss = lin(x).square().sum()
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(x.grad).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_the_storage_decodes_with_the_torch_decoder_and_no_package_call(monkeypatch):
    """gguf_storage.dequantize of a type gguf_decode reads never calls the package (the host
    path), on the CPU as on a device; a type without a torch decoder still decodes on the host."""
    raw = torch.from_numpy(_blocks(Q.Q5_K, rows=4, blocks_per_row=1))
    want = gguf_storage.dequantize(raw, int(Q.Q5_K), torch.float32)

    def refuse(*_a, **_k):
        raise AssertionError("the host decoder was called")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    assert torch.equal(gguf_storage.dequantize(raw, int(Q.Q5_K), torch.float32).view(torch.int32),
                       want.view(torch.int32))
    monkeypatch.undo()
    monkeypatch.delitem(gguf_decode._DECODERS, gguf_decode.Q5_K)
    assert not gguf_decode.supported(int(Q.Q5_K))
    ref = torch.from_numpy(_reference(raw.numpy(), Q.Q5_K))
    assert torch.equal(gguf_storage.dequantize(raw, int(Q.Q5_K), torch.float32).view(torch.int32),
                       ref.view(torch.int32))


def test_every_type_the_storage_keeps_has_a_torch_decoder():
    assert {gguf_decode.SIZES[t] for t in gguf_storage.taken_types().values()} \
        == {gguf.GGML_QUANT_SIZES[Q(t)] for t in gguf_storage.taken_types().values()}
    assert all(gguf_decode.supported(t) for t in gguf_storage.taken_types().values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cuda_decode_equals_the_cpu_reference(qtype, monkeypatch):
    """GPU-only: blocks on CUDA decode on the device (the host decoder is never called) to the
    reference's values: every non-NaN value's bits equal, NaN where the reference is NaN (a GPU
    writes its own canonical NaN); a bf16 decode in tiles equals the reference rounded once; the
    tiled decode's device bytes beyond its output stay within the tile bound (10 bytes per value of
    a tile: the fp32 tile, the uint8 codes, IQ4's int32 indices), and a Linear on CUDA computes
    forward and backward with the reference's weights."""
    values, _ = gguf.GGML_QUANT_SIZES[qtype]
    raw = _blocks(qtype, rows=1024, blocks_per_row=3072 // values, seed=2)
    want = torch.from_numpy(_reference(raw, qtype))

    def refuse(*_a, **_k):
        raise AssertionError("the host decoder was called")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    dev = torch.from_numpy(raw).cuda()
    got = gguf_decode.dequantize(dev, int(qtype)).cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])

    tile = 256 * 3072
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    bf16 = gguf_decode.dequantize(dev, int(qtype), torch.bfloat16, tile_values=tile)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - bf16.numel() * 2
    assert extra <= 10 * tile + (1 << 20), extra
    ref16 = want.to(torch.bfloat16)
    nan16 = ref16.isnan()
    assert torch.equal(bf16.isnan().cpu(), nan16)
    assert torch.equal(bf16.cpu().view(torch.int16)[~nan16], ref16.view(torch.int16)[~nan16])

    blocks = torch.from_numpy(_finite_blocks(qtype, rows=8, blocks_per_row=3072 // values, seed=3))
    w = torch.from_numpy(_reference(blocks.numpy(), qtype)).cuda()
    assert torch.isfinite(w).all()
    lin = torch.nn.Linear(3072, 8).cuda()
    lin.weight = torch.nn.Parameter(blocks.cuda(), requires_grad=False)
    gguf_storage.use_gguf_weight(lin, int(qtype))
    x = torch.randn(3, 3072, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lin(x), torch.nn.functional.linear(x2, w, lin.bias)
    assert torch.equal(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
