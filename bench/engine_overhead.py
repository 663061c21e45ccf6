"""Micro-benchmark: the memory engine's CPU time per streamed block per LoRA step, against the plain model.

    python bench/engine_overhead.py                    # tiny Flux, every block streamed, 1 thread
    python bench/engine_overhead.py --profile          # and the engine functions that cost the most

Why the tiny model: its compute is negligible, so what a streamed step costs beyond the plain step is
the engine's own bookkeeping (acquire/release, fetch and prefetch decisions, the saved-tensor
hooks, the autograd functions that route a block's inputs and outputs). Both models get the same
LoRA (rank 4 on attention + MLP) and the same batch; one is plain, the other has every block and the
non-block group streamed (checkpointing "none", so the saved-tensor hooks run: the costlier case, and
"blocks" for the checkpointed one). Steps of the two are interleaved (A, B, A, B, ...) and each
step's process CPU time (time.process_time: every thread) is taken; the medians are reported, with
    engine_ms_per_block = (median streamed step - median plain step) / streamed units.
Target (issue 21): <= 0.3 ms per block per step.
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
from leantune.models import tiny  # noqa: E402
from leantune.models.flux import FLUX_SPEC, PromptEmbeds, pack_latents, predict  # noqa: E402
from leantune.train.lora import add_lora  # noqa: E402


def make_model():
    model = tiny.flux_transformer(seed=0)
    model.requires_grad_(False)
    params = add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="attention_mlp"))
    return model, params


def make_batch():
    g = torch.Generator().manual_seed(0)
    h = w = 8
    x = pack_latents(torch.randn(1, 16, h, w, generator=g))
    embeds = PromptEmbeds(torch.randn(1, 8, 32, generator=g), torch.randn(1, 32, generator=g))
    return x, torch.rand(1, generator=g), embeds, (h, w), torch.randn(x.shape, generator=g)


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
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    plain, plain_params = make_model()
    streamed, streamed_params = make_model()
    names = [n for n, _ in FLUX_SPEC.blocks(streamed)]
    plan = Plan(streamed_blocks=tuple(names), stream_non_blocks=True, checkpointing=a.checkpointing, ring_slots=2)
    handle = apply_memory(streamed, FLUX_SPEC, plan, "cpu", offload_min_bytes=0)
    units = len(handle.streaming.units)
    batch = make_batch()
    for _ in range(a.warmup):
        step(plain, plain_params, batch)
        step(streamed, streamed_params, batch)
    t_plain, t_stream = [], []
    for _ in range(a.steps):
        t_plain.append(step(plain, plain_params, batch))
        t_stream.append(step(streamed, streamed_params, batch))
    p, s = statistics.median(t_plain), statistics.median(t_stream)
    per_block = (s - p) / units
    print(f"tiny Flux, {units} streamed units ({len(names)} blocks + the non-block group), checkpointing "
          f"{a.checkpointing}, {a.steps} interleaved steps, load {os.getloadavg()}")
    print(f"plain step {p * 1e3:.2f} ms CPU, streamed step {s * 1e3:.2f} ms CPU: "
          f"engine_ms_per_block={per_block * 1e3:.3f}")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step(streamed, streamed_params, batch)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    handle.remove(device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
