"""Wan's training block (models/wan/block.py): split, its four parts are kept for backward as their
inputs and recomputed in their own backward; for TI2V-5B's per-token timesteps it takes one
modulation row per latent frame (or one for all tokens). The math is diffusers' block's: outputs
and LoRA gradients equal the plain diffusers model's bit for bit on the tiny models (fp32), alone
and under the engine (every block streamed in poison mode, checkpointed with offloaded inputs);
the loader and the planner's copy run it, and the probe prices what it keeps."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from leantune.config import LoraConfig
from leantune.memory.plan import Plan
from leantune.memory.split_parts import set_split_parts
from leantune.models import wan as wan_family
from leantune.models.family import PromptEmbeds
from leantune.models.wan import ti2v
from leantune.models.wan.block import WanSplitBlock, split_blocks
from leantune.models.wan.spec import WAN_SPEC as SPEC
from leantune.tiny.wan import WAN_TINY, wan_ti2v_transformer, wan_transformer
from leantune.train.lora import add_lora

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread

FRAMES, H, W = 3, 4, 6          # latent frames and sides: 3 frames of 2 x 3 tokens


def _lora_model(build):
    model = build(0)
    add_lora(model, SPEC, LoraConfig(rank=4, alpha=8, targets="all"))
    for p in model.parameters():             # a trained adapter (peft starts lora_B at zero)
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    return model


def _step(model, ti2v_model: bool, first_frame: bool = False):
    """One forward and backward of the family's transformer call: (output, LoRA gradients by name)."""
    g = torch.Generator().manual_seed(2)
    channels = model.config.in_channels
    noisy = torch.randn(2, channels, FRAMES, H, W, generator=g)
    text = torch.randn(2, 7, model.config.text_dim, generator=g)
    embeds = PromptEmbeds(t5=text, pooled=text.new_zeros(2, 0))
    sigma = torch.tensor([0.3, 0.8])
    target = torch.randn(noisy.shape, generator=g)
    refs = [torch.randn(1, channels, 1, H, W, generator=g)] if first_frame else None
    model.zero_grad(set_to_none=True)
    fam = ti2v if ti2v_model else wan_family
    out = fam.predict(model, noisy, sigma, embeds, (H, W), references=refs)
    ((out - target) ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


def _assert_same(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and len(want[1]) > 0
    for name, g in want[1].items():
        assert torch.equal(got[1][name], g), name
    assert any(g.abs().sum() > 0 for g in want[1].values())


def _count(monkeypatch):
    """Calls of the FFN's second half (each split block's forward, and its recompute in backward)
    and the rows of the modulation each block was given."""
    calls, rows = [], []
    inner, forward = WanSplitBlock._ffn_out, WanSplitBlock.forward

    def counted(self, *args):
        calls.append(1)
        return inner(self, *args)

    def seen(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        rows.append(temb.shape[1] if temb.ndim == 4 else None)
        return forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb)

    monkeypatch.setattr(WanSplitBlock, "_ffn_out", counted)
    monkeypatch.setattr(WanSplitBlock, "forward", seen)
    return calls, rows


def test_the_split_block_trains_as_diffusers_block_bit_for_bit(monkeypatch):
    plain = _lora_model(wan_transformer)
    split = copy.deepcopy(plain)
    split_blocks(split)
    assert all(type(b) is WanSplitBlock for b in split.blocks)
    calls, _ = _count(monkeypatch)
    want = _step(plain, False)
    assert not calls
    _assert_same(_step(split, False), want)            # split_parts off: diffusers' forward
    assert not calls
    set_split_parts(split, True)
    _assert_same(_step(split, False), want)
    assert len(calls) == 2 * len(split.blocks)           # each part run, then recomputed in backward
    calls.clear()
    with torch.no_grad():                                # sampling: nothing kept, nothing recomputed
        _step_no_grad = split(hidden_states=torch.zeros(1, 16, 1, H, W), timestep=torch.tensor([500.0]),
                              encoder_hidden_states=torch.zeros(1, 7, WAN_TINY["text_dim"]), return_dict=False)
    assert not calls and _step_no_grad[0].shape == (1, 16, 1, H, W)


@pytest.mark.parametrize("first_frame", [False, True], ids=["t2v", "i2v"])
@pytest.mark.parametrize("split_on", [False, True], ids=["whole", "split"])
def test_ti2v_modulates_per_frame_as_diffusers_per_token_bit_for_bit(first_frame, split_on, monkeypatch):
    """TI2V-5B's per-token timesteps as predict builds them: text-to-video (every token at t: one
    modulation row for all tokens, the output norm's too) and image-to-video (the first latent
    frame's tokens at 0: a row per frame). The blocks get those rows, never a row per token, and
    the step equals the plain diffusers model's, which modulates every token with its own row."""
    plain = _lora_model(wan_ti2v_transformer)
    model = copy.deepcopy(plain)
    split_blocks(model)
    set_split_parts(model, split_on)
    want = _step(plain, True, first_frame)
    calls, rows = _count(monkeypatch)
    _assert_same(_step(model, True, first_frame), want)
    assert rows and set(rows) == {FRAMES if first_frame else 1}
    assert len(calls) == (2 if split_on else 1) * len(model.blocks)


def test_timesteps_that_differ_within_a_frame_keep_the_per_token_modulation(monkeypatch, caplog):
    """A timestep per token that is not constant per latent frame: the rows differ, so the blocks
    take diffusers' per-token projection (and say so); a trained scale_shift_table (a full
    fine-tune) keeps it too. Both equal the plain model."""
    plain = wan_ti2v_transformer(0).requires_grad_(False)
    model = copy.deepcopy(plain)
    split_blocks(model)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, plain.config.in_channels, FRAMES, H, W, generator=g)
    text = torch.randn(1, 7, plain.config.text_dim, generator=g)
    t = torch.rand(1, FRAMES * (H // 2) * (W // 2), generator=g) * 1000
    _, rows = _count(monkeypatch)

    def run(m):
        return m(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]

    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert torch.equal(run(model), run(plain))
    assert set(rows) == {t.shape[1]} and "differ within a latent frame" in caplog.text
    rows.clear()
    for m in (plain, model):
        m.blocks[0].scale_shift_table.requires_grad_(True)
    t = t[:, :1].expand(-1, t.shape[1])
    out, ref = run(model), run(plain)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(out, ref) and set(rows) == {t.shape[1]}
    assert torch.equal(model.blocks[0].scale_shift_table.grad, plain.blocks[0].scale_shift_table.grad)


@pytest.mark.parametrize("build", [wan_transformer, wan_ti2v_transformer], ids=["a14b", "ti2v"])
def test_streamed_in_poison_mode_and_offloaded_it_trains_as_diffusers_block(build, monkeypatch):
    """Every block and the non-block group streamed through two slots whose weights are destroyed
    at each release, blocks checkpointed with their inputs offloaded, the plan's split blocks on:
    the parts' recompute in the block's backward (nested in the block's own recompute) reads the
    block's weights while they are fetched, so the step equals the plain diffusers model's."""
    from leantune.memory.engine import apply_memory

    ti2v_model = build is wan_ti2v_transformer
    plain = _lora_model(build)
    model = copy.deepcopy(plain)
    split_blocks(model)
    want = _step(plain, ti2v_model, first_frame=ti2v_model)
    blocks = tuple(n for n, _ in SPEC.blocks(model))
    plan = Plan(streamed_blocks=blocks, stream_non_blocks=True, debug_poison=True, checkpointing="offload",
                ring_slots=2, split_blocks=True)
    handle = apply_memory(model, SPEC, plan, "cpu", offload_min_bytes=0)
    calls, _ = _count(monkeypatch)
    try:
        got = _step(model, ti2v_model, first_frame=ti2v_model)
        report = handle.step_report()
    finally:
        handle.remove()
    assert report["bytes_h2d"] > 0 and report["offload_tensors"] > 0
    assert len(calls) == 2 * len(blocks)
    _assert_same(got, want)


def test_the_loader_and_the_planners_copy_run_the_split_block(tmp_path):
    from leantune.config import ModelConfig
    from leantune.models.wan import loading
    from leantune.planner.meta import build_meta_packaged, short_copy

    wan_ti2v_transformer(0).save_pretrained(tmp_path / "transformer")
    sources = ti2v.TI2V.resolve_sources(ModelConfig(path=str(tmp_path), family="wan2.2-ti2v"), tmp_path)
    for device in ("cpu", "meta"):
        model = loading.load_transformer(sources, torch.float32, device=device, ti2v=True)
        assert all(type(b) is WanSplitBlock for b in model.blocks), device
    copy_ = short_copy(SPEC, build_meta_packaged("wan2.2", "wan22_a14b"), torch.bfloat16)
    assert len(copy_.blocks) == 2 and all(type(b) is WanSplitBlock for b in copy_.blocks)


def test_the_probe_prices_what_the_split_block_and_the_frame_rows_keep(monkeypatch):
    """The planner's probe (on meta) of a full-width TI2V-5B stack at 20 latent frames of 352 x 640:
    split, a block keeps its parts' inputs (the residual stream twice, the FFN's projection) and its
    output; the plain block keeps several times that, and diffusers' per-token modulation (the
    time projection plus scale_shift_table, (B, L, 6, D) float32, kept by the gates) more again."""
    from leantune.planner.activation_probe import probe_activations
    from leantune.planner.meta import build_meta_packaged
    from leantune.planner.workload import Workload

    model = build_meta_packaged("wan2.2-ti2v", "wan22_ti2v_5b")
    w = Workload(mode="lora", rank=4, targets="attention_mlp", buckets=((352, 640),), text_length=64, frames=20,
                 autocast=True, dtype=torch.bfloat16)
    split = probe_activations(ti2v.SPEC, model, w, (352, 640), split=True).kinds["main"]
    whole = probe_activations(ti2v.SPEC, model, w, (352, 640)).kinds["main"]
    ffn = model.config.ffn_dim / (model.config.num_attention_heads * model.config.attention_head_dim)
    assert split.out == whole.out
    assert split.saved <= (3 + ffn + 0.5) * split.out and whole.saved > 4 * split.saved
    assert split.bwd_transient > whole.bwd_transient and split.bwd_flops > whole.bwd_flops
    tokens = 20 * (352 // 32) * (640 // 32)
    per_token_modulation = tokens * 6 * model.config.num_attention_heads * model.config.attention_head_dim * 4
    from leantune.models.wan import block

    monkeypatch.setattr(block, "compact_modulation", lambda m: None)        # diffusers' per-token layout
    per_token = probe_activations(ti2v.SPEC, model, w, (352, 640)).kinds["main"]
    assert per_token.saved - whole.saved >= per_token_modulation


def test_the_probe_runs_torchs_rmsnorm_in_fp32_under_autocast_as_cuda_does():
    """Wan's q/k norms are torch.nn.RMSNorm (F.rms_norm), which CUDA's autocast runs in float32
    (torch's own autocast test lists, and the simulated GPU's): the probe's emulation casts it so,
    or it underprices each attention's norms by half (a 480 x 832 x 81 A14B block: 1.2 GiB)."""
    from leantune.planner.activation_probe import _GpuSemantics

    norm = torch.nn.RMSNorm(64, elementwise_affine=True, device="meta", dtype=torch.bfloat16)
    x = torch.empty(1, 8, 64, device="meta", dtype=torch.bfloat16)
    with _GpuSemantics(True):
        assert norm(x).dtype == torch.float32
    with _GpuSemantics(False):
        assert norm(x).dtype == torch.bfloat16
