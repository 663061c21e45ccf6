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
from leantune.models import tiny_qwen_image as tq

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
    from leantune.models.qwen_image_edit import encode_prompts

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
