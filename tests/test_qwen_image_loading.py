"""Loading Qwen-Image: the diffusers folder, the official shards, ComfyUI's repackaged bf16 and fp8
single files (fp8 kept fp8), architecture read from shapes (the full-size one too), and clear errors
for another family's file and for a Qwen-Image file given to another family."""

# Checks moved to the conformance suite (issue 33):
# - test_comfy_single_file_loads_to_the_folder_model[model.diffusion_model.] and [] (removed): moved to
#   tests/families/test_conformance.py::test_loads_each_single_file_layout_it_claims[qwen-image] (the spec's
#   ComfyUI layout, the names and rotary-split metadata save_comfy_transformer writes, under both prefixes:
#   weights, whole config, outputs bit for bit, and guess_family of the file)
# - test_folder_loads_every_component, trimmed to the Qwen-Image specifics (description, VAE config,
#   the encoding's rows): the transformer's weights, guess_family of the folder and the meta build moved to
#   tests/families/test_conformance.py::test_builds_from_its_tiny_preset[qwen-image]

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leantune.config import ModelConfig
from leantune.io import load_safetensors, save_safetensors
from leantune import tiny
from leantune.tiny import qwen_image as tq
from leantune.models.component_files import packaged_config
from leantune.models.family import get_family
from leantune.models.qwen_image.loading import config_from_shapes, fp8_block_weights, resolve_sources, save_comfy_transformer
from leantune.models.weights import LoadError

FAM = get_family("qwen-image")


def _sources(path):
    return resolve_sources(ModelConfig(path=str(path), family="qwen-image"), Path("/"))


@torch.no_grad()
def _out(model, dtype=torch.float32):
    from leantune.models.family import PromptEmbeds

    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 12, 64, generator=g).to(dtype)
    e = PromptEmbeds(t5=torch.randn(1, 5, 32, generator=g).to(dtype), pooled=torch.zeros(1, 0))
    return FAM.predict(model, x, torch.tensor([0.4]), e, (8, 6)).float()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tq.save_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "qwen-tiny", seed=2)


def test_folder_loads_every_component(folder):
    # (The transformer's weights, guess_family and the meta build: tests/families, see the top of this file.)
    src = _sources(folder)
    tr = FAM.load_transformer(src, dtype=torch.float32)
    assert FAM.describe(tr) == "Qwen-Image (2 blocks, width 32)"
    vae = FAM.load_vae(src, torch.float32, "cpu")
    assert vae.config.scaling_factor == 1.0 and vae.config.z_dim == 16
    enc = FAM.load_text_encoders(src, torch.float32, "cpu")
    emb, lengths = FAM.encode_prompts(["a cat"], enc, max_length=64, device="cpu")
    assert emb.t5.shape == (1, int(lengths[0]), 32)


def test_official_shards_load_together(tmp_path):
    """One shard of the official transformer folder given as the file: its siblings load with it."""
    ref = tq.qwen_image_transformer(seed=5)
    state = ref.state_dict()
    keys = sorted(state)
    meta = {"leantune.config": json.dumps({"axes_dims_rope": [4, 6, 6]})}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:]), start=1):
        save_safetensors({k: state[k] for k in part}, tmp_path / f"diffusion_pytorch_model-{i:05d}-of-00002.safetensors",
                         meta)
    tr = FAM.load_transformer(_sources(tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors"),
                              dtype=torch.float32)
    assert torch.equal(_out(tr), _out(ref))
    (tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoadError, match="missing.*00002-of-00002"):
        FAM.load_transformer(_sources(tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors"))


@pytest.mark.parametrize("fp8", ["e4m3", "scaled"])
def test_fp8_file_stays_fp8(fp8, tmp_path):
    ref = tq.qwen_image_transformer(seed=3)
    path = save_comfy_transformer(ref, tmp_path / f"qwen_image_fp8_{fp8}.safetensors", fp8=fp8)
    tensors, _ = load_safetensors(path)
    assert tensors["model.diffusion_model.transformer_blocks.0.attn.to_q.weight"].dtype == torch.float8_e4m3fn
    tr = FAM.load_transformer(_sources(path), dtype=torch.bfloat16)
    state = tr.state_dict()
    eligible = fp8_block_weights(tr)
    assert "transformer_blocks.1.img_mlp.net.2.weight" in eligible and "transformer_blocks.0.img_mod.1.weight" in eligible
    for name in eligible:
        assert state[name].dtype == torch.float8_e4m3fn, name
        assert state[name[: -len("weight")] + "weight_scale"].shape == (state[name].shape[0], 1)
    assert state["img_in.weight"].dtype == torch.bfloat16 and state["txt_in.weight"].dtype == torch.bfloat16
    no_mod = FAM.load_transformer(_sources(path), dtype=torch.bfloat16, fp8_modulation=False).state_dict()
    assert no_mod["transformer_blocks.0.txt_mod.1.weight"].dtype == torch.bfloat16
    assert no_mod["transformer_blocks.0.attn.add_k_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(state["transformer_blocks.1.attn.to_k.weight"].view(torch.uint8),
                       tensors["model.diffusion_model.transformer_blocks.1.attn.to_k.weight"].view(torch.uint8))
    want = _out(ref)
    rel = ((_out(tr, torch.bfloat16) - want).norm() / want.norm()).item()
    assert 0 < rel < 0.1, rel


def test_full_size_architecture_from_shapes():
    """The packaged Qwen-Image config is what the shapes of a full-size file say (60 blocks, 24
    heads of 128, text width 3584, rotary axes 16/56/56)."""
    from leantune.planner.meta import build_meta_packaged

    config = packaged_config("qwen_image")
    model = build_meta_packaged("qwen-image", "qwen_image")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    read = config_from_shapes(shapes, {}, "full-size")
    for key in ("num_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim", "in_channels",
                "out_channels", "patch_size"):
        assert read[key] == config[key], key
    assert tuple(read["axes_dims_rope"]) == tuple(config["axes_dims_rope"]) == (16, 56, 56)
    params = sum(p.numel() for p in model.parameters())
    assert 20.0e9 < params < 20.6e9, params


def test_other_families_files_are_named(tmp_path):
    from leantune.models.flux.loading import load_transformer as flux_load, resolve_sources as flux_sources
    from leantune.models.flux.loading import save_bfl_transformer
    from leantune.models.sd3.loading import save_stability_transformer

    bfl = save_bfl_transformer(tiny.flux_transformer(), tmp_path / "flux.safetensors")
    with pytest.raises(LoadError, match="not a Qwen-Image transformer.*it looks like a Flux transformer"):
        FAM.load_transformer(_sources(bfl))
    sd3 = save_stability_transformer(tiny.sd3_transformer(), tmp_path / "sd3.safetensors")
    with pytest.raises(LoadError, match="not a Qwen-Image transformer.*SD3"):
        FAM.load_transformer(_sources(sd3))
    qwen = save_comfy_transformer(tq.qwen_image_transformer(), tmp_path / "qwen.safetensors")
    with pytest.raises(LoadError, match="not a Flux transformer: it looks like a Qwen-Image transformer"):
        flux_load(flux_sources(ModelConfig(path=str(qwen)), Path("/")))
    # A missing tensor is named with the file's own key.
    tensors, meta = load_safetensors(qwen)
    del tensors["model.diffusion_model.transformer_blocks.1.txt_mod.1.weight"]
    save_safetensors(tensors, tmp_path / "broken.safetensors", meta)
    with pytest.raises(LoadError, match=r"broken\.safetensors: missing key.*model\.diffusion_model\.transformer_blocks\.1\.txt_mod\.1\.weight"):
        FAM.load_transformer(_sources(tmp_path / "broken.safetensors"))
    # Pickle is refused.
    ckpt = tmp_path / "qwen_image.ckpt"
    torch.save({"a": torch.zeros(1)}, ckpt)
    with pytest.raises(LoadError, match="pickle"):
        _sources(ckpt)


@pytest.mark.parametrize("fp8", [None, "scaled"])
@pytest.mark.parametrize("prefix", ["", "text_encoders.qwen25_7b.transformer."])
def test_text_encoder_single_file_round_trip(folder, tmp_path, fp8, prefix):
    """Qwen2.5-VL written in ComfyUI's single-file layout (the original checkpoint's names:
    model.layers.*, visual.*; bf16, or fp8 with per-tensor scale_weight) loads back as the same
    model through [model] text_encoder = FILE: every tensor equal (fp8: its dequantized value, upcast
    per tensor, or kept e4m3 with the scale), and the prompts encode as the folder's encoder does."""
    from leantune.models.qwen_image.loading import load_text_encoder_file, save_text_encoder_file

    enc = FAM.load_text_encoders(_sources(folder), torch.float32, "cpu")
    original = enc.text_encoder
    path = save_text_encoder_file(original, tmp_path / "qwen_2.5_vl_7b.safetensors", dtype=torch.bfloat16, fp8=fp8,
                                  prefix=prefix)
    keys = list(load_safetensors(path)[0])
    assert f"{prefix}model.layers.0.self_attn.q_proj.weight" in keys and f"{prefix}visual.patch_embed.proj.weight" in keys
    file_tensors = load_safetensors(path)[0]

    def expected(legacy):                      # the file's value, dequantized when stored in fp8
        t = file_tensors[prefix + legacy].float()
        scale = file_tensors.get(prefix + legacy[: -len("weight")] + "scale_weight")
        return t * scale.float() if scale is not None else t

    loaded = load_text_encoder_file(path, torch.float32)
    state = loaded.state_dict()
    assert set(state) == set(original.state_dict())
    for key, t in state.items():
        legacy = key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        assert torch.equal(t, expected(legacy)), key
    if fp8:
        from leantune.models.component_loading import dequantized_state

        kept = load_text_encoder_file(path, torch.float32, keep_fp8=True)
        q = kept.model.language_model.layers[0].self_attn.q_proj.weight
        assert q.dtype == torch.float8_e4m3fn
        for key, t in dequantized_state(kept.state_dict()).items():
            legacy = key.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
            assert torch.allclose(t.float(), expected(legacy), rtol=0, atol=1e-6), key

    # Through the family: [model] text_encoder = FILE; the prompts encode as the folder's encoder does
    # (bf16 file: within bf16 rounding of the fp32 folder).
    cfg = ModelConfig(path=str(folder), family="qwen-image", text_encoder=str(path))
    sources = resolve_sources(cfg, Path("/"))
    from_file = FAM.load_text_encoders(sources, torch.float32, "cpu")
    a, la = FAM.encode_prompts(["a photo of a dog"], enc, max_length=64, device="cpu")
    b, lb = FAM.encode_prompts(["a photo of a dog"], from_file, max_length=64, device="cpu")
    assert torch.equal(la, lb)
    err = (a.t5 - b.t5).abs().max() / a.t5.abs().max()
    assert err < (0.05 if fp8 else 0.01), err     # measured: 0.016 and 0.002


def test_text_encoder_file_of_another_kind_is_named(folder, tmp_path):
    bad = tmp_path / "t5.safetensors"
    save_safetensors({"encoder.block.0.layer.0.SelfAttention.q.weight": torch.zeros(4, 4)}, bad)
    cfg = ModelConfig(path=str(folder), family="qwen-image", text_encoder=str(bad))
    with pytest.raises(LoadError, match=r"text_encoder: .*t5.safetensors: not a Qwen2.5-VL text encoder"):
        FAM.load_text_encoders(resolve_sources(cfg, Path("/")), torch.float32, "cpu")
