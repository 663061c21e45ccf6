"""Dataset scanning, aspect buckets and the resumable batch order (no models involved)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from leantune.config import validate
from leantune.data.buckets import BatchOrder, bucket_sizes, fit_to_bucket, nearest_bucket
from leantune.data.dataset import DataError, DataWarning, load_rgb, scan_datasets


def _image(path: Path, size: tuple[int, int], color=(200, 30, 30), **save_args) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, (20, 20, 20))
    w, h = size
    img.paste(Image.new("RGB", (w // 2, h // 2), color), (w // 4, h // 4))
    img.save(path, **save_args)
    return path


def _data_cfg(datasets: list[dict], **data):
    """Small test images are kept (min_size = 0) unless a test is about sizes."""
    datasets = [{"min_size": 0, **d} for d in datasets]
    return validate({"model": {"path": "unused"}, "data": {"datasets": datasets, **data}}).data


# -- scanning --------------------------------------------------------------------------------------

def test_scan_captions_trigger_repeats_nested_default(tmp_path):
    a = tmp_path / "a"
    _image(a / "cat.png", (64, 48))
    (a / "cat.txt").write_text("a red square\non grey\n")
    _image(a / "sub" / "deep" / "dog.jpg", (40, 90))
    (a / "sub" / "deep" / "dog.txt").write_text("a dog")
    _image(a / "nocap.webp", (50, 50))
    _image(a / ".hidden.png", (50, 50))          # hidden files are not data
    (a / "notes.txt").write_text("not a caption of anything")
    b = tmp_path / "b"
    _image(b / "x.jpeg", (30, 30))
    (b / "x.caption").write_text("bee")

    cfg = _data_cfg([
        {"path": str(a), "trigger_word": "lnt", "repeats": 3, "default_caption": "a picture", "caption_dropout": 0.2},
        {"path": "b", "caption_extension": ".caption"},        # relative to base_dir
    ])
    items = scan_datasets(cfg, base_dir=tmp_path)
    by_name = {it.path.name: it for it in items}
    assert sorted(by_name) == ["cat.png", "dog.jpg", "nocap.webp", "x.jpeg"]
    assert by_name["cat.png"].caption == "lnt, a red square on grey"
    assert by_name["dog.jpg"].caption == "lnt, a dog"
    assert by_name["nocap.webp"].caption == "lnt, a picture"
    assert by_name["x.jpeg"].caption == "bee"
    assert (by_name["dog.jpg"].width, by_name["dog.jpg"].height) == (40, 90)
    assert [by_name[n].repeats for n in ("cat.png", "x.jpeg")] == [3, 1]
    assert by_name["cat.png"].caption_dropout == 0.2 and by_name["x.jpeg"].dataset == 1

    flat = scan_datasets(_data_cfg([{"path": str(a), "recursive": False}]), base_dir=tmp_path)
    assert sorted(it.path.name for it in flat) == ["cat.png", "nocap.webp"]
    assert flat[0].caption in ("a red square on grey", "")     # no trigger, default caption empty


def test_trigger_alone_when_caption_empty(tmp_path):
    _image(tmp_path / "d" / "one.png", (32, 32))
    items = scan_datasets(_data_cfg([{"path": str(tmp_path / "d"), "trigger_word": "sks"}]))
    assert items[0].caption == "sks"


def test_unreadable_images_listed_in_one_warning(tmp_path):
    d = tmp_path / "d"
    _image(d / "good.png", (64, 64))
    full = _image(d / "broken.jpg", (256, 256), quality=95).read_bytes()
    (d / "broken.jpg").write_bytes(full[: len(full) // 2])      # truncated: `open` accepts it, `load` does not
    (d / "fake.png").write_text("this is not an image")
    with pytest.warns(DataWarning) as record:
        items = scan_datasets(_data_cfg([{"path": str(d)}]))
    assert [it.path.name for it in items] == ["good.png"]
    ours = [w for w in record if issubclass(w.category, DataWarning) and "unreadable image(s):" in str(w.message)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert str(d / "broken.jpg") in text and str(d / "fake.png") in text and "skipped 2" in text


def test_empty_dataset_is_an_error_naming_the_folder(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("no images here")
    with pytest.raises(DataError, match=str(empty)):
        scan_datasets(_data_cfg([{"path": str(empty)}]))
    with pytest.raises(DataError, match="is not a folder"):
        scan_datasets(_data_cfg([{"path": str(tmp_path / "missing")}]))
    # A folder whose only image is unreadable is empty too, and says so.
    (empty / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        with pytest.raises(DataError, match=r"1 unreadable"):
            scan_datasets(_data_cfg([{"path": str(empty)}]))


def test_exif_orientation_swaps_the_displayed_size(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6                          # rotate 90 degrees on display
    path = _image(tmp_path / "d" / "rot.jpg", (80, 40), exif=exif)
    item = scan_datasets(_data_cfg([{"path": str(tmp_path / "d")}]))[0]
    assert (item.width, item.height) == (40, 80)
    assert load_rgb(path).size == (40, 80)


def test_transparency_composited_on_white(tmp_path):
    path = tmp_path / "t.png"
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(path)
    assert np.asarray(load_rgb(path)).min() == 255


@pytest.mark.parametrize("mode", ["I;16", "I", "F", "F01", "LA", "P", "CMYK"])
def test_every_image_mode_converts_by_its_range(tmp_path, mode):
    """A 16-bit gray 33025 is 129 of 255, not white; alpha is composited on white; CMYK is converted."""
    path = tmp_path / "img.png"
    if mode == "I;16":
        Image.fromarray(np.full((4, 4), 33025, dtype=np.uint16)).save(path)
        assert Image.open(path).mode == "I;16"
        expected = (129, 129, 129)          # 33025 / 257 = 128.5, rounded half to even... to 128 or 129
    elif mode == "I":
        Image.fromarray(np.full((4, 4), 33025, dtype=np.int32), mode="I").save(path := tmp_path / "img.tif")
        expected = (129, 129, 129)
    elif mode == "F":
        Image.fromarray(np.full((4, 4), 33025.0, dtype=np.float32), mode="F").save(path := tmp_path / "img.tif")
        expected = (129, 129, 129)
    elif mode == "F01":
        Image.fromarray(np.full((4, 4), 0.5, dtype=np.float32), mode="F").save(path := tmp_path / "img.tif")
        expected = (128, 128, 128)          # float images in 0..1
    elif mode == "LA":
        img = Image.new("LA", (4, 4), (0, 255))
        img.putpixel((0, 0), (0, 0))        # one transparent pixel: white, the rest black
        img.save(path)
        out = np.asarray(load_rgb(path))
        assert tuple(out[0, 0]) == (255, 255, 255) and tuple(out[1, 1]) == (0, 0, 0)
        return
    elif mode == "P":
        img = Image.new("P", (4, 4), 1)
        img.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
        img.putpixel((0, 0), 0)
        img.info["transparency"] = 0        # palette entry 0 is transparent
        img.save(path, transparency=0)
        out = np.asarray(load_rgb(path))
        assert tuple(out[0, 0]) == (255, 255, 255) and tuple(out[1, 1]) == (200, 30, 30)
        return
    else:
        Image.new("CMYK", (4, 4), (255, 0, 0, 0)).save(path := tmp_path / "img.jpg", quality=100)
        expected = (0, 255, 255)            # pure cyan
    out = np.asarray(load_rgb(path)).astype(int)
    assert out.shape == (4, 4, 3)
    assert np.abs(out[0, 0] - np.array(expected)).max() <= 1, (mode, out[0, 0])


def _captioned(d: Path, name: str, caption: bytes | None) -> Path:
    path = _image(d / f"{name}.png", (64, 64))
    if caption is not None:
        path.with_suffix(".txt").write_bytes(caption)
    return path


def test_captions_with_byte_order_marks_decode(tmp_path):
    d = tmp_path / "d"
    _captioned(d, "bom8", "\ufeffa red café".encode("utf-8"))
    _captioned(d, "utf16", "a blue café".encode("utf-16"))            # BOM + UTF-16 LE
    _captioned(d, "utf16be", b"\xfe\xff" + "a green square".encode("utf-16-be"))
    _captioned(d, "plain", "a plain caption".encode("utf-8"))
    items = {it.path.stem: it.caption for it in scan_datasets(_data_cfg([{"path": str(d)}]))}
    assert items == {"bom8": "a red café", "utf16": "a blue café", "utf16be": "a green square",
                     "plain": "a plain caption"}
    assert not any("\ufeff" in c for c in items.values())


def test_undecodable_caption_skips_its_image_and_is_listed(tmp_path):
    d = tmp_path / "d"
    _captioned(d, "good", b"a good caption")
    _captioned(d, "latin1", "caf\xe9 cr\xe8me".encode("latin-1"))
    with pytest.warns(DataWarning) as record:
        items = scan_datasets(_data_cfg([{"path": str(d)}]))
    assert [it.path.stem for it in items] == ["good"]
    text = " ".join(str(w.message) for w in record if issubclass(w.category, DataWarning))
    assert "skipped 1 unreadable" in text and str(d / "latin1.png") in text and "latin1.txt" in text


def test_missing_and_empty_captions_one_warning_or_an_error(tmp_path):
    d = tmp_path / "d"
    _captioned(d, "ok", b"a caption")
    for i in range(7):
        _captioned(d, f"none{i}", None)
    _captioned(d, "blank", b"  \n ")
    with pytest.warns(DataWarning) as record:
        items = scan_datasets(_data_cfg([{"path": str(d), "trigger_word": "sks"}]))
    assert len(items) == 9
    ours = [str(w.message) for w in record if issubclass(w.category, DataWarning)]
    assert len(ours) == 1
    assert ours[0].startswith("8 image(s) have no caption file or an empty one") and "(and 3 more)" in ours[0]
    assert str(d / "blank.png") in ours[0]
    # A default caption is the user's choice: no warning for the missing files.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        scan_datasets(_data_cfg([{"path": str(d), "default_caption": "a picture"}]))
    # require_captions: an error naming the count and the first paths, even with a default caption.
    with pytest.raises(DataError, match=r"8 image\(s\) have no caption.*require_captions = true") as err:
        scan_datasets(_data_cfg([{"path": str(d), "require_captions": True, "default_caption": "x"}]))
    assert str(d / "blank.png") in str(err.value)


def test_tiny_images_skipped_and_heavy_crops_warned(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    Image.new("RGB", (1, 1), (9, 9, 9)).save(d / "tiny.png")
    (d / "tiny.txt").write_text("one pixel")
    Image.new("RGB", (2000, 40), (9, 9, 9)).save(d / "strip.png")     # 50:1 into a 4:1 bucket
    (d / "strip.txt").write_text("a strip")
    _captioned(d, "fine", b"a fine image")                            # 64x64 at resolution 64
    Image.new("RGB", (40, 40), (9, 9, 9)).save(d / "small_at_128.png")   # ok at 64 (1.6x), too small at 128
    (d / "small_at_128.txt").write_text("small")
    cfg = _data_cfg([{"path": str(d), "min_size": 0.5}], resolutions=[64, 128])
    with pytest.warns(DataWarning) as record:
        items = {it.path.stem: it for it in scan_datasets(cfg)}
    assert sorted(items) == ["fine", "small_at_128", "strip"]
    assert items["small_at_128"].too_small_for == {128} and items["fine"].too_small_for == frozenset()
    ours = [str(w.message) for w in record if issubclass(w.category, DataWarning)]
    small = [m for m in ours if "smaller than min_size" in m]
    crops = [m for m in ours if "lose more than half" in m]
    assert len(small) == 1 and "skipped 2 image(s)" in small[0] and str(d / "tiny.png") in small[0]
    assert len(crops) == 1 and str(d / "strip.png") in crops[0] and "fine" not in crops[0]
    # min_size = 0 keeps every image.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        assert len(scan_datasets(_data_cfg([{"path": str(d), "min_size": 0}], resolutions=[64]))) == 4


# -- buckets ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("res", [64, 256, 512, 768, 1024])
def test_bucket_sizes(res):
    buckets = bucket_sizes(res)
    assert (res, res) in buckets
    assert set(buckets) == {(h, w) for w, h in buckets}          # mirrored
    tolerance = 0.07 if res < 256 else 0.02                      # rounding to 16 px weighs more when small
    for w, h in buckets:
        assert w % 16 == 0 and h % 16 == 0
        assert abs(w * h / (res * res) - 1) <= tolerance
        assert 1 / 4 <= w / h <= 4
    ratios = [w / h for w, h in buckets]
    assert ratios == sorted(ratios) and min(ratios) == pytest.approx(1 / 4) and max(ratios) == pytest.approx(4)


def test_nearest_bucket_by_aspect_within_resolution():
    b512 = bucket_sizes(512)
    assert nearest_bucket(3000, 3000, b512) == (512, 512)
    assert nearest_bucket(4000, 1000, b512) == (1024, 256)
    assert nearest_bucket(100, 1000, b512) == (256, 1024)       # beyond 1:4 clamps to the extreme
    # 2:1 lies between 688x384 (1.79) and 816x320 (2.55); on a log scale 1.79 is nearer.
    assert nearest_bucket(1000, 500, b512) == (688, 384)
    assert nearest_bucket(500, 1000, b512) == (384, 688)
    for w, h in [(333, 517), (1280, 720), (999, 1000), (64, 200)]:
        chosen = nearest_bucket(w, h, b512)
        best = min(abs(math.log((bw / bh) / (w / h))) for bw, bh in b512)
        assert abs(math.log((chosen[0] / chosen[1]) / (w / h))) == pytest.approx(best)
    assert nearest_bucket(1280, 720, bucket_sizes(1024)) == (1360, 768)


def test_fit_to_bucket_center_crops():
    # Three vertical bands: red | green | blue. A square crop of a 3:1 image keeps only green.
    img = Image.new("RGB", (300, 100))
    for i, c in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        img.paste(Image.new("RGB", (100, 100), c), (100 * i, 0))
    out = np.asarray(fit_to_bucket(img, (64, 64))).astype(float)
    assert out.shape == (64, 64, 3)
    inner = out[:, 2:-2]                      # Lanczos may bleed one pixel at the crop edges
    assert inner[..., 1].min() > 240 and inner[..., 0].max() < 15 and inner[..., 2].max() < 15
    # A tall crop of a wide image: width is the binding side, nothing is stretched.
    out = fit_to_bucket(img, (48, 80))
    assert out.size == (48, 80)


# -- batch order -----------------------------------------------------------------------------------

def _sample_buckets():
    # 23 samples over three buckets, counts chosen so batches of 4 leave short last batches.
    return [(64, 64)] * 9 + [(48, 80)] * 7 + [(80, 48)] * 7


def _take(order, n):
    return [(s.epoch, s.index, s.bucket, s.samples, s.dropped) for s in (next(order) for _ in range(n))]


def test_batches_never_mix_buckets_and_cover_each_epoch():
    buckets = _sample_buckets()
    order = BatchOrder(buckets, batch_size=4, seed=3)
    assert order.batches_per_epoch == 3 + 2 + 2
    for epoch in range(3):
        seen = []
        for _ in range(order.batches_per_epoch):
            slot = next(order)
            assert slot.epoch == epoch
            assert all(buckets[i] == slot.bucket for i in slot.samples)
            assert 1 <= len(slot.samples) <= 4
            seen.extend(slot.samples)
        assert sorted(seen) == list(range(len(buckets)))       # every sample exactly once per epoch


def test_order_is_deterministic_per_seed_and_shuffled_per_epoch():
    buckets = _sample_buckets()
    n = 7
    a = _take(BatchOrder(buckets, 4, seed=1), 2 * n)
    b = _take(BatchOrder(buckets, 4, seed=1), 2 * n)
    c = _take(BatchOrder(buckets, 4, seed=2), 2 * n)
    assert a == b
    assert [x[3] for x in a] != [x[3] for x in c]
    assert [x[3] for x in a[:n]] != [x[3] for x in a[n:]]         # epochs differ
    plain = _take(BatchOrder(buckets, 4, seed=1, shuffle=False), n)
    assert [x[3] for x in plain] == [(0, 1, 2, 3), (4, 5, 6, 7), (8,), (9, 10, 11, 12), (13, 14, 15),
                                     (16, 17, 18, 19), (20, 21, 22)]


def test_resume_from_saved_position_yields_the_same_batches():
    buckets = _sample_buckets()
    dropout = [0.5] * len(buckets)
    run = BatchOrder(buckets, 4, seed=9, dropout=dropout)
    _take(run, 5)
    saved = json.loads(json.dumps(run.state_dict()))              # as a checkpoint stores it
    expected = _take(run, 12)                                    # crosses into the next epoch

    resumed = BatchOrder(buckets, 4, seed=9, dropout=dropout)
    _take(resumed, 2)                                            # a different position, then restore
    resumed.load_state_dict(saved)
    assert _take(resumed, 12) == expected
    assert any(any(x[4]) for x in expected) and not all(all(x[4]) for x in expected)


def test_caption_dropout_rate():
    buckets = [(64, 64)] * 10
    order = BatchOrder(buckets, 5, seed=0, dropout=[0.0] * 5 + [1.0] * 5)
    for _ in range(4):
        slot = next(order)
        assert all(d == (i >= 5) for i, d in zip(slot.samples, slot.dropped))
    order = BatchOrder([(64, 64)] * 100, 10, seed=0, dropout=[0.3] * 100)
    drops = [d for _ in range(40) for d in next(order).dropped]
    assert 0.25 < sum(drops) / len(drops) < 0.35                 # 4000 draws: sd ~0.007


def test_position_of_another_run_is_refused():
    buckets = _sample_buckets()
    state = BatchOrder(buckets, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed 1"):
        BatchOrder(buckets, 4, seed=2).load_state_dict(state)
    other = BatchOrder(buckets + [(64, 64)], 4, seed=1)
    with pytest.raises(ValueError, match="different sample list"):
        other.load_state_dict(state)
    state["epoch"] = 4
    with pytest.warns(UserWarning, match="start of epoch 5"):
        other.load_state_dict(state, strict=False)
    assert next(other).epoch == 5
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"epoch": 0})
