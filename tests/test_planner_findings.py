"""Planner findings of the family conformance suite (tests/families/test_conformance.py, promise 10),
each pinned by a focused check of its cause (the conformance test shows the whole prediction):

- a block mix with no plain block of a kind outside the trailing, special ones (a tiny or pruned
  SD3.5 Medium: a dual-attention block, then the last, context-pre-only one) is traced and priced;
- Qwen-Image's rotary tables (plain tensor attributes, no buffers) are device bytes of every plan;
- the simulated edit step feeds the reference latents the planner prices (training_references).
"""

from __future__ import annotations

import pytest
import torch

from leantune import tiny
from leantune.tiny import qwen_image as tq
from leantune.memory.plan import Plan
from leantune.planner.machine import assumed_machine
from leantune.planner.meta import build_meta_packaged, meta_from_config, short_copy
from leantune.planner.search import Planner
from leantune.planner.weight_bytes import device_tables, measure_weights
from leantune.planner.workload import Workload


def _meta_sd3_medium(**overrides):
    from diffusers import SD3Transformer2DModel

    return meta_from_config(SD3Transformer2DModel, {**tiny.SD3_TINY_MEDIUM, **overrides})


@pytest.mark.parametrize("layers,dual", [(2, (0,)), (3, (0, 1)), (1, (0,))])
def test_the_probe_copy_traces_every_kind_the_stack_is_priced_as(layers, dual):
    """The trailing (context-pre-only) block is priced as a plain joint block; when no plain joint
    block comes before it, the probe copy still holds plain ones to trace, after the dual ones."""
    from leantune.models.sd3.spec import SD3_SPEC

    model = _meta_sd3_medium(num_layers=layers, dual_attention_layers=dual)
    kinds = set(SD3_SPEC.block_kinds(model))
    copy = short_copy(SD3_SPEC, model, torch.bfloat16)
    copied = SD3_SPEC.block_kinds(copy)
    assert kinds <= set(copied), (kinds, copied)
    # The special trailing block is cut off; the ones traced are built like the body's.
    assert not any(b.context_pre_only for b in copy.transformer_blocks)
    # A kind only the trailing block had gets two plain blocks after the others: its last traced
    # block takes its input from one of its own kind, as most of that kind's blocks do.
    if "joint" in kinds and "joint" not in SD3_SPEC.block_kinds(model)[:-1]:
        assert copied[-2:] == ["joint", "joint"], copied


def test_a_medium_with_only_dual_blocks_before_the_last_is_priced():
    from leantune.models.sd3.spec import SD3_SPEC

    model = _meta_sd3_medium(num_layers=2, dual_attention_layers=(0,))
    assert SD3_SPEC.block_kinds(model) == ["joint_dual", "joint"]
    workload = Workload(rank=4, targets="all", buckets=((64, 64),), text_length=16)
    planner = Planner(SD3_SPEC, model, workload, assumed_machine(8 * 2**30))
    plan = Plan(streamed_blocks=tuple(n for n, _ in SD3_SPEC.blocks(model)), checkpointing="blocks", ring_slots=2)
    est = planner.estimate(plan)
    assert all(b["activations"] > 0 for b in est.per_bucket.values()), est.per_bucket
    assert est.peak_vram == sum(est.vram.values())


def test_qwen_image_rotary_tables_are_device_bytes_of_every_plan():
    """QwenEmbedRope keeps pos_freqs / neg_freqs (4096 x 64 complex64 each) as plain attributes,
    and its forward copies them to the device and keeps the copy: 4 MiB on the real model."""
    from leantune.models.qwen_image.spec import QWEN_IMAGE_SPEC

    model = build_meta_packaged("qwen-image", "qwen_image")
    assert not any("freqs" in n for n, _ in model.named_buffers())      # why the buffers missed them
    assert device_tables(model) == 2 * 4096 * 64 * 8
    workload = Workload(rank=4, targets="all", buckets=((512, 512),), text_length=64)
    assert measure_weights(QWEN_IMAGE_SPEC, model, workload).device_tables == 2 * 4096 * 64 * 8
    planner = Planner(QWEN_IMAGE_SPEC, model, workload, assumed_machine(24 * 2**30))
    for plan in (Plan(), Plan(streamed_blocks=tuple(n for n, _ in QWEN_IMAGE_SPEC.blocks(model)),
                              stream_non_blocks=True, ring_slots=2)):
        est = planner.estimate(plan)
        assert est.vram["device tables"] == 2 * 4096 * 64 * 8, dict(est.vram)
        assert est.peak_vram == sum(est.vram.values())
    # A family without such tensors lists no such term.
    from leantune.models.flux.spec import FLUX_SPEC
    flux = build_meta_packaged("flux", "flux1_dev")
    assert device_tables(flux) == 0
    assert "device tables" not in Planner(FLUX_SPEC, flux, workload, assumed_machine(24 * 2**30)).estimate(Plan()).vram


def test_the_measured_device_tables_survive_the_profile_cache():
    from leantune.models.qwen_image.spec import QWEN_IMAGE_SPEC
    from leantune.planner.spec_cache import MeasuredModel

    from diffusers import QwenImageTransformer2DModel

    model = meta_from_config(QwenImageTransformer2DModel, tq.QWEN_IMAGE_TINY)
    weights = measure_weights(QWEN_IMAGE_SPEC, model, Workload(rank=4))
    assert weights.device_tables == device_tables(model) > 0
    back = MeasuredModel.from_dict(MeasuredModel(weights, "k", {}).to_dict())
    assert back.weights == weights


def test_the_simulated_edit_step_feeds_the_references_the_planner_prices():
    from diffusers import QwenImageTransformer2DModel

    from leantune.models.family import get_family
    from leantune.simulated_run import probed_references, training_references

    model = meta_from_config(QwenImageTransformer2DModel, tq.QWEN_IMAGE_TINY)
    edit, plain = get_family("qwen-image-edit"), get_family("qwen-image")
    assert probed_references(edit, model.config, (64, 96)) == 1
    refs = training_references(edit, model.config, (64, 96), 2, torch.bfloat16)
    assert [tuple(r.shape) for r in refs] == [(2, edit.latent_channels, 8, 12)]      # the target's size
    assert training_references(plain, model.config, (64, 96), 2, torch.bfloat16) is None
    assert training_references(edit, model.config, (64, 96), 2, torch.bfloat16, count=0) is None
    with pytest.raises(ValueError, match="takes no reference images"):
        training_references(plain, model.config, (64, 96), 1, torch.bfloat16, count=1)
    with pytest.raises(ValueError, match="at most"):
        training_references(edit, model.config, (64, 96), 1, torch.bfloat16, count=edit.references.most + 1)
