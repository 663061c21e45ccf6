"""Qwen-Image-Edit (Plus) on tiny real components against QwenImageEditPlusPipeline: the prompt
encoded with the reference images (Picture tags, the vision tower, 64 rows dropped), the
references' VAE latents appended to the image sequence, true CFG, one and two references. fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from leantune.tiny import qwen_image as tq

W, H = 96, 64


pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def comps():
    return tq.qwen_image_edit_components(seed=0)


def _refs(n):
    rng = np.random.default_rng(4)
    sizes = [(80, 48), (40, 56)]
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes[:n]]


def _encoders(c):
    from types import SimpleNamespace

    return SimpleNamespace(tokenizer=c["tokenizer"], text_encoder=c["text_encoder"],
                           image_processor=c["processor"].image_processor, device=torch.device("cpu"))


def _pipe(c):
    from diffusers import QwenImageEditPlusPipeline

    pipe = QwenImageEditPlusPipeline(**c)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_encode_with_references_equals_the_pipelines(comps):
    from leantune.models.qwen_image.edit import condition_images, encode_prompts

    pipe = _pipe(comps)
    for n in (1, 2):
        refs = _refs(n)
        ref, mask = pipe.encode_prompt("make it red", image=condition_images(refs), device="cpu")
        ours, lengths = encode_prompts(["make it red"], _encoders(comps), images=[refs], device="cpu")
        assert mask is None and torch.equal(ours.t5, ref) and int(lengths[0]) == ref.shape[1]
    # The references matter: without them the rows differ in number and value.
    plain, _ = encode_prompts(["make it red"], _encoders(comps), device="cpu")
    assert plain.t5.shape[1] < ours.t5.shape[1]


@pytest.mark.parametrize("n", [1, 2])
def test_edit_sampling_equals_the_pipeline(comps, n):
    from leantune.infer.decode import decode_latents
    from leantune.infer.sampler import denoise
    from leantune.models.family import get_family
    from leantune.models.qwen_image import QwenVAE
    from leantune.models.qwen_image.edit import encode_prompts, encode_reference_latents

    refs = _refs(n)
    pipe = _pipe(comps)
    ref = pipe(image=refs, prompt="make it red", negative_prompt="blurry", true_cfg_scale=4.0, height=H, width=W,
               num_inference_steps=2, generator=torch.Generator().manual_seed(3), output_type="np").images
    family = get_family("qwen-image-edit")
    enc = _encoders(comps)
    cond, _ = encode_prompts(["make it red"], enc, images=[refs], device="cpu")
    neg, _ = encode_prompts(["blurry"], enc, images=[refs], device="cpu")
    vae = QwenVAE(comps["vae"])
    latents = encode_reference_latents(vae, refs)
    lat = denoise(comps["transformer"], cond, [3], width=W, height=H, steps=2, guidance=4.0,
                  schedule=family.sampling.schedule("qwen-image", None), device="cpu", negative=neg,
                  family=family, cfg_batched=False, references=latents)
    ours = decode_latents(vae, lat, "cpu").permute(0, 2, 3, 1).numpy()
    assert np.abs(ours - ref).max() == 0.0
    # Without the reference latents the image is another one.
    alone = denoise(comps["transformer"], cond, [3], width=W, height=H, steps=2, guidance=4.0,
                    schedule=family.sampling.schedule("qwen-image", None), device="cpu", negative=neg,
                    family=family, cfg_batched=False)
    assert (alone - lat).abs().max() > 1e-3


def test_leantune_sample_with_a_reference_equals_the_pipeline(comps, tmp_path):
    """`leantune sample --reference` on a tiny Qwen-Image-Edit-2509 folder: the prompt encoded with
    the reference, its latents at the pipeline's VAE size, true CFG with a negative prompt; the PNG
    equals QwenImageEditPlusPipeline's image (fp32, bit for bit)."""
    from PIL import Image

    from leantune.cli import main

    folder = tq.save_qwen_image_folder(tmp_path / "edit", seed=0, edit=True)
    ref_file = tmp_path / "before.png"
    _refs(1)[0].save(ref_file)
    rc = main(["sample", "--model", str(folder), "--prompt", "make it red", "--negative-prompt", "blurry",
               "--reference", str(ref_file), "--guidance", "4.0", "--steps", "2", "--seed", "3",
               "--width", str(W), "--height", str(H), "--out", str(tmp_path / "out"), "--set", "model.dtype=fp32"])
    assert rc == 0
    (png,) = sorted((tmp_path / "out").glob("*.png"))
    ours = np.asarray(Image.open(png))
    assert Image.open(png).text["references"] == str(ref_file)
    ref = _pipe(comps)(image=[Image.open(ref_file).convert("RGB")], prompt="make it red", negative_prompt="blurry",
                       true_cfg_scale=4.0, height=H, width=W, num_inference_steps=2,
                       generator=torch.Generator().manual_seed(3), output_type="pil").images[0]
    assert ours.shape == (H, W, 3) and np.array_equal(ours, np.asarray(ref))


def test_references_refused_with_the_key_and_file(tmp_path, capsys):
    """A family without references, too many references, a missing file: errors before any model
    is read, naming the key and the file."""
    from leantune.config import ConfigError
    from leantune.infer.references import load_reference_images
    from leantune.models.family import get_family

    ref_file = tmp_path / "before.png"
    _refs(1)[0].save(ref_file)
    with pytest.raises(ConfigError, match=r"references: family = \"qwen-image\" takes no reference images"):
        load_reference_images([ref_file], get_family("qwen-image"))
    edit = get_family("qwen-image-edit")
    with pytest.raises(ConfigError, match="5 reference images, but qwen-image-edit takes at most 4"):
        load_reference_images([ref_file] * 5, edit)
    with pytest.raises(ConfigError, match="missing.png: no such image file"):
        load_reference_images([tmp_path / "missing.png"], edit)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ConfigError, match="bad.png: not a readable image"):
        load_reference_images([tmp_path / "bad.png"], edit)
    assert len(load_reference_images([ref_file], edit)) == 1
    # The command refuses them before reading any model (the folder here holds none).
    from leantune.cli import main

    capsys.readouterr()
    rc = main(["sample", "--model", str(tmp_path), "--family", "qwen-image", "--prompt", "x", "--reference", str(ref_file)])
    assert rc == 2 and 'references: family = "qwen-image" takes no reference images' in capsys.readouterr().err


def test_guess_family_tells_an_edit_folder_from_qwen_image(tmp_path):
    """Both folders hold a QwenImageTransformer2DModel; the pipeline class in model_index.json says
    which family the folder is (an Edit folder was taken for Qwen-Image)."""
    import json

    from leantune.models.family import guess_family

    for pipeline, family in (("QwenImageEditPlusPipeline", "qwen-image-edit"), ("QwenImagePipeline", "qwen-image")):
        folder = tmp_path / pipeline
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps(
            {"_class_name": pipeline, "transformer": ["diffusers", "QwenImageTransformer2DModel"]}))
        assert guess_family(folder) == family
