"""[validation] (data/held_out.py, train/validation.py): the held-out images are chosen by content
and never trained on; their loss at fixed noise is the same in every run and after a resume, and
lands in the log, TensorBoard, the loss history and the state."""

import json
import shutil

import pytest
import torch
from conftest import tiny_lora_rest, tiny_run_toml

from leantune.config import load_config
from leantune.data.cache import prepare_caches
from leantune.data.dataset import DataError
from leantune.demo import draw_shapes
from leantune.trainer import train

@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("val") / "images"
    draw_shapes(folder, count=6, size=64, seed=4)
    return folder


def _config(tmp_path, model, images, validation: str, out: str = "out", name: str = "run.toml"):
    p = tmp_path / name
    p.write_text(tiny_run_toml(model, images, tiny_lora_rest(tmp_path / out, "v", f"[validation]\n{validation}\n")))
    return load_config(p)


def test_validation_keys_are_checked_with_their_names(tmp_path, images):
    with pytest.raises(Exception, match="path and fraction: set both"):
        _config(tmp_path, tmp_path, images, 'path = "x"\nfraction = 0.2')
    with pytest.raises(Exception, match="needs path .* or fraction"):
        _config(tmp_path, tmp_path, images, "every = 5")
    with pytest.raises(Exception, match="each noise level is in \\(0, 1\\)"):
        _config(tmp_path, tmp_path, images, "fraction = 0.2\nsigmas = [0.5, 1.0]")
    with pytest.raises(Exception, match="fraction"):
        _config(tmp_path, tmp_path, images, "fraction = 0.9")


def test_a_share_is_held_out_by_content_and_not_trained(tmp_path, tiny_flux_dir, images):
    cfg = _config(tmp_path, tiny_flux_dir, images, "fraction = 0.34")
    data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32, validation=cfg.validation)
    held = {s.item.path for s in data.validation_samples}
    trained = {s.item.path for s in data.samples}
    assert len(held) == 2 and len(trained) == 4 and not held & trained        # floor(0.34 * 6)

    # the same images again from a copy of the folder with one image more: chosen by their bytes
    more = tmp_path / "more"
    shutil.copytree(images, more)
    draw_shapes(tmp_path / "extra", count=1, size=64, seed=99)
    for f in (tmp_path / "extra").iterdir():
        shutil.copy(f, more / ("z_" + f.name))
    cfg2 = _config(tmp_path, tiny_flux_dir, more, "fraction = 0.34", name="more.toml")
    data2 = prepare_caches(cfg2.data, cfg2.model, cfg2.base_dir, "cpu", torch.float32, validation=cfg2.validation)
    assert {s.item.sha256 for s in data2.validation_samples} == {s.item.sha256 for s in data.validation_samples}

    one = tmp_path / "one"
    one.mkdir()
    first = sorted(images.glob("*.png"))[0]
    shutil.copy(first, one / first.name)
    cfg3 = _config(tmp_path, tiny_flux_dir, one, "fraction = 0.5", name="one.toml")
    with pytest.raises(DataError, match="would leave none to train on"):
        prepare_caches(cfg3.data, cfg3.model, cfg3.base_dir, "cpu", torch.float32, validation=cfg3.validation)


def test_a_held_out_folder_must_not_repeat_training_images(tmp_path, tiny_flux_dir, images):
    held = tmp_path / "held"
    draw_shapes(held, count=2, size=64, seed=77)
    cfg = _config(tmp_path, tiny_flux_dir, images, f'path = "{held}"')
    data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32, validation=cfg.validation)
    assert {s.item.path.parent for s in data.validation_samples} == {held} and len(data.samples) == 6
    batches = data.validation_batches()
    assert [b.latents.shape[0] for b in batches] == [2]
    own = [s.item.caption for s in sorted(data.validation_samples, key=lambda s: str(s.item.path))]
    assert batches[0].captions == own and all(own)          # their own captions, never dropped

    shutil.copy(sorted(images.glob("*.png"))[0], held / "copy.png")
    with pytest.raises(DataError, match="1 held-out image\\(s\\) are also training images"):
        prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32, validation=cfg.validation)


def test_the_validation_loss_is_the_same_in_every_run_and_after_a_resume(tmp_path, tiny_flux_dir, images):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    validation = "fraction = 0.34\nevery = 2\nsigmas = [0.3, 0.8]"
    a = train(_config(tmp_path, tiny_flux_dir, images, validation, out="a", name="a.toml"), progress=False)
    b = train(_config(tmp_path, tiny_flux_dir, images, validation, out="b", name="b.toml"), progress=False)
    history = json.loads(a.paths.loss_history.read_text())
    assert [s for s, _ in history["validation"]] == [2, 4]
    assert history == json.loads(b.paths.loss_history.read_text())        # bit for bit, two runs
    assert history["validation"][0][1] != history["validation"][1][1]       # it measures the training

    cfg = _config(tmp_path, tiny_flux_dir, images, validation, out="c", name="c.toml")
    assert train(cfg, stop_after=2, progress=False).final_step == 2
    resumed = train(cfg, resume=True, progress=False)
    assert json.loads(resumed.paths.loss_history.read_text()) == history

    events = EventAccumulator(str(a.paths.tensorboard))
    events.Reload()
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars("loss/validation")] == \
        [(s, v) for s, v in history["validation"]]
