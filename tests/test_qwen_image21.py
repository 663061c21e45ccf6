"""Qwen-Image-2.1 (issue 35): the tiny preset, loading of the diffusers folder and of the single
files, text encoding and the transformer call, each against diffusers' / the pipeline's own (the
modules of leantune/models/qwen_image21/ called directly), and what the registered family
(`qwen-image-2.1`) does beyond the conformance suite's promises (tests/families): samples through
leantune's sampler at a size the model takes, the kohya LoRA files of each adapter type in
ComfyUI's generic key map, [model] processor.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from leantune.models.qwen_image21 import keys, loading, text
from leantune.models.weights import LoadError
from leantune.tiny import qwen_image21 as tq

RES = tq.TINY_RESOLUTION
PROMPTS = ["a photo of a cat", "a small orange ellipse next to a large purple square two shapes"]


def _rgba(seed: int, size=(RES, RES)) -> Image.Image:
    """A reference with a real alpha channel (half transparent, half opaque)."""
    rng = np.random.RandomState(seed)
    pixels = (rng.rand(size[1], size[0], 4) * 255).astype(np.uint8)
    pixels[:, : size[0] // 2, 3] = 0
    pixels[:, size[0] // 2:, 3] = 255
    return Image.fromarray(pixels, "RGBA")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tq.save_qwen_image21_folder(tmp_path_factory.mktemp("qwen_image21") / "model")


@pytest.fixture(scope="module")
def pipe(folder):
    p = tq.load_qwen_image21_pipeline(folder)
    p.set_progress_bar_config(disable=True)
    return p


def _sources(path, **override):
    cfg = SimpleNamespace(path=str(path), family=None, transformer=None, text_encoder=None, processor=None, vae=None)
    for k, v in override.items():
        setattr(cfg, k, v)
    return loading.resolve_sources(cfg, Path("."))


def _sample(p, image=None, **kw):
    return p("a red cube on a table", image=image, num_inference_steps=2, output_resolution=RES, output_type="np",
             generator=torch.Generator().manual_seed(0), **kw).images


# -- (1) the tiny preset ---------------------------------------------------------------------------------

def test_the_tiny_folder_loads_in_diffusers_and_samples_as_the_pipeline_it_was_saved_from(folder, pipe):
    """The folder holds every component in the published layout (model_index names transformers'
    Qwen3VLProcessor); QwenImage21Pipeline.from_pretrained reads it, and its samples equal those
    of the in-memory pipeline it was written from, bit for bit, for text to image and for an
    edit with one RGBA reference, which the pipeline decodes to RGBA."""
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline" and index["processor"] == ["transformers", "Qwen3VLProcessor"]
    assert {p.name for p in folder.iterdir()} >= {"transformer", "text_encoder", "processor", "vae", "scheduler"}
    built = tq.qwen_image21_pipeline()
    built.set_progress_bar_config(disable=True)
    for name in ("transformer", "vae", "text_encoder"):
        want = getattr(built, name).state_dict()
        got = getattr(pipe, name).state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    t2i, edit = _sample(pipe), _sample(pipe, image=[_rgba(1)])
    assert t2i.shape == (1, RES, RES, 4) and edit.shape == (1, RES, RES, 4)
    assert np.array_equal(t2i, _sample(built)) and np.array_equal(edit, _sample(built, image=[_rgba(1)]))
    assert np.abs(t2i - edit).max() > 1e-3          # the reference conditions the sample
    # The system message is dropped by its own token count, derived from the folder's chat template.
    assert pipe._drop_idx == text.drop_count(pipe.processor.tokenizer) > 5


def test_the_tiny_transformer_is_block_causal_as_released(pipe):
    """causal_condition is on (the released config), so the pipeline's prefix KV cache is used;
    with it and without it the fp32 samples agree, as the pipeline documents."""
    assert pipe.transformer.config.causal_condition
    cached, uncached = _sample(pipe, image=[_rgba(2)]), _sample(pipe, image=[_rgba(2)], use_kv_cache=False)
    np.testing.assert_allclose(cached, uncached, atol=1e-4)


# -- (2) the diffusers folder ----------------------------------------------------------------------------

def _inputs(transformer, n_refs: int, seed: int = 0):
    """Transformer inputs laid out as the pipeline lays them: text rows with `n_refs` runs of image
    slots, the references' latent tokens, then the target's; img_mask with the target's slots."""
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    side = RES // 16
    ref_tokens, slots = side * side, (side // 2) ** 2
    text_rows = 6 + n_refs * slots
    slot_mask = torch.zeros(1, text_rows, dtype=torch.bool)
    for r in range(n_refs):
        slot_mask[0, 3 + r * slots: 3 + (r + 1) * slots] = True
    img_mask = torch.cat([slot_mask, torch.ones(1, slots, dtype=torch.bool)], dim=1)
    return dict(hidden_states=torch.randn(1, ref_tokens * (n_refs + 1), cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, text_rows, cfg.context_in_dim, generator=g),
                timestep=torch.tensor([0.7]), img_shapes=[[(1, side, side)] * (n_refs + 1)], img_mask=img_mask,
                return_dict=False)


def _forward_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)[0]
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_folders_transformer_equals_diffusers_own_load(folder):
    """load_transformer builds on meta and fills tensor by tensor; every weight equals
    QwenImage21Transformer2DModel.from_pretrained's, and so do the forward (one reference, the
    block-causal mask) and every parameter's gradient, exactly."""
    from diffusers import QwenImage21Transformer2DModel

    want = QwenImage21Transformer2DModel.from_pretrained(folder / "transformer", dtype=torch.float32)
    got = loading.load_transformer(_sources(folder), torch.float32)
    def arch(m):
        return {k: v for k, v in dict(m.config).items() if not k.startswith("_")}

    assert arch(got) == arch(want)
    sw, sg = want.state_dict(), got.state_dict()
    assert sw.keys() == sg.keys() and all(torch.equal(sw[k], sg[k]) for k in sw)
    inputs = _inputs(want, n_refs=1)
    out_w, grads_w = _forward_and_grads(want.train(), inputs)
    out_g, grads_g = _forward_and_grads(got.train(), inputs)
    # The joint sequence: text rows with each reference's slots replaced by its 4x as many latent
    # tokens, then the target's tokens.
    rows = inputs["encoder_hidden_states"].shape[1]
    joint = rows - int(inputs["img_mask"][0, :rows].sum()) + inputs["hidden_states"].shape[1]
    assert torch.equal(out_w, out_g) and out_w.shape == (1, joint, 64)
    assert grads_w.keys() == grads_g.keys() and all(torch.equal(grads_w[k], grads_g[k]) for k in grads_w)
    assert all(bool(g.abs().sum() > 0) for g in grads_w.values())


def test_meta_build_and_bf16(folder):
    """device="meta" reads no weight and gives the shapes; bf16 loads every tensor in bf16 equal
    to the fp32 weights rounded."""
    fp32 = loading.load_transformer(_sources(folder), torch.float32).state_dict()
    meta = loading.load_transformer(_sources(folder), torch.bfloat16, device="meta").state_dict()
    bf16 = loading.load_transformer(_sources(folder), torch.bfloat16).state_dict()
    assert all(meta[k].is_meta and meta[k].shape == fp32[k].shape for k in fp32)
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    assert loading.describe(loading.load_transformer(_sources(folder), device="meta")) == \
        "Qwen-Image-2.1 (2 single-stream blocks, width 32)"


def test_the_folders_vae_equals_diffusers_own_load_and_keeps_alpha(folder, pipe):
    """The RGBA VAE from vae/ equals AutoencoderKLQwenImage21.from_pretrained's: its encoding of a
    four-channel image, and the alpha channel changes the latents."""
    vae = loading.load_vae(_sources(folder), torch.float32)
    ref = pipe.image_processor.preprocess(_rgba(3), width=RES, height=RES).unsqueeze(2)
    assert ref.shape[1] == 4
    want = pipe.vae.encode(ref).latent_dist.mode()
    assert torch.equal(vae.encode(ref).latent_dist.mode(), want) and want.shape[1] == 64
    opaque = ref.clone()
    opaque[:, 3] = 1.0
    assert not torch.allclose(vae.encode(opaque).latent_dist.mode(), want)


def test_a_folder_with_a_missing_or_misshapen_weight_is_named(folder, tmp_path):
    import shutil

    bad = tmp_path / "transformer"
    shutil.copytree(folder / "transformer", bad)
    weights = bad / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    del state["transformer_blocks.1.attn.to_k.weight"]
    save_file(state, weights)
    with pytest.raises(LoadError, match=r"transformer_blocks\.1\.attn\.to_k\.weight"):
        loading.load_transformer(_sources(folder, transformer=str(bad)), torch.float32)
    state["transformer_blocks.1.attn.to_k.weight"] = torch.zeros(5, 32)
    save_file(state, weights)
    with pytest.raises(LoadError, match=r"transformer_blocks\.1\.attn\.to_k\.weight"):
        loading.load_transformer(_sources(folder, transformer=str(bad)), torch.float32)


# -- (3) text encoding -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def encoders(folder):
    return loading.load_text_encoders(_sources(folder), torch.float32, "cpu")


def _resized(p, image):
    """A reference at the size the pipeline encodes it (its __call__ resizes before encode_prompt)."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    w, h, _ = calculate_dimensions(RES * RES, image.size[0] / image.size[1])
    return p.image_processor.resize(image, width=w, height=h)


@pytest.mark.parametrize("n_refs", [0, 1, 3])
def test_encoding_equals_the_pipelines_encode_prompt(pipe, encoders, n_refs):
    """Two prompts of different lengths (left padded in one batch), with no reference, one, and
    three of different sizes in RGBA: our rows, image-slot masks and padding mask, stacked as the
    pipeline stacks them, equal QwenImage21Pipeline.encode_prompt's bit for bit; each reference
    takes one slot per 32x32 pixels; the hidden states are the last layer's before the final norm."""
    refs = [_resized(pipe, _rgba(10 + i, size=(RES + 32 * i, RES))) for i in range(n_refs)]
    want, want_mask, want_slots = pipe.encode_prompt(PROMPTS, image=refs or None, device="cpu")
    got = text.encode_prompts(PROMPTS, encoders, images=refs)
    embeds, mask, slots = text.pipeline_layout(got)
    assert torch.equal(embeds, want) and torch.equal(slots, want_slots)
    assert mask is not None and want_mask is not None and torch.equal(mask, want_mask.long())
    per_image = [(r.size[0] // 32) * (r.size[1] // 32) for r in refs]
    assert [int(e.image_slots.sum()) for e in got] == [sum(per_image)] * 2
    assert got[0].embeds.shape[0] < got[1].embeds.shape[0]
    # Not the normed output: the final RMSNorm applied to our rows differs from them.
    norm = encoders.text_encoder.model.language_model.norm
    assert not torch.allclose(norm(got[0].embeds), got[0].embeds, atol=1e-3)


def test_the_language_model_left_in_its_files_encodes_the_same(folder, pipe, encoders):
    """Over the host-RAM budget Qwen3-VL's language model stays in its files and its decoder layers
    are read one at a time (streamed_encoder.py), while the vision tower is read into host RAM:
    encodings with no reference and with two equal the loaded encoder's bit for bit."""
    from leantune.models.streamed_encoder import is_file_backed, text_encoder_ram_budget

    with text_encoder_ram_budget(1):
        backed = loading.load_text_encoders(_sources(folder), torch.float32, "cpu")
    assert is_file_backed(backed.text_encoder.model.language_model)
    assert not any(p.is_meta for p in backed.text_encoder.model.visual.parameters())
    for refs in ([], [_resized(pipe, _rgba(30)), _resized(pipe, _rgba(31))]):
        for a, b in zip(text.encode_prompts(PROMPTS, backed, images=refs),
                        text.encode_prompts(PROMPTS, encoders, images=refs)):
            assert torch.equal(a.embeds, b.embeds) and torch.equal(a.image_slots, b.image_slots)
    assert int(a.image_slots.sum()) == 2 * (RES // 32) ** 2


def test_the_alpha_is_flattened_over_white_for_the_encoder_only(pipe, encoders):
    """An RGBA reference encodes as the same image composited over white in RGB (the pipeline's
    rule); a different background would change the encoding."""
    ref = _resized(pipe, _rgba(20))
    white = Image.new("RGB", ref.size, (255, 255, 255))
    white.paste(ref, mask=ref.getchannel("A"))
    black = Image.new("RGB", ref.size, (0, 0, 0))
    black.paste(ref, mask=ref.getchannel("A"))
    rgba, over_white, over_black = (text.encode_prompts(PROMPTS[:1], encoders, images=[im])[0].embeds
                                    for im in (ref, white, black))
    assert torch.equal(rgba, over_white) and not torch.allclose(rgba, over_black)


# -- (4) single files --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder_transformer(folder):
    return loading.load_transformer(_sources(folder), torch.float32)


def _diffusers_single_file(path, folder):
    """diffusers' own reader of these layouts (from_single_file with the folder's config)."""
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                          torch_dtype=torch.float32, local_files_only=True)


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


@pytest.mark.parametrize("layout", ["official", "comfyui"])
def test_single_files_load_as_diffusers_reads_them(folder, folder_transformer, tmp_path, layout):
    """The official layout (diffusers names, no prefix) and ComfyUI's (model.diffusion_model., each
    block's gate and up fused, gate rows first): written by save_single_file, read back by our
    loader with the architecture from the shapes (the tiny rotary split from the metadata), and by
    diffusers' from_single_file (its convert_qwen_image21_transformer_checkpoint_to_diffusers):
    both give the folder's weights exactly."""
    path = loading.save_single_file(folder_transformer, tmp_path / f"{layout}.safetensors", layout=layout)
    stored = load_file(path)
    fused = [k for k in stored if k.endswith(keys.FUSED)]
    if layout == "comfyui":
        assert all(k.startswith(keys.COMFY_PREFIX) for k in stored) and len(fused) == 2
        assert not any("gate_layer" in k or "img_mlp.proj" in k for k in stored)
        assert stored[keys.COMFY_PREFIX + "transformer_blocks.0." + keys.FUSED].shape == (192, 32)
    else:
        assert set(stored) == set(folder_transformer.state_dict()) and not fused
    ours = loading.load_transformer(_sources(path), torch.float32)
    assert {k: v for k, v in dict(ours.config).items() if not k.startswith("_")} == \
        {k: v for k, v in dict(folder_transformer.config).items() if not k.startswith("_")}
    assert _same_weights(ours, folder_transformer)
    assert _same_weights(_diffusers_single_file(path, folder), folder_transformer)


def test_a_comfyui_scaled_fp8_file_keeps_its_block_weights_e4m3(folder_transformer, tmp_path):
    """ComfyUI's scaled fp8 (per-tensor scale_weight, the fused gate_up included): the block
    Linears stay e4m3 with their scale, split along with the fused weight; the norms and every
    weight outside the blocks load in the compute dtype; the forward matches the dequantized
    weights'."""
    path = loading.save_single_file(folder_transformer, tmp_path / "fp8.safetensors", fp8="scaled", layout="comfyui")
    model = loading.load_transformer(_sources(path), torch.float32)
    state = model.state_dict()
    block = "transformer_blocks.0."
    for name in ("attn.to_q", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj", "img_mlp.out"):
        assert state[f"{block}{name}.weight"].dtype == torch.float8_e4m3fn, name
    assert state[f"{block}attn.norm_q.weight"].dtype == torch.float32
    assert state["img_in.weight"].dtype == torch.float32 and state["modulation.1.weight"].dtype == torch.float32
    from leantune.models.component_loading import dequantized_state

    plain = dequantized_state(state)
    for name in ("img_mlp.gate_layer", "img_mlp.proj"):
        w = plain[f"{block}{name}.weight"]
        ref = folder_transformer.state_dict()[f"{block}{name}.weight"]
        assert (w - ref).abs().max() <= ref.abs().max() / 8       # e4m3 rounding, not the other half's rows
    inputs = _inputs(folder_transformer, n_refs=1)
    with torch.no_grad():
        out = model(**inputs)[0]
        want = folder_transformer(**inputs)[0]
    assert torch.allclose(out, want, atol=0.15) and not torch.equal(out, want)


def test_other_families_files_and_foreign_keys_are_refused_by_name(folder_transformer, tmp_path):
    """A Krea 2 or Qwen-Image transformer file is not read as Qwen-Image-2.1 (the message names the
    file and what it lacks); a Qwen-Image-2.1 file with a stray key names that key; a missing key
    is named in the file's own layout (the fused name for ComfyUI's)."""
    from leantune.tiny.krea2 import krea2_transformer
    from leantune.tiny.qwen_image import qwen_image_transformer

    for name, model in (("krea2", krea2_transformer()), ("qwen_image", qwen_image_transformer())):
        path = tmp_path / f"{name}.safetensors"
        save_file({keys.COMFY_PREFIX + k: v.contiguous() for k, v in model.state_dict().items()}, path)
        with pytest.raises(LoadError, match=rf"{path.name}: not a Qwen-Image-2.1 transformer"):
            loading.load_transformer(_sources(path), torch.float32)
    from safetensors import safe_open

    path = loading.save_single_file(folder_transformer, tmp_path / "c.safetensors", layout="comfyui")
    state = load_file(path)
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()            # the tiny rotary split
    stray = dict(state, **{keys.COMFY_PREFIX + "extra_head.weight": torch.zeros(2, 2)})
    save_file(stray, tmp_path / "stray.safetensors", metadata=meta)
    with pytest.raises(LoadError, match=r"stray\.safetensors.*extra_head\.weight"):
        loading.load_transformer(_sources(tmp_path / "stray.safetensors"), torch.float32)
    fused = keys.COMFY_PREFIX + "transformer_blocks.1." + keys.FUSED
    del state[fused]
    save_file(state, tmp_path / "missing.safetensors", metadata=meta)
    with pytest.raises(LoadError, match=rf"missing\.safetensors.*{fused.replace('.', '[.]')}"):
        loading.load_transformer(_sources(tmp_path / "missing.safetensors"), torch.float32)


def test_the_packaged_full_size_config_is_the_7b_and_reads_back_from_its_shapes():
    """models/configs/qwen_image21.json builds on meta to about 7B parameters (issue 35: a 7B DiT of
    32 blocks), and config_from_shapes gives it back from the shapes alone (no metadata: the
    released rotary split, epsilon and block-causal conditioning are the defaults)."""
    from diffusers import QwenImage21Transformer2DModel

    from leantune.models.component_files import packaged_config
    from leantune.models.weights import build_empty

    config = packaged_config("qwen_image21")
    model = build_empty(lambda: QwenImage21Transformer2DModel.from_config(config))
    assert 6.5e9 < sum(p.numel() for p in model.parameters()) < 7.5e9 and len(model.transformer_blocks) == 32
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    arch = {k: v for k, v in config.items() if not k.startswith("_")}
    assert keys.config_from_shapes(shapes, {}, "x") == arch
    assert keys.metadata(model) == {}


# -- latents and the transformer call ------------------------------------------------------------------

def test_latents_round_trip_and_equal_the_pipelines_encoding(pipe, folder):
    """pack/unpack are inverse and equal the pipeline's _pack_latents/_unpack_latents; encode equals
    the pipeline's _encode_vae_image (mode, normalized) on an RGBA reference."""
    from leantune.models.qwen_image21 import latents as lat

    x = torch.randn(2, 64, 4, 6)
    packed = lat.pack_latents(x)
    assert torch.equal(packed, pipe._pack_latents(x, 2, 64, 4, 6))
    assert torch.equal(lat.unpack_latents(packed, 4, 6), x)
    assert torch.equal(pipe._unpack_latents(packed, 4 * 16, 6 * 16, 16)[:, :, 0], x)
    vae = loading.load_vae(_sources(folder), torch.float32)
    pixels = pipe.image_processor.preprocess(_rgba(40), width=RES, height=RES)
    want = pipe._encode_vae_image(pixels.unsqueeze(2), None)[:, :, 0]
    assert torch.equal(lat.encode(vae, pixels), want)
    with pytest.raises(ValueError, match="RGBA"):
        lat.encode(vae, pixels[:, :3])


def _our_sample(pipe, transformer, encoders, vae, prompt, image, steps, noise):
    """An Euler loop over our text encoding, reference latents and predict (KV cache as the
    pipeline uses it), with the pipeline's scheduler settings."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift
    from leantune.models.qwen_image21 import forward
    from leantune.models.qwen_image21 import latents as lat
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    refs = [_resized(pipe, image)] if image is not None else []
    embeds, mask, slots = text.pipeline_layout(text.encode_prompts([prompt], encoders, images=refs))
    ref_latents = [lat.encode(vae, pipe.image_processor.preprocess(r, width=r.size[0], height=r.size[1]))
                   for r in refs]
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    c = scheduler.config
    mu = calculate_shift(noise.shape[1], c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    scheduler.set_begin_index(0)
    cache = QwenImage21KVCache(len(transformer.transformer_blocks))
    x = noise
    side = RES // 16
    for i, t in enumerate(scheduler.timesteps):
        v = forward.predict(transformer, x, t.expand(1).to(x.dtype) / 1000, embeds, mask, slots, (side, side),
                            references=ref_latents, kv_cache=cache, kv_mode="extract" if i == 0 else "cached")
        x = scheduler.step(v, t, x, return_dict=False)[0]
    return x


@pytest.mark.parametrize("with_reference", [False, True], ids=["t2i", "edit"])
def test_our_call_samples_equal_the_pipelines_bit_for_bit(pipe, folder, folder_transformer, encoders, with_reference):
    """Three Euler steps from the same noise: our encoding, reference latents and transformer call
    (prefix KV cache reused after the first step) give QwenImage21Pipeline's latents exactly, for
    text to image and for an edit with one RGBA reference; the reference's slots moved by one row
    change the prediction (the layout is read, not ignored)."""
    vae = loading.load_vae(_sources(folder), torch.float32)
    side = RES // 16
    noise = torch.randn(1, side * side, 64, generator=torch.Generator().manual_seed(5))
    image = _rgba(50) if with_reference else None
    want = pipe("a red cube on a table", image=[image] if image is not None else None, num_inference_steps=3,
                output_resolution=RES, latents=noise.clone(), output_type="latent").images
    with torch.no_grad():
        got = _our_sample(pipe, folder_transformer, encoders, vae, "a red cube on a table", image, 3, noise.clone())
    assert got.shape == want.shape == noise.shape and torch.equal(got, want)
    assert not torch.allclose(got, noise, atol=1e-2)
    if with_reference:
        # The reference's slots one row early: the tokens land elsewhere and the prediction changes.
        from leantune.models.qwen_image21 import forward
        from leantune.models.qwen_image21 import latents as lat

        ref = _resized(pipe, image)
        embeds, mask, slots = text.pipeline_layout(text.encode_prompts(["a red cube on a table"], encoders,
                                                                       images=[ref]))
        ref_latents = [lat.encode(vae, pipe.image_processor.preprocess(ref, width=RES, height=RES))]
        shifted = torch.roll(slots, -1, dims=1)
        sigma = torch.tensor([0.5])
        with torch.no_grad():
            right, wrong = (forward.predict(folder_transformer, noise, sigma, embeds, mask, m, (side, side),
                                            references=ref_latents) for m in (slots, shifted))
        assert not torch.allclose(right, wrong, atol=1e-4)


def test_references_are_prepared_as_the_pipeline_prepares_them(pipe, folder, folder_transformer, encoders):
    """Three references (RGBA, RGB, another aspect) resized to the pipeline's sizes and encoded to
    its latents; with them, our encoding and a three-step Euler loop give the pipeline's latents
    bit for bit (3 references: issue 35's edit case)."""
    from leantune.models.qwen_image21 import forward, references
    from leantune.models.qwen_image21 import latents as lat
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions, calculate_shift

    images = [_rgba(60), _rgba(61, size=(RES + 32, RES)).convert("RGB"), _rgba(62, size=(RES, 2 * RES))]
    resized, pixels = references.prepare(images, RES)
    for img, r, x in zip(images, resized, pixels):
        w, h, _ = calculate_dimensions(RES * RES, img.size[0] / img.size[1])
        assert r.size == (w, h) and r.mode == "RGBA" and x.shape == (1, 4, h, w)
        assert torch.equal(x, pipe.image_processor.preprocess(img.convert("RGBA"), width=w, height=h))
    vae = loading.load_vae(_sources(folder), torch.float32)
    ref_latents = references.sampling_latents(vae, images, RES)
    tw, th = references.target_size(images, RES)
    hl, wl = th // 16, tw // 16
    noise = torch.randn(1, hl * wl, 64, generator=torch.Generator().manual_seed(7))
    prompt = "put the cube on the table"
    want = pipe(prompt, image=images, num_inference_steps=3, output_resolution=RES, latents=noise.clone(),
                output_type="latent").images
    embeds, mask, slots = text.pipeline_layout(text.encode_prompts([prompt], encoders, images=resized))
    assert int(slots.sum()) == sum(lat.slots(r.shape[2], r.shape[3]) for r in ref_latents)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    c = scheduler.config
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 3, 3),
                            mu=calculate_shift(hl * wl, c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                                               c.max_shift))
    scheduler.set_begin_index(0)
    transformer = folder_transformer
    cache = QwenImage21KVCache(len(transformer.transformer_blocks))
    x = noise.clone()
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            v = forward.predict(transformer, x, t.expand(1).to(x.dtype) / 1000, embeds, mask, slots, (hl, wl),
                                references=ref_latents, kv_cache=cache, kv_mode="extract" if i == 0 else "cached")
            x = scheduler.step(v, t, x, return_dict=False)[0]
    assert torch.equal(x, want)


# -- the registered family -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["lora", "lokr", "loha", "dora"])
def test_every_adapter_types_kohya_file_loads_whole_in_comfyuis_generic_key_map(kind, tmp_path):
    """The comfyui-layout export (kohya `lora_unet_` names) loads whole through
    tests/comfyui_keymap.py's model of ComfyUI's generic key map (ComfyUI's own code for this model
    cannot be read here, see the conformance FINDINGS) and gives the trained weights (peft's merge)
    at strength 1 (DoRA under the output-axis norm, Comfy-Org/ComfyUI#15458): a LoRA on every Linear
    (gate and up fused into ComfyUI's img_mlp.gate_up), a LoKr / LoHa / DoRA on the attention. Of
    those on every Linear, the fused gate_up's parts are written under LyCORIS names
    (`lycoris_..._img_mlp_gate_layer`: a Kronecker or Hadamard factor pair cannot be stacked), which
    the generic map does not have: under this model ComfyUI skips exactly those (LoKr / LoHa)."""
    import copy

    from comfyui_keymap import comfyui_load, comfyui_native_state
    from safetensors.torch import load_file as read

    from leantune.models.family import get_family
    from leantune.train.lora import add_lora, lora_layers, lora_weights_from_model, save_lora

    family = get_family("qwen-image-2.1")
    base = tq.qwen_image21_transformer(0).eval().requires_grad_(False)
    model = copy.deepcopy(base)
    cfg = SimpleNamespace(rank=4, effective_alpha=8.0, alpha=8.0, dropout=0.0, blocks=None, type=kind, factor=-1,
                          targets="all_linear" if kind == "lora" else "attention", decompose_both=False)
    params = add_lora(model, family.spec, cfg)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in params:
            p.copy_(p * (1 + 0.1 * torch.randn(p.shape, generator=g)) if p.dim() == 1
                    else torch.randn(p.shape, generator=g) * 0.1)
    model.eval().requires_grad_(False)
    merged = dict(base.state_dict())
    for name, layer in lora_layers(copy.deepcopy(model), "default").items():
        layer.merge(adapter_names=["default"])
        merged[f"{name}.weight"] = layer.get_base_layer().weight.detach().clone()
    native = comfyui_native_state("qwen-image-2.1", base)
    want = comfyui_native_state("qwen-image-2.1", base, merged)
    changed = {k for k in native if not torch.equal(want[k], native[k])}
    assert any(k.endswith("img_mlp.gate_up.weight") for k in changed) == (kind == "lora")
    tensors = read(save_lora(lora_weights_from_model(model), tmp_path / f"{kind}.safetensors", "comfyui"))
    assert not any(k.startswith("transformer.") for k in tensors)
    load = comfyui_load("qwen-image-2.1", native, tensors, dora_fixed=True)
    assert not load.skipped and load.loaded == set(tensors)
    assert set(load.deltas) == changed
    for k in load.deltas:
        torch.testing.assert_close(native[k] + load.deltas[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    if kind in ("lokr", "loha"):          # on every Linear: the fused gate_up's LyCORIS-named parts are skipped
        everything = copy.deepcopy(base)
        add_lora(everything, family.spec, SimpleNamespace(**{**vars(cfg), "targets": "all_linear"}))
        tensors = read(save_lora(lora_weights_from_model(everything), tmp_path / "all.safetensors", "comfyui"))
        load = comfyui_load("qwen-image-2.1", native, tensors)
        lycoris = {k for k in tensors if k.startswith("lycoris_")}
        assert lycoris and all("_img_mlp_gate_layer." in k or "_img_mlp_proj." in k for k in lycoris)
        assert set(load.skipped) == lycoris and load.loaded == set(tensors) - lycoris


def test_model_processor_overrides_the_folders_and_other_families_refuse_it(folder, tmp_path):
    """[model] processor names the processor/ component as QwenImage21Pipeline's repository does;
    the family's sources take it over the folder's, and a family without a processor refuses the key
    by name."""
    import shutil

    from leantune.config import ConfigError, validate
    from leantune.models.family import get_family

    other = tmp_path / "my_processor"
    shutil.copytree(folder / "processor", other)
    base = {"data": {"datasets": [{"path": "unused"}]}, "lora": {"rank": 4}}
    cfg = validate({**base, "model": {"path": str(folder), "family": "qwen-image-2.1", "processor": str(other)}})
    sources = get_family("qwen-image-2.1").resolve_sources(cfg.model, tmp_path)
    assert sources.processor == other and sources.text_encoder == folder / "text_encoder"
    plain = validate({**base, "model": {"path": str(folder), "family": "qwen-image-2.1"}})
    assert get_family("qwen-image-2.1").resolve_sources(plain.model, tmp_path).processor == folder / "processor"
    with pytest.raises((ConfigError, ValueError), match=r"\[model\] processor"):
        validate({**base, "model": {"path": str(folder), "family": "flux", "processor": str(other)}})


@pytest.mark.parametrize("guidance, n_refs", [(1.0, 0), (4.0, 0), (1.0, 1)], ids=["t2i", "t2i-cfg", "edit"])
def test_leantunes_sampler_samples_as_the_pipeline(folder, pipe, guidance, n_refs):
    """The registered family through leantune's staged sampler (encode_prompts_stage, denoise,
    decode_latents: the slot rows as zero rows of the embeddings, family.predict) gives
    QwenImage21Pipeline's RGBA images bit for bit at 64x64 in fp32: text to image, with true CFG
    at 4.0 (a negative prompt) and an edit with one RGBA reference (at the pipeline's 1024² size).
    Both keep the prefix KV cache (the pipeline's default use_kv_cache): the text and reference
    keys and values from the first step, only the target's rows computed after (at this size the
    whole-sequence path gives the same bits; test_the_prefix_cache_is_kept_and_priced shows the
    rows each step computes)."""
    from leantune.infer.decode import decode_latents
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.references import reference_latents, text_images
    from leantune.infer.sampler import denoise
    from leantune.models.family import get_family

    family = get_family("qwen-image-2.1")
    sources = _sources(folder)
    encoders = family.load_text_encoders(sources, torch.float32, "cpu")
    vae = family.load_vae(sources, torch.float32, "cpu")
    transformer = family.load_transformer(sources, torch.float32).eval().requires_grad_(False)
    images = [_rgba(70)] if n_refs else []
    cfg = family.sampling.guides(guidance)
    encoded = encode_prompts_stage(encoders, ["a red cube on a table"], max_length=64, device="cpu", family=family,
                                   negative_prompts=["a blue square"] if cfg else None,
                                   images=text_images(images, family))
    embeds, negative = encoded if cfg else (encoded, None)
    schedule = family.sampling.schedule(family.sampling.variant(transformer), folder)
    with torch.no_grad():
        latents = denoise(transformer, embeds, [3], width=RES, height=RES, steps=2, guidance=guidance,
                          schedule=schedule, device="cpu", family=family, negative=negative, cfg_batched=False,
                          references=reference_latents(vae, images, family) or None)
        ours = decode_latents(vae, latents, "cpu").permute(0, 2, 3, 1).numpy()
    p = tq.load_qwen_image21_pipeline(folder)
    p.set_progress_bar_config(disable=True)
    p.transformer, p.vae = transformer, vae.vae
    want = p("a red cube on a table", image=images or None, negative_prompt="a blue square" if cfg else None,
             true_cfg_scale=guidance, height=RES, width=RES, num_inference_steps=2, use_kv_cache=True,
             generator=torch.Generator().manual_seed(3), output_type="np").images
    assert ours.shape == want.shape == (1, RES, RES, 4)
    assert np.abs(ours - want).max() == 0.0


def test_the_prefix_cache_is_kept_and_priced(folder):
    """The staged sampler's denoising computes the whole sequence at its first step and only the
    target's rows after (the prefix KV cache kept, as the pipeline's use_kv_cache), and
    family.sampling.prefix_cache_bytes equals the bytes a filled cache holds (every block's keys
    and values of the text without its slots plus the references' tokens), for a batch of two
    with two references of different sizes."""
    from leantune.models.family import get_family

    family = get_family("qwen-image-2.1")
    transformer = family.load_transformer(_sources(folder), torch.float32).eval().requires_grad_(False)
    cfg = dict(transformer.config)
    assert cfg["causal_condition"]
    g = torch.Generator().manual_seed(0)
    refs_hw = [(4, 4), (4, 6)]
    refs = [torch.randn(1, 64, h, w, generator=g) for h, w in refs_hw]
    text = 12 + sum((h // 2) * (w // 2) for h, w in refs_hw)            # 12 text rows and the refs' slots
    seq = torch.randn(2, text, cfg["context_in_dim"], generator=g)
    seq[:, 3:3 + 4] = 0.0                                               # slot rows are zero rows
    seq[:, 9:9 + 6] = 0.0
    from leantune.models.family import PromptEmbeds

    cache = family.sampling.prefix_cache(transformer)
    x = torch.randn(2, 16, 64, generator=g)
    with torch.no_grad():
        family.predict(transformer, x, torch.full((2,), 0.5), PromptEmbeds(seq, torch.zeros(2, 1)), (4, 4),
                       references=refs, prefix_cache=(cache, True))
    held = sum(t.numel() * t.element_size() for layer in cache.layer_caches for t in (layer.k, layer.v))
    assert held == family.sampling.prefix_cache_bytes(cfg, 2, text, refs_hw, torch.float32) > 0

    from leantune.infer.sampler import denoise

    rows = []
    hook = transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: rows.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    try:
        with torch.no_grad():
            denoise(transformer, [PromptEmbeds(seq[:1], torch.zeros(1, 1))], [3], width=64, height=64, steps=3,
                    guidance=1.0, schedule=family.sampling.schedule(family.name, folder), device="cpu",
                    family=family, references=refs)
    finally:
        hook.remove()
    prefix = text - 10 + 16 + 24                     # text rows without the 10 slots, then both references' tokens
    assert rows == [prefix + 16, 16, 16]             # a 64 px target: 4 x 4 latent tokens


def test_the_slot_mask_travels_as_zero_rows_and_reads_back_as_the_pipelines(pipe, encoders):
    """The family's encoding writes each image slot as a zero row (the transformer overwrites those
    rows with the reference's latents); cut and padded as the cache batches it, text_layout gives
    back the pipeline's padding mask and image-slot mask exactly, and its other rows bit for bit:
    two prompts of different lengths, each with two references of different aspects."""
    from leantune.models.qwen_image21 import encode_prompts, text_layout

    refs = [_rgba(80), _rgba(81, size=(RES + 32, RES))]
    prompts = ["a cat", "a small orange ellipse next to a large purple square, two shapes on a table"]
    got, lengths = encode_prompts(prompts, encoders, images=[refs, refs])
    padded = torch.cat([got.t5, got.t5.new_zeros(2, 5, got.t5.shape[2])], dim=1)    # the cache's batch padding
    seq, mask, slots = text_layout(padded)
    for i, prompt in enumerate(prompts):
        resized = [pipe.image_processor.resize(r.convert("RGBA"), width=w, height=h) for r in refs
                   for w, h in [_pipeline_size(r)]]
        want, want_mask, want_slots = pipe.encode_prompt(prompt=prompt, image=resized, device="cpu")
        n = int(lengths[i])
        assert n == want.shape[1] and torch.equal(slots[i, :n], want_slots[0].bool()) and want_slots.any()
        assert not slots[i, n:].any() and (mask is not None and mask[i, :n].all() and not mask[i, n:].any())
        keep = ~want_slots[0].bool()
        assert torch.equal(seq[i, :n][keep], want[0][keep]) and not seq[i, :n][~keep].any()


def _pipeline_size(image):
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    w, h, _ = calculate_dimensions(1024 * 1024, image.size[0] / image.size[1])
    return w, h


def test_an_edit_dataset_caches_references_and_slots_as_the_pipeline_sees_them(folder, pipe, tmp_path):
    """An edit dataset (targets, references matched by file stem: the reference-image seam of
    data/references.py) on the registered family: each reference is cached as the pipeline encodes
    it (resized to 1024² of area, RGBA with an opaque alpha: QwenImage21Pipeline's latents rounded
    to the cache's bf16, within one bf16 step: the family's normalisation rounds otherwise than the
    pipeline's in fp32, by 1.2e-7 measured), and each caption's text entry holds exactly as many slot rows (zero rows) as those
    latents have 2x2 token groups, so the batch conditions the transformer as the pipeline does."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_reference_images import RUN, _caches, _dataset

    from leantune.config import load_config
    from leantune.data.dataset import load_rgb
    from leantune.models.qwen_image21 import latents as lat
    from leantune.models.qwen_image21 import text_layout

    images, refs = _dataset(tmp_path, count=2)
    p = tmp_path / "run.toml"
    p.write_text(RUN.format(family="qwen-image-2.1", model=folder, images=images, refs=refs, cache=tmp_path / "c"))
    data = _caches(load_config(p, []))
    batch = next(data.batches(seed=0))
    (ref,) = batch.references
    assert ref.shape[1:] == (64, 64, 64)            # 1024² of area at the reference's (square) aspect
    s = data.samples[0]
    image = load_rgb(s.item.references[0].path).convert("RGBA")
    pixels = pipe.image_processor.preprocess(image, width=1024, height=1024).unsqueeze(2)
    want = pipe._encode_vae_image(pixels, None)[:, :, 0]
    stored = want.to(torch.bfloat16).to(ref.dtype)      # the cache stores latents in bf16
    assert any(torch.allclose(ref[i:i + 1], stored, rtol=2 ** -7, atol=1e-3) for i in range(ref.shape[0]))
    _, _, slots = text_layout(batch.embeds.t5)
    assert (slots.sum(dim=1) == lat.slots(*ref.shape[2:])).all()


# -- the planner --------------------------------------------------------------------------------------------

def _vision_tower_parameters(v: dict) -> int:
    """Qwen3-VL's vision tower counted by hand from its config: the 3-D patch embedding, the
    learned position table, the blocks (two LayerNorms, qkv, proj, a two-layer MLP) and the four
    patch mergers (the main one normed at the patch width, the deepstack ones after the 2x2 shuffle)."""
    d, i, out = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"]
    embed = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2 * d + d
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * i + i) + (i * d + d)
    merged = d * v["spatial_merge_size"] ** 2

    def merger(norm_width: int) -> int:
        return 2 * norm_width + (merged * merged + merged) + (merged * out + out)

    return (embed + v["num_position_embeddings"] * d + v["depth"] * block + merger(d)
            + len(v["deepstack_visual_indexes"]) * merger(merged))


def test_plan_model_prices_the_stock_architecture_and_its_encoder_per_reference_count(capsys, tmp_path,
                                                                                      monkeypatch):
    """`leantune plan --model qwen-image-2.1 [--references N]`: the packaged 7B (the meta build runs
    meta_model's class, whose forward reads the slot mask), a LoRA plan within 12 GiB over the one
    block list, and the caching phase's Qwen3-VL-8B priced from its packaged config: the language
    model counted by hand, captions in batches of 8 without references; with references, a caption
    encoded alone with 32 x 32 tokens and the tags per reference, and the vision tower (counted by
    hand) in host RAM whole, streamed to the device unit by unit (tests/test_qwen_image21_vision_stream.py
    prices that). References lengthen the training step's sequence: the plan needs more streaming
    and activations for three than for none or one."""
    from test_planner import _run_plan

    from leantune.models.component_files import packaged_config

    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))
    docs = {}
    for refs in (0, 1, 3):
        rc, out, err = _run_plan(capsys, "--model", "qwen-image-2.1", "--vram", "12GiB", "--ram", "64GiB",
                                 "--references", str(refs), "--json")
        assert rc == 0, err
        docs[refs] = json.loads(out)
    acts, streamed = [], []
    for refs, doc in docs.items():
        entry = doc["plans"][0]
        notes = entry["plan"]["notes"]
        assert notes["predicted_peak_vram"] <= entry["budget_bytes"] - notes["margin_vram"]
        assert set(entry["plan"]["streamed_blocks"]) <= {f"transformer_blocks.{i}" for i in range(32)}
        assert (f"{refs} reference" in doc["workload"]) == bool(refs)
        acts.append(notes["vram_breakdown"]["activations"])
        streamed.append(len(entry["plan"]["streamed_blocks"]))
    # 12 GiB holds the plain blocks' activations (a split plan, models/qwen_image21/block.py, pays one
    # more forward per block: chosen only where the plain one does not fit), which grow per reference
    assert acts[0] < acts[1] < acts[2]
    assert not any(doc["plans"][0]["plan"].get("split_blocks") for doc in docs.values())
    assert streamed[0] <= streamed[2] and streamed[1] <= streamed[2]

    full = packaged_config("qwen3_vl_8b")
    t, v = full["text_config"], full["vision_config"]
    h, i, hd = t["hidden_size"], t["intermediate_size"], t["head_dim"]
    layer = (h * t["num_attention_heads"] * hd * 2 + h * t["num_key_value_heads"] * hd * 2 + 3 * h * i
             + 2 * hd + 2 * h) * 2
    plain = docs[0]["text_encoding"]
    assert plain["resident"] == t["vocab_size"] * h * 2 + h * 2 and plain["layer"] == layer
    assert (plain["layers"], plain["layers_run"], plain["tokens"]) == (36, 36, 8 * 528)
    assert "vision" not in plain
    for refs in (1, 3):
        phase = docs[refs]["text_encoding"]
        vision = phase["vision"]
        assert vision["weights"] == _vision_tower_parameters(v) * 2
        assert (vision["tokens_per_reference"], vision["patches"]) == (32 * 32, refs * 64 * 64)
        assert phase["edit"]["tokens"] == 528 + refs * (32 * 32 + 8)
        assert phase["device"] >= phase["edit"]["device"] > vision["streamed_weights"] + layer
        assert vision["streamed_weights"] < vision["weights"]
        assert phase["host_streamed"] == plain["host_streamed"] + vision["weights"]
    assert docs[1]["text_encoding"]["device"] < docs[3]["text_encoding"]["device"]


def test_the_probes_reference_layout_is_the_one_the_transformer_call_builds(folder_transformer):
    """probe_inputs(references=N) lays out what forward.predict gives the transformer for N
    references at the pipeline's size: each reference's latent tokens before the target's, its
    slots in the text (and nowhere else), and the meta copy's forward runs on that layout, each
    reference's tokens taking its slots' place in the joint sequence."""
    from leantune.models import qwen_image21 as fam
    from leantune.models.qwen_image21 import latents as lat
    from leantune.models.qwen_image21.meta_model import QwenImage21Transformer2DModel as Meta

    config = folder_transformer.config
    inputs = fam.probe_inputs(config, 2, (4, 6), 20, torch.float32, references=2)
    ref_side = 1024 // lat.VAE_SCALE_FACTOR
    ref_slots = lat.slots(ref_side, ref_side)
    text_rows = 20 + 2 * (fam.REFERENCE_TAG_ROWS + ref_slots)
    assert inputs["encoder_hidden_states"].shape[:2] == (2, text_rows)
    assert inputs["hidden_states"].shape[:2] == (2, 2 * ref_side * ref_side + 4 * 6)
    mask = inputs["img_mask"]
    assert mask.shape == (2, text_rows + lat.slots(4, 6))
    assert int(mask[0, :text_rows].sum()) == 2 * ref_slots and bool(mask[0, text_rows:].all())
    assert inputs["img_shapes"][0] == [(1, ref_side, ref_side)] * 2 + [(1, 4, 6)]
    with torch.device("meta"):
        meta = Meta.from_config(config)
    out = meta(**{k: v.to("meta") if isinstance(v, torch.Tensor) and v.dtype != torch.bool else v
                  for k, v in inputs.items()})[0]
    # the joint sequence: the text's own rows, then every image token (a reference's in place of its slots)
    assert out.shape[:2] == (2, (text_rows - 2 * ref_slots) + inputs["hidden_states"].shape[1])


def test_references_in_a_plan_are_counted_from_the_datasets_and_refused_where_unpriced(capsys, tmp_path):
    """A config's edit dataset gives the plan its reference count (the most a target has, by file
    name); --references on a family the planner prices no references for, or over the family's
    most, is a clear error naming the flag."""
    from test_planner import _run_plan

    from leantune.config import load_config
    from leantune.planner.from_config import reference_count

    data, refs = tmp_path / "data", tmp_path / "refs"
    data.mkdir(), refs.mkdir()
    for name in ("cat", "dog"):
        Image.new("RGB", (64, 64), (200, 10, 10)).save(data / f"{name}.png")
    for name in ("cat_0", "cat_1", "cat_2", "dog"):
        Image.new("RGB", (64, 64), (10, 200, 10)).save(refs / f"{name}.png")
    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\nfamily = "qwen-image-2.1"\npath = "{tmp_path / "model"}"\n'
                    f'[[data.datasets]]\npath = "{data}"\nreference_path = "{refs}"\n'
                    f"[train]\nsteps = 10\n", encoding="utf-8")
    assert reference_count(load_config(toml)) == 3
    rc, _, err = _run_plan(capsys, "--model", "flux-dev", "--vram", "12GiB", "--references", "1")
    assert rc != 0 and "--references 1" in err and "flux" in err
    rc, _, err = _run_plan(capsys, "--model", "qwen-image-2.1", "--vram", "12GiB", "--references", "11")
    assert rc != 0 and "--references 11" in err and "at most 10" in err


def test_rgba_targets_and_references_keep_their_alpha_through_the_cache(folder, pipe, tmp_path):
    """A dataset of RGBA targets with RGBA references (half transparent): each target's latent
    entry is the pipeline VAE's encoding of the RGBA image itself (its alpha, not a white matte,
    which encodes far otherwise), each reference's the pipeline's at its 1024² size, both within
    one bf16 step of the pipeline's latents (the family's normalisation rounds otherwise than the
    pipeline's in fp32, by 1.2e-7 measured, which can flip a bf16 rounding); the caption's text entry is the encoding of the RGBA reference, which the family
    flattens over white for the vision tower as QwenImage21Pipeline does."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_reference_images import RUN, _caches, _dataset

    from leantune.config import load_config
    from leantune.data.dataset import load_rgb
    from leantune.io import load_safetensors
    from leantune.models.family import get_family
    from leantune.models.qwen_image21 import encode_prompts

    images, refs = _dataset(tmp_path, count=2)
    for i, png in enumerate(sorted(images.glob("*.png")) + sorted(refs.glob("*.png"))):
        _rgba(200 + i, size=(64, 64)).save(png)
    p = tmp_path / "run.toml"
    p.write_text(RUN.format(family="qwen-image-2.1", model=folder, images=images, refs=refs, cache=tmp_path / "c"))
    cfg = load_config(p, [])
    data = _caches(cfg)

    @torch.no_grad()
    def vae_latent(image, size):
        pixels = pipe.image_processor.preprocess(image, width=size, height=size).unsqueeze(2)
        return pipe._encode_vae_image(pixels, None)[0, :, 0].to(torch.bfloat16).float()

    def entry(key):
        return load_safetensors(tmp_path / "c" / "latents" / f"{key}.safetensors")[0]["latent"].float()

    def opened(path):
        with Image.open(path) as im:
            return im.convert("RGBA")

    family = get_family("qwen-image-2.1")
    enc = family.load_text_encoders(family.resolve_sources(cfg.model, Path(cfg.base_dir)), torch.float32, "cpu")
    texts = {}
    for s in data.samples:
        stored = entry(s.latent_key)
        assert torch.allclose(stored, vae_latent(opened(s.item.path), 64), rtol=2 ** -7, atol=1e-3)
        assert (stored - vae_latent(load_rgb(s.item.path).convert("RGBA"), 64)).abs().max() > 0.05   # a white matte
        (ref_key,) = s.reference_keys
        ref_path = s.item.references[0].path
        ref_stored, want = entry(ref_key), vae_latent(opened(ref_path), 1024)
        assert torch.allclose(ref_stored, want, rtol=2 ** -7, atol=1e-3)
        assert (ref_stored - vae_latent(load_rgb(ref_path).convert("RGBA"), 1024)).abs().max() > 0.05
        texts[s.item.caption] = opened(ref_path)
    batch = next(data.batches(seed=0))
    for caption, ref in texts.items():
        want, lengths = encode_prompts([caption], enc, max_length=64, images=[[ref]])
        n = int(lengths[0])
        assert any(torch.equal(batch.embeds.t5[i, :n], want.t5[0, :n].to(torch.bfloat16).to(batch.embeds.t5.dtype))
                   for i in range(batch.embeds.t5.shape[0])), caption


@pytest.mark.parametrize("n_refs", [0, 1])
def test_the_samplers_plan_prices_the_prefix_cache_and_the_references(folder, monkeypatch, n_refs):
    """Under a VRAM budget, `leantune sample`'s plan for a loaded Qwen-Image-2.1 is asked for with the
    references counted and the prefix caches' bytes (one cache per CFG half) as the family prices
    them for the prompt's rows and the references' latent sizes, and it plans: the activation probe
    runs its meta copy of the loaded model (built with the family's meta class, planner/meta.py
    _probe_class), as `leantune plan --model` runs the meta-built one."""
    from leantune.infer import run
    from leantune.infer.request import validate_request
    from leantune.models.family import get_family

    family = get_family("qwen-image-2.1")
    transformer = family.load_transformer(_sources(folder), torch.float32).eval().requires_grad_(False)
    request = validate_request({"model": {"path": str(folder), "family": "qwen-image-2.1", "dtype": "fp32"},
                                "prompts": ["a cube"], "steps": 2,
                                "width": 64, "height": 64, "memory": {"vram_budget": "8GiB"}}, "test request")
    seen = []
    real = run.inference_workload
    monkeypatch.setattr(run, "inference_workload", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    refs = [torch.zeros(1, 64, 4, 6)] * n_refs
    plan, _ = run.transformer_plan(request, transformer, torch.device("cpu"), 8 * 2**30, 1, 30, cfg=True,
                                   references=refs)
    want = family.sampling.prefix_cache_bytes(dict(transformer.config), 2, 30, [(4, 6)] * n_refs, torch.float32)
    assert seen and want > 0 and plan is not None
    assert all(w.prefix_cache_bytes == want and w.references == n_refs for w in seen)
