"""Which scaled-dot-product-attention kernels a CUDA run may use.

Why: on the first real GPU this project ran on (H100, torch 2.11.0+cu130, cuDNN's fused attention
chosen by torch for bf16), a plain LoRA training step of a Flux model with nothing of leantune's
engine applied (no streaming, no checkpointing) returned NaN from its second step, or ended in
"an illegal memory access", and cuDNN's attention backward itself failed ("mha_graph.execute ...
is_good()") at full size; with the cuDNN backend off, the same runs trained normally. Flash and
memory-efficient attention stay available, so this costs little. `LEANTUNE_CUDNN_SDP=1` allows
cuDNN attention again (for a torch/cuDNN pair known to be sound).

The setting is process-wide, and not only training runs attention: caching (`leantune cache`, a
run's cache fill) and the sampler's encode stage run text encoders on the GPU before any memory
plan is applied. So every command guards its process once at start (`guard_process`, from
leantune/cli.py), and `apply_memory` guards again for library callers that do not come through it.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("leantune.memory")
_done = False


def guard_attention_kernels(device: torch.device) -> None:
    """Turn torch's cuDNN SDPA backend off for CUDA runs, once per process (module docstring)."""
    global _done
    if _done or device.type != "cuda" or os.environ.get("LEANTUNE_CUDNN_SDP") == "1":
        return
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("attention: cuDNN's fused attention is off (it produced NaN/illegal memory accesses in "
                 "training on H100 with torch 2.11; LEANTUNE_CUDNN_SDP=1 allows it)")
    _done = True


def guard_process() -> None:
    """`guard_attention_kernels` for this process when it can see a GPU: every command calls it
    once at start, before caching, encoding or training touches attention (module docstring)."""
    if torch.cuda.is_available():
        guard_attention_kernels(torch.device("cuda"))
