"""GPU-only checks of issue 40 (bench/gpu_checks.sh, window 4); each prints one JSON line.

`cudnn-attention`: every command turns cuDNN's fused attention off in a process that sees a GPU
(leantune/memory/attention_kernels.py, `guard_process`, called by leantune/cli.py). Checked here:
after `guard_process` the flag is off; then a bf16 SDPA forward and backward at a text encoder's
and a Flux block's shapes with cuDNN allowed and with it off, both finite, and their difference
(what the H100 run showed as NaN is the cuDNN column). `rng`: a save's CUDA random state is the
run's device's alone and resumes onto it.

Window 3's single-GPU checks (the GPU machines at hand have one GPU; the two-GPU parts wait in
window 5 for a two-GPU lease): `dequant-rate` (finding 5: the fp8 dequantize formed in its bf16
output moves ~7 bytes per element where an fp32 product moved ~19: its bits against the fp32
product, its rate beside the fp32-temporary way and a plain bf16 copy, and the bytes it allocates
above its output) and `host-step` (finding 10: a full-width host AdamW step of a Flux MLP weight,
37.7M parameters, on the GPU host's cores less one: the gradient's pinned D2H and the kernel's
time, the kernel's update against torch's AdamW formula). Each phase prints its own JSON line as
it ends (PYTHONUNBUFFERED), so a part stopped at its budget still leaves numbers.
"""

from __future__ import annotations

import json
import sys
import time

import torch


def _phase(name: str, **values) -> dict:
    """One phase's numbers, printed at once (a part stopped later still leaves them)."""
    print(json.dumps({"phase": name, **values}), flush=True)
    return values


def _cuda_seconds(fn, repeat: int) -> float:
    """Mean seconds of fn() on the current stream, by CUDA events, after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeat


def dequant_rate() -> dict:
    from leantune.memory.fp8 import dequantize, quantize

    out_f, in_f = 3072, 12288                     # a Flux MLP weight
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    q, scale = quantize(w)
    nb = scale.shape[-1]
    want = (q.float().view(out_f, nb, in_f // nb) * scale.float()[..., None]).view(out_f, in_f).to(torch.bfloat16)
    got = dequantize(q, scale, torch.bfloat16)
    bitwise = bool(torch.equal(got, want))
    del got
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = dequantize(q, scale, torch.bfloat16)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    del out
    _phase("bits", bitwise=bitwise, allocated_above_output=extra)
    n = out_f * in_f
    ours = _cuda_seconds(lambda: dequantize(q, scale, torch.bfloat16), 20)
    fp32_way = _cuda_seconds(lambda: (q.float().view(out_f, nb, in_f // nb) * scale.float()[..., None])
                             .view(out_f, in_f).to(torch.bfloat16), 20)
    dst = torch.empty_like(w)
    copy = _cuda_seconds(lambda: dst.copy_(w), 20)
    rates = _phase("rates", elements=n, ours_s=ours, fp32_temporary_s=fp32_way, bf16_copy_s=copy,
                   ours_GBps_at_7_bytes=7 * n / ours / 1e9, copy_GBps=4 * n / copy / 1e9,
                   speedup_over_fp32_temporary=fp32_way / ours)
    return {"ok": bitwise and extra <= 2 * 2**20 and rates["speedup_over_fp32_temporary"] > 1.0,
            "allocated_above_output": extra, **rates}


def host_step() -> dict:
    from leantune import native
    from leantune.train import host_kernels

    if host_kernels.library() is None:
        return {"ok": False, "reason": host_kernels.unavailable_reason()}
    native.leave_a_core()
    n = 3072 * 12288
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    grad_dev = torch.randn(n, device="cuda") * 1e-3
    g = torch.empty(n, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g.copy_(grad_dev, non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t0
    _phase("d2h", seconds=d2h, GBps=4 * n / d2h / 1e9, threads=torch.get_num_threads())
    lr, beta1, beta2, eps, wd = 1e-4, 0.9, 0.999, 1e-8, 0.01
    ref_w = w[:4096].clone()
    ref_g = g[:4096].clone()
    t0 = time.perf_counter()
    done = host_kernels.adamw(w, None, g, m, v, gscale=1.0, decay=1 - lr * wd, beta1=beta1, beta2=beta2, eps=eps,
                              step_size=lr / (1 - beta1), bc2_sqrt=(1 - beta2) ** 0.5, sr_w=False, sr_state=False,
                              key=1)
    kernel = time.perf_counter() - t0
    # torch's AdamW at step 1 on the first 4096 values, fp32
    ref_m = (1 - beta1) * ref_g
    ref_v = (1 - beta2) * ref_g * ref_g
    ref = ref_w * (1 - lr * wd) - (lr / (1 - beta1)) * ref_m / (ref_v.sqrt() / (1 - beta2) ** 0.5 + eps)
    err = float((w[:4096] - ref).abs().max())
    _phase("kernel", seconds=kernel, GBps_moved=(4 * 4 + 4) * n / kernel / 1e9, max_abs_error=err, ran=bool(done))
    return {"ok": bool(done) and err < 1e-6, "d2h_s": d2h, "kernel_s": kernel, "max_abs_error": err}


def cudnn_attention() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from leantune.memory import attention_kernels

    before = torch.backends.cuda.cudnn_sdp_enabled()
    attention_kernels.guard_process()
    out = {"cudnn_before": before, "cudnn_after_guard": torch.backends.cuda.cudnn_sdp_enabled()}
    torch.manual_seed(0)
    for name, (b, h, n, d) in {"encoder_512": (8, 32, 512, 128), "flux_block_4608": (1, 24, 4608, 128)}.items():
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        row = {}
        for label, backends in (("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                                ("default_after_guard", [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])):
            try:
                with sdpa_kernel(backends):
                    o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                    o.float().square().sum().backward()
                torch.cuda.synchronize()
                row[label] = {"finite": bool(torch.isfinite(o).all() and torch.isfinite(q.grad).all()),
                              "out": o.detach().float()}
            except RuntimeError as e:
                row[label] = {"error": str(e).splitlines()[0][:200]}
            q.grad = k.grad = v.grad = None
        if "out" in row.get("cudnn", {}) and "out" in row.get("default_after_guard", {}):
            row["max_diff"] = float((row["cudnn"]["out"] - row["default_after_guard"]["out"]).abs().max())
        for r in row.values():
            if isinstance(r, dict):
                r.pop("out", None)
        out[name] = row
    out["ok"] = not out["cudnn_after_guard"] and all(
        out[n]["default_after_guard"].get("finite") for n in ("encoder_512", "flux_block_4608"))
    return out


def rng() -> dict:
    from leantune.train.state import rng_state, set_rng_state

    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    saved = rng_state(gen, device)
    a = torch.rand(4, device=device)
    set_rng_state(saved, gen, torch.device("cuda", 0))
    b = torch.rand(4, device="cuda:0")
    return {"saved_shape": list(saved["cuda"].shape), "ok": torch.equal(a.cpu(), b.cpu())}


if __name__ == "__main__":
    result = {"cudnn-attention": cudnn_attention, "rng": rng, "dequant-rate": dequant_rate,
              "host-step": host_step}[sys.argv[1]]()
    print(json.dumps(result))
    sys.exit(0 if result.get("ok") else 1)
