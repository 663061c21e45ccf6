"""Bulk caption edits of the dataset view (ui/caption_tools.py, issue 42): prefix / suffix / replace
on the ticked images or all of them, written as the caption box writes them; pressing twice adds a
trigger word once; the route's errors name the page's fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from test_ui_labels import _names_the_field, _refused, _route, app  # noqa: F401 (the fixture)

from leantune.ui import caption_tools
from leantune.ui.dataset_view import OutsideRoots


def _folder(root: Path) -> Path:
    root.mkdir()
    for name, caption in (("a", "a red box"), ("b", "a blue box"), ("c", None)):
        Image.new("RGB", (64, 64), (200, 0, 0)).save(root / f"{name}.png")
        if caption is not None:
            (root / f"{name}.txt").write_text(caption + "\n")
    return root


def test_prefix_on_every_image_once_suffix_on_the_ticked_and_replace(tmp_path):
    folder = _folder(tmp_path / "d")
    changed = caption_tools.apply(str(folder), "prefix", "ohwx, ", roots=[tmp_path])
    assert changed == ["a.png", "b.png", "c.png"]
    assert (folder / "a.txt").read_text() == "ohwx, a red box\n" and (folder / "c.txt").read_text() == "ohwx,\n"
    assert caption_tools.apply(str(folder), "prefix", "ohwx, ", roots=[tmp_path]) == []      # twice: once
    assert caption_tools.apply(str(folder), "suffix", ", studio light", names=["b.png"], roots=[tmp_path]) == ["b.png"]
    assert (folder / "b.txt").read_text() == "ohwx, a blue box, studio light\n"
    assert (folder / "a.txt").read_text() == "ohwx, a red box\n"
    assert caption_tools.apply(str(folder), "replace", "cube", find="box", roots=[tmp_path]) == ["a.png", "b.png"]
    assert (folder / "a.txt").read_text() == "ohwx, a red cube\n"


def test_the_route_edits_and_its_errors_name_the_pages_fields(app, tmp_path):  # noqa: F811
    folder = str(_folder(tmp_path / "d"))
    post = _route(app, "/api/captions", "POST")
    assert post({"path": folder, "op": "suffix", "text": " photo", "names": ["a.png"]}) == {"changed": ["a.png"]}
    _names_the_field(_refused(app, "/api/captions", "POST", {"path": folder, "op": "prefix", "text": " "}),
                     "caption_text")
    _names_the_field(_refused(app, "/api/captions", "POST", {"path": folder, "op": "replace", "text": "x"}),
                     "caption_find")
    _names_the_field(_refused(app, "/api/captions", "POST", {"path": folder, "op": "prefix", "text": "x",
                                                              "names": ["nope.png"]}), "caption_op")
    outside = _folder(tmp_path.parent / f"{tmp_path.name}-outside")       # beyond the page's data roots
    with pytest.raises(OutsideRoots):
        post({"path": str(outside), "op": "prefix", "text": "x"})
    assert (outside / "a.txt").read_text() == "a red box\n"
