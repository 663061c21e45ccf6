"""The demo's analytic VAE: the real AutoencoderKL class, reconstructing the demo's shapes."""

import numpy as np
import torch
from PIL import Image

from leantune.demo import DEMO_PAIRS, colour_match, draw_shapes
from leantune.demo_vae import shape_vae


def _pixels(paths):
    return torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB")).copy()).permute(2, 0, 1).float()
                        / 127.5 - 1 for p in paths])


def test_shape_vae_reconstructs_the_demo_images_and_a_random_one_does_not(tmp_path):
    from leantune import tiny

    x = _pixels(draw_shapes(tmp_path / "img", count=12, size=128, cycle=True))
    vae = shape_vae()
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        rec = vae.decode(z).sample.clamp(-1, 1)
        random_rec = tiny.vae().decode(tiny.vae().encode(x).latent_dist.mean).sample.clamp(-1, 1)
    assert z.shape == (12, 16, 16, 16)
    assert abs(float(z.pow(2).mean().sqrt()) - 1.0) < 0.05          # unit-scale latents for flow matching
    err = float((rec - x).abs().mean() * 127.5)                      # mean error in 0..255 levels
    random_err = float((random_rec - x).abs().mean() * 127.5)
    assert err < 25 and random_err > 3 * err, (err, random_err)
    # Every image's shape colour and background come back (blurred edges aside).
    for img, rec_img, i in zip(x, rec, range(12)):
        pil = Image.fromarray(((rec_img.permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())
        colour, bg = DEMO_PAIRS[i % 3][0], ("white", "black")[(i // 3) % 2]
        shape_share, bg_share = colour_match(pil, f"a {colour} shape on a {bg} background")
        assert shape_share > 0.05 and bg_share > 0.5, (i, shape_share, bg_share)


def test_shape_vae_round_trips_through_diffusers_save_and_load(tmp_path):
    from diffusers import AutoencoderKL

    from leantune.demo_vae import save_shape_vae

    save_shape_vae(tmp_path / "vae")
    loaded = AutoencoderKL.from_pretrained(tmp_path / "vae")
    x = _pixels(draw_shapes(tmp_path / "img", count=2, size=64, cycle=True))
    with torch.no_grad():
        a = shape_vae().decode(shape_vae().encode(x).latent_dist.mean).sample
        b = loaded.decode(loaded.encode(x).latent_dist.mean).sample
    assert torch.allclose(a, b, atol=1e-5)
    assert loaded.config.scaling_factor == 1.0 and loaded.config.shift_factor == 0.0


def test_qwen_shape_vae_reconstructs_the_demo_images_and_a_random_one_does_not(tmp_path):
    """The hand-set AutoencoderKLQwenImage (Qwen-Image's demo), through the family's VAE wrapper (its
    latents_mean / latents_std normalisation) and saved and read back as a diffusers vae/ folder:
    the demo's images come back within a few levels away from the shapes' edges; a random
    AutoencoderKLQwenImage of the same config gives noise."""
    from diffusers import AutoencoderKLQwenImage

    from leantune.demo_vae import QWEN_DEMO_VAE, save_qwen_shape_vae
    from leantune.models.qwen_image import QwenVAE

    x = _pixels(draw_shapes(tmp_path / "img", count=6, size=128, cycle=True, centred=True))
    save_qwen_shape_vae(tmp_path / "vae")
    vae = QwenVAE(AutoencoderKLQwenImage.from_pretrained(tmp_path / "vae"))
    torch.manual_seed(0)
    random_vae = QwenVAE(AutoencoderKLQwenImage(**QWEN_DEMO_VAE).eval())
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
        rec = vae.decode(z)[0].clamp(-1, 1)
        random_rec = random_vae.decode(random_vae.encode(x).latent_dist.mean)[0].clamp(-1, 1)
    assert z.shape == (6, 16, 16, 16)
    assert 0.5 < float(z.pow(2).mean().sqrt()) < 1.5                  # unit-scale latents for flow matching
    err = (rec - x).abs() * 127.5                                     # 0..255 levels
    random_err = float(((random_rec - x).abs() * 127.5).mean())
    # measured: mean 11.7 levels (edges blur over 8x8 blocks), median 1.1; random 100+
    assert float(err.mean()) < 20 and float(err.median()) < 3 and random_err > 3 * float(err.mean()), \
        (float(err.mean()), float(err.median()), random_err)
    for i, rec_img in enumerate(rec):
        pil = Image.fromarray(((rec_img.permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())
        colour, bg = DEMO_PAIRS[i % 3][0], ("white", "black")[(i // 3) % 2]
        shape_share, bg_share = colour_match(pil, f"a {colour} shape on a {bg} background")
        assert shape_share > 0.08 and bg_share > 0.5, (i, shape_share, bg_share)    # the triangle: 13 %
