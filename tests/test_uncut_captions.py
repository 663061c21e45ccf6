"""A family that cuts no caption (ModelFamily.cuts_text False: Qwen-Image-2.1, as QwenImage21Pipeline
encodes every prompt whole): a caption longer than [data] max_text_length prices is cached whole,
read back as a valid entry on the next run (it was taken for a damaged one and encoded again every
run), and the run is told, by the key, that its plan prices those steps short."""

from __future__ import annotations

import logging

import pytest

from leantune.tiny import qwen_image21 as tq


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tq.save_qwen_image21_folder(tmp_path_factory.mktemp("qwen_image21") / "model")


def test_a_long_caption_of_a_family_that_cuts_none_is_cached_once_and_said(folder, tmp_path, caplog):
    from test_reference_images import RUN, _caches

    from leantune.config import load_config
    from leantune.demo import draw_shapes
    from leantune.models.family import get_family

    images = tmp_path / "images"
    draw_shapes(images, count=2, size=64, seed=5)
    long = " ".join(["a red circle on a white background with a long and careful description"] * 12)
    first = sorted(images.glob("*.txt"))[0]
    first.write_text(long)
    text = RUN.format(family="qwen-image-2.1", model=folder, images=images, refs="", cache=tmp_path / "c")
    text = text.replace('reference_path = ""\n', "").replace("max_text_length = 64", "max_text_length = 16")
    (tmp_path / "run.toml").write_text(text)
    cfg = load_config(tmp_path / "run.toml", [])
    fam = get_family("qwen-image-2.1")
    assert not fam.cuts_text
    with caplog.at_level(logging.WARNING, logger="leantune.data.cache"):
        data = _caches(cfg)
    warned = [r.getMessage() for r in caplog.records if "cuts no caption" in r.getMessage()]
    assert len(warned) == 1 and "raise [data] max_text_length to" in warned[0], warned
    assert data.stats["text"].misses == 3 and data.stats["text"].recomputed == 0   # 2 captions + the empty prompt
    caplog.clear()
    again = _caches(cfg)
    stats = again.stats["text"]
    assert stats.recomputed == 0 and stats.misses == 0, stats           # the long entry is read back whole
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("leantune")]
