"""Saving a fully fine-tuned model: block by block (host RAM), into files other loaders read."""

from __future__ import annotations

import json

import pytest
import torch
from test_memory_helpers import make_batch
from test_memory_host import HAS_PROC, MiB, SLACK, _Peak

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.memory.trainable_streaming import TrainableStreamingEngine, WeightAccess
from leantune import tiny
from leantune.models.flux import FLUX_SPEC, predict
from leantune.models.flux.loading import FluxSources, load_transformer
from leantune.train.full_export import write_model_file


def _streamed_trainable(model, names):
    model.requires_grad_(True)
    return apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(names)), "cpu",
                        streaming_engine=TrainableStreamingEngine)


def test_bfl_file_of_a_streamed_model_loads_with_the_same_outputs(tmp_path):
    model = tiny.flux_transformer(seed=4)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=2)
    with torch.no_grad():
        want = predict(model, x, sigma, embeds, hw, guidance=1.0)
    handle = _streamed_trainable(model, [n for n, _ in FLUX_SPEC.blocks(model)])
    path = write_model_file(model, FLUX_SPEC, WeightAccess(handle), tmp_path / "m.safetensors", "comfyui",
                            torch.float32, {"leantune.config": json.dumps({"axes_dims_rope": [4, 6, 6]})})
    loaded = load_transformer(FluxSources(path, None, None, None, None, None), dtype=torch.float32)
    with torch.no_grad():
        got = predict(loaded, x, sigma, embeds, hw, guidance=1.0)
    assert torch.equal(got, want)


@pytest.mark.skipif(not HAS_PROC, reason="needs Linux /proc/self/status and a writable clear_refs")
def test_export_streams_block_by_block_without_a_second_copy(tmp_path):
    """A 324 MiB model whose single blocks live in host buffers: writing its BFL file adds about one
    converted block of resident memory (the fused linear1 of a block), not the model again, which
    safetensors' save_file would (it serializes every tensor to bytes first)."""
    model = tiny.wide_flux_transformer()
    singles = [n for n, _ in FLUX_SPEC.blocks(model) if n.startswith("single")]
    handle = _streamed_trainable(model, singles)
    units = handle.streaming.unit_bytes()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    double = sum(p.numel() * p.element_size() for p in model.transformer_blocks[0].parameters())
    # A first write pays the one-time costs (modules imported on first use, allocator arenas), which
    # are not what this test is about; the second is measured.
    write_model_file(model, FLUX_SPEC, WeightAccess(handle), tmp_path / "warm.safetensors", "comfyui", torch.bfloat16)
    with _Peak() as m:
        write_model_file(model, FLUX_SPEC, WeightAccess(handle), tmp_path / "wide.safetensors", "comfyui", torch.bfloat16)
    # the resident double block is concatenated (qkv) once: its size bounds one group's copy
    bound = max(max(units.values()), double) + SLACK
    assert m.peak <= bound, f"peak {m.peak / MiB:.0f} MiB over {bound / MiB:.0f} MiB; model {total / MiB:.0f} MiB"
    assert total > 3 * bound                     # a second copy would be far above the bound
    handle.remove()


@pytest.mark.slow
def test_diffusers_from_single_file_reads_the_export_at_real_width(tmp_path):
    """diffusers' converter hard-codes Flux's width 3072, so this builds a real-width Flux (one
    double, one single block, small text width) and reads our file back with `from_single_file`."""
    from diffusers import FluxTransformer2DModel

    kw = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
              num_attention_heads=24, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=True,
              axes_dims_rope=(16, 56, 56))
    with torch.device("meta"):
        model = FluxTransformer2DModel(**kw)
    # 531 M parameters: allocated in bf16 and drawn in place (2.5 CPU-s), not drawn in fp32, scaled
    # and cast (7 CPU-s, three 2 GiB temporaries). Only their being random matters: every tensor
    # must come back bit for bit under its own name, whatever its values.
    model.to(torch.bfloat16).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.04, 0.04, generator=g)
    model.save_config(str(tmp_path / "config"))
    path = write_model_file(model, FLUX_SPEC, WeightAccess(None), tmp_path / "flux.safetensors", "comfyui",
                            torch.bfloat16)
    loaded = FluxTransformer2DModel.from_single_file(str(path), config=str(tmp_path / "config"),
                                                     torch_dtype=torch.bfloat16)
    want = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
