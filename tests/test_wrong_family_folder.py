"""A diffusers folder of one family given under another [model] family is refused before anything
loads, naming the family to set (issue 41: a FLUX.2 or Qwen-Image folder under family = "flux" used
to fail late, after caching began, with "describes a AutoencoderKLFlux2, not a VAE").

The check reads model_index.json and asks every registered family (models/family.guess_family),
so a new family is covered by registering; the folders here are the tiny presets' real ones."""

from __future__ import annotations

import pytest

from leantune.config import ModelConfig
from leantune.models.family import get_family
from leantune.models.weights import LoadError


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from leantune import tiny
    from leantune.tiny import flux2 as tf
    from leantune.tiny import qwen_image as tq
    from leantune.tiny import z_image as tz

    root = tmp_path_factory.mktemp("families")
    return {
        "flux": tiny.save_flux_folder(root / "flux"),
        "sd3": tiny.save_sd3_folder(root / "sd3"),
        "qwen-image": tq.save_qwen_image_folder(root / "qwen"),
        "flux2-dev": tf.save_flux2_folder(root / "flux2", variant="dev"),
        "z-image": tz.save_z_image_folder(root / "z_image"),
    }


CASES = [("flux2-dev", "flux"), ("qwen-image", "flux"), ("sd3", "flux"), ("flux", "sd3"), ("flux2-dev", "sd3"),
         ("qwen-image", "sd3"), ("flux", "qwen-image"), ("sd3", "qwen-image"), ("flux2-dev", "qwen-image"),
         ("flux", "flux2-dev"), ("qwen-image", "flux2-dev"), ("sd3", "flux2-dev"),
         ("z-image", "flux"), ("z-image", "qwen-image"), ("flux", "z-image"), ("flux2-dev", "z-image")]


@pytest.mark.parametrize("actual,configured", CASES)
def test_a_folder_of_another_family_is_refused_naming_the_family_to_set(folders, actual, configured, tmp_path):
    folder = folders[actual]
    cfg = ModelConfig(path=str(folder), family=configured)
    with pytest.raises(LoadError) as err:
        get_family(configured).resolve_sources(cfg, tmp_path)
    text = str(err.value)
    assert str(folder) in text and f'[model] family = "{configured}"' in text, text
    assert f'set [model] family = "{actual}"' in text, text


@pytest.mark.parametrize("family", ["flux", "sd3", "qwen-image", "flux2-dev", "z-image"])
def test_a_folder_of_the_configured_family_resolves(folders, family, tmp_path):
    sources = get_family(family).resolve_sources(ModelConfig(path=str(folders[family]), family=family), tmp_path)
    assert sources.transformer is not None and sources.vae is not None
