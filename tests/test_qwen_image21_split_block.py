"""Qwen-Image-2.1's training block (models/qwen_image21/block.py): when the plan splits blocks
(Plan.split_blocks, the blocks' split_parts switch), its attention and MLP branches are kept for backward as their inputs and recomputed in
their own backward. The math is diffusers' block's: outputs and LoRA gradients equal the plain
block's bit for bit on the tiny model (fp32), alone and under the engine (every block streamed in
poison mode, checkpointed with offloaded inputs); the loader and the planner's meta copy both run
it, and the planner prices what it keeps."""

from __future__ import annotations

import copy

import pytest
import torch

from leantune.config import LoraConfig
from leantune.memory.plan import Plan
from leantune.memory.split_parts import set_split_parts
from leantune.models import qwen_image21 as fam
from leantune.models.family import PromptEmbeds
from leantune.models.qwen_image21 import latents as lat
from leantune.models.qwen_image21.block import QwenImage21SplitBlock, split_blocks
from leantune.models.qwen_image21.spec import QWEN_IMAGE21_SPEC as SPEC
from leantune.tiny import qwen_image21 as tq
from leantune.train.lora import add_lora

REFS_HW = [(4, 4), (2, 6)]          # two references' latent sizes (sides even: one slot per 2x2)
TARGET_HW = (4, 4)


def _lora_model():
    model = tq.qwen_image21_transformer(0)
    add_lora(model, SPEC, LoraConfig(rank=4, alpha=8, targets="all"))
    for p in model.parameters():             # a trained adapter (peft starts lora_B at zero)
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    return model


def _embeds(refs_hw, width: int) -> PromptEmbeds:
    """Two prompts as encode_prompts writes them: per reference two tag rows and its slots as zero
    rows, then the caption; the second prompt's caption two rows shorter (right padding)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for caption in (5, 3):
        parts = []
        for h, w in refs_hw:
            parts += [torch.randn(2, width, generator=g), torch.zeros(lat.slots(h, w), width)]
        parts += [torch.randn(caption, width, generator=g), torch.zeros(5 - caption, width)]
        rows.append(torch.cat(parts))
    seq = torch.stack(rows)
    return PromptEmbeds(t5=seq, pooled=seq.new_zeros(2, 0))


def _step(model, refs_hw=REFS_HW):
    """One forward and backward of the family's transformer call: (output, LoRA gradients by name)."""
    g = torch.Generator().manual_seed(2)
    embeds = _embeds(refs_hw, model.config.context_in_dim)
    refs = [torch.randn(2, 64, h, w, generator=g) for h, w in refs_hw]
    noisy = torch.randn(2, TARGET_HW[0] * TARGET_HW[1], 64, generator=g)
    sigma = torch.tensor([0.3, 0.8])
    target = torch.randn(noisy.shape, generator=g)
    model.zero_grad(set_to_none=True)
    out = fam.predict(model, noisy, sigma, embeds, TARGET_HW, references=refs or None)
    ((out - target) ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


def _count_branches(monkeypatch):
    """Calls of the MLP's second part (each block's forward, and its recompute in backward)."""
    calls = []
    inner = QwenImage21SplitBlock._mlp_out

    def counted(self, *args):
        calls.append(1)
        return inner(self, *args)

    monkeypatch.setattr(QwenImage21SplitBlock, "_mlp_out", counted)
    return calls


def _assert_same(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and len(want[1]) > 0
    for name, g in want[1].items():
        assert torch.equal(got[1][name], g), name
    assert any(g.abs().sum() > 0 for g in want[1].values())


def test_the_split_block_trains_as_diffusers_block_bit_for_bit(monkeypatch):
    plain = _lora_model()
    split = copy.deepcopy(plain)
    split_blocks(split)
    assert all(type(b) is QwenImage21SplitBlock for b in split.transformer_blocks)
    calls = _count_branches(monkeypatch)
    want = _step(plain)
    assert not calls                                    # diffusers' own block: no branch of ours ran
    assert _step(split)[0].equal(want[0]) and not calls     # switched off: the reference forward
    assert set_split_parts(split, True) == len(split.transformer_blocks)
    got = _step(split)
    n = len(split.transformer_blocks)
    assert len(calls) == 2 * n                          # each branch run, then recomputed in backward
    _assert_same(got, want)
    # text to image splits too in a split plan (the planner prices it so), with the same bits
    calls.clear()
    _assert_same(_step(split, refs_hw=[]), _step(plain, refs_hw=[]))
    assert len(calls) == 2 * n
    calls.clear()
    with torch.no_grad():                               # sampling: nothing to keep, nothing recomputed
        fam.predict(split, torch.zeros(2, 16, 64), torch.tensor([0.5, 0.5]),
                    _embeds(REFS_HW, split.config.context_in_dim), TARGET_HW,
                    references=[torch.zeros(2, 64, h, w) for h, w in REFS_HW])
    assert not calls


def test_streamed_in_poison_mode_and_offloaded_it_trains_as_diffusers_block(monkeypatch):
    """Every block and the non-block group streamed through two slots whose weights are destroyed
    at each release, blocks checkpointed with their inputs offloaded: the branches' recompute in
    the block's backward (nested in the block's own recompute) reads the block's weights while
    they are fetched, so the step equals the plain diffusers model's bit for bit."""
    from leantune.memory.engine import apply_memory

    plain = _lora_model()
    model = copy.deepcopy(plain)
    split_blocks(model)
    want = _step(plain)
    blocks = tuple(n for n, _ in SPEC.blocks(model))
    plan = Plan(streamed_blocks=blocks, stream_non_blocks=True, debug_poison=True, checkpointing="offload",
                ring_slots=2, split_blocks=True)
    handle = apply_memory(model, SPEC, plan, "cpu", offload_min_bytes=0)
    calls = _count_branches(monkeypatch)
    try:
        got = _step(model)
        report = handle.step_report()
    finally:
        handle.remove()
    assert report["bytes_h2d"] > 0 and report["offload_tensors"] > 0
    # the forward, then the branch's own recompute: the block's recompute (nested checkpoints) stops
    # once it has the branches' inputs again (torch's non-reentrant early stop), before running it
    assert len(calls) == 2 * len(blocks)
    _assert_same(got, want)


def test_the_loader_and_the_planners_copy_run_the_split_block(tmp_path):
    from leantune.models.qwen_image21 import loading
    from leantune.models.qwen_image21.meta_model import QwenImage21Transformer2DModel as Meta
    from test_qwen_image21 import _sources

    folder = tmp_path / "model"
    tq.qwen_image21_transformer(0).save_pretrained(folder / "transformer")
    sources = _sources(folder)
    real = loading.load_transformer(sources, torch.float32)
    meta = loading.load_transformer(sources, torch.float32, device="meta")
    assert all(type(b) is QwenImage21SplitBlock for b in real.transformer_blocks)
    assert all(isinstance(b, QwenImage21SplitBlock) for b in meta.transformer_blocks)
    assert type(meta) is Meta


@pytest.mark.parametrize("autocast", [False, True])
def test_the_probe_prices_what_the_split_block_keeps(autocast):
    """The planner's probe (on meta, the meta copy's split blocks) with references: a block keeps
    its branches' inputs only, the attention branch's and the MLP's halves (the residual stream
    after attention, the gate and up projections, mlp_ratio wide each) and its output, so what it
    adds to the live set is (2 + 2 mlp_ratio) block outputs; the plain block keeps several times
    that. Under autocast the recompute casts as the forward did (else checkpoint refuses it)."""
    from leantune.models.qwen_image21.meta_model import QwenImage21Transformer2DModel as Meta
    from leantune.planner.activation_probe import probe_activations
    from leantune.planner.workload import Workload

    with torch.device("meta"):
        model = Meta.from_config(dict(tq.QWEN_IMAGE21_TINY))
    w = Workload(mode="lora", rank=4, targets="all", buckets=((64, 64),), text_length=7, references=1,
                 autocast=autocast, dtype=torch.bfloat16 if autocast else torch.float32)
    split = probe_activations(SPEC, model, w, (64, 64), split=True).kinds["single"]
    ratio = model.config.mlp_ratio
    assert split.saved == (2 + 2 * ratio) * split.out
    plain = probe_activations(SPEC, model, w, (64, 64)).kinds["single"]
    assert plain.out == split.out and plain.saved > 2 * split.saved
    assert split.bwd_transient > plain.bwd_transient            # the branches' recompute, in backward
    assert split.bwd_flops > plain.bwd_flops


@pytest.mark.parametrize("checkpointing", ["blocks", "offload"])
@pytest.mark.parametrize("split", [False, True])
def test_the_planners_activation_peak_is_what_a_real_step_holds(checkpointing, split):
    """Like with like: the planner's activation peak for a step with one reference at the
    pipeline's size (probe_inputs' layout: its tags and 32 x 32 slots before the caption, 64 x 64
    latent tokens before the target's), its blocks split or not (Plan.split_blocks, which the engine
    applies), and the live bytes a real fp32 step of the tiny model holds at its peak under the
    engine's checkpointing, counted by the probe's own allocator simulation on real CPU tensors,
    agree within 5 %; the split step holds less, in both."""
    from leantune.memory.engine import apply_memory
    from leantune.models.qwen_image21.meta_model import QwenImage21Transformer2DModel as Meta
    from leantune.planner.activation_probe import _Tracker
    from leantune.planner.machine import assumed_machine
    from leantune.planner.search import Planner
    from leantune.planner.workload import Workload

    text, side = 7, 1024 // lat.VAE_SCALE_FACTOR
    with torch.device("meta"):
        meta = Meta.from_config(dict(tq.QWEN_IMAGE21_TINY))
    w = Workload(mode="lora", rank=4, targets="all", buckets=((64, 64),), text_length=text, references=1,
                 autocast=False, dtype=torch.float32)
    planner = Planner(SPEC, meta, w, assumed_machine())
    predicted = planner.activation_peak((64, 64), False, checkpointing, split=split)
    other = planner.activation_peak((64, 64), False, checkpointing, split=not split)

    model = _lora_model()
    fam.QWEN_IMAGE21.split_blocks(model)             # as the loader gives it (the family's seam)
    g = torch.Generator().manual_seed(0)
    width = model.config.context_in_dim
    seq = torch.cat([torch.randn(fam.REFERENCE_TAG_ROWS, width, generator=g), torch.zeros(lat.slots(side, side), width),
                     torch.randn(text, width, generator=g)])[None]
    embeds = PromptEmbeds(t5=seq, pooled=seq.new_zeros(1, 0))
    refs = [torch.randn(1, 64, side, side, generator=g)]
    noisy, target = torch.randn(1, 16, 64, generator=g), torch.randn(1, 16, 64, generator=g)
    handle = apply_memory(model, SPEC, Plan(checkpointing=checkpointing, split_blocks=split), "cpu")
    tracker = _Tracker()
    try:
        assert all(b.split_parts is split for b in model.transformer_blocks)
        with tracker:
            tracker.open("step")
            out = fam.predict(model, noisy, torch.tensor([0.4]), embeds, (4, 4), references=refs)
            loss = ((out.float() - target) ** 2).mean()
            loss.backward()
            del out, loss
            tracker.close()
        # the offloader's host slabs (host RAM, priced on the host side) are CPU tensors here too
        slabs = handle.checkpointing.offloader.host_bytes() if handle.checkpointing.offloader else 0
    finally:
        handle.remove()
    window = tracker.windows["step"]
    held = max(p[0] for p in window["points"]) - window["start"][0] - slabs
    assert 0.95 <= predicted / held <= 1.05, (predicted, held)
    assert (predicted < other) is split              # splitting keeps less (the tiny model: 15 vs 21 MB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only (bench/gpu_checks.sh window 1): the split "
                                                          "block's recompute under torch's real CUDA autocast")
def test_the_split_block_recomputes_under_cuda_autocast_as_diffusers_block_trains():
    """On CUDA with bf16 autocast (torch's real autocast and its weight cast cache, which the CPU
    probe only fakes), the split block's recomputed branches give diffusers' block's output and LoRA
    gradients bit for bit (or, where the device's own kernels do not repeat their bits, no further
    from it than two runs of diffusers' block are from each other)."""
    def step(model):
        g = torch.Generator().manual_seed(2)
        embeds = _embeds(REFS_HW, model.config.context_in_dim)
        embeds = PromptEmbeds(t5=embeds.t5.cuda(), pooled=embeds.pooled.cuda())
        refs = [torch.randn(2, 64, h, w, generator=g).cuda() for h, w in REFS_HW]
        noisy = torch.randn(2, TARGET_HW[0] * TARGET_HW[1], 64, generator=g).cuda()
        target = torch.randn(noisy.shape, generator=g).cuda()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fam.predict(model, noisy, torch.tensor([0.3, 0.8]).cuda(), embeds, TARGET_HW, references=refs)
        ((out.float() - target) ** 2).mean().backward()
        torch.cuda.synchronize()
        return out.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.requires_grad}

    plain = _lora_model().cuda()
    split = copy.deepcopy(plain)
    split_blocks(split)
    want, again, got = step(plain), step(plain), step(split)

    def gap(a, b) -> float:
        return max([(a[0] - b[0]).abs().max().item()] + [(a[1][n] - b[1][n]).abs().max().item() for n in b[1]])
    if gap(again, want) == 0:                 # the device repeats itself: the split must too, bitwise
        _assert_same(got, want)
    else:                                     # an atomic reduction somewhere: no more apart than two plain runs
        assert gap(got, want) <= 2 * gap(again, want), (gap(got, want), gap(again, want))
