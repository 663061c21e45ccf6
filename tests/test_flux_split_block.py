"""Flux.1's training blocks (models/flux/block.py): when the plan splits blocks (Plan.split_blocks,
the blocks' split_parts switch), each part of a double and a single block is kept for backward as
its inputs and recomputed in its own backward. The math is diffusers' blocks': outputs and LoRA
gradients equal the plain FluxTransformer2DModel's bit for bit on the tiny model (fp32), alone and
under the engine (every block streamed in poison mode, checkpointed with offloaded inputs); the
loader (meta too) and the planner's copy run the split classes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_memory_helpers import SHAPES, assert_records_equal, block_names, lora_flux, train

from leantune.memory.plan import Plan
from leantune.memory.split_parts import set_split_parts
from leantune.models.flux import FLUX, FLUX_SPEC
from leantune.models.flux.block import FluxSplitSingleTransformerBlock, FluxSplitTransformerBlock, split_blocks


def _split_copy(plain):
    model = copy.deepcopy(plain)
    split_blocks(model)
    return model


def _count_parts(monkeypatch) -> list[str]:
    """Calls of the last part of each block (the forward's, and its recompute in backward)."""
    calls = []
    for cls, name in ((FluxSplitTransformerBlock, "_ff_context_out"), (FluxSplitSingleTransformerBlock, "_output")):
        inner = getattr(cls, name)

        def counted(self, *args, _inner=inner, _name=name):
            calls.append(_name)
            return _inner(self, *args)

        monkeypatch.setattr(cls, name, counted)
    return calls


def test_the_split_blocks_train_as_diffusers_blocks_bit_for_bit(monkeypatch):
    plain = lora_flux(preset="all")
    model = _split_copy(plain)
    assert all(type(b) is FluxSplitTransformerBlock for b in model.transformer_blocks)
    assert all(type(b) is FluxSplitSingleTransformerBlock for b in model.single_transformer_blocks)
    calls = _count_parts(monkeypatch)
    want = train(copy.deepcopy(plain))
    assert not calls
    assert_records_equal(train(copy.deepcopy(model)), want)     # switched off: diffusers' forward
    assert not calls
    n = len(model.transformer_blocks) + len(model.single_transformer_blocks)
    assert set_split_parts(model, True) == n
    got = train(model)
    assert len(calls) == 2 * n * len(SHAPES)          # each block's last part run, then recomputed in backward
    assert_records_equal(got, want)
    assert any(g.abs().sum() > 0 for g in want[0]["grads"].values())
    calls.clear()
    from test_memory_helpers import make_batch
    from leantune.models.flux import predict

    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=0)
    with torch.no_grad():                              # sampling: nothing kept, nothing split
        predict(model, x, sigma, embeds, hw, guidance=1.0)
    assert not calls


def test_streamed_in_poison_mode_and_offloaded_they_train_as_diffusers_blocks(monkeypatch):
    """Every block and the non-block group streamed through slots whose weights are destroyed at
    each release, blocks checkpointed with their inputs offloaded, the plan splitting blocks: the
    parts' recompute (nested in the block's) reads the block's weights while they are fetched, so
    the steps equal the plain model's bit for bit."""
    from leantune.memory.engine import apply_memory

    plain = lora_flux(preset="all")
    want = train(copy.deepcopy(plain))
    model = _split_copy(plain)
    plan = Plan(streamed_blocks=tuple(block_names(model)), stream_non_blocks=True, debug_poison=True,
                checkpointing="offload", ring_slots=2, split_blocks=True)
    handle = apply_memory(model, FLUX_SPEC, plan, "cpu", offload_min_bytes=0)
    calls = _count_parts(monkeypatch)
    try:
        assert all(b.split_parts for b in model.transformer_blocks)
        got = train(model)
        report = handle.step_report()
    finally:
        handle.remove()
    assert not any(b.split_parts for b in model.single_transformer_blocks)      # off again on remove
    assert report["bytes_h2d"] > 0 and report["offload_tensors"] > 0
    assert len(calls) == 2 * len(block_names(model)) * len(SHAPES)
    assert_records_equal(got, want)


def test_the_loader_meta_load_and_the_planners_copy_run_the_split_blocks(tmp_path):
    from leantune import tiny
    from leantune.models.flux import loading
    from leantune.planner.meta import short_copy

    assert FLUX.split_blocks is not None
    path = loading.save_bfl_transformer(tiny.flux_transformer(seed=1), tmp_path / "flux.safetensors")
    sources = loading.FluxSources(path, None, None, None, None, None)
    for device in ("cpu", "meta"):
        model = loading.load_transformer(sources, dtype=torch.float32, device=device)
        assert all(type(b) is FluxSplitTransformerBlock for b in model.transformer_blocks), device
        assert all(type(b) is FluxSplitSingleTransformerBlock for b in model.single_transformer_blocks), device
    probe = short_copy(FLUX_SPEC, tiny.flux_transformer(seed=1), torch.float32)    # a plain diffusers model
    assert all(isinstance(b, (FluxSplitTransformerBlock, FluxSplitSingleTransformerBlock))
               for _, b in FLUX_SPEC.blocks(probe))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only (bench/gpu_checks.sh window 1): the split "
                                                          "blocks' recompute under torch's real CUDA autocast")
def test_the_split_blocks_recompute_under_cuda_autocast_as_diffusers_blocks_train():
    """On CUDA with bf16 autocast (torch's real autocast and its weight cast cache, which the CPU
    tests never meet), the split Flux blocks' recomputed parts give diffusers' blocks' output and LoRA
    gradients bit for bit (or, where the device's kernels do not repeat their bits, no further from
    them than two runs of diffusers' blocks are from each other)."""
    from test_memory_helpers import make_batch

    from leantune.models.flux import predict

    def step(model):
        x, sigma, embeds, hw, target = make_batch(8, 8, seed=1, device="cuda")
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = predict(model, x, sigma, embeds, hw, guidance=1.0)
        ((out.float() - target) ** 2).mean().backward()
        torch.cuda.synchronize()
        return out.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}

    plain = lora_flux(preset="all").cuda()
    split = _split_copy(plain)
    assert set_split_parts(split, True) > 0
    want, again, got = step(plain), step(plain), step(split)

    def gap(a, b) -> float:
        return max([(a[0] - b[0]).abs().max().item()] + [(a[1][n] - b[1][n]).abs().max().item() for n in b[1]])
    assert got[1].keys() == want[1].keys() and any(g.abs().sum() > 0 for g in want[1].values())
    if gap(again, want) == 0:                 # the device repeats itself: the split must too, bitwise
        assert gap(got, want) == 0
    else:                                     # an atomic reduction somewhere: no more apart than two plain runs
        assert gap(got, want) <= 2 * gap(again, want), (gap(got, want), gap(again, want))
