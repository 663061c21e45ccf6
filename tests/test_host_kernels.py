"""The host optimizer step's kernels (train/host_kernels.py, train/fused_optim.py `_host_step`).

What is exact and what is within a stated tolerance:
- fp32 weights with fp32 AdamW moments step with torch's fused CPU AdamW: bitwise torch's
  `AdamW(fused=True)`, weight decay included.
- Every other setting runs host_kernels.c. Against the torch-op path (`host_kernels=False`, what a
  device runs) with round-to-nearest, the weights agree to one bf16 step (the fp32 update differs in
  the order of a few operations, which can flip a rounding) on under 1 % of the elements, fp32
  weights to 1e-3 of the learning rate, fp32 moments to 1e-5 of their scale, bf16 moments to 2^-7. With clipping, the kernel scales the gradient in fp32 where the
  torch-op path rounds `g * coef` to bf16 first: the moments agree to bf16's 2^-8 relative.
- fp32 Adafactor runs the kernels too (three passes over the gradient instead of torch's dozen
  ops): against torch.optim.Adafactor over 100 steps (weight decay, gradients whose scale sweeps
  three decades, so the update-RMS clip binds on some steps), the weights stay within 5e-5 of
  their largest displacement and the row/column moments within 5e-6 of their largest value
  (measured: 5.1e-6 and 7.0e-7 at worst). The kernel sums in another order than torch's norms and
  forms rsqrt(row * col) as rsqrt(row) * rsqrt(col): a few ulp per step.
- Stochastic rounding draws its bits from a hash of (seed, tensor, step, element): unbiased (the
  mean of many rounded weights is the fp32 value); AdamW's and Adafactor's results (sums included)
  do not depend on how many threads split the tensor.
- The kernel paths allocate nothing the size of the tensor (the torch-op path allocates several
  fp32 copies).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from leantune.memory.simulated import DeviceMemoryTracker
from leantune.train import host_kernels
from leantune.train.fused_optim import FusedOptimizer
from leantune.train.in_backward import InBackwardStep

needs_kernels = pytest.mark.skipif(host_kernels.library() is None, reason=host_kernels.unavailable_reason())
SHAPE = (96, 160)


def _steps(dtype, kind="adamw", state_dtype="fp32", master=False, sr=True, clip=0.0, kernels=True, steps=4,
           shape=SHAPE, weight_decay=0.01, lr=1e-3, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
    opt = FusedOptimizer(lin, {"weight": lin.weight}, kind, lr=lr, state_dtype=state_dtype, master_weights=master,
                         stochastic_rounding=sr, weight_decay=weight_decay, host_kernels=kernels)
    stepper = InBackwardStep(opt, [], max_grad_norm=clip)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _ in range(steps):
            stepper._update(lin.weight, (torch.randn(shape, generator=gen) * 1e-2).to(dtype))
    state = {k: v.float().clone() for k, v in opt.holders["weight"].tensors().items()}
    return lin.weight.detach().clone(), state


def test_fp32_adamw_on_the_host_is_bitwise_torch_fused_adamw():
    torch.manual_seed(0)
    w0 = torch.randn(SHAPE)
    lin = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)
    lin.weight.data.copy_(w0)
    opt = FusedOptimizer(lin, {"weight": lin.weight}, "adamw", lr=1e-3, weight_decay=0.1)
    ref = torch.nn.Parameter(w0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1, fused=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        g = torch.randn(SHAPE, generator=gen)
        ref.grad = g.clone()
        ref_opt.step()
        opt.step_param(lin.weight, g.clone())
    assert torch.equal(lin.weight.detach(), ref.detach())
    st = opt.holders["weight"].tensors()
    assert torch.equal(st["exp_avg"], ref_opt.state[ref]["exp_avg"])
    assert torch.equal(st["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"])


def _bf16_spacing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16's spacing at the larger of |a|, |b| (one step of the last mantissa bit)."""
    mag = torch.maximum(a.float().abs(), b.float().abs()).clamp(min=1e-30)
    return torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(mag)))


def _assert_weights_close(got: torch.Tensor, want: torch.Tensor, lr: float) -> None:
    diff = (got.float() - want.float()).abs()
    if want.dtype == torch.bfloat16:                   # at most one rounding flipped, rarely
        assert (diff <= _bf16_spacing(got, want)).all(), diff.max()
        assert (diff > 0).float().mean() < 0.01
    else:                                              # fp32: far below one step's size (lr)
        assert diff.max() <= 1e-3 * lr


def _assert_state_close(got: dict, want: dict, rtol: float) -> None:
    """Relative to each tensor's scale (a moment that cancels to ~0 has no relative precision)."""
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=rtol * float(want[k].abs().max()))


@needs_kernels
@pytest.mark.parametrize("dtype,state_dtype,master", [
    (torch.bfloat16, "fp32", False), (torch.bfloat16, "bf16", False), (torch.bfloat16, "fp32", True),
    (torch.float32, "bf16", False)], ids=["bf16-fp32m", "bf16-bf16m", "bf16-masters", "fp32-bf16m"])
def test_adamw_kernel_matches_the_torch_op_path_with_round_to_nearest(dtype, state_dtype, master):
    got, got_st = _steps(dtype, state_dtype=state_dtype, master=master, sr=False)
    want, want_st = _steps(dtype, state_dtype=state_dtype, master=master, sr=False, kernels=False)
    _assert_weights_close(got, want, lr=1e-3)
    moved = (want.float() - _steps(dtype, steps=0)[0].float()).abs() > 0
    assert moved.float().mean() > 0.5                       # the weights did move
    _assert_state_close(got_st, want_st, rtol=1e-5 if state_dtype == "fp32" else 2 ** -7)


@needs_kernels
def test_clipping_scales_the_gradient_in_the_kernel():
    """max_grad_norm 1e-3 against gradients of norm ~1.2: the moments follow the clipped gradient
    (to bf16 rounding of the torch-op path's clipped bf16 gradient)."""
    got, got_st = _steps(torch.bfloat16, sr=False, clip=1e-3, steps=1, weight_decay=0.0)
    want, want_st = _steps(torch.bfloat16, sr=False, clip=1e-3, steps=1, weight_decay=0.0, kernels=False)
    torch.testing.assert_close(got_st["exp_avg"], want_st["exp_avg"], rtol=2 ** -7, atol=1e-12)
    assert float(got_st["exp_avg"].norm()) == pytest.approx(0.1 * 1e-3, rel=1e-3)   # (1 - beta1) * max norm


@needs_kernels
def test_adafactor_kernel_matches_the_torch_op_path_on_bf16_weights():
    got, got_st = _steps(torch.bfloat16, kind="adafactor", sr=False, lr=1e-2)
    want, want_st = _steps(torch.bfloat16, kind="adafactor", sr=False, lr=1e-2, kernels=False)
    _assert_weights_close(got, want, lr=1e-2)
    _assert_state_close(got_st, want_st, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("shape", [(520, 96), (96, 520)], ids=["tall", "wide"])
def test_fp32_adafactor_kernel_follows_torch_adafactor_within_its_tolerance(shape):
    """100 steps of the host step (kernels) and of torch.optim.Adafactor from the same weights and
    gradients; 520 rows span three of the kernel's 256-row blocks of column sums."""
    torch.manual_seed(0)
    w0 = torch.randn(shape) * 0.05
    lin = torch.nn.Linear(shape[1], shape[0], bias=False)
    lin.weight.data.copy_(w0)
    opt = FusedOptimizer(lin, {"weight": lin.weight}, "adafactor", lr=1e-2, weight_decay=0.1)
    ref = torch.nn.Parameter(w0.clone())
    ref_opt = torch.optim.Adafactor([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    calls = []
    real = host_kernels.adafactor_matrix
    gen = torch.Generator().manual_seed(1)
    try:
        host_kernels.adafactor_matrix = lambda *a, **k: calls.append(1) or real(*a, **k)
        for s in range(100):
            g = torch.randn(shape, generator=gen) * 10 ** (-4 + 3 * (s % 5) / 4)   # 1e-4 ... 1e-1.75
            ref.grad = g.clone()
            ref_opt.step()
            opt.step_param(lin.weight, g.clone())
    finally:
        host_kernels.adafactor_matrix = real
    assert len(calls) == 100                                  # the kernel path ran, every step
    moved = (ref.detach() - w0).abs().max()
    assert moved > 0.01                                       # the weights did move (~0.026)
    assert (lin.weight.detach() - ref.detach()).abs().max() <= 5e-5 * moved
    st, ref_st = opt.holders["weight"].tensors(), ref_opt.state[ref]
    for k in ("row_var", "col_var"):
        assert (st[k] - ref_st[k]).abs().max() <= 5e-6 * ref_st[k].abs().max(), k


@needs_kernels
def test_adafactor_clipping_rides_in_the_kernel_first_pass():
    """max_grad_norm 1e-3 against gradients of norm ~2.2: the clipping scale follows from the row
    sums of the first pass, and the result follows the torch-op path (clip_in_place, then torch's
    Adafactor) within the tolerance above."""
    w0 = _steps(torch.float32, kind="adafactor", steps=0)[0]
    got, got_st = _steps(torch.float32, kind="adafactor", clip=1e-3, lr=1e-2, steps=6)
    want, want_st = _steps(torch.float32, kind="adafactor", clip=1e-3, lr=1e-2, steps=6, kernels=False)
    moved = (want - w0).abs().max()
    assert moved > 0
    assert (got - want).abs().max() <= 5e-5 * moved
    _assert_state_close(got_st, want_st, rtol=5e-6)
    unclipped = _steps(torch.float32, kind="adafactor", lr=1e-2, steps=6)[1]
    assert float(unclipped["row_var"].max()) > 1e3 * float(got_st["row_var"].max())   # clipping did bind


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adafactor_kernel_does_not_depend_on_the_thread_split(dtype, monkeypatch):
    """One thread or two (ranges forced small): the same weights and moments, bit for bit, with
    clipping and stochastic rounding (the sums run over fixed blocks, the noise is a hash)."""
    def once(threads: int):
        torch.set_num_threads(threads)
        assert len(host_kernels._ranges(600 * 40)) == threads      # the split this run takes
        return _steps(dtype, kind="adafactor", clip=1e-3, lr=1e-2, steps=3, shape=(600, 40))

    threads = torch.get_num_threads()
    monkeypatch.setattr(host_kernels, "MIN_PER_THREAD", 1024)
    try:
        (w1, st1), (w2, st2) = once(1), once(2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(w1, w2)
    for k in st1:
        assert torch.equal(st1[k], st2[k]), k


@needs_kernels
def test_stochastic_rounding_is_unbiased_and_does_not_depend_on_the_thread_split():
    """Weights at 1.0 moved down by half of bf16's spacing below 1.0: half of them land on the
    next value down, the others stay, and the mean moves by the fp32 update."""
    n = 1 << 20
    w = torch.ones(n, dtype=torch.bfloat16)
    g = torch.full((n,), 1.0, dtype=torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    delta = torch.finfo(torch.bfloat16).eps / 4            # the spacing below 1.0 is eps/2
    kw = dict(gscale=1.0, decay=1.0, beta1=0.0, beta2=0.0, eps=0.0, step_size=delta, bc2_sqrt=1.0,
              sr_w=True, sr_state=False, key=12345)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w.clone()
        assert host_kernels.adamw(one, None, g, m.clone(), v.clone(), **kw)
        torch.set_num_threads(2)
        two = w.clone()
        assert host_kernels.adamw(two, None, g, m.clone(), v.clone(), **kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert set(one.float().unique().tolist()) == {1.0 - torch.finfo(torch.bfloat16).eps / 2, 1.0}
    assert float(one.float().mean()) == pytest.approx(1.0 - delta, abs=8 * delta / n ** 0.5)   # 8 sigma


@needs_kernels
@pytest.mark.parametrize("kind,dtype,state_dtype,master", [
    ("adamw", torch.bfloat16, "fp32", False), ("adamw", torch.bfloat16, "bf16", False),
    ("adamw", torch.bfloat16, "fp32", True), ("adafactor", torch.bfloat16, "fp32", False),
    ("adamw", torch.float32, "fp32", False), ("adafactor", torch.float32, "fp32", False)])
def test_the_host_step_allocates_nothing_the_size_of_the_tensor(kind, dtype, state_dtype, master):
    """Peak bytes allocated by a steady-state step with clipping, well under one byte per element
    (the torch-op path allocates several fp32 copies: > 8 bytes per element)."""
    def peak(kernels: bool) -> int:
        lin = torch.nn.Linear(256, 512, bias=False).to(dtype)
        opt = FusedOptimizer(lin, {"weight": lin.weight}, kind, lr=1e-3, state_dtype=state_dtype,
                             master_weights=master, host_kernels=kernels)
        stepper = InBackwardStep(opt, [], max_grad_norm=1e-3)
        stepper._update(lin.weight, torch.ones(512, 256, dtype=dtype))
        grad = torch.ones(512, 256, dtype=dtype)
        tracker = DeviceMemoryTracker()
        with tracker:
            stepper._update(lin.weight, grad)
        return max(tracker.peak.values(), default=0)

    n = 512 * 256
    assert peak(True) < 0.1 * n
    assert peak(False) > 2 * n                              # what the torch-op path costs, for contrast


def test_without_the_kernels_the_step_falls_back_to_torch_ops(tmp_path):
    """LEANTUNE_HOST_KERNELS=0 (as on a machine without a C compiler): no library, and a bf16 step
    with stochastic rounding still runs (the torch-op path)."""
    code = ("import torch\n"
            "from leantune.train import host_kernels\n"
            "from leantune.train.fused_optim import FusedOptimizer\n"
            "assert host_kernels.library() is None, 'built'\n"
            "print(host_kernels.unavailable_reason())\n"
            "lin = torch.nn.Linear(8, 4, bias=False).to(torch.bfloat16)\n"
            "w0 = lin.weight.detach().clone()\n"
            "opt = FusedOptimizer(lin, {'weight': lin.weight}, 'adamw', lr=0.1)\n"
            "opt.step_param(lin.weight, torch.ones(4, 8, dtype=torch.bfloat16))\n"
            "assert not torch.equal(w0, lin.weight.detach())\n")
    env = {**os.environ, "LEANTUNE_HOST_KERNELS": "0", "LEANTUNE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "LEANTUNE_HOST_KERNELS=0" in done.stdout


class _EngineGivingANorm:
    """The host-step side of trainable_streaming.step_on_host on CUDA: it hands the step the norm
    the device took (here a chosen one) beside the gradient's host copy, when asked for one."""

    def __init__(self, weight: torch.Tensor, norm: float):
        self.weight, self.norm, self.asked = weight, norm, []

    def step_on_host(self, p, grad, step, norm=False):
        self.asked.append(norm)
        step(self.weight, None if grad is None else grad.clone(), self.norm if norm else None)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-fused", "bf16-kernel"])
def test_the_host_step_clips_by_the_norm_the_device_took(dtype):
    """A host step asks the device for the clipping norm and clips by it with no pass of its own:
    handed 4x the gradient's norm, the first moment is (1 - beta1) * max_norm / (4 |g|) * g, not the
    clipping by |g|. With a host accumulator to add first, no norm is asked (the device's gradient
    is not the whole gradient)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False).to(dtype)
    opt = FusedOptimizer(lin, {"weight": lin.weight}, "adamw", lr=1e-3, weight_decay=0.0, stochastic_rounding=False)
    stepper = InBackwardStep(opt, [], max_grad_norm=1e-3)
    g = (torch.randn(SHAPE) * 1e-2).to(dtype)
    true_norm = float(torch.linalg.vector_norm(g, dtype=torch.float32))
    engine = _EngineGivingANorm(lin.weight.data, 4 * true_norm)
    stepper.begin_step()
    stepper._update_on_host(engine, lin.weight, g, None)
    assert engine.asked == [True]
    m = opt.holders["weight"].tensors()["exp_avg"].float()
    want = 0.1 * g.float() * (1e-3 / (4 * true_norm + 1e-6))
    torch.testing.assert_close(m, want, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=1e-12)
    assert float(m.norm()) == pytest.approx(0.1 * 1e-3 / 4, rel=1e-2)      # a quarter of the own-norm clip

    stepper._update_on_host(engine, lin.weight, g, torch.zeros(SHAPE, dtype=dtype))
    assert engine.asked == [True, False]

    # Adafactor takes its norm from its own first pass: the device is not asked for one.
    ada = FusedOptimizer(lin, {"weight": lin.weight}, "adafactor", lr=1e-3)
    ada_engine = _EngineGivingANorm(lin.weight.data, 4 * true_norm)
    InBackwardStep(ada, [], max_grad_norm=1e-3)._update_on_host(ada_engine, lin.weight, g, None)
    assert ada_engine.asked == [False]
