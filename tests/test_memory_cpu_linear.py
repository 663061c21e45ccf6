"""Frozen 16-bit Linears and fp8 Linears on CPU compute through fp32 (memory/cpu_linear.py), and
the fp8 Linear computes in the autocast dtype, not its input's."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from leantune.memory import fp8_matmul
from leantune.memory.cpu_linear import apply_cpu_linears, matmul_dtype, remove_cpu_linears
from leantune.memory.fp8 import _Fp8Linear, dequantize, quantize


class _MatmulDtypes(TorchDispatchMode):
    """Records the dtypes of every mm/addmm/bmm the CPU runs."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.seen.append(args[-1].dtype)
        return func(*args, **(kwargs or {}))


def test_frozen_bf16_linear_matches_plain_linear_and_runs_no_bf16_matmul():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 48).to(torch.bfloat16).requires_grad_(False)
    lin.bias.requires_grad_(True)                  # a trainable bias still gets its gradient
    ref = nn.Linear(96, 48).to(torch.bfloat16)
    ref.load_state_dict(lin.state_dict())
    ref.weight.requires_grad_(False)
    x = torch.randn(3, 7, 96, generator=g).to(torch.bfloat16).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    gy = torch.randn(3, 7, 48, generator=g).to(torch.bfloat16)

    handle = apply_cpu_linears(nn.Sequential(lin))
    assert handle.linears == [lin]
    with _MatmulDtypes() as rec:
        y = lin(x)
        y.backward(gy)
    assert rec.seen and set(rec.seen) == {torch.float32}
    y2 = ref(x2)
    y2.backward(gy)
    assert y.dtype == y2.dtype == torch.bfloat16
    torch.testing.assert_close(y, y2, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1.6e-2, atol=1e-2)
    assert lin.weight.grad is None

    remove_cpu_linears(handle)
    assert "forward" not in lin.__dict__
    with _MatmulDtypes() as rec:
        lin(x)
    assert set(rec.seen) == {torch.bfloat16}


def test_only_frozen_16_bit_linears_are_wrapped():
    trainable = nn.Linear(8, 8).to(torch.bfloat16)
    fp32 = nn.Linear(8, 8).requires_grad_(False)
    frozen = nn.Linear(8, 8).to(torch.bfloat16).requires_grad_(False)
    handle = apply_cpu_linears(nn.Sequential(trainable, fp32, frozen))
    assert handle.linears == [frozen]


def test_matmul_dtype_follows_autocast():
    x = torch.randn(2, 4)
    assert matmul_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert matmul_dtype(x) == torch.bfloat16
    assert matmul_dtype(x.bfloat16()) == torch.bfloat16


def test_fp8_linear_under_autocast_computes_in_the_autocast_dtype():
    """An fp32 input under bf16 autocast (Flux's modulated activations): the product is the bf16
    product of bf16-rounded operands, with bf16 output and an input-gradient in the input's dtype;
    on CPU the matmuls themselves run in fp32."""
    g = torch.Generator().manual_seed(2)
    q, s = quantize(torch.randn(32, 128, generator=g))
    x = torch.randn(4, 128, generator=g, requires_grad=True)
    bias = torch.randn(32, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16), _MatmulDtypes() as rec:
        y = _Fp8Linear.apply(x, q, s, bias)
    assert y.dtype == torch.bfloat16
    assert set(rec.seen) == {torch.float32}
    w16 = dequantize(q, s, torch.bfloat16)
    ref = (x.detach().bfloat16().float() @ w16.float().t() + bias.bfloat16().float()).bfloat16()
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    gy = torch.randn(4, 32, generator=g).bfloat16()
    y.backward(gy)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, (gy.float() @ w16.float()).bfloat16().float(), rtol=0, atol=0)


def test_scaled_mm_path_is_off_without_fp8_tensor_cores():
    q, s = quantize(torch.randn(32, 64), block=0)
    assert s.shape == (32, 1)
    x = torch.randn(4, 64)
    assert not fp8_matmul.usable(x, q, s, torch.bfloat16)
    assert fp8_matmul.scaled_mm_linear(x, q, s, None, torch.bfloat16) is None


def test_scaled_mm_path_is_off_unless_asked_for_as_per_token_inputs_lose_accuracy(monkeypatch):
    """bench/fp8_accuracy.py (docs/benchmarks.md): with Flux's per-channel input outliers, the
    _scaled_mm product (input quantized per token row) is off the bf16 product by 3.3-3.5 %, the
    dequantized weight's product by 2.7 %: the more accurate path is the default even where fp8
    tensor cores are."""
    monkeypatch.setitem(fp8_matmul._state, "failed", set())
    monkeypatch.setattr(fp8_matmul, "fp8_tensor_cores", lambda device: True)
    q, s = quantize(torch.randn(48, 64), block=0)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert not fp8_matmul.usable(x, q, s, torch.bfloat16)
    monkeypatch.setattr(fp8_matmul, "SCALED_MM", True)
    assert fp8_matmul.usable(x, q, s, torch.bfloat16)


def _contract_checked_scaled_mm(calls: list):
    """torch._scaled_mm (torch 2.13 has a CPU kernel) behind the checks its CUDA build makes for
    row-wise scaling, which the CPU kernel does not all make."""
    real = torch._scaled_mm

    def checked(a, b, *, scale_a, scale_b, bias=None, out_dtype=None, **kw):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert a.stride() == (k, 1), f"mat_a must be row-major, stride {a.stride()}"
        assert b.stride() == (1, k), f"mat_b must be column-major, stride {b.stride()}"
        assert k % 16 == 0 and n % 16 == 0 and m % 16 == 0
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.shape == (m, 1) and scale_a.is_contiguous()
        assert scale_b.shape == (1, n) and scale_b.is_contiguous()
        assert bias is None or bias.dtype == out_dtype
        calls.append(out_dtype)
        return real(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, **kw)

    return checked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_call_keeps_torchs_contract_and_matches_the_dequantized_product(monkeypatch, dtype):
    """The fp8 tensor-core call, run on torch's CPU kernel: operand layouts, scale shapes, padding of
    a token count that is no multiple of 16, bias dtype, and the result."""
    monkeypatch.setitem(fp8_matmul._state, "failed", set())
    monkeypatch.setattr(fp8_matmul, "fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr(fp8_matmul, "SCALED_MM", True)
    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", _contract_checked_scaled_mm(calls))
    g = torch.Generator().manual_seed(5)
    q, s = quantize(torch.randn(48, 64, generator=g), block=0)           # (48, 64) e4m3, (48, 1)
    x = torch.randn(2, 37, 64, generator=g).to(dtype)                     # 74 token rows
    bias = torch.randn(48, generator=g)
    y = fp8_matmul.scaled_mm_linear(x, q, s, bias, dtype)
    assert calls == [dtype]
    assert y.shape == (2, 37, 48) and y.dtype == dtype
    ref = nn.functional.linear(x.float(), dequantize(q, s, torch.float32), bias.float())
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.05, rel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizing_the_input_for_scaled_mm_needs_the_e4m3_result_and_one_chunk(monkeypatch, dtype):
    """The input's e4m3 copy is built a chunk of rows at a time: transient bytes are the (M, K) result
    plus one fp32 chunk (it was an fp32 copy and an fp32 quotient of the whole input besides: 9
    bytes per element). Values bitwise as the one-expression quantization, zero rows padded."""
    from leantune.memory.simulated import DeviceMemoryTracker

    monkeypatch.setattr(fp8_matmul, "QUANT_CHUNK", 64 * 2**10)
    g = torch.Generator().manual_seed(1)
    m, k, pad = 500, 1024, 12
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).to(dtype)
    x[7] = 0
    tracker = DeviceMemoryTracker()
    with tracker:
        q, s = fp8_matmul.quantize_rows(x, pad)
    assert tracker.peak["cpu"] <= (m + pad) * k + fp8_matmul.QUANT_CHUNK + 16 * (m + pad)
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    want_s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    want_q = (x.float() / want_s).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert q.shape == (m + pad, k) and s.shape == (m + pad, 1)
    assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s[:m], want_s)
    assert not q[m:].view(torch.uint8).any() and bool((s[m:] == 1).all())


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def test_the_scaled_mm_path_runs_no_op_that_cuda_autocast_would_recast(monkeypatch):
    """Under bf16 autocast on CUDA an op on autocast's lists casts its input first (a norm: to fp32,
    a full copy of the activation). The tensor-core path's ops must all fall through autocast; read
    from torch's own dispatch table for AutocastCUDA, so this holds without a GPU."""
    monkeypatch.setitem(fp8_matmul._state, "failed", set())
    monkeypatch.setattr(fp8_matmul, "fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr(fp8_matmul, "SCALED_MM", True)
    q, s = quantize(torch.randn(48, 64), block=0)
    x = torch.randn(37, 64).bfloat16()
    rec = _OpNames()
    with rec:
        assert fp8_matmul.scaled_mm_linear(x, q, s, torch.randn(48), torch.bfloat16) is not None
    recast = [op for op in sorted(rec.names)
              if any(line.startswith("AutocastCUDA:") and "fallthrough" not in line
                     for line in torch._C._dispatch_dump_table(op).splitlines())]
    assert "aten::_scaled_mm" in rec.names and recast == []


def test_a_refused_scaled_mm_falls_back_for_that_dtype_only_and_oom_propagates(monkeypatch):
    """torch reports a broken _scaled_mm contract as ValueError: that falls back to dequantizing
    (it used to escape, as only RuntimeError was caught), and only for the refused output dtype
    (row-wise fp16 output is refused by some builds where bf16 works). An out-of-memory error is
    the OOM guard's to handle: it propagates and does not switch the path off."""
    monkeypatch.setitem(fp8_matmul._state, "failed", set())
    monkeypatch.setattr(fp8_matmul, "fp8_tensor_cores", lambda device: True)
    monkeypatch.setattr(fp8_matmul, "SCALED_MM", True)
    real = torch._scaled_mm
    raised = {"oom": False}

    def picky(a, b, *, out_dtype=None, **kw):
        if raised["oom"]:
            raised["oom"] = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if out_dtype == torch.float16:
            raise ValueError("Only bf16 high precision output types are supported for row-wise scaling.")
        return real(a, b, out_dtype=out_dtype, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", picky)
    q, s = quantize(torch.randn(32, 64), block=0)
    x = torch.randn(16, 64)
    assert fp8_matmul.scaled_mm_linear(x.half(), q, s, None, torch.float16) is None
    assert not fp8_matmul.usable(x, q, s, torch.float16)
    assert fp8_matmul.usable(x, q, s, torch.bfloat16)
    raised["oom"] = True
    with pytest.raises(torch.OutOfMemoryError):
        fp8_matmul.scaled_mm_linear(x.bfloat16(), q, s, None, torch.bfloat16)
    y = fp8_matmul.scaled_mm_linear(x.bfloat16(), q, s, None, torch.bfloat16)
    assert y is not None and y.dtype == torch.bfloat16
    assert not fp8_matmul.usable(x, q.t().contiguous().t(), s, torch.bfloat16)   # a non-contiguous weight


@pytest.mark.gpu
def test_scaled_mm_matches_the_dequantized_product_on_fp8_tensor_cores():
    dev = torch.device("cuda")
    if not fp8_matmul.fp8_tensor_cores(dev):
        pytest.skip("needs a CUDA device of compute capability 8.9 or newer")
    g = torch.Generator().manual_seed(3)
    q, s = quantize(torch.randn(256, 512, generator=g), block=0)
    q, s = q.to(dev), s.to(dev)
    x = torch.randn(2, 40, 512, generator=g).to(dev, torch.bfloat16)
    bias = torch.randn(256, generator=g).to(dev, torch.bfloat16)
    assert fp8_matmul.usable(x, q, s, torch.bfloat16)
    y = fp8_matmul.scaled_mm_linear(x, q, s, bias, torch.bfloat16)
    assert y is not None and y.shape == (2, 40, 256) and not fp8_matmul._state["failed"]
    ref = nn.functional.linear(x.float(), dequantize(q, s, torch.float32), bias.float())
    rel = (y.float() - ref).norm() / ref.norm()
    assert rel < 0.05, rel          # the input is quantized to e4m3 per row: a few percent at most
