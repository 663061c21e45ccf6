"""[model] variant and [sample] base_variant (issue 34): a single file of Krea 2 Raw or Turbo, of
Z-Image Turbo or base, cannot say which it is (same names and shapes), so the key says it, and the
previews and `leantune sample` take that checkpoint's published schedule; a diffusers folder's own
scheduler config still decides (a Z-Image base folder's shift 6.0, a Krea 2 Turbo folder's fixed mu)."""

from __future__ import annotations

import json

import pytest
import torch

from leantune.config import load_config
from leantune.models.family import get_family
from leantune.models.krea2 import TURBO_MU
from leantune.models.krea2 import published_schedule as krea2_published
from leantune.models.z_image import published_schedule as z_image_published
from leantune.trainer import preview_schedule


def _config(tmp_path, family: str, model: str, model_keys: str = "", sample_keys: str = ""):
    path = tmp_path / "run.toml"
    path.write_text(f"""[model]
family = "{family}"
path = "{model}"
{model_keys}
[data]
[[data.datasets]]
path = "images"
[sample]
{sample_keys}
""")
    return load_config(path)


@pytest.mark.parametrize("family, variant", [("krea2", "raw"), ("krea2", "turbo"), ("z-image", "turbo"),
                                             ("z-image", "base"), ("flux", "schnell")])
def test_each_family_takes_its_own_variants(tmp_path, family, variant):
    assert _config(tmp_path, family, "m.safetensors", f'variant = "{variant}"').model.variant == variant


@pytest.mark.parametrize("family, variant, words", [
    ("krea2", "base", 'variant = \'base\' is not a krea2 checkpoint: one of "auto", "raw", "turbo"'),
    ("z-image", "raw", 'is not a z-image checkpoint: one of "auto", "turbo", "base"'),
    ("flux", "turbo", 'one of "auto", "dev", "schnell"'),
    ("sd3", "dev", "family = 'sd3' has one kind of checkpoint; remove the key")])
def test_a_variant_of_another_family_is_refused_by_name(tmp_path, family, variant, words):
    with pytest.raises(Exception, match=words.replace("(", r"\(")):
        _config(tmp_path, family, "m.safetensors", f'variant = "{variant}"')


def test_sample_base_variant_needs_a_base_and_one_of_the_familys_kinds(tmp_path):
    with pytest.raises(Exception, match=r'\[sample\] base_variant = "turbo": set, but \[sample\] base is not'):
        _config(tmp_path, "krea2", "raw.safetensors", sample_keys='base_variant = "turbo"')
    with pytest.raises(Exception, match=r'base_variant = "base" is not a krea2 checkpoint'):
        _config(tmp_path, "krea2", "raw.safetensors", sample_keys='base = "t.safetensors"\nbase_variant = "base"')
    cfg = _config(tmp_path, "krea2", "raw.safetensors", sample_keys='base = "t.safetensors"\nbase_variant = "turbo"')
    assert cfg.sample.base_variant == "turbo"


def test_a_single_files_previews_take_the_variants_published_schedule(tmp_path):
    """No folder: [model] variant decides; auto is what the transformer tells (Raw, Turbo)."""
    krea2, z_image = get_family("krea2"), get_family("z-image")
    model = torch.nn.Module()
    turbo = preview_schedule(_config(tmp_path, "krea2", "k.safetensors", 'variant = "turbo"'), krea2, model)
    assert turbo == krea2_published("krea2-turbo") and turbo.base_shift == turbo.max_shift == TURBO_MU
    assert preview_schedule(_config(tmp_path, "krea2", "k.safetensors"), krea2, model) == krea2_published("krea2")
    base = preview_schedule(_config(tmp_path, "z-image", "z.safetensors", 'variant = "base"'), z_image, model)
    assert (base.shift, base.default_steps, base.default_guidance) == (6.0, 50, 5.0)
    assert preview_schedule(_config(tmp_path, "z-image", "z.safetensors"), z_image, model) == z_image_published()


def _folder(tmp_path, scheduler: dict, model_index: dict | None = None):
    folder = tmp_path / "folder"
    (folder / "scheduler").mkdir(parents=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    if model_index is not None:
        (folder / "model_index.json").write_text(json.dumps(model_index))
    return folder


def test_a_folders_scheduler_config_decides_the_previews(tmp_path):
    """A Z-Image base folder (shift 6.0) previews as the base, with the pipeline's 50 steps at CFG 5;
    a Krea 2 Turbo folder (is_distilled) with its fixed mu: before, previews took the Turbo's and
    Raw's published schedules whatever the folder said."""
    model = torch.nn.Module()
    base = _folder(tmp_path / "z", {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 6.0,
                                    "use_dynamic_shifting": False})
    s = preview_schedule(_config(tmp_path, "z-image", str(base)), get_family("z-image"), model)
    assert (s.shift, s.use_dynamic_shifting, s.default_steps, s.default_guidance) == (6.0, False, 50, 5.0)
    turbo = _folder(tmp_path / "k", {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_dynamic_shifting": True,
                                     "base_shift": 0.5, "max_shift": 1.15}, {"is_distilled": True})
    s = preview_schedule(_config(tmp_path, "krea2", str(turbo)), get_family("krea2"), model)
    assert (s.base_shift, s.max_shift, s.default_steps) == (TURBO_MU, TURBO_MU, 8)
    raw = preview_schedule(_config(tmp_path, "krea2", str(turbo), 'variant = "raw"'), get_family("krea2"), model)
    assert (raw.base_shift, raw.max_shift, raw.default_steps) == (0.5, 1.15, 28)      # the key wins


def test_leantune_sample_variant_flag_reaches_the_request_and_is_checked(tmp_path):
    import argparse

    from leantune.commands import sample as sample_cmd
    from leantune.infer.request import validate_request

    parser = argparse.ArgumentParser()
    sample_cmd.configure(parser)

    def request(*flags):
        data, source = sample_cmd.request_data(parser.parse_args(
            ["--model", str(tmp_path / "krea-2-turbo.safetensors"), "--family", "krea2", "--prompt", "a", *flags]))
        return validate_request(data, source, tmp_path)

    assert request("--variant", "turbo").model.variant == "turbo"
    assert request().model.variant == "auto"
    with pytest.raises(Exception, match="is not a krea2 checkpoint"):
        request("--variant", "schnell")
