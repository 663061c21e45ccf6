"""Krea 2 beyond the conformance suite (tests/families): text encoding against Krea2Pipeline's own
(a batch of prompts of different lengths, the encoder in host RAM and read from its files), the
Turbo folder's schedule and samples, a LoRA's samples at strength 0.5, a full fine-tune's exports,
and the training noise levels on Krea 2's line."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from leantune.config import ModelConfig
from leantune.models.family import get_family
from leantune.tiny import krea2 as tk

PROMPTS = ["a photo of a cat", "a small orange ellipse next to a large purple square two shapes, a circle and a square"]
TEXT_LENGTH = 32


@pytest.fixture(scope="module")
def family():
    return get_family("krea2")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tk.save_krea2_folder(tmp_path_factory.mktemp("krea2") / "raw")


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import Krea2Pipeline

    p = Krea2Pipeline.from_pretrained(str(folder), local_files_only=True)
    p.set_progress_bar_config(disable=True)
    for m in p.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval().requires_grad_(False)
    return p


def sources(family, path, **model):
    return family.resolve_sources(ModelConfig(path=str(path), family="krea2", **model), Path("."))


@pytest.fixture(scope="module")
def loaded(family, folder):
    """The folder's text encoders, VAE and transformer as the family's loaders give them (read only)."""
    from types import SimpleNamespace

    src = sources(family, folder)
    return SimpleNamespace(encoders=family.load_text_encoders(src, torch.float32, "cpu"),
                           vae=family.load_vae(src, torch.float32, "cpu"),
                           transformer=family.load_transformer(src, torch.float32).eval().requires_grad_(False))


# -- text ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("from_files", [False, True], ids=["loaded", "file_backed"])
def test_encoding_equals_the_pipelines(family, folder, pipe, from_files):
    """Prompts of different lengths: the stacked hidden states and mask Krea2Pipeline.encode_prompt
    gives, bit for bit, with the encoder loaded or left in its files (read layer by layer); our rows
    are each prompt's real rows, fed back in the pipeline's layout with its mask."""
    from leantune.models.krea2 import text as krea2_text
    from leantune.models.streamed_encoder import is_file_backed, text_encoder_ram_budget

    with text_encoder_ram_budget(1 if from_files else None):
        encoders = family.load_text_encoders(sources(family, folder), torch.float32, "cpu")
    assert is_file_backed(encoders.text_encoder.language_model) == from_files
    assert encoders.select_layers == tk.SELECT_LAYERS
    want, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=TEXT_LENGTH)
    assert not bool(mask.all()) and mask.sum(1).tolist()[0] < mask.sum(1).tolist()[1]
    embeds, lengths = family.encode_prompts(PROMPTS, encoders, max_length=TEXT_LENGTH, device="cpu")
    assert embeds.t5.shape == (2, TEXT_LENGTH, want.shape[2] * want.shape[3]) and embeds.pooled.shape == (2, 0)
    assert lengths.tolist() == mask.sum(1).tolist()
    for i, n in enumerate(lengths.tolist()):
        assert torch.equal(embeds.t5[i, :n].view(n, *want.shape[2:]), want[i][mask[i]])
        assert not embeds.t5[i, n:].any()
    rows, got_mask = krea2_text.transformer_text(embeds.t5, want.shape[2])
    assert torch.equal(got_mask, mask)
    assert torch.equal(rows[mask], want[mask])


@pytest.mark.parametrize("from_files", [False, True], ids=["loaded", "file_backed"])
def test_comfyui_single_file_text_encoder_encodes_as_the_folder(family, folder, loaded, tmp_path, from_files):
    """Qwen3-VL as one file in ComfyUI's layout (bare `model.` language model, `visual.` tower, as
    Comfy-Org's qwen3vl_4b_bf16.safetensors and musubi-tuner read it; the tiny config in the
    metadata): [model] text_encoder = the file encodes exactly as the folder's encoder, loaded or
    read from the file layer by layer."""
    from leantune.models.krea2.loading import save_text_encoder_file
    from leantune.models.streamed_encoder import is_file_backed, text_encoder_ram_budget

    path = save_text_encoder_file(loaded.encoders.text_encoder, tmp_path / "qwen3vl_tiny.safetensors")
    names = load_file(str(path)).keys()
    assert "model.layers.0.self_attn.q_proj.weight" in names and "visual.blocks.0.attn.qkv.weight" in names
    with text_encoder_ram_budget(1 if from_files else None):
        encoders = family.load_text_encoders(sources(family, folder, text_encoder=str(path)), torch.float32, "cpu")
    assert is_file_backed(encoders.text_encoder.language_model) == from_files
    if not from_files:
        want_state = loaded.encoders.text_encoder.state_dict()
        got_state = encoders.text_encoder.state_dict()
        assert got_state.keys() == want_state.keys() and all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    got, n = family.encode_prompts(PROMPTS, encoders, max_length=TEXT_LENGTH, device="cpu")
    want, m = family.encode_prompts(PROMPTS, loaded.encoders, max_length=TEXT_LENGTH, device="cpu")
    assert torch.equal(n, m) and torch.equal(got.t5, want.t5)


def test_the_cache_trimmed_rows_give_the_pipelines_prediction(family, loaded, pipe):
    """A batch padded only to its longest prompt (as the cache batches trimmed entries) predicts
    what the pipeline's transformer predicts on its max_sequence_length rows, up to rounding."""
    embeds, lengths = family.encode_prompts(PROMPTS, loaded.encoders, max_length=TEXT_LENGTH, device="cpu")
    trimmed = type(embeds)(embeds.t5[:, : int(lengths.max())], embeds.pooled)
    want, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=TEXT_LENGTH)
    g = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(2, 6, 64, generator=g), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ref = pipe.transformer(hidden_states=x, encoder_hidden_states=want, timestep=sigma,
                               position_ids=pipe.prepare_position_ids(TEXT_LENGTH, 2, 3, "cpu"),
                               encoder_attention_mask=mask, return_dict=False)[0]
        full = family.predict(pipe.transformer, x, sigma, embeds, (4, 6))
        short = family.predict(pipe.transformer, x, sigma, trimmed, (4, 6))
    assert torch.equal(full, ref)
    torch.testing.assert_close(short, ref, rtol=1e-5, atol=1e-6)


# -- sampling --------------------------------------------------------------------------------------------

def _our_images(family, folder, transformer, vae, encoders, guidance, steps=2, negative=""):
    from leantune.infer.decode import decode_latents
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import denoise

    cfg = family.sampling.guides(guidance)
    encoded = encode_prompts_stage(encoders, [PROMPTS[0]], max_length=TEXT_LENGTH, device="cpu", family=family,
                                   negative_prompts=[negative] if cfg else None)
    embeds, neg = encoded if cfg else (encoded, None)
    schedule = family.sampling.schedule(family.sampling.variant(transformer), folder)
    latents = denoise(transformer, embeds, [3], width=64, height=48, steps=steps, guidance=guidance, schedule=schedule,
                      device="cpu", family=family, negative=neg, cfg_batched=False)
    return decode_latents(vae, latents, "cpu").permute(0, 2, 3, 1).numpy()


def _pipeline_images(pipe, guidance, steps=2):
    return pipe(prompt=PROMPTS[0], height=48, width=64, num_inference_steps=steps, guidance_scale=guidance,
                max_sequence_length=TEXT_LENGTH, generator=torch.Generator().manual_seed(3), output_type="np").images


def test_turbo_folder_samples_as_the_distilled_pipeline(family, tmp_path):
    """A folder whose model_index.json says is_distilled: the pipeline pins mu = 1.15 and samples
    without guidance at 0; ours follows it (the schedule's sigmas are the scheduler's), bit for bit."""
    from diffusers import Krea2Pipeline

    folder = tk.save_krea2_folder(tmp_path / "turbo", distilled=True)
    src = sources(family, folder)
    assert src.distilled
    schedule = family.sampling.schedule(family.sampling.variant(None), folder)
    assert (schedule.default_steps, schedule.default_guidance) == (8, 0.0)
    pipe = Krea2Pipeline.from_pretrained(str(folder), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    image_tokens = family.image_tokens(48 // 8, 64 // 8)
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=1.15)
    assert torch.equal(schedule.sigmas(4, image_tokens)[:-1], pipe.scheduler.sigmas[:-1].to(torch.float32))
    vae = family.load_vae(src, torch.float32, "cpu")
    transformer = family.load_transformer(src, torch.float32).eval().requires_grad_(False)
    encoders = family.load_text_encoders(src, torch.float32, "cpu")
    pipe = Krea2Pipeline(**{**pipe.components, "transformer": transformer, "vae": vae.vae},
                         text_encoder_select_layers=tk.SELECT_LAYERS, is_distilled=True)
    pipe.set_progress_bar_config(disable=True)
    for m in pipe.components.values():
        if isinstance(m, torch.nn.Module):
            m.eval().requires_grad_(False)
    ours = _our_images(family, folder, transformer, vae, encoders, 0.0)
    assert np.abs(ours - _pipeline_images(pipe, 0.0)).max() == 0.0


def test_a_lora_samples_as_the_pipelines_load_lora_weights_at_strength_half(family, folder, pipe, loaded, tmp_path):
    """A trained all_linear LoRA (our diffusers file) at strengths 1 and 0.5: our model with the LoRA
    applied at the strength predicts what Krea2Pipeline's transformer predicts after
    load_lora_weights + set_adapters(weight), bit for bit; and our sampler on that transformer gives
    the pipeline's images, bit for bit in fp32 (one transformer object for both: CPU kernels round
    1e-7 apart on equal weights elsewhere in memory); the two strengths' images differ."""
    import copy
    from types import SimpleNamespace

    from leantune.models.family import PromptEmbeds
    from leantune.train.lora import add_lora, apply_lora, lora_weights_from_model, read_lora, save_lora

    base, vae, encoders = loaded.transformer, loaded.vae, loaded.encoders
    model = copy.deepcopy(base)
    cfg = SimpleNamespace(rank=4, effective_alpha=8.0, alpha=8.0, dropout=0.0, targets="all_linear", blocks=None)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in add_lora(model, family.spec, cfg):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    path = save_lora(lora_weights_from_model(model), tmp_path / "lora_diffusers.safetensors", "diffusers")
    x, sigma = torch.randn(2, 6, 64, generator=g), torch.tensor([0.4, 0.9])
    text = torch.randn(2, 9, 96, generator=g)
    text[0, 6:] = 0
    embeds = PromptEmbeds(text, torch.zeros(2, 0))
    images = {}
    for strength in (1.0, 0.5):
        ours = copy.deepcopy(base)
        apply_lora(ours, read_lora(path), strength=strength)
        ours.eval().requires_grad_(False)
        theirs = copy.deepcopy(base)
        p = type(pipe)(**{**pipe.components, "transformer": theirs, "vae": vae.vae},
                       text_encoder_select_layers=tk.SELECT_LAYERS)
        p.set_progress_bar_config(disable=True)
        p.load_lora_weights(str(path), adapter_name="x")
        p.set_adapters(["x"], adapter_weights=[strength])
        theirs.eval().requires_grad_(False)
        with torch.no_grad():
            assert torch.equal(family.predict(ours, x, sigma, embeds, (4, 6)),
                               family.predict(theirs, x, sigma, embeds, (4, 6))), strength
        images[strength] = _our_images(family, folder, theirs, vae, encoders, 4.5)
        assert np.abs(images[strength] - _pipeline_images(p, 4.5)).max() == 0.0, strength
    assert np.abs(images[1.0] - images[0.5]).max() > 1e-4


# -- training --------------------------------------------------------------------------------------------

def test_training_noise_levels_follow_krea2s_line(family):
    """auto is krea2_shift: the logit-normal draw time-shifted by mu on the sampler's line
    (0.5 at 256 tokens, 1.15 at 6400; musubi-tuner's krea2_shift): at 1024 px (4096 tokens)
    mu = 0.90625, and the median draw 0.5 lands on e^mu / (e^mu + 1)."""
    from leantune.train import flow_matching as fm

    assert fm.sampling_method("auto", family) == "krea2_shift"
    assert fm.flux_mu(4096, fm.KREA2_MAX_SEQ_LEN) == pytest.approx(0.90625)
    assert fm.flux_mu(6400, fm.KREA2_MAX_SEQ_LEN) == pytest.approx(1.15)
    a = fm.sample_sigmas(64, "krea2_shift", torch.Generator().manual_seed(0), image_seq_len=4096)
    base = fm.sample_sigmas(64, "sigmoid", torch.Generator().manual_seed(0))
    e = math.exp(0.90625)
    torch.testing.assert_close(a, (e / (e + 1 / base - 1)).clamp(1e-4, 1 - 1e-4))


FULL = """
[model]
family = "krea2"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 1
cache_dir = "{cache}"
max_text_length = 32

[[data.datasets]]
path = "{images}"

[train]
mode = "full"
steps = 2
learning_rate = 1e-3
mixed_precision = "no"
seed = 3

[full]
save_dtype = "fp32"

[memory]
streamed_blocks = 2
stream_non_blocks = true
debug_poison = true
checkpointing = "blocks"

[output]
dir = "out"
name = "t"
formats = ["comfyui", "diffusers"]
"""


def test_full_finetune_exports_krea_ai_and_diffusers_files_with_the_trained_weights(family, folder, tmp_path):
    """A full fine-tune (every block streamed in poison mode, checkpointed) exports krea-ai's single
    file (official names, block modulation flattened) and a diffusers folder: our loader reads the
    single file's architecture from its shapes, both hold the same trained weights, and those are
    not the base's."""
    from diffusers import Krea2Transformer2DModel

    from leantune.config import load_config
    from leantune.demo import draw_shapes
    from leantune.trainer import train

    images = tmp_path / "images"
    draw_shapes(images, count=2, size=64, seed=5)
    (tmp_path / "run.toml").write_text(FULL.format(model=folder, cache=tmp_path / "cache", images=images))
    result = train(load_config(tmp_path / "run.toml", []), progress=False)
    assert len(result.losses) == 2 and all(math.isfinite(v) for v in result.losses)
    root = result.paths.root
    single = root / "t_comfyui.safetensors"
    keys = load_file(str(single)).keys()
    assert "blocks.0.attn.wq.weight" in keys and "txtfusion.projector.weight" in keys
    assert load_file(str(single))["blocks.0.mod.lin"].dim() == 1
    ours = family.load_transformer(sources(family, single, text_encoder=str(folder / "text_encoder"),
                                           tokenizer=str(folder / "tokenizer"), vae=str(folder / "vae")),
                                   dtype=torch.float32)
    theirs = Krea2Transformer2DModel.from_pretrained(str(root / "t_diffusers"), torch_dtype=torch.float32)
    base = Krea2Transformer2DModel.from_pretrained(str(folder / "transformer"), torch_dtype=torch.float32)
    a, b, c = ours.state_dict(), theirs.state_dict(), base.state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.startswith("transformer_blocks."))


# -- the planner --------------------------------------------------------------------------------------------

def test_plan_model_krea2_prices_the_stock_architecture_without_weights(capsys, tmp_path, monkeypatch):
    """`leantune plan --model krea2 | krea2-turbo`: the packaged architecture (krea-ai's 28 blocks
    of 6144; the planner over a 12.9B meta model, ~10 s), a LoRA plan within 16 GiB over the one
    block list, and the caching phase's Qwen3-VL-4B priced from the packaged config: the embedding
    table resident, 36 layers of the encoder's own shapes counted here by hand, all run."""
    from test_planner import _run_plan

    from leantune.models.component_files import packaged_config

    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))
    from leantune.planner.meta import build_meta_packaged

    meta = build_meta_packaged("krea2", "krea2")
    d, f, kv = 6144, 16384, 12 * 128
    block = 3 * d * d + 2 * d * kv + 3 * d * f + 6 * d + 2 * 128 + 2 * d     # q, gate, o; k, v; MLP; table; norms
    assert len(meta.transformer_blocks) == packaged_config("krea2")["num_layers"] == 28
    assert sum(p.numel() for p in meta.transformer_blocks[0].parameters()) == block
    assert 12.8e9 < sum(p.numel() for p in meta.parameters()) < 13.0e9       # "12.9B"
    docs = {}
    for model in ("krea2", "krea2-turbo"):
        rc, out, err = _run_plan(capsys, "--model", model, "--resolution", "1024", "--vram", "16GiB", "--ram",
                                 "64GiB", "--json")
        assert rc == 0, err
        docs[model] = __import__("json").loads(out)
    doc = docs["krea2"]
    entry = doc["plans"][0]
    notes = entry["plan"]["notes"]
    assert notes["predicted_peak_vram"] <= entry["budget_bytes"] - notes["margin_vram"]
    assert set(entry["plan"]["streamed_blocks"]) <= {f"transformer_blocks.{i}" for i in range(28)}
    phase = doc["text_encoding"]
    t = packaged_config("qwen3_vl_4b")["text_config"]
    h, i, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    layer = (h * t["num_attention_heads"] * hd * 2 + h * t["num_key_value_heads"] * hd * 2 + 3 * h * i
             + 2 * hd + 2 * h) * 2
    assert phase["resident"] == t["vocab_size"] * h * 2 + h * 2             # embedding + final norm (all run)
    assert phase["layer"] == layer and (phase["layers"], phase["layers_run"]) == (36, 36)
    assert phase["tokens"] == 8 * (512 + 34)
    assert docs["krea2-turbo"]["text_encoding"] == phase


# -- parity with krea-ai's own model -------------------------------------------------------------------------

def _official_inputs(cfg, seed: int = 5):
    """Inputs of krea-ai's forward (B = 2; 4 x 6 latents; 9 text rows, the first prompt with 6 real
    ones laid out as the pipeline lays them, [1 prompt row | 3 padding | 5 suffix], its padding
    random, not zero) and the same conditioning as our PromptEmbeds (real rows first, zeros after)."""
    from leantune.models.family import PromptEmbeds
    from leantune.models.krea2 import position_ids

    g = torch.Generator().manual_seed(seed)
    n_layers, d = cfg.num_text_layers, cfg.text_hidden_dim
    img = torch.randn(2, 6, cfg.in_channels, generator=g)
    context = torch.randn(2, 9, n_layers, d, generator=g)
    text_mask = torch.ones(2, 9, dtype=torch.bool)
    text_mask[0, 1:4] = False
    t = torch.tensor([0.35, 0.8])
    pos = position_ids(9, 2, 3)[None].expand(2, -1, -1)
    mask = torch.cat([text_mask, torch.ones(2, 6, dtype=torch.bool)], dim=1)
    rows = torch.zeros(2, 9, n_layers * d)
    for i in range(2):
        real = context[i][text_mask[i]]
        rows[i, : real.shape[0]] = real.reshape(real.shape[0], -1)
    return img, context, t, pos, mask, PromptEmbeds(rows, torch.zeros(2, 0))


def _reference(sd, cfg, img, context, t, pos, mask):
    from krea2_reference import reference_forward

    return reference_forward(sd, img, context, t, pos, mask, heads=cfg.num_attention_heads,
                             kv_heads=cfg.num_key_value_heads, text_heads=cfg.text_num_attention_heads,
                             text_kv_heads=cfg.text_num_key_value_heads, theta=cfg.rope_theta)


def test_loaded_official_file_forward_and_gradients_equal_krea_ais_model(family, tmp_path):
    """A seeded tiny model in krea-ai's layout (the official file's names, no prefix): leantune's
    loader reads it (architecture from the shapes) and its forward through `predict` equals krea-ai's
    model (tests/krea2_reference.py, an independent model of mmdit.py) on the official inputs, the
    padded text rows included, and so do the gradients of every weight, mapped by name."""
    from leantune.models.krea2 import keys as krea2_keys
    from leantune.models.krea2.loading import save_single_file

    path = save_single_file(tk.krea2_transformer(0), tmp_path / "krea2-tiny.safetensors")
    sd = {k: v.clone().requires_grad_(True) for k, v in load_file(str(path)).items()}
    assert "blocks.0.mod.lin" in sd and sd["blocks.0.mod.lin"].dim() == 1
    model = family.load_transformer(sources(family, path), dtype=torch.float32).train()
    cfg = model.config
    img, context, t, pos, mask, embeds = _official_inputs(cfg)
    w = torch.randn(2, 6, cfg.in_channels, generator=torch.Generator().manual_seed(9))
    want = _reference(sd, cfg, img, context, t, pos, mask)
    got = family.predict(model, img, t, embeds, (4, 6))
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    (want * w).sum().backward()
    (got * w).sum().backward()
    params = dict(model.named_parameters())
    assert len(params) == len(sd)
    for native, ref in sd.items():
        p = params[krea2_keys.to_diffusers(native)]
        torch.testing.assert_close(p.grad.reshape(ref.shape), ref.grad, rtol=1e-4, atol=1e-6, msg=native)


@pytest.mark.parametrize("fp8", [None, "e4m3", "scaled"], ids=["bf16", "e4m3", "scaled"])
def test_comfyui_files_bf16_and_fp8_compute_as_krea_ai_on_their_values(family, tmp_path, fp8):
    """ComfyUI's repackaged files (model.diffusion_model. prefix): bf16, or fp8 plain e4m3 or scaled
    with a per-tensor scale_weight. fp8 block Linears stay float8_e4m3fn in the loaded model, the
    rest loads in the compute dtype, and the forward equals krea-ai's model on the file's
    (dequantized) values; the output stays near the fp32 source's."""
    from leantune.models.krea2.keys import COMFY_PREFIX
    from leantune.models.krea2.loading import save_single_file

    tiny = tk.krea2_transformer(0)
    path = save_single_file(tiny, tmp_path / f"krea2_{fp8}.safetensors", fp8=fp8, prefix=COMFY_PREFIX,
                            dtype=torch.bfloat16)
    raw = load_file(str(path))
    sd = {}
    for key, v in raw.items():
        if key.endswith(("scale_weight", "scaled_fp8")):
            continue
        name = key[len(COMFY_PREFIX):]
        scale = raw.get(key[: -len("weight")] + "scale_weight") if key.endswith(".weight") else None
        sd[name] = v.float() * (scale.float() if scale is not None else 1.0) if v.dtype == torch.float8_e4m3fn else v.float()
    model = family.load_transformer(sources(family, path), dtype=torch.float32)
    block_dtype = torch.float32 if fp8 is None else torch.float8_e4m3fn
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == block_dtype
    assert model.transformer_blocks[1].ff.down.weight.dtype == block_dtype
    assert model.img_in.weight.dtype == torch.float32 and model.transformer_blocks[0].scale_shift_table.dtype == torch.float32
    cfg = model.config
    img, context, t, pos, mask, embeds = _official_inputs(cfg)
    with torch.no_grad():
        got = family.predict(model, img, t, embeds, (4, 6))
        want = _reference(sd, cfg, img, context, t, pos, mask)
        exact = family.predict(tiny, img, t, embeds, (4, 6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


# -- leantune convert: other trainers' Krea 2 LoRAs -------------------------------------------------------------
#
# Each trainer's file layout, modelled from its code (not copied):
# - musubi-tuner (kohya-ss/musubi-tuner 30c658c, networks/lora_krea2.py + networks/lora.py): every Linear
#   of krea-ai's model (target modules None), `lora_unet_<module path with _>.lora_down.weight`,
#   `.lora_up.weight`, `.alpha` (delta = alpha / rank * up @ down);
# - ai-toolkit (ostris/ai-toolkit 27a03a91, extensions_built_in/diffusion_models/krea2/krea2.py
#   convert_lora_weights_before_save + toolkit/network_mixins.py peft_format): krea-ai's module paths,
#   `diffusion_model.<path>.lora_A.weight` / `.lora_B.weight`, no alpha (alpha = rank);
# - diffusion-pipe (tdrussell/diffusion-pipe 8f83dbf, models/krea2.py get_target_modules +
#   models/base.py ComfyPipeline.save_adapter): the Linears of the blocks, the text fusion and txtmlp
#   (not first / last / tmlp / tproj), peft's `diffusion_model.<path>.lora_A.weight` / `.lora_B.weight`,
#   metadata {"format": "pt"}, alpha = rank.

def _native_linears(model) -> dict[str, tuple[int, int]]:
    """krea-ai module path -> (out, in) of every Linear of a tiny Krea 2."""
    from leantune.models.krea2.keys import to_native

    return {to_native(f"{n}.weight")[: -len(".weight")]: tuple(m.weight.shape)
            for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _trainer_file(layout: str, linears: dict, rank: int = 4):
    """(tensors, metadata, {module path: delta}) of a random LoRA in `layout`."""
    g = torch.Generator().manual_seed(21)
    tensors, deltas = {}, {}
    for path, (out, inp) in linears.items():
        if layout == "diffusion-pipe" and path.split(".")[0] in ("first", "last", "tmlp", "tproj"):
            continue
        r = min(rank, out, inp)
        down, up = torch.randn(r, inp, generator=g) * 0.1, torch.randn(out, r, generator=g) * 0.1
        if layout == "musubi-tuner":
            alpha = 2.0
            stem = "lora_unet_" + path.replace(".", "_")
            tensors.update({f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up,
                            f"{stem}.alpha": torch.tensor(alpha)})
            deltas[path] = alpha / r * up @ down
        else:
            tensors.update({f"diffusion_model.{path}.lora_A.weight": down, f"diffusion_model.{path}.lora_B.weight": up})
            deltas[path] = up @ down
    metadata = {"format": "pt"} if layout == "diffusion-pipe" else {}
    return tensors, metadata, deltas


@pytest.mark.parametrize("layout", ["musubi-tuner", "ai-toolkit", "diffusion-pipe"])
def test_convert_reads_other_trainers_krea2_loras(family, folder, pipe, tmp_path, layout):
    """`leantune convert` on a musubi-tuner / ai-toolkit / diffusion-pipe Krea 2 LoRA (the family told
    from its names alone) writes a ComfyUI file whose every key ComfyUI's Krea2 key map loads with the
    source's deltas, and a diffusers file whose deltas Krea2Pipeline.load_lora_weights applies; where
    diffusers reads the source itself (its Krea 2 converter takes the diffusion_model. layouts), our
    diffusers file gives its output."""
    import copy

    from comfyui_keymap import comfyui_load, comfyui_native_state

    from leantune.cli import main
    from leantune.io import save_safetensors
    from leantune.models.krea2.keys import to_diffusers
    from leantune.train.lora import lora_layers, read_lora

    tiny = tk.krea2_transformer(0).eval().requires_grad_(False)
    tensors, metadata, deltas = _trainer_file(layout, _native_linears(tiny))
    src = save_safetensors(tensors, tmp_path / f"{layout}.safetensors", metadata=metadata)
    assert read_lora(src).keys is family.spec.lora_keys
    comfy, diff = tmp_path / "comfyui.safetensors", tmp_path / "diffusers.safetensors"
    assert main(["convert", str(src), str(comfy), "--to", "comfyui"]) == 0
    assert main(["convert", str(src), str(diff), "--to", "diffusers"]) == 0
    # ComfyUI: every key loads, onto the native weights, with the source's deltas
    native = comfyui_native_state("krea2", tiny)
    load = comfyui_load("krea2", native, load_file(str(comfy)))
    assert not load.skipped and load.loaded == set(load_file(str(comfy)))
    assert set(load.deltas) == {f"{p}.weight" for p in deltas}
    for path, delta in deltas.items():
        torch.testing.assert_close(load.deltas[f"{path}.weight"], delta, rtol=1e-5, atol=1e-7, msg=path)
    # diffusers: load_lora_weights gives the deltas on diffusers' module names
    ours = type(pipe)(**{**pipe.components, "transformer": copy.deepcopy(tiny)},
                      text_encoder_select_layers=tk.SELECT_LAYERS)
    ours.load_lora_weights(str(diff), adapter_name="x")
    layers = lora_layers(ours.transformer, "x")
    assert set(layers) == {to_diffusers(f"{p}.weight")[: -len(".weight")] for p in deltas}
    for path, delta in deltas.items():
        got = layers[to_diffusers(f"{path}.weight")[: -len(".weight")]].get_delta_weight("x")
        torch.testing.assert_close(got, delta, rtol=1e-5, atol=1e-7, msg=path)
    if layout != "musubi-tuner":          # diffusers' converter reads the diffusion_model. layouts itself
        theirs = type(pipe)(**{**pipe.components, "transformer": copy.deepcopy(tiny)},
                            text_encoder_select_layers=tk.SELECT_LAYERS)
        theirs.load_lora_weights(str(src), adapter_name="x")
        img, _, t, _, _, embeds = _official_inputs(tiny.config)
        with torch.no_grad():
            a = family.predict(ours.transformer.eval(), img, t, embeds, (4, 6))
            b = family.predict(theirs.transformer.eval(), img, t, embeds, (4, 6))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_folders_under_the_wrong_family_are_refused_naming_the_family(family, folder, tmp_path):
    """A Krea 2 folder under [model] family = "qwen-image" is refused before anything is read, naming
    krea2; a Qwen-Image folder under krea2 names qwen-image."""
    from leantune.models.weights import LoadError
    from leantune.tiny.qwen_image import save_qwen_image_folder

    with pytest.raises(LoadError, match='Krea 2 model.*set \\[model\\] family = "krea2"'):
        get_family("qwen-image").resolve_sources(ModelConfig(path=str(folder), family="qwen-image"), Path("."))
    qwen = save_qwen_image_folder(tmp_path / "qwen")
    with pytest.raises(LoadError, match='set \\[model\\] family = "qwen-image"'):
        sources(family, qwen)


def test_fp8_storage_quantizes_the_block_linears_while_loading(family, folder, loaded):
    """[memory] fp8 (family.fp8_load_options): every block Linear of the bf16 folder becomes
    block-scaled e4m3 as it is read, nothing outside the blocks and no block modulation table does,
    and the output stays within fp8's error of the plain load."""
    from types import SimpleNamespace

    from leantune.models.family import fp8_load_options

    opts = fp8_load_options(SimpleNamespace(fp8=True, fp8_modulation="auto", vram_budget=None))
    model = family.load_transformer(sources(family, folder), dtype=torch.float32, **opts)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    in_blocks = {n for n in linears if n.startswith("transformer_blocks.")}
    assert in_blocks and all(linears[n].weight.dtype == torch.float8_e4m3fn for n in in_blocks)
    assert all(linears[n].weight.dtype == torch.float32 for n in set(linears) - in_blocks)
    assert model.transformer_blocks[0].scale_shift_table.dtype == torch.float32
    img, _, t, _, _, embeds = _official_inputs(model.config)
    with torch.no_grad():
        got = family.predict(model, img, t, embeds, (4, 6))
        want = family.predict(loaded.transformer, img, t, embeds, (4, 6))
    err = ((got - want).norm() / want.norm()).item()
    assert 0 < err < 0.05, err


def test_bf16_load_keeps_the_norms_in_fp32_as_diffusers_does(family, folder):
    """In bf16 the RMSNorm scales (1 + weight) stay float32, as Krea2Transformer2DModel.from_pretrained
    (torch_dtype=bfloat16) keeps its _keep_in_fp32_modules: every tensor has diffusers' dtype and value."""
    from diffusers import Krea2Transformer2DModel

    ours = family.load_transformer(sources(family, folder), dtype=torch.bfloat16).state_dict()
    theirs = Krea2Transformer2DModel.from_pretrained(str(folder / "transformer"), torch_dtype=torch.bfloat16,
                                                     local_files_only=True).state_dict()
    assert ours.keys() == theirs.keys()
    assert ours["transformer_blocks.0.attn.norm_q.weight"].dtype == torch.float32
    assert ours["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k
