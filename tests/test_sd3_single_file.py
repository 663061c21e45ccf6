"""SD3.5 single files in Stability's layout (sd3.5_large.safetensors: `model.diffusion_model.*` keys,
or none; bf16, fp8 e4m3, ComfyUI scaled fp8), the separate clip_l / clip_g / t5xxl files, and the
key mapping both ways (checked against diffusers' own converter at a non-default width)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from leantune.config import ModelConfig
from leantune.io import load_safetensors, save_safetensors
from leantune.models import component_files as cf
from leantune.models import sd3
from leantune.models.sd3 import keys as sd3_keys
from leantune import tiny
from leantune.models.family import PromptEmbeds, get_family
from leantune.models.sd3.loading import LoadError, fp8_block_weights, save_stability_transformer
from leantune.planner.meta import meta_from_config

FAM = get_family("sd3")
# Non-default shapes everywhere: width 48 (3 heads of 16), 3 blocks (a middle one besides the first
# and the context-pre-only last), two dual-attention blocks, a 12x12 position grid.
WIDE_MEDIUM = dict(sample_size=24, patch_size=2, in_channels=16, num_layers=3, attention_head_dim=16,
                   num_attention_heads=3, joint_attention_dim=40, caption_projection_dim=48,
                   pooled_projection_dim=24, out_channels=16, pos_embed_max_size=12, qk_norm="rms_norm",
                   dual_attention_layers=(0, 1))
# Large-style without qk-norm: the head size is then invisible in the weights (the metadata says it).
WIDE_LARGE_NO_QK = dict(WIDE_MEDIUM, dual_attention_layers=(), qk_norm=None, attention_head_dim=12,
                        num_attention_heads=4)
CONFIG_KEYS = ("patch_size", "in_channels", "num_layers", "attention_head_dim", "num_attention_heads",
               "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim", "out_channels",
               "pos_embed_max_size", "qk_norm", "sample_size")


def _model(cfg: dict, seed: int = 0):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    model = SD3Transformer2DModel(**cfg)
    with torch.no_grad():
        for p in model.parameters():          # adaLN-zero layers start at zero; swapped halves must differ
            p.add_(torch.randn(p.shape) * 0.02)
    return model.eval()


def _sources(path, **kw):
    return FAM.resolve_sources(ModelConfig(path=str(path), family="sd3", **kw), Path("/"))


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _out(model, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    x = torch.randn(1, 16, 8, 8, generator=g)
    emb = PromptEmbeds(torch.randn(1, 5, cfg.joint_attention_dim, generator=g),
                       torch.randn(1, cfg.pooled_projection_dim, generator=g))
    with torch.no_grad():
        return sd3.predict(model, x.to(dtype), torch.tensor([0.6]), emb, (8, 8)).float()


@pytest.mark.parametrize("cfg", [WIDE_MEDIUM, WIDE_LARGE_NO_QK], ids=["medium_qk", "large_no_qk"])
@pytest.mark.parametrize("prefix", ["model.diffusion_model.", ""], ids=["prefixed", "bare"])
def test_stability_file_loads_to_the_folder_model(cfg, prefix, tmp_path):
    ref = _model(cfg)
    ref.save_pretrained(tmp_path / "transformer", safe_serialization=True)
    path = save_stability_transformer(ref, tmp_path / "sd3.5.safetensors", prefix=prefix)
    keys = load_safetensors(path)[0].keys()
    assert f"{prefix}joint_blocks.2.context_block.adaLN_modulation.1.weight" in keys
    assert (f"{prefix}joint_blocks.1.x_block.attn2.qkv.weight" in keys) == bool(cfg["dual_attention_layers"])

    from_folder = FAM.load_transformer(_sources(tmp_path / "transformer"), dtype=torch.float32)
    from_file = FAM.load_transformer(_sources(path), dtype=torch.float32)
    _same_weights(from_file, from_folder)
    _same_weights(from_file, ref)
    for key in CONFIG_KEYS:
        assert from_file.config[key] == cfg[key], key
    assert tuple(from_file.config.dual_attention_layers) == cfg["dual_attention_layers"]
    assert torch.equal(_out(from_file), _out(ref))


def test_mapping_agrees_with_diffusers_converter_at_a_non_default_width():
    """diffusers' converter maps Stability keys at any width (its from_single_file only lacks a
    config for them); ours is its exact inverse and round-trips."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    for cfg in (WIDE_MEDIUM, WIDE_LARGE_NO_QK):
        state = _model(cfg).state_dict()
        stability = sd3_keys.diffusers_to_stability(state)
        theirs = convert_sd3_transformer_checkpoint_to_diffusers(
            {"model.diffusion_model." + k: v.clone() for k, v in stability.items()})
        assert theirs.keys() == state.keys()
        assert all(torch.equal(theirs[k], state[k]) for k in state)
        back = sd3_keys.stability_to_diffusers(stability)
        assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("name", ["sd35_large", "sd35_medium"])
def test_full_size_architecture_is_read_from_shapes(name):
    """The shipped SD3.5 configs, through the Stability layout on the meta device (no memory): every
    key maps, and the config read back from the shapes is the shipped one."""
    from diffusers import SD3Transformer2DModel

    config = cf.packaged_config(name)
    model = meta_from_config(SD3Transformer2DModel, config)
    stability = sd3_keys.diffusers_to_stability(model.state_dict())
    shapes = {k: tuple(v.shape) for k, v in stability.items()}
    ops, unknown = sd3_keys.stability_to_diffusers_ops(shapes)
    assert not unknown
    targets = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(shapes[op.source]))}
    assert targets == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    read = sd3_keys.sd3_config_from_shapes(targets)
    for key in CONFIG_KEYS + ("dual_attention_layers",):
        want = config[key]
        assert (list(read[key]) if key == "dual_attention_layers" else read[key]) == want, key
    joint = len([k for k in shapes if k.endswith("x_block.attn.qkv.weight")])
    assert joint == config["num_layers"] and shapes["x_embedder.proj.weight"][0] == 64 * config["num_attention_heads"]


@pytest.mark.parametrize("fp8", ["e4m3", "scaled"])
def test_fp8_file_stays_fp8(fp8, tmp_path):
    ref = _model(WIDE_MEDIUM, seed=3)
    path = save_stability_transformer(ref, tmp_path / f"sd3.5_{fp8}.safetensors", fp8=fp8)
    tensors, _ = load_safetensors(path)
    assert tensors["model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight"].dtype == torch.float8_e4m3fn
    assert ("model.diffusion_model.joint_blocks.0.x_block.attn.qkv.scale_weight" in tensors) == (fp8 == "scaled")

    tr = FAM.load_transformer(_sources(path), dtype=torch.bfloat16)                  # keep_fp8 by default
    eligible = fp8_block_weights(tr)
    state = tr.state_dict()
    assert "transformer_blocks.0.attn2.to_q.weight" in eligible
    assert "transformer_blocks.0.norm1.linear.weight" in eligible            # adaLN too, as the file has it
    for name in eligible:
        assert state[name].dtype == torch.float8_e4m3fn, name
        assert state[name[: -len("weight")] + "weight_scale"].shape == (state[name].shape[0], 1)
    assert state["pos_embed.proj.weight"].dtype == torch.bfloat16             # outside the blocks: never fp8
    no_mod = FAM.load_transformer(_sources(path), dtype=torch.bfloat16, fp8_modulation=False).state_dict()
    assert no_mod["transformer_blocks.0.norm1.linear.weight"].dtype == torch.bfloat16   # [memory] fp8_modulation = false
    assert no_mod["transformer_blocks.0.norm1_context.linear.weight"].dtype == torch.bfloat16
    assert no_mod["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float8_e4m3fn
    if fp8 == "scaled":     # q, k and v share the fused tensor's one scale
        qkv = tensors["model.diffusion_model.joint_blocks.1.x_block.attn.qkv.scale_weight"].float()
        for part in ("to_q", "to_k", "to_v"):
            assert torch.equal(state[f"transformer_blocks.1.attn.{part}.weight_scale"],
                               qkv.expand(state[f"transformer_blocks.1.attn.{part}.weight"].shape[0], 1))
    # Same bytes as the file: the loader copied e4m3 without converting it.
    assert torch.equal(state["transformer_blocks.2.attn.to_k.weight"].view(torch.uint8),
                       tensors["model.diffusion_model.joint_blocks.2.x_block.attn.qkv.weight"].view(torch.uint8)[48:96])
    want = _out(ref)
    rel = ((_out(tr, torch.bfloat16) - want).norm() / want.norm()).item()
    assert 0 < rel < 0.1, rel
    # Loaded back without keep_fp8 the weights are upcast; written again, the file reloads.
    up = FAM.load_transformer(_sources(path), dtype=torch.float32, keep_fp8=False)
    assert all(p.dtype == torch.float32 for p in up.parameters())


def test_clip_and_t5_single_files_and_embedded_vae(tiny_sd3_dir, tmp_path):
    """ComfyUI's layout: the transformer file carries the VAE (first_stage_model., LDM keys);
    clip_l, clip_g and t5xxl come as separate files; tokenizers from a folder."""
    refs = tiny.sd3_components("large")
    stability = sd3_keys.diffusers_to_stability(refs["transformer"].state_dict())
    sd = {"model.diffusion_model." + k: v for k, v in stability.items()}
    sd.update({"first_stage_model." + k: v for k, v in cf.vae_diffusers_to_ldm(refs["vae"].state_dict()).items()})
    meta = {f"{cf.METADATA_CONFIG_KEY}.vae": json.dumps(dict(norm_num_groups=4, sample_size=64)),
            f"{cf.METADATA_CONFIG_KEY}.transformer": json.dumps(dict(sample_size=32))}
    model_file = save_safetensors(sd, tmp_path / "sd3.5_large.safetensors", meta)

    def clip_file(name, part, extra):
        model, tok = refs[part], refs["tokenizer"]
        state = {k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}": v
                 for k, v in model.state_dict().items()}     # ComfyUI's keys, whatever transformers names them
        conf = dict(num_attention_heads=model.config.num_attention_heads, bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **extra)
        return save_safetensors(state, tmp_path / name, {cf.METADATA_CONFIG_KEY: json.dumps(conf)})

    clip_l = clip_file("clip_l.safetensors", "text_encoder", {})
    clip_g = clip_file("clip_g.safetensors", "text_encoder_2", {})
    t5 = {k: v for k, v in refs["text_encoder_3"].state_dict().items() if k != "encoder.embed_tokens.weight"}
    t5_file = save_safetensors(t5, tmp_path / "t5xxl_fp16.safetensors",
                               {cf.METADATA_CONFIG_KEY: json.dumps(dict(relative_attention_max_distance=16))})

    sources = _sources(model_file, text_encoder=str(clip_l), text_encoder_2=str(clip_g), text_encoder_3=str(t5_file),
                       tokenizer=str(tiny_sd3_dir), tokenizer_2=str(tiny_sd3_dir), tokenizer_3=str(tiny_sd3_dir))
    assert sources.vae == model_file and sources.text_encoder == clip_l
    _same_weights(FAM.load_transformer(sources, dtype=torch.float32), refs["transformer"])
    vae = FAM.load_vae(sources, dtype=torch.float32)
    _same_weights(vae, refs["vae"])
    assert (vae.config.scaling_factor, vae.config.shift_factor) == (1.5305, 0.0609)   # SD3's, from sd3_vae.json
    enc = FAM.load_text_encoders(sources, dtype=torch.float32)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        _same_weights(getattr(enc, name), refs[name])
    assert enc.text_encoder_2.config.hidden_act == "gelu" and enc.text_encoder.config.hidden_act == "quick_gelu"


def test_bad_files_are_named(tmp_path, tiny_sd3_dir):
    ref = _model(WIDE_MEDIUM)
    good = save_stability_transformer(ref, tmp_path / "sd3.5.safetensors")
    tensors, meta = load_safetensors(good)
    # A missing tensor is named by its Stability key.
    broken = {k: v for k, v in tensors.items() if k != "model.diffusion_model.joint_blocks.1.x_block.attn2.proj.weight"}
    save_safetensors(broken, tmp_path / "broken.safetensors", meta)
    with pytest.raises(LoadError, match=r"broken\.safetensors: missing key.*joint_blocks\.1\.x_block\.attn2\.proj\.weight"):
        FAM.load_transformer(_sources(tmp_path / "broken.safetensors"), dtype=torch.float32)
    # A key no SD3 module has.
    save_safetensors({**tensors, "model.diffusion_model.joint_blocks.0.x_block.extra.weight": torch.zeros(2)},
                     tmp_path / "extra.safetensors", meta)
    with pytest.raises(LoadError, match=r"extra\.safetensors: unexpected key.*x_block\.extra\.weight"):
        FAM.load_transformer(_sources(tmp_path / "extra.safetensors"), dtype=torch.float32)
    # Pickle checkpoints are refused without being opened as pickle.
    ckpt = tmp_path / "sd3.5_large.ckpt"
    torch.save({"a": torch.zeros(1)}, ckpt)
    with pytest.raises(LoadError, match="pickle"):
        _sources(ckpt)
    # Flux's loader names an SD3 file for what it is.
    from leantune.models.flux.loading import load_transformer as flux_load, resolve_sources as flux_sources

    with pytest.raises(LoadError, match="not a Flux transformer: it looks like an SD3/SD3.5 transformer"):
        flux_load(flux_sources(ModelConfig(path=str(good)), Path("/")))
    # ... and SD3's a Flux file.
    from leantune.models.flux.loading import save_bfl_transformer

    bfl = save_bfl_transformer(tiny.flux_transformer(), tmp_path / "flux.safetensors")
    with pytest.raises(LoadError, match="not an SD3 transformer: it looks like a Flux transformer"):
        FAM.load_transformer(_sources(bfl), dtype=torch.float32)


def test_all_in_one_checkpoint(tiny_sd3_dir, tmp_path):
    """One file with the transformer, CLIP-L, CLIP-G and T5 under ComfyUI's text_encoders.* prefixes
    and the VAE (as sd3_medium_incl_clips_t5xxlfp8.safetensors is laid out); tokenizers from a folder."""
    refs = tiny.sd3_components("medium")
    sd = {"model.diffusion_model." + k: v
          for k, v in sd3_keys.diffusers_to_stability(refs["transformer"].state_dict()).items()}
    sd.update({"first_stage_model." + k: v for k, v in cf.vae_diffusers_to_ldm(refs["vae"].state_dict()).items()})
    meta = {f"{cf.METADATA_CONFIG_KEY}.vae": json.dumps(dict(norm_num_groups=4, sample_size=64)),
            f"{cf.METADATA_CONFIG_KEY}.transformer": json.dumps(dict(sample_size=32)),
            f"{cf.METADATA_CONFIG_KEY}.t5": json.dumps(dict(relative_attention_max_distance=16))}
    tok = refs["tokenizer"]
    for part, name, kind in (("text_encoder", "clip_l", "clip"), ("text_encoder_2", "clip_g", "clip_g")):
        model = refs[part]
        sd.update({f"text_encoders.{name}.transformer." + (k if k.startswith(("text_model.", "text_projection"))
                                                         else f"text_model.{k}"): v
                   for k, v in model.state_dict().items()})
        meta[f"{cf.METADATA_CONFIG_KEY}.{kind}"] = json.dumps(dict(
            num_attention_heads=model.config.num_attention_heads, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    sd.update({"text_encoders.t5xxl.transformer." + k: v for k, v in refs["text_encoder_3"].state_dict().items()
               if k != "encoder.embed_tokens.weight"})
    path = save_safetensors(sd, tmp_path / "sd3.5_medium_incl_clips_t5xxl.safetensors", meta)

    sources = _sources(path, tokenizer=str(tiny_sd3_dir), tokenizer_2=str(tiny_sd3_dir), tokenizer_3=str(tiny_sd3_dir))
    assert {sources.transformer, sources.text_encoder, sources.text_encoder_2, sources.text_encoder_3,
            sources.vae} == {path}
    _same_weights(FAM.load_transformer(sources, dtype=torch.float32), refs["transformer"])
    _same_weights(FAM.load_vae(sources, dtype=torch.float32), refs["vae"])
    enc = FAM.load_text_encoders(sources, dtype=torch.float32)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        _same_weights(getattr(enc, name), refs[name])
    # [model] t5 = false leaves the embedded T5 unread.
    assert _sources(path, t5=False, tokenizer=str(tiny_sd3_dir), tokenizer_2=str(tiny_sd3_dir)).text_encoder_3 is None
