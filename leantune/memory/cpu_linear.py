"""Frozen bf16/fp16 Linears on CPU: matmuls in fp32, so backward does not crawl.

Why: on CPUs without native bf16 matmul kernels (AVX2, the common case), torch runs a bf16 `mm`
through a generic fallback. `grad_out @ W` — the input-gradient of every frozen Linear in a LoRA
step — measured 0.1-0.3 GFLOP/s there, 10-40x slower than the same product in fp32; one LoRA step of
the full-size Flux model at 64 px did not finish in 15 minutes. bf16 `F.linear` forward is faster
than `mm` but still well below fp32.

What: the same products computed on fp32 copies of the (bf16-exact) operands and rounded back to
the compute dtype (operands are rounded to that dtype first, as a bf16 matmul would see them). The fp32 kernels accumulate in fp32 as the bf16 ones do, so results match a
bf16 matmul to its rounding. The cost is one fp32 temporary of the weight per call, in host RAM.

- `matmul_dtype(x)`: the dtype a Linear's product runs in — autocast's when autocast is on for the
  input's device, else the input's own. fp8.py dequantizes to it (never to an fp32 input's dtype
  under autocast, which would make a 4-byte temporary and then a cast).
- `linear(x, w, b, dtype)`: y = x w^T + b in `dtype`, through fp32 on CPU.
- `linear_input_grad(grad, w)`: grad w, through fp32 on CPU.
- `apply_cpu_linears(model)`: gives every frozen bf16/fp16 nn.Linear of a CPU model a forward
  whose backward computes the input-gradient this way (`_FrozenLinear` saves the weight itself, no
  copy; when the weight streams, the streaming engine's pack hooks swap it for a handle as usual).
  The engine applies it when the compute device is the CPU; `remove_cpu_linears` undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

_LOW = (torch.bfloat16, torch.float16)


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype torch would run a Linear on `x` in: the autocast dtype if autocast is on for
    x's device type, else x's dtype. On meta, where torch has no autocast, a torch function mode
    that emulates it (the planner's probe, planner/activation_probe._GpuSemantics) answers through
    its `emulated_autocast_dtype()`: without it a stored-format Linear would decode its weight to an
    fp32 input's dtype in the probe (Flux's q/k RMSNorm in fp32 makes its attention output fp32) and
    price a 4-byte weight the GPU never holds."""
    dev = x.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except RuntimeError:            # a device type autocast does not know
        pass
    if dev == "meta":
        from torch.overrides import _get_current_function_mode_stack

        for mode in reversed(_get_current_function_mode_stack()):
            emulated = getattr(mode, "emulated_autocast_dtype", None)
            if emulated is not None:
                return emulated() or x.dtype
    return x.dtype


def _slow_low_precision(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and dtype in _LOW


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x @ w^T + b with inputs rounded to `dtype` and the result in `dtype`; on CPU with a 16-bit
    dtype the product runs on fp32 copies with autocast off (see module docstring). Elsewhere the
    operands are already what autocast would make them."""
    if _slow_low_precision(x, dtype):
        with torch.autocast("cpu", enabled=False):
            b32 = None if b is None else b.to(dtype).float()
            return F.linear(x.to(dtype).float(), w.to(dtype).float(), b32).to(dtype)
    return F.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))


def linear_input_grad(grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """grad @ w (the input-gradient of y = x w^T), in grad's dtype; through fp32 on CPU."""
    if _slow_low_precision(grad, grad.dtype):
        return (grad.float() @ w.float()).to(grad.dtype)
    return grad @ w.to(grad.dtype)


class _FrozenLinear(torch.autograd.Function):
    """y = x w^T + b for a weight that takes no gradient, saving the weight (not a copy)."""

    @staticmethod
    def forward(ctx, x, w, bias):
        dtype = matmul_dtype(x)
        ctx.save_for_backward(w)
        ctx.bias_needs_grad = bias is not None and bias.requires_grad
        ctx.bias_dtype = None if bias is None else bias.dtype
        return linear(x, w, bias, dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (w,) = ctx.saved_tensors
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = linear_input_grad(grad_out, w)
        if ctx.bias_needs_grad:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, grad_b


class _FrozenForward:
    """Instance-level forward of a frozen Linear; reads weight and bias at call time (streaming
    re-points them at slots). Falls back to the module's own forward if the weight is trainable."""

    def __init__(self, linear_module: nn.Linear):
        self.linear = linear_module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        if lin.weight.requires_grad:
            return nn.Linear.forward(lin, x)
        return _FrozenLinear.apply(x, lin.weight, lin.bias)


@dataclass
class CpuLinearHandle:
    linears: list[nn.Linear] = field(default_factory=list)


def apply_cpu_linears(model: nn.Module) -> CpuLinearHandle:
    """Give every frozen 16-bit nn.Linear of `model` without a forward of its own (fp8 Linears have
    one) the fp32-on-CPU forward/backward."""
    handle = CpuLinearHandle()
    for m in model.modules():
        if type(m) is not nn.Linear or "forward" in m.__dict__:
            continue
        if m.weight.requires_grad or m.weight.dtype not in _LOW:
            continue
        m.forward = _FrozenForward(m)
        handle.linears.append(m)
    return handle


def remove_cpu_linears(handle: CpuLinearHandle) -> None:
    for m in handle.linears:
        if isinstance(m.__dict__.get("forward"), _FrozenForward):
            del m.forward
    handle.linears.clear()
