"""Masked loss (data/masks.py): masks found, checked and named; resized with their image's crop;
cached; a mask of ones is the plain loss; a masked half sends no gradient."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_run_toml
from PIL import Image

from leantune.config import load_config
from leantune.data.cache import prepare_caches
from leantune.data.dataset import DataError, scan_datasets
from leantune.data.masks import MaskImage, attach_masks, loss_weights, mask_grid
from leantune.demo import draw_shapes
from leantune.models.family import get_family
from leantune.train import flow_matching as fm
from leantune.trainer import _loss, train


def _data_cfg(tmp_path, images, keys: str = "", extra_datasets: str = ""):
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(tmp_path / "no-model", images, keys + "\n" + extra_datasets))
    return load_config(p)


def _mask(path: Path, size, white_cols: int | None = None, value: int = 255) -> Path:
    """A grayscale mask: white in the first `white_cols` columns (all of it when None)."""
    arr = np.zeros((size[1], size[0]), dtype=np.uint8)
    arr[:, : size[0] if white_cols is None else white_cols] = value
    Image.fromarray(arr, mode="L").save(path)
    return path


@pytest.fixture()
def images(tmp_path):
    folder = tmp_path / "images"
    draw_shapes(folder, count=4, size=64, seed=2)
    return folder


# -- config ---------------------------------------------------------------------------------------

def test_mask_keys_are_checked_with_their_names(tmp_path, images):
    with pytest.raises(Exception, match="mask_path and mask_suffix"):
        _data_cfg(tmp_path, images, 'mask_path = "m"\nmask_suffix = "_mask"')
    with pytest.raises(Exception, match="mask_floor: set, but the dataset has no masks"):
        _data_cfg(tmp_path, images, "mask_floor = 0.1")
    with pytest.raises(Exception, match="mask suffix '../x' is not a plain file name"):
        _data_cfg(tmp_path, images, 'mask_suffix = "../x"')
    with pytest.raises(Exception, match="mask_floor"):
        _data_cfg(tmp_path, images, 'mask_suffix = "_mask"\nmask_floor = 1.0')


# -- finding masks ----------------------------------------------------------------------------------

def test_suffix_masks_are_not_training_images_and_attach_to_theirs(tmp_path, images):
    pngs = sorted(images.glob("*.png"))
    for p in pngs:
        _mask(p.with_name(p.stem + "_mask.png"), (64, 64), white_cols=32)
    cfg = _data_cfg(tmp_path, images, 'mask_suffix = "_mask"\nmask_floor = 0.25')
    items = attach_masks(scan_datasets(cfg.data, tmp_path), cfg.data.datasets, tmp_path)
    assert sorted(it.path for it in items) == pngs           # the masks are not images of the dataset
    assert all(it.mask.path == it.path.with_name(it.path.stem + "_mask.png") for it in items)
    assert {it.mask.floor for it in items} == {0.25}


def test_folder_masks_match_by_stem_and_every_failure_names_the_file(tmp_path, images):
    masks = tmp_path / "masks"
    masks.mkdir()
    pngs = sorted(images.glob("*.png"))
    for p in pngs[1:]:
        _mask(masks / f"{p.stem}.png", (64, 64))
    cfg = _data_cfg(tmp_path, images, f'mask_path = "{masks}"')

    with pytest.raises(DataError, match=f"1 image\\(s\\) have no mask .*mask_path {masks}.*{pngs[0].name}"):
        attach_masks(scan_datasets(cfg.data, tmp_path), cfg.data.datasets, tmp_path)

    _mask(masks / f"{pngs[0].stem}.png", (48, 64))
    with pytest.raises(DataError, match=f"mask {masks / pngs[0].stem}.png is 48x64 px but its image .*64x64"):
        attach_masks(scan_datasets(cfg.data, tmp_path), cfg.data.datasets, tmp_path)

    (masks / f"{pngs[0].stem}.png").write_bytes(b"not a png")
    with pytest.raises(DataError, match=f"mask {masks / pngs[0].stem}.png \\(of {pngs[0]}\\) cannot be read"):
        attach_masks(scan_datasets(cfg.data, tmp_path), cfg.data.datasets, tmp_path)

    _mask(masks / f"{pngs[0].stem}.png", (64, 64))
    _mask(masks / f"{pngs[0].stem}.jpg", (64, 64))
    with pytest.raises(DataError, match=f"{pngs[0]}: 2 masks match it"):
        attach_masks(scan_datasets(cfg.data, tmp_path), cfg.data.datasets, tmp_path)

    cfg = _data_cfg(tmp_path, images, f'mask_path = "{tmp_path / "nowhere"}"')
    with pytest.raises(DataError, match="#1: mask_path .*nowhere is not a folder"):
        attach_masks(scan_datasets(cfg.data, tmp_path), cfg.data.datasets, tmp_path)


# -- the latent grid --------------------------------------------------------------------------------

def test_mask_grid_covers_the_pixels_its_image_is_trained_on(tmp_path):
    """A 96x64 image in the 64x64 bucket is centre-cropped to x in [16, 80): a mask white left of
    x = 48 gives latent columns 0-3 white and 4-7 black (8 px a cell), and a cell half white is 0.5."""
    path = _mask(tmp_path / "m.png", (96, 64), white_cols=48)
    grid = mask_grid(MaskImage(path, "x", 0.0), (64, 64), 8)
    assert grid.shape == (1, 8, 8) and grid.dtype == torch.float32
    expected = torch.zeros(1, 8, 8)
    expected[..., :4] = 1.0
    assert torch.equal(grid, expected)

    path = _mask(tmp_path / "half.png", (64, 64), white_cols=36)       # column 4 covers x 32..40: half white
    grid = mask_grid(MaskImage(path, "x", 0.0), (64, 64), 8)
    assert torch.allclose(grid[0, :, 4], torch.full((8,), 0.5)) and torch.equal(grid[0, :, 5:], torch.zeros(8, 3))

    rgba = np.zeros((64, 64, 4), dtype=np.uint8)
    rgba[..., :3] = 255
    rgba[:, :32, 3] = 255                                              # transparent right half: black
    Image.fromarray(rgba, mode="RGBA").save(tmp_path / "alpha.png")
    grid = mask_grid(MaskImage(tmp_path / "alpha.png", "x", 0.0), (64, 64), 8)
    assert torch.equal(grid[0, :, :4], torch.ones(8, 4)) and torch.equal(grid[0, :, 4:], torch.zeros(8, 4))

    assert torch.equal(loss_weights(torch.tensor([0.0, 1.0, 0.5]), 0.2), torch.tensor([0.2, 1.0, 0.6]))


# -- the loss -----------------------------------------------------------------------------------------

def test_a_mask_of_ones_is_the_plain_loss():
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 16, 40, generator=g), torch.randn(3, 16, 40, generator=g)
    plain = fm.flow_matching_loss(pred, target)
    masked = fm.masked_flow_matching_loss(pred, target, torch.ones_like(pred))
    assert torch.allclose(masked, plain, rtol=1e-6, atol=0)


def test_a_half_mask_sends_no_gradient_from_the_masked_half():
    """Through the tiny Flux's own packing and prediction: the gradient reaching the prediction is
    zero on every token of the black half and equals twice the plain loss's on the white half
    (each sample is normalised by its weight sum)."""
    from leantune.tiny import flux_transformer

    family = get_family("flux")
    transformer = flux_transformer(seed=0)
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(2, 16, 8, 8, generator=g)
    target = family.pack_latents(torch.randn(2, 16, 8, 8, generator=g))
    mask = torch.zeros(2, 1, 8, 8)
    mask[..., :4] = 1.0                                   # the left half of the latent grid

    def pred_and_grad(weights):
        embeds = family_embeds(transformer, 2)
        pred = family.predict(transformer, family.pack_latents(x0), torch.tensor([0.5, 0.7]), embeds, (8, 8), 1.0)
        pred.retain_grad()
        _loss(family, pred, target, weights, x0).backward()
        return pred.grad

    masked = pred_and_grad(mask)
    plain = pred_and_grad(None)
    tokens = masked.view(2, 4, 4, -1)                     # (B, h/2, w/2, C*4): 2x2 patches
    assert torch.count_nonzero(tokens[:, :, 2:]) == 0
    assert torch.count_nonzero(tokens[:, :, :2]) == tokens[:, :, :2].numel()
    assert torch.allclose(tokens[:, :, :2], 2 * plain.view(2, 4, 4, -1)[:, :, :2], rtol=1e-5, atol=1e-8)


def family_embeds(transformer, batch: int):
    from leantune.models.family import PromptEmbeds

    cfg = transformer.config
    return PromptEmbeds(t5=torch.zeros(batch, 4, cfg.joint_attention_dim),
                        pooled=torch.zeros(batch, cfg.pooled_projection_dim))


# -- end to end ---------------------------------------------------------------------------------------

RUN = """mask_path = "masks"

[lora]
rank = 4
targets = "all"

[train]
steps = 3
learning_rate = 1e-3
mixed_precision = "no"
save_every = 0
seed = 3

[output]
dir = "{out}"
name = "m"
"""

UNMASKED = RUN.replace('mask_path = "masks"\n', "")


def _run(tmp_path, tiny_flux_dir, images, rest, out):
    p = tmp_path / f"{out}.toml"
    p.write_text(tiny_run_toml(tiny_flux_dir, images, rest.format(out=tmp_path / out)))
    return load_config(p)


def test_a_masked_run_caches_its_masks_and_ones_train_as_no_mask(tmp_path, tiny_flux_dir, images):
    (tmp_path / "masks").mkdir()
    for p in sorted(images.glob("*.png")):
        _mask(tmp_path / "masks" / p.name, (64, 64))                        # all white
    ones = train(_run(tmp_path, tiny_flux_dir, images, RUN, "ones"), progress=False)
    plain = train(_run(tmp_path, tiny_flux_dir, images, UNMASKED, "plain"), progress=False)
    assert ones.losses == pytest.approx(plain.losses, rel=1e-5)
    # [data] cache_dir = "cache"; four masks of the same bytes are one entry (keyed by content)
    assert len(list((tmp_path / "cache" / "masks").glob("*.safetensors"))) == 1

    for p in sorted(images.glob("*.png")):
        _mask(tmp_path / "masks" / p.name, (64, 64), white_cols=32)         # changed: re-read, not reused
    cfg = _run(tmp_path, tiny_flux_dir, images, RUN, "half")
    data = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32)
    assert data.stats["masks"].misses == 1 and data.stats["latents"].hits == 4
    batch = next(data.batches(seed=0))
    assert batch.loss_weights.shape == (2, 1, 8, 8)
    assert torch.equal(batch.loss_weights[..., :4], torch.ones(2, 1, 8, 4))
    assert torch.equal(batch.loss_weights[..., 4:], torch.zeros(2, 1, 8, 4))
    again = prepare_caches(cfg.data, cfg.model, cfg.base_dir, "cpu", torch.float32)
    assert again.stats["masks"].hits == 1 and again.stats["masks"].misses == 0
    half = train(cfg, progress=False)
    assert all(np.isfinite(half.losses)) and half.losses != ones.losses
