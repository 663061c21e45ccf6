"""Bulk caption edits for the dataset view: add text before or after every caption (a trigger
word, a style tag), or replace a word everywhere.

Fixing captions one box at a time does not scale past a few dozen images. An edit applies to the
images the user selected, or to every image of the folder; each caption is read with the trainer's
own reader (dataset_view.scan) and written back as one typed into its box is (write_caption:
atomic, confined to the page's data roots). Adding text a caption already starts (or ends) with
changes nothing, so pressing the button twice does not put the trigger word in twice.
"""

from __future__ import annotations

from . import dataset_view
from .form import FormError

OPS = ("prefix", "suffix", "replace")


def edit(caption: str, op: str, text: str, find: str = "") -> str:
    """The caption after the edit (unchanged when there is nothing to do)."""
    if op == "prefix":
        return caption if caption.startswith(text.strip()) else text + caption
    if op == "suffix":
        return caption if caption.endswith(text.strip()) else caption + text
    if op == "replace":
        return caption.replace(find, text)
    raise FormError(f"caption_op {op!r}: one of {', '.join(OPS)}")


def apply(folder: str, op: str, text: str, find: str = "", names: list[str] | None = None, roots=None) -> list[str]:
    """Edit the captions of `names` (all of the folder's images when None or empty) in `folder`;
    returns the names whose caption changed."""
    if op not in OPS:
        raise FormError(f"caption_op {op!r}: one of {', '.join(OPS)}")
    if op == "replace" and not find:
        raise FormError("caption_find: give the text to find")
    if op != "replace" and not text.strip():
        raise FormError("caption_text: give the text to add")
    images = {entry["name"]: entry for entry in dataset_view.scan(folder, None, roots)}
    chosen = list(names) if names else sorted(images)
    unknown = [n for n in chosen if n not in images]
    if unknown:
        raise FormError(f"caption_op: no image {unknown[0]!r} in {folder}")
    changed = []
    for name in chosen:
        before = images[name]["caption"]
        if op == "replace" and not before:
            continue
        after = " ".join(edit(before, op, text, find).split())
        if after != " ".join(before.split()):
            dataset_view.write_caption(folder, name, after, roots)
            changed.append(name)
    return changed
