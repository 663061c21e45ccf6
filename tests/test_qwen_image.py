"""Qwen-Image on tiny real components against diffusers' QwenImagePipeline: prompt encoding
(template, the 34 dropped rows, masks), the schedule (dynamic shift, stretched to 0.02), true CFG
with a negative prompt (norm-rescaled), the Qwen VAE's per-channel latent statistics, and the text
encoder streamed layer by layer. Parity is exact in fp32.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from leantune.tiny import qwen_image as tq

PROMPTS = ["a photo of a cat", "sks person riding a horse in the style of lnt"]
NEGATIVE = "a blue square"
SEEDS = [3, 7]
W, H = 96, 64          # latent 12 x 8: non-square
MAX_LEN = 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def comps():
    return tq.qwen_image_components(seed=0)


def _pipe(components):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _encoders(c):
    return SimpleNamespace(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"], device=torch.device("cpu"))


def _family():
    from leantune.models.family import get_family

    return get_family("qwen-image")


def test_encode_prompts_equals_the_pipelines_encode_prompt(comps):
    """Template, last hidden state from row 34 on, zero padding to the longest prompt, the cut to
    max_length; the mask the pipeline passes is what `text_mask` reads back from the rows."""
    from leantune.models.qwen_image import encode_prompts, text_mask

    pipe = _pipe(comps)
    ref, ref_mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=MAX_LEN)
    ours, lengths = encode_prompts(PROMPTS, _encoders(comps), max_length=MAX_LEN, device="cpu")
    assert ours.t5.shape == ref.shape and torch.equal(ours.t5, ref)
    assert ours.pooled.shape == (2, 0)
    assert lengths.tolist() == ref_mask.sum(dim=1).tolist() and lengths[0] < lengths[1]
    seq, mask = text_mask(ours.t5)
    assert torch.equal(seq, ref) and torch.equal(mask, ref_mask)
    # One prompt alone: no padding, and the pipeline passes no mask.
    ref1, mask1 = pipe.encode_prompt(PROMPTS[:1], device="cpu", max_sequence_length=MAX_LEN)
    alone, _ = encode_prompts(PROMPTS[:1], _encoders(comps), max_length=MAX_LEN, device="cpu")
    assert mask1 is None and text_mask(alone.t5)[1] is None and torch.equal(alone.t5, ref1)
    # The first prompt's rows of the batch, read back without the padding, are its rows (the
    # batch's padding shifts the encoder's float sums a little, in the pipeline as here).
    assert text_mask(ours.t5[:1])[0].shape == ref1.shape
    # A shorter max_length cuts rows as the pipeline does.
    short, n = encode_prompts(PROMPTS, _encoders(comps), max_length=3, device="cpu")
    assert torch.equal(short.t5, pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=3)[0])
    assert n.tolist() == [3, 3]


def test_text_encoder_streamed_layer_by_layer_encodes_the_same(comps):
    """The caching phase's streaming (one decoder layer on the device at a time): same embeddings,
    and the layers hold no weights outside their own forward."""
    from leantune.memory.blockwise import blockwise_offload
    from leantune.models.qwen_image import encode_prompts

    enc = _encoders(comps)
    ref, _ = encode_prompts(PROMPTS, enc, max_length=MAX_LEN, device="cpu")
    lm = comps["text_encoder"].model.language_model
    seen = []
    hook = lm.layers[1].register_forward_pre_hook(lambda m, *a: seen.append(lm.layers[0].mlp.up_proj.weight.numel()))
    try:
        with blockwise_offload(lm, lm.layers, "cpu"):
            assert lm.layers[0].mlp.up_proj.weight.numel() == 0
            ours, _ = encode_prompts(PROMPTS, enc, max_length=MAX_LEN, device="cpu")
    finally:
        hook.remove()
    assert seen == [0]                      # layer 0 was dropped before layer 1 ran
    assert torch.equal(ours.t5, ref.t5)
    assert lm.layers[0].mlp.up_proj.weight.numel() > 0


def test_schedule_equals_the_pipelines_sigmas():
    """Qwen-Image's schedule: linspace sigmas, dynamic shift (0.5..0.9 over 256..8192 tokens), then
    stretched to end at 0.02 (shift_terminal), as the pipeline gets it from the scheduler."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sched = tq.qwen_scheduler()
    ours = _family().sampling.schedule("qwen-image", None)
    assert (ours.default_steps, ours.default_guidance, ours.shift_terminal) == (50, 4.0, 0.02)
    for steps, tokens in ((2, 24), (4, 24), (50, 4096), (30, 6000)):
        mu = calculate_shift(tokens, 256, 8192, 0.5, 0.9)
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        assert torch.equal(ours.sigmas(steps, tokens), sched.sigmas)
        assert abs(float(sched.sigmas[-2]) - 0.02) < 1e-6


def _reference(pipe, prompts=PROMPTS, seeds=SEEDS, steps=3, cfg=4.0, negative=NEGATIVE):
    return pipe(prompts, negative_prompt=None if negative is None else [negative] * len(prompts), height=H,
                width=W, num_inference_steps=steps, true_cfg_scale=cfg, max_sequence_length=MAX_LEN,
                generator=[torch.Generator().manual_seed(s) for s in seeds], output_type="np").images


def _ours(c, prompts=PROMPTS, seeds=SEEDS, steps=3, cfg=4.0, negative=NEGATIVE, transformer=None, **kw):
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import sample_images
    from leantune.models.qwen_image import QwenVAE

    embeds, neg = encode_prompts_stage(_encoders(c), prompts, max_length=MAX_LEN, device="cpu", family=_family(),
                                       negative_prompts=[negative] * len(prompts))
    images = sample_images(transformer or c["transformer"], QwenVAE(c["vae"]), embeds, seeds, width=W, height=H,
                           steps=steps, guidance=cfg, device="cpu", negative=neg, **kw)
    return np.stack([np.asarray(im) for im in images])


def _u8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


def test_sampler_equals_pipeline_with_true_cfg_and_negative_prompt(comps):
    """Images equal QwenImagePipeline's with true CFG (norm-rescaled) and a negative prompt, in fp32:
    the float images before rounding too, and the guidance scale and negative prompt both matter."""
    from leantune.infer.decode import decode_latents
    from leantune.infer.encode import encode_prompts_stage
    from leantune.infer.sampler import denoise
    from leantune.models.qwen_image import QwenVAE

    pipe = _pipe(comps)
    # The pipeline runs each prompt's halves one after the other: so does the sampler here.
    ref = np.concatenate([_reference(pipe, [p], [s]) for p, s in zip(PROMPTS, SEEDS)])
    ours = _ours(comps, cfg_batched=False)
    assert ours.shape == (2, H, W, 3)
    assert np.array_equal(ours, _u8(ref))
    family = _family()
    # One prompt per encoder batch, as the pipeline encoded them one call per prompt.
    embeds, neg = encode_prompts_stage(_encoders(comps), PROMPTS, max_length=MAX_LEN, device="cpu", family=family,
                                       negative_prompts=[NEGATIVE] * 2, batch_size=1)
    lat = denoise(comps["transformer"], embeds, SEEDS, width=W, height=H, steps=3, guidance=4.0,
                  schedule=family.sampling.schedule("qwen-image", None), device="cpu", negative=neg,
                  batch_size=1, cfg_batched=False)
    floats = decode_latents(QwenVAE(comps["vae"]), lat, "cpu").permute(0, 2, 3, 1).numpy()
    assert np.abs(floats - ref).max() == 0.0
    # Both prompts in one batch (padded rows masked), as the pipeline batches them.
    ref_batch = _reference(pipe)
    assert np.abs(_ours(comps, cfg_batched=False).astype(int) - _u8(ref_batch).astype(int)).max() <= 1
    # The scale and the negative prompt both change the latents (the tiny VAE flattens images).
    def latents(cfg=4.0, negative=neg):
        return denoise(comps["transformer"], embeds, SEEDS, width=W, height=H, steps=3, guidance=cfg,
                       schedule=family.sampling.schedule("qwen-image", None), device="cpu", negative=negative,
                       batch_size=1, cfg_batched=False)

    empty = encode_prompts_stage(_encoders(comps), [""], max_length=MAX_LEN, device="cpu", family=family)
    assert (latents(cfg=2.0) - lat).abs().max() > 1e-2 * lat.abs().max()
    assert (latents(negative=empty) - lat).abs().max() > 1e-2 * lat.abs().max()


def test_run_sampling_from_the_folder_with_a_lora_and_streaming(tmp_path):
    """`leantune sample`'s staged run on a Qwen-Image diffusers folder: the negative prompt, true CFG,
    a ComfyUI-layout LoRA at 0.7, the published schedule from the folder; the pipeline's image
    (within one level: stage 2 batches the CFG halves, the pipeline runs them one after the other).
    Every block streamed with poisoned slots gives the same image."""
    from diffusers import QwenImagePipeline
    from PIL import Image

    from leantune.infer.request import validate_request
    from leantune.infer.run import run_sampling
    from leantune.train.lora import lora_weights_from_model, save_lora
    from test_qwen_image_lora import trained

    folder = tq.save_qwen_image_folder(tmp_path / "qwen", seed=0)
    w = lora_weights_from_model(trained())
    comfy = save_lora(w, tmp_path / "l_comfy.safetensors", "comfyui")
    diffusers_file = save_lora(w, tmp_path / "l_diffusers.safetensors", "diffusers")

    def request(out, **kw):
        data = {"model": {"path": str(folder), "family": "qwen-image", "dtype": "fp32"}, "prompts": [PROMPTS[0]],
                "negative_prompt": NEGATIVE, "seed": 3, "steps": 3, "guidance": 4.0, "width": W, "height": H,
                "max_text_length": MAX_LEN, "out": str(out), "lora": [{"path": str(comfy), "strength": 0.7}], **kw}
        return validate_request(data, "test request")

    result = run_sampling(request(tmp_path / "out"))
    ours = np.asarray(Image.open(result.files[0]))
    pipe = QwenImagePipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(diffusers_file), adapter_name="l")
    pipe.set_adapters(["l"], [0.7])
    ref = _u8(_reference(pipe, [PROMPTS[0]], [3]))[0]
    assert np.abs(ours.astype(int) - ref.astype(int)).max() <= 1
    stream = run_sampling(request(tmp_path / "stream", memory={"streamed_blocks": "all", "stream_non_blocks": True,
                                                               "debug_poison": True}))
    assert stream.stream_report["bytes_h2d"] > 0 and len(stream.plan.streamed_blocks) == 2
    assert np.array_equal(np.asarray(Image.open(stream.files[0])), ours)
