"""FLUX.2 on tiny real components against diffusers' Flux2Pipeline (dev: Mistral3, distilled guidance)
and Flux2KleinPipeline (klein: Qwen3, classifier-free guidance): prompt encoding (stacked hidden
layers, every padded row kept), the schedule (BFL's empirical mu in tokens and steps), the VAE's
batch-norm latents and 2x2 patches, 4-axis position ids, LoRAs and reference images. Parity is exact
in fp32. (Plain sampling against both pipelines, for every variant: tests/families/test_conformance.py.)
"""

# Checks moved to the conformance suite (issue 33):
# - test_folder_loads_with_the_pipelines_weights_and_meta_builds_for_the_probe, trimmed to the FLUX.2
#   specifics and renamed test_folder_encodes_as_the_pipeline_and_a_klein_folder_is_refused_under_dev: the
#   transformer's weights and the meta build whose probe forward gives the target's shape moved to
#   tests/families/test_conformance.py::test_builds_from_its_tiny_preset[flux2-dev], the VAE's tensors (the
#   batch-norm statistics among them) to
#   tests/families/test_conformance.py::test_loads_its_diffusers_folder_as_diffusers_does[flux2-dev]

from __future__ import annotations

import numpy as np
import pytest
import torch

from leantune.tiny import flux2 as tf

PROMPTS = ["a photo of a cat", "a red circle on a white background"]
SEEDS = [3, 7]
W, H = 96, 64          # 6 x 4 tokens: non-square
MAX_LEN = 48


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def dev():
    return tf.flux2_pipeline("dev", seed=0)


@pytest.fixture(scope="module")
def klein():
    return tf.flux2_pipeline("klein", seed=1)


def _quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _family(name):
    from leantune.models.family import get_family

    return get_family(name)


def _encoders(pipe):
    from leantune.models.flux2.loading import Flux2TextEncoders

    kind = "mistral3" if type(pipe).__name__ == "Flux2Pipeline" else "qwen3"
    return Flux2TextEncoders(kind=kind, tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder,
                             device=torch.device("cpu"))


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_encode_prompts_equals_the_pipelines_encode_prompt(variant, dev, klein):
    """The stacked hidden layers, every row kept (the pipelines pass no text mask)."""
    from leantune.models.flux2.text import encode_prompts

    pipe = dev if variant == "dev" else klein
    ref, ref_ids = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LEN)
    ours, lengths = encode_prompts(PROMPTS, _encoders(pipe), max_length=MAX_LEN, device="cpu")
    assert ours.t5.shape == ref.shape == (2, MAX_LEN, 3 * tf.TEXT_WIDTH)
    assert torch.equal(ours.t5, ref)
    assert ours.pooled.shape == (2, 0) and lengths.tolist() == [MAX_LEN, MAX_LEN]
    # the prompts are not all padding: the two differ, and a shorter cut gives the pipeline's too
    assert not torch.equal(ours.t5[0], ours.t5[1])
    short, _ = encode_prompts(PROMPTS, _encoders(pipe), max_length=MAX_LEN - 8, device="cpu")
    assert torch.equal(short.t5, pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LEN - 8)[0])


@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_encode_runs_only_the_layers_the_pipeline_reads(variant, dev, klein):
    """The pipelines stack hidden states (10, 20, 30) / (9, 18, 27): the layers after the deepest
    one never run (nor are read from files), and the result is still encode_prompt's, the final
    norm's tie to the last hidden state included; the model is whole again afterwards."""
    from leantune.models.flux2.text import HIDDEN_LAYERS, encode_prompts, text_model

    pipe = dev if variant == "dev" else klein
    enc = _encoders(pipe)
    lm = text_model(enc)
    layers, norm = list(lm.layers), lm.norm
    deepest = max(HIDDEN_LAYERS[enc.kind])
    assert len(layers) > deepest                  # the tiny model has layers past the deepest read
    ran = []
    hooks = [layer.register_forward_pre_hook(lambda m, *a, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    try:
        ours, _ = encode_prompts(PROMPTS, enc, max_length=MAX_LEN, device="cpu")
    finally:
        for h in hooks:
            h.remove()
    assert sorted(ran) == list(range(deepest)), ran
    assert torch.equal(ours.t5, pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LEN)[0])
    assert list(lm.layers) == layers and lm.norm is norm


def test_text_model_streamed_layer_by_layer_encodes_the_same(dev):
    from leantune.memory.blockwise import blockwise_offload
    from leantune.models.flux2.text import encode_prompts, text_model

    enc = _encoders(dev)
    ref, _ = encode_prompts(PROMPTS, enc, max_length=MAX_LEN, device="cpu")
    lm = text_model(enc)
    seen = []
    hook = lm.layers[1].register_forward_pre_hook(lambda m, *a: seen.append(lm.layers[0].mlp.up_proj.weight.numel()))
    try:
        with blockwise_offload(lm, lm.layers, "cpu"):
            ours, _ = encode_prompts(PROMPTS, enc, max_length=MAX_LEN, device="cpu")
    finally:
        hook.remove()
    assert seen == [0] and torch.equal(ours.t5, ref.t5)


def test_schedule_equals_the_pipelines_sigmas():
    """linspace sigmas shifted by compute_empirical_mu(tokens, steps), as the scheduler gets them."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    sched = tf.flux2_scheduler()
    family = _family("flux2-dev")
    ours = family.sampling.schedule("dev", None)
    assert (ours.default_steps, ours.default_guidance) == (50, 4.0)
    for steps, tokens in ((2, 24), (4, 24), (50, 4096), (28, 6000), (10, 1024)):
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(tokens, steps))
        assert torch.equal(ours.sigmas(steps, tokens), sched.sigmas)
    # mu depends on the steps below 4300 tokens: the schedule is not the Flux.1 one
    assert not torch.equal(ours.sigmas(4, 1024), _family("flux").sampling.schedule("dev", None).sigmas(4, 1024))


def test_distilled_klein_folder_samples_without_guidance(tmp_path):
    """A klein folder whose model_index.json says is_distilled: 4 steps, no CFG (scale 1)."""
    folder = tf.save_flux2_folder(tmp_path / "k", "klein", is_distilled=True)
    s = _family("flux2-klein-4b").sampling.schedule("klein", folder)
    assert (s.default_steps, s.default_guidance, s.empirical_mu) == (4, 1.0, True)
    base = tf.save_flux2_folder(tmp_path / "b", "klein")
    assert _family("flux2-klein-4b").sampling.schedule("klein", base).default_steps == 50


def _u8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


def _sample(pipe, family_name, prompt, seed, guidance, steps=3, references=None, transformer=None,
            negative=None):
    """Our staged sampler: encode, denoise, decode; float images (1, H, W, 3)."""
    from leantune.infer.decode import decode_latents
    from leantune.infer.sampler import denoise
    from leantune.models.flux2 import Flux2VAE, encode_reference_latents
    from leantune.models.flux2.text import encode_prompts

    family = _family(family_name)
    enc = _encoders(pipe)
    cond, _ = encode_prompts([prompt], enc, max_length=MAX_LEN, device="cpu")
    neg = encode_prompts([negative], enc, max_length=MAX_LEN, device="cpu")[0] if negative is not None else None
    vae = Flux2VAE(pipe.vae)
    refs = encode_reference_latents(vae, references) if references else None
    lat = denoise(transformer or pipe.transformer, cond, [seed], width=W, height=H, steps=steps, guidance=guidance,
                  schedule=family.sampling.schedule(family.sampling.variant(pipe.transformer), None), device="cpu",
                  family=family, negative=neg, cfg_batched=False, references=refs)
    return decode_latents(vae, lat, "cpu").permute(0, 2, 3, 1).numpy()


def _pipeline(pipe, prompt, seed, guidance, steps=3, references=None):
    kw = {"image": references} if references else {}
    return _quiet(pipe)(prompt=prompt, height=H, width=W, num_inference_steps=steps, guidance_scale=guidance,
                        max_sequence_length=MAX_LEN, generator=torch.Generator().manual_seed(seed),
                        output_type="np", **kw).images


def _ref_images(n):
    from PIL import Image

    rng = np.random.default_rng(5)
    sizes = [(100, 70), (64, 80), (96, 64)]     # the first cropped to multiples of 16
    return [Image.fromarray(rng.integers(0, 255, (sizes[i][1], sizes[i][0], 3), dtype=np.uint8)) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2])
def test_reference_images_condition_as_the_pipelines_image(dev, klein, n):
    """Multi-reference conditioning: the references' tokens with their own time coordinate follow
    the target's; the images equal the pipelines' `image=` ones, and the references matter."""
    refs = _ref_images(n)
    ref = _pipeline(dev, PROMPTS[0], SEEDS[0], 4.0, references=refs)
    ours = _sample(dev, "flux2-dev", PROMPTS[0], SEEDS[0], 4.0, references=refs)
    assert np.abs(ours - ref).max() == 0.0
    assert np.abs(ours - _sample(dev, "flux2-dev", PROMPTS[0], SEEDS[0], 4.0)).max() > 1e-4
    kref = _pipeline(klein, PROMPTS[0], SEEDS[0], 4.0, references=refs)
    kours = _sample(klein, "flux2-klein-4b", PROMPTS[0], SEEDS[0], 4.0, references=refs, negative="")
    assert np.abs(kours - kref).max() == 0.0


def test_leantune_sample_with_a_reference_equals_the_pipeline(tmp_path):
    """`leantune sample --reference` on a tiny FLUX.2-dev folder: the family's sampling_latents
    prepare and encode the reference as Flux2Pipeline's `image=`; the PNG equals the pipeline's
    image (fp32, bit for bit), and differs from the image drawn without the reference."""
    from PIL import Image

    from leantune.cli import main

    folder = tf.save_flux2_folder(tmp_path / "dev", "dev", seed=2)
    ref_file = tmp_path / "before.png"
    _ref_images(1)[0].save(ref_file)
    common = ["sample", "--model", str(folder), "--prompt", PROMPTS[0], "--guidance", "4.0", "--steps", "2",
              "--seed", "3", "--width", str(W), "--height", str(H), "--set", "model.dtype=fp32",
              "--set", f"max_text_length={MAX_LEN}"]
    assert main(common + ["--reference", str(ref_file), "--out", str(tmp_path / "out")]) == 0
    assert main(common + ["--out", str(tmp_path / "plain")]) == 0
    (png,) = sorted((tmp_path / "out").glob("*.png"))
    (plain,) = sorted((tmp_path / "plain").glob("*.png"))
    ours = np.asarray(Image.open(png))
    assert Image.open(png).text["references"] == str(ref_file)
    pipe = tf.flux2_pipeline("dev", seed=2)
    ref = _u8(_pipeline(pipe, PROMPTS[0], 3, 4.0, steps=2, references=[Image.open(ref_file).convert("RGB")]))[0]
    assert ours.shape == (H, W, 3) and np.array_equal(ours, ref)
    assert not np.array_equal(ours, np.asarray(Image.open(plain)))


def test_reference_size_follows_the_pipeline():
    from leantune.models.flux2 import reference_size

    assert reference_size(80, 48, (512, 512)) == (80, 48)
    assert reference_size(100, 50, (512, 512)) == (96, 48)
    w, h = reference_size(2048, 1024, (512, 512))
    assert w * h <= 1024 * 1024 and w % 16 == 0 and h % 16 == 0 and abs(w / h - 2) < 0.05


def test_lora_loaded_samples_as_the_pipeline_with_the_same_lora(dev, tmp_path):
    """A LoRA on every preset target (double and single blocks), written in the diffusers layout:
    Flux2Pipeline.load_lora_weights of the file samples what our sampler samples with the adapter."""
    import copy
    from types import SimpleNamespace

    from diffusers import Flux2Pipeline

    from leantune.models.flux2.spec import FLUX2_DEV_SPEC
    from leantune.train.lora import add_lora, lora_weights_from_model, save_lora

    model = copy.deepcopy(dev.transformer)
    add_lora(model, FLUX2_DEV_SPEC, SimpleNamespace(rank=4, effective_alpha=4.0, dropout=0.0, targets="all",
                                                    blocks=None))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.eval()
    w = lora_weights_from_model(model)
    assert any("to_qkv_mlp_proj" in n for n in w.modules) and any("ff_context.linear_in" in n for n in w.modules)
    path = save_lora(w, tmp_path / "l.safetensors", "diffusers")
    pipe = Flux2Pipeline(**{k: getattr(dev, k) for k in ("scheduler", "vae", "text_encoder", "tokenizer")},
                         transformer=copy.deepcopy(dev.transformer))
    pipe.load_lora_weights(str(path))
    ref = _pipeline(pipe, PROMPTS[0], SEEDS[0], 4.0)
    ours = _sample(dev, "flux2-dev", PROMPTS[0], SEEDS[0], 4.0, transformer=model)
    assert np.abs(ours - ref).max() == 0.0
    assert np.abs(ref - _pipeline(dev, PROMPTS[0], SEEDS[0], 4.0)).max() > 1e-4


def test_folder_encodes_as_the_pipeline_and_a_klein_folder_is_refused_under_dev(tmp_path):
    """The diffusers folder through the family's loaders: the text encoders encode as the pipeline
    (the stacked hidden layers), and the model is described as FLUX.2-dev; a klein folder under
    flux2-dev is refused naming the file and the class, and loads as klein. (The weights and the meta
    build: tests/families, see the top of this file.)"""
    from types import SimpleNamespace

    from leantune.models.weights import LoadError

    folder = tf.save_flux2_folder(tmp_path / "dev", "dev", seed=4)
    pipe = tf.flux2_pipeline("dev", seed=4)
    family = _family("flux2-dev")
    cfg = SimpleNamespace(path=str(folder), family="flux2-dev", transformer=None, text_encoder=None, tokenizer=None,
                          vae=None)
    sources = family.resolve_sources(cfg, tmp_path)
    model = family.load_transformer(sources, dtype=torch.float32)
    enc = family.load_text_encoders(sources, torch.float32)
    ours, _ = family.encode_prompts(PROMPTS, enc, MAX_LEN, "cpu")
    assert torch.equal(ours.t5, pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LEN)[0])
    assert family.describe(model) == "FLUX.2-dev (2 double + 2 single blocks, width 32)"

    klein = tf.save_flux2_folder(tmp_path / "klein", "klein", seed=4)
    ksources = family.resolve_sources(SimpleNamespace(**{**vars(cfg), "path": str(klein)}), tmp_path)
    with pytest.raises(LoadError, match=r"config\.json.*Qwen3ForCausalLM.*Mistral3ForConditionalGeneration"):
        family.load_text_encoders(ksources, torch.float32)
    kfam = _family("flux2-klein-4b")
    kenc = kfam.load_text_encoders(ksources, torch.float32)
    assert kenc.kind == "qwen3" and kfam.describe(kfam.load_transformer(ksources, torch.float32)).startswith(
        "FLUX.2-klein")


def test_single_file_names_tell_the_variant():
    """guess_family's recognizer: dev has the guidance embedder; klein 4B 5 double blocks, 9B 8;
    diffusers' and BFL's names alike, and a Flux.1 file is none of them."""
    def keys(double, guidance, bfl=False):
        mod = "double_stream_modulation_img.lin.weight" if bfl else "double_stream_modulation_img.linear.weight"
        blocks = "double_blocks" if bfl else "transformer_blocks"
        out = [mod] + [f"{blocks}.{i}.img_attn.qkv.weight" if bfl else f"{blocks}.{i}.attn.to_q.weight"
                       for i in range(double)]
        if guidance:
            out.append("guidance_in.in_layer.weight" if bfl else "time_guidance_embed.guidance_embedder.linear_1.weight")
        return out

    def which(k):
        return [n for n in ("flux2-dev", "flux2-klein-4b", "flux2-klein-9b") if _family(n).recognizes_keys(k)]

    for bfl in (False, True):
        assert which(keys(8, True, bfl)) == ["flux2-dev"]
        assert which(keys(5, False, bfl)) == ["flux2-klein-4b"]
        assert which(keys(8, False, bfl)) == ["flux2-klein-9b"]
    assert which(["transformer_blocks.0.norm1.linear.weight", "time_text_embed.guidance_embedder.linear_1.weight"]) == []
