"""Micro-benchmark: the memory engine's CPU time per streamed block per LoRA step, against the plain model.

    python bench/engine_overhead.py                    # tiny Flux, every block streamed, 1 thread
    python bench/engine_overhead.py --profile          # and the engine functions that cost the most
    python bench/engine_overhead.py --width flux --steps 8 --warmup 2    # Flux width, 1 double + 2 single blocks

Why the tiny model: its compute is negligible, so what a streamed step costs beyond the plain step is
the engine's own bookkeeping (acquire/release, fetch and prefetch decisions, the saved-tensor
hooks where they are installed, the autograd functions that route a block's inputs and outputs)
and the copies of its weights into the slots. Both models get the same LoRA (rank 4 on attention +
MLP), the same engine steps that change the arithmetic (`apply_memory` with nothing streamed for
the plain one: bf16 Linears compute through fp32 on CPU in both) and the same batch; the other has
every block and the non-block group streamed (checkpointing "none": the costlier case for the
per-block hooks; "blocks" for the checkpointed one). Steps of the two are interleaved (A, B, A, B,
...) and each step's process CPU time (time.process_time: every thread) is taken; the medians are
reported, and the copies are separated from the bookkeeping by their CPU time (on a CPU
compute device a fetch is a synchronous memcpy on the calling thread; the bench adds up its process
CPU time around each copy):
    copy_ms_per_block   = CPU time of the slot fills per step / streamed units
    engine_ms_per_block = median over the pairs of (streamed step - the plain step before it)
                          / streamed units - copy_ms_per_block
The median of the paired differences is the headline because this machine's speed drifts within a
run (the plain step took 20 ms and 32 ms of CPU in two runs minutes apart): a pair's two steps are
milliseconds apart, so the drift cancels in each difference. The difference of the two medians
(what earlier results in docs/benchmarks.md used) is printed beside it.
At Flux width (3072 wide: 24 heads of 128, T5 width 4096, bf16) the compute is seconds per step, so
the difference is within its noise; the spread of the per-pair differences is printed beside it.
Target (issue 21): <= 0.3 ms per block per step on the tiny model, nothing beyond the copy at Flux width.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from leantune.config import LoraConfig  # noqa: E402
from leantune.memory.engine import apply_memory  # noqa: E402
from leantune.memory.plan import Plan  # noqa: E402
from leantune import tiny  # noqa: E402
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, pack_latents, predict  # noqa: E402
from leantune.train.lora import add_lora  # noqa: E402


FLUX_WIDTH = dict(num_layers=1, num_single_layers=2, attention_head_dim=128, num_attention_heads=24,
                  joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))


def make_model(width: str):
    if width == "flux":
        model = tiny.flux_transformer(seed=0, dtype=torch.bfloat16, **FLUX_WIDTH)
    else:
        model = tiny.flux_transformer(seed=0)
    model.requires_grad_(False)
    params = add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="attention_mlp"))
    return model, params


def make_batch(width: str):
    g = torch.Generator().manual_seed(0)
    h = w = 8
    text, pooled = (4096, 768) if width == "flux" else (32, 32)
    dtype = torch.bfloat16 if width == "flux" else torch.float32
    x = pack_latents(torch.randn(1, 16, h, w, generator=g)).to(dtype)
    embeds = PromptEmbeds(torch.randn(1, 8, text, generator=g).to(dtype), torch.randn(1, pooled, generator=g).to(dtype))
    return x, torch.rand(1, generator=g), embeds, (h, w), torch.randn(x.shape, generator=g)


def _time_copies(copies) -> list[float]:
    """Add up the process CPU time of every slot fill (on a CPU compute device a fetch is a memcpy
    on the calling thread). The engine's own copy timer is wall time, which on a loaded machine
    counts the time the process waited for a core too, so it cannot be subtracted from CPU time."""
    total = [0.0]
    direct = copies.copy_direct

    def timed(*args, **kwargs):
        t0 = time.process_time()
        try:
            return direct(*args, **kwargs)
        finally:
            total[0] += time.process_time() - t0

    copies.copy_direct = timed
    return total


def step(model, params, batch) -> float:
    """One LoRA step's process CPU time (seconds)."""
    x, sigma, embeds, hw, target = batch
    t0 = time.process_time()
    for p in params:
        p.grad = None
    pred = predict(model, x, sigma, embeds, hw, guidance=3.5)
    torch.nn.functional.mse_loss(pred.float(), target).backward()
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--checkpointing", default="none", choices=["none", "blocks"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--width", default="tiny", choices=["tiny", "flux"])
    ap.add_argument("--ring", type=int, default=2, help="ring slots; one more than the units moves nothing "
                    "after the first step, which leaves the bookkeeping alone")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    plain, plain_params = make_model(a.width)
    plain_handle = apply_memory(plain, FLUX_SPEC, Plan(), "cpu")      # same Linears, nothing streamed
    streamed, streamed_params = make_model(a.width)
    names = [n for n, _ in FLUX_SPEC.blocks(streamed)]
    plan = Plan(streamed_blocks=tuple(names), stream_non_blocks=True, checkpointing=a.checkpointing, ring_slots=a.ring)
    handle = apply_memory(streamed, FLUX_SPEC, plan, "cpu", offload_min_bytes=0)
    units = len(handle.streaming.units)
    copy_cpu = _time_copies(handle.streaming.engine.copies)
    batch = make_batch(a.width)
    for _ in range(a.warmup):
        step(plain, plain_params, batch)
        step(streamed, streamed_params, batch)
    copy_cpu[0] = 0.0
    t_plain, t_stream = [], []
    for _ in range(a.steps):
        t_plain.append(step(plain, plain_params, batch))
        t_stream.append(step(streamed, streamed_params, batch))
    copy_s = copy_cpu[0] / a.steps
    p, s = statistics.median(t_plain), statistics.median(t_stream)
    diffs = sorted(b - a_ for a_, b in zip(t_plain, t_stream))
    q1, q3 = diffs[len(diffs) // 4], diffs[(3 * len(diffs)) // 4]
    copy_per_block = copy_s / units
    per_block = (s - p) / units - copy_per_block
    paired = statistics.median(diffs) / units - copy_per_block
    print(f"{a.width} Flux, {units} streamed units ({len(names)} blocks + the non-block group), checkpointing "
          f"{a.checkpointing}, {a.steps} interleaved steps, ring {a.ring}, load {os.getloadavg()}")
    print(f"plain step {p * 1e3:.2f} ms CPU, streamed step {s * 1e3:.2f} ms CPU, copies {copy_s * 1e3:.2f} ms per step; "
          f"streamed - plain per pair: quartiles {q1 * 1e3:.2f} .. {q3 * 1e3:.2f} ms")
    print(f"copy_ms_per_block={copy_per_block * 1e3:.3f} engine_ms_per_block={paired * 1e3:.3f} "
          f"(difference of the medians: {per_block * 1e3:.3f})")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step(streamed, streamed_params, batch)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    handle.remove(device="cpu")
    plain_handle.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
