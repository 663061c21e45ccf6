"""SD3.5 spec and forward call on tiny real SD3Transformer2DModel configs (Large-style: plain joint
blocks; Medium-style: MMDiT-X with a dual-attention layer and qk-norm).

- `predict` is the call StableDiffusion3Pipeline makes (timestep = sigma * 1000, latents unpacked).
- Every LoRA preset wraps exactly the Linear layers it names, in the blocks selected by index.
- The memory engine (streaming x fp8 x checkpointing) with a LoRA trains bit-identically to the
  plain model with the same storage: the spec is all the engine needs.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from diffusers import SD3Transformer2DModel

from leantune.memory.engine import apply_memory, even_spread
from leantune.memory.plan import Plan
from leantune.models.family import PromptEmbeds
from leantune.models.sd3 import SD3_SPEC, predict

LARGE = dict(sample_size=32, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=8,
             num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
             pooled_projection_dim=64, out_channels=16, pos_embed_max_size=96, qk_norm="rms_norm")
MEDIUM = dict(LARGE, dual_attention_layers=(0,))


def _model(cfg: dict, seed: int = 0) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**cfg)
    with torch.no_grad():   # adaLN-zero output layers start at zero: give them values so the test sees them
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return model


def _inputs(b: int, h: int, w: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 16, h, w, generator=g)
    sigma = torch.rand(b, generator=g)
    embeds = PromptEmbeds(t5=torch.randn(b, 7, 32, generator=g), pooled=torch.randn(b, 64, generator=g))
    return x, sigma, embeds


@pytest.mark.parametrize("cfg", [LARGE, MEDIUM], ids=["large", "medium"])
def test_predict_is_the_pipeline_call(cfg):
    model = _model(cfg).eval()
    x, sigma, embeds = _inputs(2, 8, 12, 1)
    with torch.no_grad():
        got = predict(model, x, sigma, embeds, (8, 12))
        want = model(hidden_states=x, encoder_hidden_states=embeds.t5, pooled_projections=embeds.pooled,
                     timestep=sigma * 1000, return_dict=False)[0]
        at_other_sigma = predict(model, x, sigma * 0.5, embeds, (8, 12))
    assert got.shape == x.shape
    assert torch.equal(got, want)
    assert not torch.allclose(got, at_other_sigma)     # the timestep reaches the model


def _linear_names(model, under: str) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(under)}


@pytest.mark.parametrize("cfg", [LARGE, MEDIUM], ids=["large", "medium"])
def test_lora_presets_and_block_selection(cfg):
    model = _model(cfg)
    names = [n for n, _ in model.named_modules()]
    everything = set().union(*(_linear_names(model, f"transformer_blocks.{i}.") for i in range(3)))
    hits = {}
    for preset in ("attention", "attention_mlp", "all"):
        regex = re.compile(SD3_SPEC.lora_target_regex(preset))
        hits[preset] = {n for n in names if regex.fullmatch(n)}
        assert hits[preset] <= everything            # only Linear layers inside joint blocks
    assert hits["attention"] < hits["attention_mlp"] < hits["all"]
    assert hits["all"] == everything                 # "all": every linear of every block
    dual = {n for n in hits["attention"] if ".attn2." in n}
    assert bool(dual) == bool(cfg.get("dual_attention_layers"))   # Medium's second attention is targeted
    assert all(n.startswith("transformer_blocks.0.") for n in dual)
    picked = re.compile(SD3_SPEC.lora_target_regex("attention", {"joint": [0, 2]}))
    chosen = {n for n in names if picked.fullmatch(n)}
    assert chosen and {n.split(".")[1] for n in chosen} == {"0", "2"}


def _lora_model(cfg: dict):
    from peft import LoraConfig, inject_adapter_in_model

    model = _model(cfg)
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                       target_modules=SD3_SPEC.lora_target_regex("attention_mlp")), model)
    return model


def _train(model, steps: int = 2) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    records = []
    for k, (h, w) in enumerate([(8, 8), (8, 12)][:steps]):
        x, sigma, embeds = _inputs(2, h, w, 10 + k)
        pred = predict(model, x, sigma, embeds, (h, w))
        loss = (pred.float() - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        records.append({"loss": loss.detach().clone(),
                        "grads": [p.grad.detach().clone() for p in params]})
        opt.step()
    return records


def test_engine_parity_everything_on():
    """Medium-style, all blocks streamed, fp8 storage, checkpointed blocks: the quick case of the matrix."""
    test_engine_parity(MEDIUM, "all", True, "blocks")


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf", "fp8"])
@pytest.mark.parametrize("streaming", ["none", "all"])
@pytest.mark.parametrize("cfg", [LARGE, MEDIUM], ids=["large", "medium"])
def test_engine_parity(cfg, streaming, fp8, checkpointing):
    base = _lora_model(cfg)
    reference = copy.deepcopy(base)
    ref_handle = apply_memory(reference, SD3_SPEC, Plan(fp8=fp8), "cpu")
    want = _train(reference)
    ref_handle.remove()
    model = copy.deepcopy(base)
    blocks = [n for n, _ in SD3_SPEC.blocks(model)]
    stream = {} if streaming == "none" else {"streamed_blocks": tuple(even_spread(blocks, len(blocks))),
                                             "stream_non_blocks": True, "debug_poison": True}
    handle = apply_memory(model, SD3_SPEC, Plan(fp8=fp8, checkpointing=checkpointing, **stream), "cpu")
    got = _train(model)
    if streaming != "none":
        assert handle.step_report()["bytes_h2d"] > 0
    handle.remove()
    for g, w in zip(got, want):
        assert torch.isfinite(g["loss"])
        assert torch.equal(g["loss"], w["loss"])
        assert all(torch.equal(a, b) for a, b in zip(g["grads"], w["grads"]))
