"""GPU-only checks of issue 40 (bench/gpu_checks.sh, window 4); each prints one JSON line.

`cudnn-attention`: every command turns cuDNN's fused attention off in a process that sees a GPU
(leantune/memory/attention_kernels.py, `guard_process`, called by leantune/cli.py). Checked here:
after `guard_process` the flag is off; then a bf16 SDPA forward and backward at a text encoder's
and a Flux block's shapes with cuDNN allowed and with it off, both finite, and their difference
(what the H100 run showed as NaN is the cuDNN column). `rng`: a save's CUDA random state is the
run's device's alone and resumes onto it.
"""

from __future__ import annotations

import json
import sys

import torch


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
    result = {"cudnn-attention": cudnn_attention, "rng": rng}[sys.argv[1]]()
    print(json.dumps(result))
    sys.exit(0 if result.get("ok") else 1)
