"""The reference-image seam (edit datasets), on the tiny Qwen-Image-Edit: references matched by file
stem, cached like targets (by content), carried in the batch, and conditioning the family's
prediction; clear errors for a target without references, uneven counts and a family that takes
none."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from leantune.config import load_config
from leantune.data.dataset import DataError
from leantune.demo import draw_shapes
from leantune.tiny import qwen_image as tq

RUN = """
[model]
family = "{family}"
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "{cache}"
max_text_length = 64

[[data.datasets]]
path = "{images}"
reference_path = "{refs}"

[lora]
rank = 4
alpha = 8

[train]
steps = 2
learning_rate = 1e-3
mixed_precision = "no"
seed = 3

[output]
dir = "out"
name = "t"
formats = ["diffusers"]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tq.save_qwen_image_folder(tmp_path_factory.mktemp("qwen") / "qwen-tiny")


def _dataset(root: Path, numbered: bool = False, seed: int = 9, count: int = 4) -> tuple[Path, Path]:
    images, refs = root / "images", root / "refs"
    draw_shapes(images, count=count, size=64, seed=5)
    draw_shapes(refs, count=count, size=64, seed=seed)
    for p in refs.glob("*.txt"):
        p.unlink()
    targets = sorted(images.glob("*.png"))
    for a, b in zip(sorted(refs.glob("*.png")), targets):
        a.rename(refs / (f"{b.stem}_1.png" if numbered else f"{b.stem}.png"))
    return images, refs


def _config(root, model, images, refs, family="qwen-image-edit", cache="cache"):
    p = root / "run.toml"
    p.write_text(RUN.format(family=family, model=model, images=images, refs=refs, cache=cache))
    return load_config(p, [])


def _caches(cfg):
    from leantune.data.cache import prepare_caches

    return prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32)


def test_references_are_matched_cached_and_batched(tmp_path, model_dir):
    from leantune.models.family import get_family
    from leantune.models.qwen_image.edit import encode_prompts

    images, refs = _dataset(tmp_path, numbered=True)
    cfg = _config(tmp_path, model_dir, images, refs)
    data = _caches(cfg)
    assert data.stats["latents"].misses == 8           # 4 targets + 4 references
    s = data.samples[0]
    assert s.item.references[0].path == refs / f"{s.item.path.stem}_1.png" and len(s.reference_keys) == 1
    batch = next(data.batches(seed=0))
    assert len(batch.references) == 1 and batch.references[0].shape == batch.latents.shape    # same aspect here
    # The text entry is the caption encoded with its reference, as the Edit pipeline encodes it.
    fam = get_family("qwen-image-edit")
    enc = fam.load_text_encoders(fam.resolve_sources(cfg.model, Path(cfg.base_dir)), torch.float32, "cpu")
    from leantune.data.dataset import load_rgb

    want, _ = encode_prompts([s.item.caption], enc, images=[[load_rgb(s.item.references[0].path)]], device="cpu")
    t5, _ = data.text_entry(s.item.caption, s.text_refs)
    assert torch.equal(t5.float(), want.t5[0].to(torch.bfloat16).float())
    # Without its reference the caption's entry is another one (fewer rows: no vision tokens).
    plain, _ = encode_prompts([s.item.caption], enc, device="cpu")
    assert plain.t5.shape[1] < t5.shape[0]

    # A second run hits every entry; a changed reference image is re-encoded (its content is its key).
    again = _caches(cfg)
    assert again.stats["latents"].hits == 8 and again.stats["latents"].misses == 0
    assert again.stats["text"].misses == 0
    changed = sorted(refs.glob("*.png"))[0]
    draw_shapes(tmp_path / "other", count=1, size=64, seed=77)
    shutil.copy(next((tmp_path / "other").glob("*.png")), changed)
    third = _caches(cfg)
    assert third.stats["latents"].misses == 1 and third.stats["text"].misses == 2     # caption and empty caption


def test_references_condition_the_training(tmp_path, model_dir):
    """The same run with other reference images trains on other predictions: the first step's loss
    differs (same seed, same targets, same captions)."""
    from leantune.trainer import train

    a_root, b_root = tmp_path / "a", tmp_path / "b"
    a_root.mkdir()
    b_root.mkdir()
    la = train(_config(a_root, model_dir, *_dataset(a_root, seed=9)), progress=False).losses
    lb = train(_config(b_root, model_dir, *_dataset(b_root, seed=21)), progress=False).losses
    assert len(la) == 2 and la[0] != lb[0]


def test_reference_errors_name_the_file_or_key(tmp_path, model_dir):
    images, refs = _dataset(tmp_path)
    lonely = sorted(refs.glob("*.png"))[0]
    lonely.unlink()
    with pytest.raises(DataError, match=rf"no reference image.*{lonely.stem}"):
        _caches(_config(tmp_path, model_dir, images, refs))
    # Two references for one target, one for the others.
    draw_shapes(tmp_path / "x", count=2, size=64, seed=3)
    for i, p in enumerate(sorted((tmp_path / "x").glob("*.png"))):
        shutil.copy(p, refs / f"{lonely.stem}_{i}.png")
    with pytest.raises(DataError, match=r"different numbers of reference images"):
        _caches(_config(tmp_path, model_dir, images, refs))
    # A family without reference conditioning refuses the key.
    with pytest.raises(ValueError, match=r"reference_path: family = \"qwen-image\" takes no reference images"):
        _caches(_config(tmp_path, model_dir, images, refs, family="qwen-image"))


SAMPLE = """
[sample]
every = 1
prompts = ["make it red"]
negative_prompt = "blurry"
guidance = 4.0
steps = 2
seed = 3
width = 64
height = 48
{references}
"""


def _sampled(root, model_dir, references: str = ""):
    """A one-step Edit run (learning rate 1e-12: the LoRA leaves the base as it is) that samples at its
    step; the sample PNG and its pixels."""
    import numpy as np
    from PIL import Image

    from leantune.trainer import train

    images, refs = _dataset(root)
    cfg_path = root / "run.toml"
    cfg_path.write_text(RUN.format(family="qwen-image-edit", model=model_dir, images=images, refs=refs, cache="cache")
                        + SAMPLE.format(references=references))
    cfg = load_config(cfg_path, ["train.steps=1", "train.learning_rate=1e-12"])
    (png,) = train(cfg, progress=False).sample_files
    return cfg, png, np.asarray(Image.open(png)).astype(int)


def _base_sample(cfg, tmp_path, references):
    """`leantune sample` on the base model with the same settings (fp32, reference latents live)."""
    import numpy as np
    from PIL import Image

    from leantune.infer.request import validate_request
    from leantune.infer.run import run_sampling

    s = cfg.sample
    req = validate_request({"model": {"path": cfg.model.path, "family": "qwen-image-edit", "dtype": "fp32"},
                            "prompts": list(s.prompts), "negative_prompt": s.negative_prompt, "guidance": s.guidance,
                            "steps": s.steps, "seed": s.seed, "width": s.width, "height": s.height,
                            "references": [str(r) for r in references], "out": str(tmp_path)}, "test")
    (f,) = run_sampling(req).files
    return np.asarray(Image.open(f)).astype(int)


def _closest(ours, same, other):
    """`ours` is `same` up to the bf16 caches' rounding (a level here and there) and not `other`: the
    tiny model's references change a sixth of the pixel values by a few levels (measured: 17 %
    against 0.01 %)."""
    near, far = abs(ours - same), abs(ours - other)
    assert near.max() <= 2 and (near > 0).mean() < 0.01, (near.max(), (near > 0).mean())
    assert (far > 0).mean() > 0.05, (far > 0).mean()


def test_edit_training_samples_use_the_first_targets_references(tmp_path, model_dir):
    """Without [sample] references the samples drawn during training are conditioned on the first
    target's references: they are the base model's `leantune sample` with that reference (within
    the bf16 caches' rounding), far from the image without a reference."""
    from PIL import Image

    cfg, png, ours = _sampled(tmp_path, model_dir)
    first = sorted((tmp_path / "refs").glob("*.png"))[0]
    assert Image.open(png).text["references"] == str(first)
    with_ref = _base_sample(cfg, tmp_path / "with", [first])
    without = _base_sample(cfg, tmp_path / "without", [])
    _closest(ours, with_ref, without)


def test_edit_training_samples_use_the_sample_references(tmp_path, model_dir):
    """[sample] references (relative to the config) condition the samples instead of the dataset's
    (here a wide white image: the tiny model tells images of one aspect apart by little)."""
    from PIL import Image

    (tmp_path / "mine").mkdir()
    mine = tmp_path / "mine" / "white.png"
    Image.new("RGB", (128, 48), "white").save(mine)
    cfg, png, ours = _sampled(tmp_path, model_dir, f'references = ["mine/{mine.name}"]')
    assert Image.open(png).text["references"] == str(mine)
    with_mine = _base_sample(cfg, tmp_path / "with", [mine])
    first = sorted((tmp_path / "refs").glob("*.png"))[0]
    with_first = _base_sample(cfg, tmp_path / "first", [first])
    _closest(ours, with_mine, with_first)


def test_sample_references_refused_for_a_family_without_them(tmp_path, model_dir):
    from leantune.data.cache import prepare_caches, sample_references

    images, refs = _dataset(tmp_path)
    p = tmp_path / "run.toml"
    p.write_text(RUN.format(family="qwen-image", model=model_dir, images=images, refs=refs, cache="cache")
                 .replace(f'reference_path = "{refs}"', "")
                 + SAMPLE.format(references=f'references = ["{next(refs.glob("*.png"))}"]'))
    cfg = load_config(p, [])
    with pytest.raises(ValueError, match=r"\[sample\] references: family = \"qwen-image\" takes no reference images"):
        prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32, extra_prompts=["make it red"],
                       sample_references=sample_references(cfg.sample))
