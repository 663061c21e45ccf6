"""NF4 bases (memory/nf4_storage.py): a tiny Flux's block Linears quantized by bitsandbytes as its
bf16 file is read, computing with bitsandbytes' own dequantization.

The model is the tiny Flux 128 wide (4 heads of 32), so every block Linear's rows hold whole
64-value NF4 blocks; the file is its BFL single file in bf16, loaded as `[memory] base_format =
"nf4"` loads it (the loader's `quantize_fp8="nf4"`, trainer._fp8_load_options).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_memory_helpers import (assert_adapters_train_as_on_the_decoded_base, assert_quantized_base_streams_exactly,
                                 assert_records_equal, block_names, make_batch, train)

bnb_functional = pytest.importorskip("bitsandbytes.functional")

from leantune import tiny  # noqa: E402
from leantune.memory import nf4_storage  # noqa: E402
from leantune.memory.engine import apply_memory  # noqa: E402
from leantune.memory.fp8 import block_linears  # noqa: E402
from leantune.memory.nf4_storage import is_nf4, stored_weight, use_nf4_weight  # noqa: E402
from leantune.memory.plan import Plan  # noqa: E402
from leantune.models.flux import FLUX_SPEC, predict  # noqa: E402
from leantune.models.flux import loading as flux_loading  # noqa: E402

WIDE = dict(attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))   # inner width 128
ROOT = Path(__file__).resolve().parents[1]


def _bnb_rows(w: torch.Tensor):
    """bitsandbytes' own nested quantization of each row of `w` as a (1, in) tensor: per row
    quantize_4bit(compress_statistics=True) (NF4, 64 per absmax, the absmax codes nested by 256),
    its state in fp32, and dequantize_4bit's fp32 weight; the rows stacked."""
    rows = []
    for r in w:
        q, state = bnb_functional.quantize_4bit(r[None].contiguous(), blocksize=64, quant_type="nf4",
                                                compress_statistics=True, quant_storage=torch.uint8)
        state.dtype = torch.float32
        rows.append((q, state, bnb_functional.dequantize_4bit(q, state)))
    return rows


def _bnb_reference(w: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' own round trip of each row of `w` (fp32), stacked."""
    return torch.cat([d for _, _, d in _bnb_rows(w)])


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    """(fp32 source model, its BFL single file in bf16)."""
    ref = tiny.flux_transformer(seed=3, **WIDE)
    path = flux_loading.save_bfl_transformer(ref, tmp_path_factory.mktemp("nf4") / "flux.safetensors",
                                             dtype=torch.bfloat16)
    return ref, path


def _sources(path: Path):
    return flux_loading.FluxSources(path, None, None, None, None, None)


def _load_nf4(path: Path, **kw):
    return flux_loading.load_transformer(_sources(path), dtype=torch.float32, quantize_fp8="nf4", **kw)


# -- the format --------------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [192, 3072, 17408])
def test_rows_are_bitsandbytes_nested_quantization_of_each_row(width):
    """Each stored row is bitsandbytes' own nested quantization of that row, byte for byte: its
    packed codes, its absmax codes, its 256-code nested absmax (two blocks at 17408 wide, the
    second partial) and its offset; it decodes, bitwise, to dequantize_4bit of that state."""
    g = torch.Generator().manual_seed(width)
    w = (torch.randn(5, width, generator=g) * torch.logspace(-3, 1, 5)[:, None]).bfloat16()
    raw = nf4_storage.quantize(w)
    half, nb = width // 2, width // 64
    nested = -(-nb // 256)
    assert raw.shape == (5, half + nb + 4 * nested + 4) == (5, nf4_storage.row_bytes(width))
    for row, (q, state, want) in zip(raw, _bnb_rows(w)):
        assert torch.equal(row[:half], q.view(-1))
        assert torch.equal(row[half:half + nb], state.absmax)
        assert torch.equal(row[half + nb:-4].clone().view(torch.float32), state.state2.absmax)
        assert torch.equal(row[-4:].clone().view(torch.float32), state.offset.view(1))
        assert torch.equal(nf4_storage.dequantize(row[None], width, torch.float32), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_decode_is_the_fp32_decode_rounded_once(dtype):
    """Decoded straight into bf16 / fp16 (no fp32 weight held), the weight is the fp32 decode rounded
    once to that dtype, bit for bit, over rows of very different scales."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 3072, generator=g) * torch.logspace(-6, 3, 16)[:, None]
    raw = nf4_storage.quantize(w)
    assert torch.equal(nf4_storage.dequantize(raw, 3072, dtype), nf4_storage.dequantize(raw, 3072, torch.float32).to(dtype))


def _decode_temporaries(fn) -> int:
    """Peak bytes `fn()` holds beyond the tensor it returns, counted by the planner probe's tracker
    (every storage an op creates, until it dies)."""
    from leantune.planner.activation_probe import _Tracker

    tracker = _Tracker()
    with tracker:
        tracker.open("decode")
        out = fn()
        tracker.close()
    peak = max(a for a, _ in tracker.windows["decode"]["points"]) - tracker.windows["decode"]["start"][0]
    return peak - out.untyped_storage().nbytes()


def test_the_decode_runs_a_chunk_of_rows_at_a_time_with_the_same_bits(monkeypatch):
    """dequantize decodes DECODE_CHUNK weights at a time into one output: the bits of decoding all
    rows at once (rows are independent), and beside the output it holds one chunk's codes and
    absmax values (and on the CPU the decoded chunk before its copy), not the whole weight's. (The
    CUDA path decodes into the output, bitsandbytes' dequantize_4bit.out: not run here, no GPU.)"""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 1024, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    raw = nf4_storage.quantize(w)
    whole = nf4_storage.dequantize(raw, 1024, torch.bfloat16)
    whole_temps = _decode_temporaries(lambda: nf4_storage.dequantize(raw, 1024, torch.bfloat16))
    monkeypatch.setattr(nf4_storage, "DECODE_CHUNK", 7 * 1024)          # 7 rows a chunk: 6 chunks, the last short
    assert nf4_storage.decode_rows(1024) == 7
    assert torch.equal(nf4_storage.dequantize(raw, 1024, torch.bfloat16), whole)
    assert torch.equal(nf4_storage.dequantize(raw, 1024, torch.float32).to(torch.bfloat16), whole)
    temps = _decode_temporaries(lambda: nf4_storage.dequantize(raw, 1024, torch.bfloat16))
    bound = nf4_storage.decode_temporaries(40, 1024, "cpu")       # on CUDA, less: no chunk copy
    assert bound * 0.9 < temps <= bound < whole_temps / 3


def test_the_nf4_decode_holds_less_than_the_fp8_decode_the_probe_traces():
    """planner/base_formats.py prices an NF4 decode at nothing beyond the fp8 decode the planner's
    probe traces for the same Linear (fp8.dequantize on meta: fp32 chunks of DEQUANT_CHUNK bytes
    beside the bf16 weight). That holds while an NF4 chunk's temporaries stay under it: so for every
    NF4 Linear of Flux.1 (fp8 modulation on: the double block's 18432-row modulation too), fp8's
    measured here on meta, NF4's bound checked on real rows above."""
    from leantune.memory import fp8
    from leantune.planner.base_formats import FORMATS

    for out_f, in_f in ((3072, 15360), (12288, 3072), (3072, 12288), (3072, 3072), (18432, 3072), (9216, 3072)):
        q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn, device="meta")
        scale = torch.empty(out_f, in_f // 64, dtype=torch.float32, device="meta")
        fp8_temps = _decode_temporaries(lambda: fp8.dequantize(q, scale, torch.bfloat16))
        assert nf4_storage.decode_temporaries(out_f, in_f) <= fp8_temps, (out_f, in_f)
        assert nf4_storage.decode_temporaries(out_f, in_f, "cpu") <= fp8_temps, (out_f, in_f)   # the simulated GPU's
    assert FORMATS["nf4"].transient_bytes == FORMATS["fp8"].transient_bytes


def test_a_linear_computes_with_bitsandbytes_dequantization_forward_and_backward():
    """Rows of packed codes + nested statistics decode, bitwise, to bitsandbytes' own
    dequantize_4bit of its own nested quantize_4bit of each row; forward and input gradient equal a
    plain Linear holding that weight; a row range of the stored bytes is the quantization of that
    row range (rows are independent)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 192, generator=g).bfloat16()
    lin = torch.nn.Linear(192, 24)
    lin.weight = torch.nn.Parameter(nf4_storage.quantize(w), requires_grad=False)
    use_nf4_weight(lin)
    assert lin.weight.shape == (24, 192 // 2 + 3 + 4 + 4) and lin.weight.dtype == torch.uint8
    want = _bnb_reference(w)
    assert torch.equal(stored_weight(lin), want)
    assert torch.equal(nf4_storage.quantize(w[5:9]), lin.weight[5:9])
    x = torch.randn(3, 192, generator=g, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lin(x), torch.nn.functional.linear(x2, want, lin.bias)
    assert torch.equal(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-6, atol=1e-6)
    assert lin.bias.grad is not None
    err = (want - w.float()).norm() / w.float().norm()
    assert 0.05 < err < 0.12, err                                       # NF4's ~9 % on a Gaussian weight


def test_bad_shapes_are_named():
    lin = torch.nn.Linear(96, 8)
    with pytest.raises(ValueError, match=r"NF4 row holds whole blocks of 64 values; 96"):
        use_nf4_weight(lin)
    lin = torch.nn.Linear(128, 8)
    with pytest.raises(ValueError, match=r"use_nf4_weight: the weight is torch.float32 \(8, 128\), not the \(8, 74\) uint8"):
        use_nf4_weight(lin)


@pytest.mark.parametrize("field", ["offset", "nested absmax", "negative scale"])
def test_a_tampered_row_is_named(field):
    """Statistics no quantization writes (a NaN offset, an infinite or negative nested absmax) are
    refused when the Linear is made computable, naming the Linear and the first such row."""
    w = torch.randn(6, 128, generator=torch.Generator().manual_seed(1))
    raw = nf4_storage.quantize(w)
    lin = torch.nn.Linear(128, 6)
    lin.weight = torch.nn.Parameter(raw.clone(), requires_grad=False)
    use_nf4_weight(lin, "blocks.0.ff")                     # untouched: accepted
    value = {"offset": float("nan"), "nested absmax": float("inf"), "negative scale": -1.0}[field]
    at = -4 if field == "offset" else -8
    raw[3, at:at + 4 if at + 4 else None] = torch.tensor([value]).view(torch.uint8)
    lin.weight = torch.nn.Parameter(raw, requires_grad=False)
    with pytest.raises(ValueError, match=r"blocks\.0\.ff: NF4 row 3 \(of 6\) holds statistics no quantization writes"):
        use_nf4_weight(lin, "blocks.0.ff")


# -- quantizing while the file is read ---------------------------------------------------------------

def test_the_load_quantizes_each_weight_as_read_in_bounded_chunks(flux_file, monkeypatch):
    """Every block Linear of the loaded model holds NF4 rows equal, byte for byte, to quantizing the
    bf16 load's weight; the rows were quantized a few at a time (QUANT_CHUNK of fp32 rows, here
    one row's worth: no call saw more), and everything else is the bf16 load's."""
    _, path = flux_file
    calls = []
    real = nf4_storage.quantize_into
    monkeypatch.setattr(nf4_storage, "QUANT_CHUNK", 4 * 128)            # one 128-wide fp32 row per chunk
    monkeypatch.setattr(nf4_storage, "quantize_into", lambda w, out: (calls.append(w.shape[0]), real(w, out)))
    got = flux_loading.load_transformer(_sources(path), dtype=torch.bfloat16, quantize_fp8="nf4")
    ref = flux_loading.load_transformer(_sources(path), dtype=torch.bfloat16)
    assert calls and max(calls) == 1
    ref_linears = {q: lin for q, _, lin in block_linears(FLUX_SPEC, ref)}
    taken = 0
    for qname, rel, lin in block_linears(FLUX_SPEC, got):
        w = ref_linears[qname].weight
        if FLUX_SPEC.keeps_compute_dtype(rel):
            assert not is_nf4(lin) and torch.equal(lin.weight, w), qname
            continue
        assert is_nf4(lin) and not lin.weight.requires_grad, qname
        assert torch.equal(lin.weight, nf4_storage.quantize(w)), qname
        taken += 1
    assert taken == 34                # 2 double x 12 + 2 single x 5 block Linears; modulation kept as fp8 keeps it
    nf4_names = {f"{q}.weight" for q, _, lin in block_linears(FLUX_SPEC, got) if is_nf4(lin)}
    for name, t in got.state_dict().items():
        if name not in nf4_names:
            assert torch.equal(t, ref.state_dict()[name]), name


def test_apply_nf4_storage_on_a_loaded_model_equals_the_quantizing_load(flux_file):
    """The in-place path (a model already in memory) stores the same bytes as the load."""
    _, path = flux_file
    loaded = _load_nf4(path)
    model = flux_loading.load_transformer(_sources(path), dtype=torch.float32).requires_grad_(False)
    done = nf4_storage.apply_nf4_storage(model, FLUX_SPEC)
    assert len(done) == 34
    got = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, got[name]), name
    trainable = flux_loading.load_transformer(_sources(path), dtype=torch.float32)
    with pytest.raises(ValueError, match=r'base_format = "nf4": transformer_blocks\.0\.\S+\.weight is trainable'):
        nf4_storage.apply_nf4_storage(trainable, FLUX_SPEC)


def test_planner_weight_bytes_equal_the_stored_bytes(flux_file):
    """A meta load with NF4 (what the planner prices) reports, per block and in total, the bytes the
    real load holds: row_bytes per row for the NF4 Linears (128 wide: 64 code bytes, 2 absmax codes,
    a nested absmax and an offset), in every plan; the streamed units' packed size equals unit_bytes."""
    from leantune.planner.weight_bytes import measure_weights

    _, path = flux_file
    real = _load_nf4(path)
    meta = flux_loading.load_transformer(_sources(path), dtype=torch.float32, quantize_fp8="nf4", device="meta")
    assert all(p.is_meta for p in meta.parameters())
    weights = measure_weights(FLUX_SPEC, meta)
    to_q = real.transformer_blocks[0].attn.to_q
    assert to_q.weight.numel() == to_q.out_features * (to_q.in_features // 2 + to_q.in_features // 64 + 8)
    for (name, block), w in zip(FLUX_SPEC.blocks(real), weights.blocks):
        actual = sum(t.numel() * t.element_size() for t in list(block.parameters()) + list(block.buffers()))
        assert w.bytes(4) == w.bytes(4, fp8=True) == actual, name
    total = sum(t.numel() * t.element_size() for t in list(real.parameters()) + list(real.buffers()))
    assert weights.total(4) == total
    handle = apply_memory(real.requires_grad_(False), FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(real))), "cpu")
    try:
        packed = {u.name: u.nbytes for u in handle.streaming.units}
        for w in weights.blocks:
            assert packed[w.name] == w.unit_bytes(4), w.name
    finally:
        handle.remove()


# -- training over the stored rows ---------------------------------------------------------------------

def _lora_base(path: Path, kind: str = "lora"):
    from leantune.config import LoraConfig
    from leantune.train.lora import add_lora

    model = _load_nf4(path)
    params = add_lora(model, FLUX_SPEC, LoraConfig(type=kind, rank=4, targets="all"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_streamed_equals_resident_bitwise_in_poison_mode(flux_file):
    """Streamed and checkpointed in poison mode equals resident bitwise, the NF4 rows streamed as
    uint8 (test_memory_helpers.assert_quantized_base_streams_exactly)."""
    _, path = flux_file
    assert_quantized_base_streams_exactly(_lora_base(path), stored=34)


def test_fp8_storage_leaves_the_nf4_rows_alone(flux_file):
    _, path = flux_file
    model = _lora_base(path)
    want = train(copy.deepcopy(model))
    handle = apply_memory(model, FLUX_SPEC, Plan(fp8=True), "cpu")
    assert not handle.fp8.linears
    assert sum(p.dtype == torch.uint8 for p in model.parameters()) == 34
    assert_records_equal(train(model), want)


def test_lokr_loha_and_dora_train_on_an_nf4_base_as_on_its_decoded_weights(flux_file):
    """train/quantized_adapters.py: each type reads the Linear's shape and decoded rows, not the bytes."""
    _, path = flux_file
    assert_adapters_train_as_on_the_decoded_base(_load_nf4(path), stored=34)


def _fit(model, steps: int = 40) -> list[float]:
    """A rank-4 LoRA (B = 0 at init) fitted by Adam to one fixed batch."""
    from leantune.config import LoraConfig
    from leantune.train.lora import add_lora

    params = add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="all"))
    opt = torch.optim.Adam(params, lr=1e-2)
    x, sigma, embeds, hw, target = make_batch(8, 8, seed=0)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_lora_learns_on_an_nf4_base_and_its_file_applies_to_the_bf16_base(flux_file, tmp_path):
    """The loss ratio (last / first) of the same fit on the NF4 base and on the fp32 model: it
    learns, and about as fast (within 0.05: NF4 moves the base ~9 %). Its ComfyUI file has the keys
    and shapes of the one trained on the source and applies to the bf16 base as trained."""
    from leantune.io import load_safetensors
    from leantune.train.lora import apply_lora, lora_weights_from_model
    from leantune.train.lora_formats import read_lora, save_lora

    ref, path = flux_file
    model, source = _load_nf4(path), copy.deepcopy(ref)
    on_nf4, on_source = _fit(model), _fit(source)
    ratio, want = on_nf4[-1] / on_nf4[0], on_source[-1] / on_source[0]
    assert ratio < 0.6 and abs(ratio - want) < 0.05, (ratio, want)
    files = {name: save_lora(lora_weights_from_model(m), tmp_path / f"{name}.safetensors", "comfyui")
             for name, m in (("nf4", model), ("source", source))}
    tensors = {name: load_safetensors(f)[0] for name, f in files.items()}
    assert {k: t.shape for k, t in tensors["nf4"].items()} == {k: t.shape for k, t in tensors["source"].items()}
    bf16 = copy.deepcopy(ref).to(torch.bfloat16).requires_grad_(False)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=0, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = predict(bf16, x, sigma, embeds, hw, guidance=1.0)
    weights = read_lora(files["nf4"])
    wrapped = apply_lora(bf16, weights)
    assert len(wrapped) == len(weights.modules) == 40
    for name in wrapped:
        layer = bf16.get_submodule(name)
        assert torch.equal(layer.lora_A["lora"].weight, weights.modules[name].down.to(layer.lora_A["lora"].weight.dtype))
    with torch.no_grad():
        assert not torch.equal(predict(bf16, x, sigma, embeds, hw, guidance=1.0), plain)


# -- the [memory] key and the import -------------------------------------------------------------------

def test_base_format_nf4_loads_nf4_and_contradictions_are_named(tmp_path):
    """[memory] base_format = "nf4" makes the trainer's load (and its meta load, which the planner
    prices) quantize to NF4; "fp8" is fp8 = true; a pinned format against an fp8 key is an error
    naming both."""
    from leantune.config import MemoryConfig, RunConfig
    from leantune.trainer import _fp8_load_options

    run = dict(model={"path": "x"}, data={"datasets": [{"path": "d"}]})
    cfg = RunConfig(**run, memory={"base_format": "nf4"})
    assert _fp8_load_options(cfg) == {"quantize_fp8": "nf4"}
    assert _fp8_load_options(RunConfig(**run, memory={"base_format": "nf4", "vram_budget": "8GiB"})) == {
        "quantize_fp8": "nf4"}
    assert MemoryConfig(base_format="fp8").fp8 is True and MemoryConfig().base_format == "auto"
    for memory, message in (({"base_format": "nf4", "fp8": True}, r'base_format = "nf4" and fp8 = true'),
                            ({"base_format": "fp8", "fp8": False}, r'base_format = "fp8" .* but fp8 = false'),
                            ({"base_format": "bf16", "vram_budget": "8GiB"}, r'base_format = "bf16" with a vram_budget'),
                            ({"base_format": "int4"}, r"base_format")):
        with pytest.raises(ValueError, match=message):
            MemoryConfig(**memory)


def test_the_kernels_community_line_is_dropped_and_others_are_kept(monkeypatch):
    """quiet.quiet_bitsandbytes (nf4_storage calls it before importing bitsandbytes) filters its
    CPU backend's logger: the kernels-community line is dropped, any other record of it is kept."""
    import logging

    from leantune.quiet import quiet_bitsandbytes

    monkeypatch.delenv("LEANTUNE_VERBOSE", raising=False)
    quiet_bitsandbytes()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def record(msg: str) -> logging.LogRecord:
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, msg, ("No module named 'kernels'",), None)

    assert not logger.filter(record("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make "
                                    "sure you already `pip install kernels` and the kernels >= 0.11.1"))
    assert logger.filter(record("something else went wrong: %s"))


@pytest.mark.slow
def test_importing_bitsandbytes_through_leantune_is_quiet():
    """End to end, in fresh processes: on a CPU where a plain `import bitsandbytes` logs the
    kernels-community line (AVX512-BF16, no `kernels` package), an import through nf4_storage does not."""
    loud = subprocess.run([sys.executable, "-c", "import bitsandbytes"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if "kernels-community" not in loud.stderr:
        pytest.skip("this CPU's bitsandbytes logs nothing at import (no AVX512-BF16): nothing to silence")
    code = "from leantune.memory import nf4_storage; assert nf4_storage.available()"
    quiet = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "kernels-community" not in quiet.stderr + quiet.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only (bench/gpu_checks.sh window 1): bitsandbytes' "
                                                          "CUDA dequantize_4bit.out, a chunk of rows at a time")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_decodes_chunked_rows_as_the_cpu_does(dtype, monkeypatch):
    """On CUDA the rows decode a chunk at a time straight into the one output (dequantize_4bit's out=
    kernel): with a chunk smaller than the weight, the result equals the CPU decode of the same rows
    bit for bit."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 3072, generator=g) * torch.logspace(-3, 2, 48)[:, None]
    raw = nf4_storage.quantize(w)
    want = nf4_storage.dequantize(raw, 3072, dtype)
    monkeypatch.setattr(nf4_storage, "DECODE_CHUNK", 16 * 3072)        # three chunks of 16 rows
    got = nf4_storage.dequantize(raw.cuda(), 3072, dtype)
    assert got.is_cuda and got.dtype == dtype and torch.equal(got.cpu(), want)
