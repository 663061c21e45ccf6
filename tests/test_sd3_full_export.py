"""Saving a fully fine-tuned SD3.5 transformer: the Stability single file and the diffusers folder,
written group by group from where the weights live (streamed blocks: their host buffers), read back
by leantune's SD3 loader and by diffusers itself (`SD3Transformer2DModel.from_single_file`, at a
non-default width with the config passed, offline; `from_pretrained` for the folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leantune.config import ModelConfig
from leantune.io import load_safetensors
from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.memory.trainable_streaming import TrainableStreamingEngine, WeightAccess
from leantune.models.family import PromptEmbeds, get_family
from leantune.models.sd3 import SD3_SPEC, predict
from leantune.train.full_export import export_files
from leantune.trainer import RunPaths

FAM = get_family("sd3")
# Width 48 (3 heads of 16), 3 blocks: a first, a middle and the context-pre-only last one.
WIDE = dict(sample_size=24, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=16,
            num_attention_heads=3, joint_attention_dim=40, caption_projection_dim=48,
            pooled_projection_dim=24, out_channels=16, pos_embed_max_size=12, qk_norm="rms_norm",
            dual_attention_layers=())
STYLES = {"large": WIDE, "medium": dict(WIDE, dual_attention_layers=(0, 1)),
          "large_no_qk": dict(WIDE, qk_norm=None, attention_head_dim=12, num_attention_heads=4)}


def _model(cfg: dict, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**cfg)
    with torch.no_grad():
        for p in model.parameters():          # adaLN-zero layers start at zero; swapped halves must differ
            p.add_(torch.randn(p.shape) * 0.02)
    return model.eval()


@torch.no_grad()
def _out(model):
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    x = torch.randn(2, 16, 8, 8, generator=g)
    emb = PromptEmbeds(torch.randn(2, 5, cfg.joint_attention_dim, generator=g),
                       torch.randn(2, cfg.pooled_projection_dim, generator=g))
    return predict(model, x, torch.tensor([0.3, 0.7]), emb, (8, 8)).float()


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("style", sorted(STYLES))
def test_stability_file_and_folder_of_a_streamed_model(style, tmp_path):
    from diffusers import SD3Transformer2DModel

    model = _model(STYLES[style])
    want_out, want = _out(model), _state(model)
    # Blocks 0 and 2 stream (their weights live in host buffers), block 1 stays resident.
    model.requires_grad_(True)
    handle = apply_memory(model, SD3_SPEC, Plan(streamed_blocks=("transformer_blocks.0", "transformer_blocks.2")),
                          "cpu", streaming_engine=TrainableStreamingEngine)
    single, folder = export_files(model, SD3_SPEC, WeightAccess(handle), RunPaths(tmp_path, "ft"), step=9,
                                  intermediate=False, formats=["comfyui", "diffusers"], save_dtype="fp32", keep_last=1)
    handle.remove()
    assert single.name == "ft_comfyui.safetensors" and folder.name == "ft_diffusers"

    tensors, meta = load_safetensors(single)
    assert all(k.startswith("model.diffusion_model.") for k in tensors)
    assert "model.diffusion_model.joint_blocks.2.context_block.adaLN_modulation.1.weight" in tensors
    assert ("model.diffusion_model.joint_blocks.1.x_block.attn2.qkv.weight" in tensors) == (style == "medium")
    assert tensors["model.diffusion_model.joint_blocks.1.x_block.attn.qkv.weight"].shape == (3 * 48, 48)
    assert meta["leantune.mode"] == "full" and meta["leantune.step"] == "9"
    assert json.loads(meta["leantune.config"])["attention_head_dim"] == STYLES[style]["attention_head_dim"]

    # leantune's SD3 loader: the same model.
    loaded = FAM.load_transformer(FAM.resolve_sources(ModelConfig(path=str(single), family="sd3"), Path("/")),
                                  dtype=torch.float32)
    _same(_state(loaded), want)
    assert torch.equal(_out(loaded), want_out)

    # diffusers' own single-file loader (its converter), given the config, and its folder loader.
    config_dir = tmp_path / "config"
    model.save_config(str(config_dir))
    theirs = SD3Transformer2DModel.from_single_file(str(single), config=str(config_dir), torch_dtype=torch.float32)
    _same(_state(theirs), want)
    from_folder = SD3Transformer2DModel.from_pretrained(str(folder), torch_dtype=torch.float32)
    _same(_state(from_folder), want)


def test_last_block_adaln_halves_are_swapped_only_there(tmp_path):
    """Group by group, the converter must know the model's depth: only the last block's text adaLN
    (shift, scale) is stored swapped, exactly as a whole-model conversion stores it."""
    from leantune.models.sd3 import keys as sd3_keys

    model = _model(WIDE, seed=3)
    (single,) = export_files(model, SD3_SPEC, WeightAccess(None), RunPaths(tmp_path, "m"), step=0,
                             intermediate=False, formats=["comfyui"], save_dtype="fp32", keep_last=1)
    tensors, _ = load_safetensors(single)
    whole = sd3_keys.diffusers_to_stability(model.state_dict())
    _same({k[len("model.diffusion_model."):]: v for k, v in tensors.items()}, whole)
    d = model.transformer_blocks
    for i in range(2):
        assert torch.equal(tensors[f"model.diffusion_model.joint_blocks.{i}.context_block.adaLN_modulation.1.weight"],
                           d[i].norm1_context.linear.weight)
    last = d[2].norm1_context.linear.weight
    assert torch.equal(tensors["model.diffusion_model.joint_blocks.2.context_block.adaLN_modulation.1.weight"],
                       torch.cat([last[48:], last[:48]]))


def test_full_fine_tune_run_writes_a_stability_file(tmp_path, tiny_sd3_dir):
    """`leantune train` in full mode on SD3 (formats comfyui + diffusers): the Stability single file
    and the diffusers folder hold the same trained weights, and differ from the base."""
    from test_train_sd3 import RUN, make_config

    from leantune.demo import draw_shapes
    from leantune.trainer import train

    images = tmp_path / "images"
    draw_shapes(images, count=4, size=64, seed=5)
    text = RUN.split("[lora]")[0] + """
[train]
mode = "full"
steps = 2
learning_rate = 1e-4
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "f"
formats = ["comfyui", "diffusers"]
"""
    cfg = make_config(tmp_path / "run", tiny_sd3_dir, images, text=text)
    result = train(cfg, progress=False)
    single = result.paths.root / "f_comfyui.safetensors"
    folder = result.paths.root / "f_diffusers"
    tensors, _ = load_safetensors(single)
    assert all(k.startswith("model.diffusion_model.") for k in tensors)

    def load(path):
        return FAM.load_transformer(FAM.resolve_sources(ModelConfig(path=str(path), family="sd3"), Path("/")),
                                    dtype=torch.float32)

    from_file, from_folder = _state(load(single)), _state(load(folder))
    _same(from_file, from_folder)
    base = _state(load(tiny_sd3_dir))
    assert not torch.equal(from_file["transformer_blocks.0.attn.to_q.weight"], base["transformer_blocks.0.attn.to_q.weight"])
