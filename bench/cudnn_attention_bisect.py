"""GPU diagnosis: the first NaN step of a LoRA run on the mid-size Flux of tests/test_memory_gpu.py,
for one engine configuration per process (a CUDA error is sticky, so each gets its own).

    python bench/cudnn_attention_bisect.py '{"streamed": "none", "checkpointing": "none"}'
    python bench/cudnn_attention_bisect.py '{"streamed": "all", "stream_non_blocks": true, "checkpointing": "offload", "no_cudnn_sdp": true}'

Keys: "streamed" ("all" or "none"), the Plan's own fields, "no_cudnn_sdp" (turn torch's cuDNN
attention off first), "sync" (synchronize after each step). Run from the repository root. Note that
apply_memory now turns cuDNN attention off itself (memory/attention_kernels.py): set
LEANTUNE_CUDNN_SDP=1 to reproduce the runs recorded in docs/benchmarks.md.
"""
import sys, json
sys.path.insert(0, "tests")
import torch
cfg = json.loads(sys.argv[1])
if cfg.pop("no_cudnn_sdp", False):
    torch.backends.cuda.enable_cudnn_sdp(False)
sync = cfg.pop("sync", False)
import test_memory_gpu as G
from leantune.memory.plan import Plan
base = G._mid_model(); names = G.block_names(base)
streamed = cfg.pop("streamed")
plan = Plan(streamed_blocks=tuple(names) if streamed == "all" else (), **cfg)
model, handle, params, opt, batch = G._setup(plan, base)
losses = []
try:
    for i in range(6):
        losses.append(float(G._step(model, params, opt, batch)))
        if sync:
            torch.cuda.synchronize()
    err = None
except Exception as e:
    err = type(e).__name__ + ": " + str(e).splitlines()[0][:120]
first = next((i for i, l in enumerate(losses) if l != l), None)
print("RESULT", sys.argv[1], "first_nan", first, "losses", [round(l, 4) for l in losses], "error", err, flush=True)
