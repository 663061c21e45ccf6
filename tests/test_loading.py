"""Flux model loading: diffusers folders, BFL/ComfyUI single files (bf16, fp8, scaled fp8, all-in-one),
per-component overrides, errors that name the file and key, and loading straight into the target
dtype without a second copy in host RAM."""

# Checks moved to the conformance suite (issue 33):
# - test_diffusers_folder_matches_the_original_tiny_model, trimmed to the Flux specifics (sources, the
#   variant, the VAE's decode, tokenizers, encoding, T5's tied embedding): the transformer's weights and
#   outputs moved to tests/families/test_conformance.py::test_builds_from_its_tiny_preset[flux-dev], the
#   VAE's weights to tests/families/test_conformance.py::test_loads_its_diffusers_folder_as_diffusers_does[flux-dev]

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from leantune.config import ModelConfig
from leantune.io import load_safetensors, save_safetensors
from leantune.models.flux import keys as bfl_keys
from leantune.models import flux
from leantune import tiny
from leantune.models import component_files as cf
from leantune.models.flux.loading import FluxSources, LoadError, detect_variant, fingerprint, load_text_encoders, load_transformer, load_vae, resolve_sources, save_bfl_transformer
from leantune.models.weights import STAGING_BYTES

PROMPTS = ["a photo of a cat", "sks person riding a horse"]


# -- helpers ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def refs():
    """The components tiny.save_flux_folder(seed=0) wrote, rebuilt in memory (deterministic weights;
    the tokenizers are retrained, so tests encode with the loaded ones). Eval mode: T5 has dropout."""
    parts = tiny.flux_components(seed=0)
    for part in parts.values():
        if isinstance(part, torch.nn.Module):
            part.eval()
    return parts


def _sources(transformer=None, **kw) -> FluxSources:
    fields = dict(transformer=transformer, text_encoder=None, text_encoder_2=None, tokenizer=None,
                  tokenizer_2=None, vae=None)
    fields.update(kw)
    return FluxSources(**{k: (Path(v) if isinstance(v, (str, Path)) else v) for k, v in fields.items()})


def _flux_out(model, dtype=torch.float32, seed=0):
    """Prediction of a Flux transformer on fixed random inputs: packed latents of a 4x4 latent."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(1, 4, 64, generator=g)                                   # (B, N, 64)
    embeds = flux.PromptEmbeds(torch.randn(1, 8, 32, generator=g), torch.randn(1, 32, generator=g))
    with torch.no_grad():
        return flux.predict(model, packed.to(dtype), torch.tensor([0.7]), embeds, (4, 4), guidance=3.5).float()


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def _encode(te, tok, te2, tok2):
    embeds, _ = flux.encode_prompts(PROMPTS, tok, te, tok2, te2, max_length=tiny.T5_TINY_MAX_LENGTH)
    return embeds


def _save_clip_file(model, tok, path, prefix="", with_meta=True):
    """A ComfyUI-style clip_l.safetensors: transformers keys under text_model., plus the projection
    and logit scale a full CLIP file carries (CLIPTextModel has neither)."""
    sd = {f"{prefix}text_model.{k}": v for k, v in model.state_dict().items()}
    sd[prefix + "text_projection.weight"] = torch.randn(32, 32)
    sd[prefix + "logit_scale"] = torch.tensor(4.6)
    meta = {cf.METADATA_CONFIG_KEY: json.dumps(_clip_meta(tok))} if with_meta else {}
    return save_safetensors(sd, path, meta), sd


def _clip_meta(tok):
    # What shapes cannot show: the head count and the tokenizer's special ids.
    return dict(num_attention_heads=4, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def _t5_state(model, prefix=""):
    # Real T5 files store the shared embedding once (encoder.embed_tokens is tied to it).
    return {prefix + k: v for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}


T5_META = dict(relative_attention_max_distance=16)
VAE_META = dict(norm_num_groups=4, sample_size=64)


# -- diffusers folders -----------------------------------------------------------------------------

def test_diffusers_folder_matches_the_original_tiny_model(tiny_flux_dir, refs):
    sources = resolve_sources(ModelConfig(path=str(tiny_flux_dir)), Path("/"))
    assert sources.transformer == tiny_flux_dir / "transformer" and sources.vae == tiny_flux_dir / "vae"
    assert sources.tokenizer_2 == tiny_flux_dir / "tokenizer_2"

    # (The transformer's weights and outputs, the VAE's weights: tests/families, see the top of this file.)
    tr = load_transformer(sources, dtype=torch.float32)
    assert detect_variant(tr) == "dev"

    vae = load_vae(sources, dtype=torch.float32)
    z = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(vae.decode(z).sample, refs["vae"].decode(z).sample)

    te = load_text_encoders(sources, dtype=torch.float32)
    # The tokenizers are the saved ones (vocabularies as written), and they round-trip text.
    for tok, folder in ((te.tokenizer, "tokenizer"), (te.tokenizer_2, "tokenizer_2")):
        saved = json.loads((tiny_flux_dir / folder / "tokenizer.json").read_text())["model"]["vocab"]
        vocab = saved if isinstance(saved, dict) else {piece: i for i, (piece, _) in enumerate(saved)}
        assert tok.get_vocab() == vocab
        assert tok.decode(tok(PROMPTS[0]).input_ids, skip_special_tokens=True).strip() == PROMPTS[0]
    assert te.tokenizer.model_max_length == 77 and te.tokenizer_2.model_max_length == tiny.T5_TINY_MAX_LENGTH
    got = _encode(te.text_encoder, te.tokenizer, te.text_encoder_2, te.tokenizer_2)
    want = _encode(refs["text_encoder"], te.tokenizer, refs["text_encoder_2"], te.tokenizer_2)
    assert torch.equal(got.t5, want.t5) and torch.equal(got.pooled, want.pooled)
    # T5's encoder embedding is the shared one, as transformers ties it.
    assert te.text_encoder_2.encoder.embed_tokens.weight is te.text_encoder_2.shared.weight


class _InitRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records random/constant initialisation kernels run on real (non-meta) tensors: what building
    a model for real (then overwriting it with the checkpoint) leaves behind."""

    INIT = {"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "fill_", "zero_"}

    def __init__(self):
        super().__init__()
        self.real_inits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        first = args[0] if args else None
        if name in self.INIT and isinstance(first, torch.Tensor) and not first.is_meta and first.numel() > 1:
            self.real_inits.append(name)
        return func(*args, **(kwargs or {}))


def test_loads_straight_into_bf16_through_the_meta_device(tiny_flux_dir, refs):
    # The recorder sees a model built for real (so the assertion below can fail).
    with _InitRecorder() as naive:
        tiny.flux_transformer(seed=3)
    assert naive.real_inits

    with _InitRecorder() as rec:
        tr = load_transformer(_sources(tiny_flux_dir / "transformer"), dtype=torch.bfloat16)
    assert rec.real_inits == []                        # built on meta: no initialisation ran
    assert {p.dtype for p in tr.parameters()} == {torch.bfloat16}
    ref_bf16 = {k: v.to(torch.bfloat16) for k, v in refs["transformer"].state_dict().items()}
    for k, v in tr.state_dict().items():
        assert torch.equal(v, ref_bf16[k]), k
    # Each parameter owns exactly its own storage (split pieces of a fused tensor are not views).
    for name, p in tr.named_parameters():
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), name


def test_peak_host_memory_is_one_copy_of_the_model(tmp_path):
    """Loading a fp32 file into bf16 raises peak RSS by the bf16 model plus the staging buffer;
    a load through a full state dict would need the fp32 file's size on top."""
    import ctypes

    path = tmp_path / "mid.safetensors"
    model = tiny.flux_transformer(0, attention_head_dim=128, num_attention_heads=4, joint_attention_dim=64,
                                  axes_dims_rope=(16, 56, 56))
    save_bfl_transformer(model, path)                                   # fp32, ~114 MB
    file_bytes = path.stat().st_size
    del model
    ctypes.CDLL("libc.so.6").malloc_trim(0)   # freed heap goes back to the OS, so reuse shows as growth

    def status(key):
        return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0]) * 1024

    load_transformer(_sources(path), dtype=torch.bfloat16)             # warm-up: lazy imports, caches
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")                      # reset the peak (VmHWM) to now
    before = status("VmRSS")
    tr = load_transformer(_sources(path), dtype=torch.bfloat16)
    peak = status("VmHWM") - before
    model_bytes = sum(p.numel() * p.element_size() for p in tr.parameters())
    assert model_bytes * 2 > file_bytes * 0.99                          # the file really is fp32
    assert peak < model_bytes + 3 * STAGING_BYTES + 8 * 2**20, (peak, model_bytes)


# -- per-component overrides -------------------------------------------------------------------------

def test_component_overrides(tiny_flux_dir, refs, tmp_path):
    # VAE from another diffusers folder, CLIP-L from a ComfyUI single file, tokenizer from a
    # diffusers root (its tokenizer/ sub-folder is used); the rest from the main folder.
    vae1 = tiny.vae(seed=1)
    vae1.save_pretrained(tmp_path / "other" / "vae")
    clip1 = tiny.clip_text_encoder(refs["tokenizer"], seed=1)
    _save_clip_file(clip1, refs["tokenizer"], tmp_path / "clip_l.safetensors")
    cfg = ModelConfig(path=str(tiny_flux_dir), vae="other/vae", text_encoder="clip_l.safetensors",
                      tokenizer=str(tiny_flux_dir))
    sources = resolve_sources(cfg, tmp_path)                           # relative to the config's folder
    assert sources.vae == tmp_path / "other" / "vae"
    assert sources.text_encoder == tmp_path / "clip_l.safetensors"
    assert sources.tokenizer == tiny_flux_dir / "tokenizer"

    _assert_same_weights(load_vae(sources, dtype=torch.float32), vae1)
    te = load_text_encoders(sources, dtype=torch.float32)
    _assert_same_weights(te.text_encoder, clip1)
    _assert_same_weights(te.text_encoder_2, refs["text_encoder_2"])
    got = _encode(te.text_encoder, te.tokenizer, te.text_encoder_2, te.tokenizer_2)
    want = _encode(clip1, te.tokenizer, refs["text_encoder_2"], te.tokenizer_2)
    assert torch.equal(got.pooled, want.pooled) and torch.equal(got.t5, want.t5)


def test_single_file_t5_and_vae_in_comfyui_layouts(refs, tmp_path):
    # t5xxl_*.safetensors: T5 encoder keys, shared embedding once; ae.safetensors: BFL/LDM VAE keys.
    t5_path = save_safetensors(_t5_state(refs["text_encoder_2"]), tmp_path / "t5xxl_fp16.safetensors",
                               {cf.METADATA_CONFIG_KEY: json.dumps(T5_META)})
    ldm = cf.vae_diffusers_to_ldm(refs["vae"].state_dict())
    assert "encoder.down.0.block.0.conv1.weight" in ldm and ldm["encoder.mid.attn_1.q.weight"].dim() == 4
    ae_path = save_safetensors(ldm, tmp_path / "ae.safetensors", {cf.METADATA_CONFIG_KEY: json.dumps(VAE_META)})
    clip_path, _ = _save_clip_file(refs["text_encoder"], refs["tokenizer"], tmp_path / "clip_l.safetensors")
    refs["tokenizer"].save_pretrained(tmp_path / "tok")
    refs["tokenizer_2"].save_pretrained(tmp_path / "tok2")
    sources = _sources(text_encoder=clip_path, text_encoder_2=t5_path, vae=ae_path, tokenizer=tmp_path / "tok",
                       tokenizer_2=tmp_path / "tok2")

    vae = load_vae(sources, dtype=torch.float32)
    _assert_same_weights(vae, refs["vae"])
    assert vae.config.scaling_factor == pytest.approx(0.3611) and vae.config.shift_factor == pytest.approx(0.1159)
    te = load_text_encoders(sources, dtype=torch.float32)
    _assert_same_weights(te.text_encoder_2, refs["text_encoder_2"])
    got = _encode(te.text_encoder, te.tokenizer, te.text_encoder_2, te.tokenizer_2)
    want = _encode(refs["text_encoder"], te.tokenizer, refs["text_encoder_2"], te.tokenizer_2)
    assert torch.equal(got.t5, want.t5) and torch.equal(got.pooled, want.pooled)


def test_sharded_transformer_folder(refs, tmp_path):
    refs["transformer"].save_pretrained(tmp_path / "transformer", max_shard_size="100KB")
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    tr = load_transformer(_sources(tmp_path / "transformer"), dtype=torch.float32)
    _assert_same_weights(tr, refs["transformer"])


# -- BFL single files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dev", "schnell"])
def test_bfl_single_file_matches_the_diffusers_model(variant, tmp_path):
    ref = tiny.flux_transformer(seed=5, guidance_embeds=variant == "dev")
    path = save_bfl_transformer(ref, tmp_path / f"flux1-{variant}.safetensors")
    tensors, _ = load_safetensors(path)
    assert "double_blocks.0.img_attn.qkv.weight" in tensors and "single_blocks.1.linear1.weight" in tensors
    assert ("guidance_in.in_layer.weight" in tensors) == (variant == "dev")

    sources = resolve_sources(ModelConfig(path=str(path)), tmp_path)
    assert sources.transformer == path and sources.vae is None and sources.text_encoder is None
    tr = load_transformer(sources, dtype=torch.float32)
    assert detect_variant(tr) == variant
    assert tuple(tr.config.axes_dims_rope) == (4, 6, 6) and tr.config.num_layers == 2
    _assert_same_weights(tr, ref)
    assert torch.equal(_flux_out(tr), _flux_out(ref))

    # A bf16 file loads into bf16 bit for bit.
    path16 = save_bfl_transformer(ref, tmp_path / "bf16.safetensors", dtype=torch.bfloat16)
    tr16 = load_transformer(_sources(path16), dtype=torch.bfloat16)
    _assert_same_weights(tr16, ref.to(torch.bfloat16))


def test_variant_key_must_agree_with_the_weights(tmp_path):
    path = save_bfl_transformer(tiny.flux_transformer(seed=0), tmp_path / "dev.safetensors")
    assert load_transformer(resolve_sources(ModelConfig(path=str(path), variant="dev"), tmp_path)) is not None
    with pytest.raises(LoadError, match=r"dev\.safetensors.*variant = 'schnell'.*weights are dev"):
        load_transformer(resolve_sources(ModelConfig(path=str(path), variant="schnell"), tmp_path))


def test_bfl_without_rope_metadata_uses_the_derived_split(tmp_path):
    ref = tiny.flux_transformer(seed=0)
    path = save_bfl_transformer(ref, tmp_path / "plain.safetensors", metadata={cf.METADATA_CONFIG_KEY: "{}"})
    tr = load_transformer(_sources(path), dtype=torch.float32)
    assert tuple(tr.config.axes_dims_rope) == bfl_keys.default_axes_dims_rope(16) == (4, 6, 6)
    assert bfl_keys.default_axes_dims_rope(128) == (16, 56, 56)
    _assert_same_weights(tr, ref)


@pytest.mark.parametrize("fp8", ["e4m3", "scaled"])
def test_fp8_bfl_file_loads_within_fp8_tolerance(fp8, tmp_path):
    ref = tiny.flux_transformer(seed=2)
    path = save_bfl_transformer(ref, tmp_path / f"flux-{fp8}.safetensors", fp8=fp8)
    tensors, _ = load_safetensors(path)
    assert tensors["double_blocks.0.img_attn.qkv.weight"].dtype == torch.float8_e4m3fn
    assert ("double_blocks.0.img_attn.qkv.scale_weight" in tensors) == (fp8 == "scaled")

    tr = load_transformer(_sources(path), dtype=torch.bfloat16, keep_fp8=False)     # upcast on load
    ref_sd, got = ref.state_dict(), tr.state_dict()
    for k, w in ref_sd.items():
        g = got[k].float()
        if k.startswith(("transformer_blocks.", "single_transformer_blocks.")) and w.dim() == 2:
            # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal step near zero.
            step = 2.0 ** -9 * (w.abs().max() / 448 if fp8 == "scaled" else 1.0)
            assert ((g - w).abs() <= w.abs() * 2 ** -4 + step + 1e-7).all(), k
        else:  # everything else is stored in the compute dtype
            assert torch.equal(got[k], w.to(torch.bfloat16)), k
    out, want = _flux_out(tr, torch.bfloat16), _flux_out(ref)
    rel = (out - want).norm() / want.norm()
    assert 0 < rel < 0.1


def test_all_in_one_comfyui_checkpoint(refs, tmp_path, tiny_flux_dir):
    """One file with model.diffusion_model. (BFL), text_encoders.clip_l/t5xxl.transformer. and vae. (LDM)."""
    bfl = bfl_keys.diffusers_to_bfl(refs["transformer"].state_dict())
    sd = {"model.diffusion_model." + k: v for k, v in bfl.items()}
    clip = refs["text_encoder"].state_dict()
    sd.update({f"text_encoders.clip_l.transformer.text_model.{k}": v for k, v in clip.items()})
    sd.update(_t5_state(refs["text_encoder_2"], "text_encoders.t5xxl.transformer."))
    sd.update({"vae." + k: v for k, v in cf.vae_diffusers_to_ldm(refs["vae"].state_dict()).items()})
    meta = {f"{cf.METADATA_CONFIG_KEY}.transformer": json.dumps({"axes_dims_rope": [4, 6, 6]}),
            f"{cf.METADATA_CONFIG_KEY}.clip": json.dumps(_clip_meta(refs["tokenizer"])),
            f"{cf.METADATA_CONFIG_KEY}.t5": json.dumps(T5_META), f"{cf.METADATA_CONFIG_KEY}.vae": json.dumps(VAE_META)}
    path = save_safetensors(sd, tmp_path / "flux1-dev-aio.safetensors", meta)

    # Tokenizers are not in weights: without them the error says which key to set.
    sources = resolve_sources(ModelConfig(path=str(path)), tmp_path)
    assert sources.transformer == sources.text_encoder == sources.text_encoder_2 == sources.vae == path
    with pytest.raises(LoadError, match=r"set \[model\] tokenizer "):
        load_text_encoders(sources)

    sources = resolve_sources(ModelConfig(path=str(path), tokenizer=str(tiny_flux_dir),
                                          tokenizer_2=str(tiny_flux_dir)), tmp_path)
    _assert_same_weights(load_transformer(sources, dtype=torch.float32), refs["transformer"])
    _assert_same_weights(load_vae(sources, dtype=torch.float32), refs["vae"])
    te = load_text_encoders(sources, dtype=torch.float32)
    _assert_same_weights(te.text_encoder, refs["text_encoder"])
    _assert_same_weights(te.text_encoder_2, refs["text_encoder_2"])


# -- errors ---------------------------------------------------------------------------------------------

def test_pickle_checkpoints_are_refused(tmp_path, tiny_flux_dir):
    ckpt = tmp_path / "flux1-dev.ckpt"
    ckpt.write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(LoadError, match=r"flux1-dev\.ckpt: \[model\] path is a pickle"):
        resolve_sources(ModelConfig(path=str(ckpt)), tmp_path)
    pt = tmp_path / "ae.pt"
    pt.write_bytes(b"x")
    with pytest.raises(LoadError, match=r"ae\.pt: \[model\] vae is a pickle"):
        resolve_sources(ModelConfig(path=str(tiny_flux_dir), vae=str(pt)), tmp_path)
    # A folder holding only pickle weights is refused too, naming it.
    folder = tmp_path / "transformer"
    folder.mkdir()
    shutil.copy(tiny_flux_dir / "transformer" / "config.json", folder / "config.json")
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(LoadError, match=r"transformer: only pickle weights .*diffusion_pytorch_model\.bin"):
        load_transformer(_sources(folder))


def test_wrong_architecture_file_is_named(tmp_path, refs):
    from diffusers import SD3Transformer2DModel

    sd3 = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8,
                                num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                pooled_projection_dim=64, out_channels=16, pos_embed_max_size=96)
    path = save_safetensors(sd3.state_dict(), tmp_path / "sd3.5_medium.safetensors")
    with pytest.raises(LoadError, match=r"sd3\.5_medium\.safetensors: not a Flux transformer: .*SD3"):
        load_transformer(resolve_sources(ModelConfig(path=str(path)), tmp_path))
    # A VAE given as the CLIP text encoder.
    ae = save_safetensors(cf.vae_diffusers_to_ldm(refs["vae"].state_dict()), tmp_path / "ae.safetensors")
    refs["tokenizer"].save_pretrained(tmp_path / "tok")
    refs["tokenizer_2"].save_pretrained(tmp_path / "tok2")
    with pytest.raises(LoadError, match=r"ae\.safetensors: not a CLIP text encoder: it looks like a VAE"):
        load_text_encoders(_sources(text_encoder=ae, text_encoder_2=ae, tokenizer=tmp_path / "tok",
                                    tokenizer_2=tmp_path / "tok2"))


def test_missing_components_and_keys_are_named(tmp_path, tiny_flux_dir):
    path = save_bfl_transformer(tiny.flux_transformer(seed=0), tmp_path / "flux.safetensors")
    sources = resolve_sources(ModelConfig(path=str(path), tokenizer=str(tiny_flux_dir),
                                          tokenizer_2=str(tiny_flux_dir)), tmp_path)
    with pytest.raises(LoadError, match=r"no CLIP-L text encoder.*set \[model\] text_encoder"):
        load_text_encoders(sources)
    with pytest.raises(LoadError, match=r"no VAE.*set \[model\] vae"):
        load_vae(sources)
    with pytest.raises(LoadError, match=r"\[model\] text_encoder_2: .*nowhere.*no such file"):
        resolve_sources(ModelConfig(path=str(tiny_flux_dir), text_encoder_2="nowhere"), tmp_path)
    empty = tmp_path / "empty_repo"
    (empty / "vae").mkdir(parents=True)
    with pytest.raises(LoadError, match=r"\[model\] path: .*empty_repo: no transformer/ sub-folder"):
        resolve_sources(ModelConfig(path=str(empty)), tmp_path)

    # A BFL file with a missing tensor: the message gives the BFL key and the file.
    tensors, meta = load_safetensors(path)
    del tensors["double_blocks.1.img_attn.qkv.weight"]
    broken = save_safetensors(tensors, tmp_path / "broken.safetensors", meta)
    with pytest.raises(LoadError, match=r"broken\.safetensors: missing key\(s\) "
                                        r"'double_blocks\.1\.img_attn\.qkv\.weight'"):
        load_transformer(_sources(broken))
    # An extra tensor is not silently ignored.
    tensors, meta = load_safetensors(path)
    tensors["double_blocks.0.img_attn.extra.weight"] = torch.zeros(2, 2)
    extra = save_safetensors(tensors, tmp_path / "extra.safetensors", meta)
    with pytest.raises(LoadError, match=r"extra\.safetensors: unexpected key.*"
                                        r"double_blocks\.0\.img_attn\.extra\.weight"):
        load_transformer(_sources(extra))
    # A truncated file is caught from its header, before reading.
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(LoadError, match=r"cut\.safetensors: key .*truncated"):
        load_transformer(_sources(tmp_path / "cut.safetensors"))


def test_shape_mismatch_names_file_and_key(tmp_path, tiny_flux_dir):
    # A folder whose config claims another text width than its weights have.
    folder = tmp_path / "transformer"
    shutil.copytree(tiny_flux_dir / "transformer", folder)
    config = json.loads((folder / "config.json").read_text())
    config["joint_attention_dim"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"diffusion_pytorch_model\.safetensors: key 'context_embedder\.weight' has "
                                        r"shape \(32, 32\), but .* expects \(32, 64\)"):
        load_transformer(_sources(folder))
    # A BFL file with one block of another width.
    path = save_bfl_transformer(tiny.flux_transformer(seed=0), tmp_path / "flux.safetensors")
    tensors, meta = load_safetensors(path)
    tensors["double_blocks.1.txt_mlp.0.weight"] = torch.zeros(96, 32)
    bad = save_safetensors(tensors, tmp_path / "bad.safetensors", meta)
    with pytest.raises(LoadError, match=r"bad\.safetensors: key 'double_blocks\.1\.txt_mlp\.0\.weight' has shape "
                                        r"\(96, 32\), but .* expects \(128, 32\)"):
        load_transformer(_sources(bad))


# -- conversion at real width, full-size configs ----------------------------------------------------------

def test_bfl_converter_matches_diffusers_at_full_width():
    """Our width-aware BFL->diffusers mapping equals diffusers' own (which assumes width 3072) on the
    keys of one double and one single block of real width. Rows are real (they are what is split);
    columns are cut to 8 to keep this a few MB."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    from leantune.models.weights import build_empty

    config = {**cf.packaged_config("flux1_dev"), "num_layers": 1, "num_single_layers": 1}
    meta = build_empty(lambda: FluxTransformer2DModel.from_config(config)).state_dict()
    bfl_shapes = {k: v.shape for k, v in bfl_keys.diffusers_to_bfl(meta).items()}
    g = torch.Generator().manual_seed(0)
    bfl = {k: torch.randn(s[0], min(s[1], 8), generator=g) if len(s) == 2 else torch.randn(*s, generator=g)
           for k, s in bfl_shapes.items()}
    assert bfl["single_blocks.0.linear1.weight"].shape == (3 * 3072 + 12288, 8)

    ours = bfl_keys.convert_bfl_state_dict(bfl)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    assert ours.keys() == theirs.keys() == meta.keys()
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), k
    # And back: diffusers_to_bfl is the exact inverse.
    back = bfl_keys.diffusers_to_bfl(ours)
    assert back.keys() == bfl.keys() and all(torch.equal(back[k], bfl[k]) for k in bfl)


def test_architecture_is_read_from_full_size_shapes():
    """The shipped configs build models of the published sizes, and reading a full-size BFL key set's
    shapes (on meta: no memory) gives back the dev config."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from leantune.models.weights import build_empty

    def count(model, skip=()):
        return sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False) if n not in skip)

    dev = build_empty(lambda: FluxTransformer2DModel.from_config(cf.packaged_config("flux1_dev")))
    assert count(dev) == 11_901_408_320
    assert detect_variant(dev) == "dev"
    schnell = build_empty(lambda: FluxTransformer2DModel.from_config(cf.packaged_config("flux1_schnell")))
    assert detect_variant(schnell) == "schnell"
    clip = build_empty(lambda: CLIPTextModel(CLIPTextConfig.from_dict(cf.packaged_config("clip_l"))))
    assert count(clip) == 123_060_480
    t5 = build_empty(lambda: T5EncoderModel(T5Config.from_dict(cf.packaged_config("t5_xxl"))))
    assert count(t5, skip={"encoder.embed_tokens.weight"}) == 4_762_310_656
    vae = build_empty(lambda: AutoencoderKL.from_config(cf.packaged_config("flux_vae")))
    assert count(vae) == 83_819_683

    bfl = bfl_keys.diffusers_to_bfl(dev.state_dict())
    ops, unknown = bfl_keys.bfl_to_diffusers_ops({k: tuple(v.shape) for k, v in bfl.items()})
    assert unknown == []
    shapes = {t: s for op in ops for t, s in zip(op.targets, op.target_shapes(tuple(bfl[op.source].shape)))}
    inferred = bfl_keys.flux_config_from_shapes(shapes)
    for key, value in cf.packaged_config("flux1_dev").items():
        if not key.startswith("_"):
            assert inferred[key] == value, key
    # Full-size encoders and VAE read back from their own shapes.
    assert cf.t5_config({k: tuple(v.shape) for k, v in t5.state_dict().items()}, {}, "t5") == \
        {**cf.packaged_config("t5_xxl")}
    ldm = cf.vae_diffusers_to_ldm(vae.state_dict())
    assert cf.vae_config({k: tuple(v.shape) for k, v in ldm.items()}, {}, "ae") == \
        {k: v for k, v in cf.packaged_config("flux_vae").items() if k != "_class_name"}
    assert cf.clip_config({k: tuple(v.shape) for k, v in clip.state_dict().items()}, {}, "clip") == \
        cf.packaged_config("clip_l")


# -- identity --------------------------------------------------------------------------------------------

def test_fingerprint_follows_content_not_location(tmp_path, tiny_flux_dir):
    a = fingerprint(tiny_flux_dir / "vae")
    copy = tmp_path / "copy_of_vae"
    shutil.copytree(tiny_flux_dir / "vae", copy)
    assert fingerprint(copy) == a
    weights = copy / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF                                   # one byte of tensor data
    weights.write_bytes(bytes(data))
    assert fingerprint(copy) != a
    assert fingerprint(weights) != fingerprint(tiny_flux_dir / "vae" / "diffusion_pytorch_model.safetensors")

    f1 = save_safetensors({"w": torch.ones(4)}, tmp_path / "a.safetensors", {"k": "1"})
    f2 = save_safetensors({"w": torch.ones(4)}, tmp_path / "b.safetensors", {"k": "1"})
    f3 = save_safetensors({"w": torch.ones(4)}, tmp_path / "c.safetensors", {"k": "2"})
    assert fingerprint(f1) == fingerprint(f2) != fingerprint(f3)
    assert len(fingerprint(f1)) == 32
    with pytest.raises(LoadError, match="nothing_here"):
        fingerprint(tmp_path / "nothing_here")


@pytest.mark.gpu
def test_loads_straight_onto_the_gpu(tmp_path):
    ref = tiny.flux_transformer(seed=0)
    path = save_bfl_transformer(ref, tmp_path / "flux.safetensors", fp8="scaled")
    cpu = load_transformer(_sources(path), dtype=torch.bfloat16)
    gpu = load_transformer(_sources(path), dtype=torch.bfloat16, device="cuda")
    assert {p.device.type for p in gpu.parameters()} == {"cuda"}
    for k, v in cpu.state_dict().items():
        assert torch.equal(gpu.state_dict()[k].cpu(), v), k


@pytest.mark.parametrize("fp8", [None, "scaled"])
def test_tensors_kept_as_read_are_copied_by_the_workers_bitwise(fp8, tmp_path, monkeypatch):
    """fill_rows_into splits a tensor kept in the load dtype (fp32 -> bf16 cast, or a scaled e4m3
    weight dequantised) into chunks copied on the load's workers, each chunk unmapped after its copy:
    with chunks of a few rows, on two workers, the model is bit for bit the one-chunk load."""
    import threading

    from leantune.models import weights

    ref = tiny.flux_transformer(seed=3)
    path = save_bfl_transformer(ref, tmp_path / "flux.safetensors", fp8=fp8)
    whole = load_transformer(_sources(path), dtype=torch.bfloat16, keep_fp8=False)

    threads: set[str] = set()
    read = weights.CheckpointFiles.read_rows_into

    def spy(self, key, r0, r1, out, dequantize=True):
        threads.add(threading.current_thread().name)
        return read(self, key, r0, r1, out, dequantize)

    monkeypatch.setattr(weights.CheckpointFiles, "read_rows_into", spy)
    monkeypatch.setattr(weights, "STAGING_BYTES", 512)            # a few rows per chunk
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        chunked = load_transformer(_sources(path), dtype=torch.bfloat16, keep_fp8=False)
    finally:
        torch.set_num_threads(n)
    assert any(t.startswith("leantune-load") for t in threads), threads      # the workers copied
    _assert_same_weights(chunked, whole)
