"""Every path of a run's config, confined to the folders the page may use.

The form's dataset field is checked as it is typed, but the extra TOML can add datasets, reference
folders, a cache or an output folder anywhere, and the trainer reads and writes what the merged,
validated config says. So that config is what is checked, key by key, before a run starts or
resumes. Each path key has the roots it may lie in (PATHS): what is read and shown (datasets,
references) under the data roots (`--data`); what is written (outputs, caches) in the run's folder
or the page's runs folder; model weights anywhere, since they are only read as weights and the
form's model field (like `leantune sample`) takes any path. Paths are compared after following
symlinks, so a link inside a root that points out of it is outside.

The config's paths are plain strings, so a key is found by its type, not its name: every field
whose type admits free text (str, a Path, lists and unions of them; not a Literal) is either listed
here as a path, as a file-name component (NAMES) or as text (TEXT), or, when nobody has listed it
yet (a key the config gained later), checked as a path that must lie under the data roots or the
run's folder. A test compares these lists with the config's fields, so a new key is classified
the day it is added.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path, PurePath

from pydantic import BaseModel

from .dataset_view import OutsideRoots, within

ANYWHERE = "anywhere"      # read as model weights: any folder
DATA = "data"              # read (and shown): under a --data root
RUN = "run"                # written: in this run's folder
RUNS = "runs"              # written, shared by the page's runs: under the runs folder

MODEL = (ANYWHERE,)
PATHS: dict[str, tuple[str, ...]] = {
    "model.path": MODEL, "model.transformer": MODEL, "model.text_encoder": MODEL, "model.text_encoder_2": MODEL,
    "model.text_encoder_3": MODEL, "model.tokenizer": MODEL, "model.tokenizer_2": MODEL,
    "model.tokenizer_3": MODEL, "model.vae": MODEL,
    "model.processor": MODEL,                         # Qwen-Image-2.1's processor folder, read as the tokenizers are
    "model.image_encoder": MODEL, "model.image_processor": MODEL,   # Wan 2.1 I2V's CLIP encoder, read as weights
    "lora.init_from": MODEL,                          # a LoRA file read as weights, like the model's
    "model.base_adapters.path": MODEL,                # frozen LoRA files, read as weights (train/base_adapters.py)
    "sample.base_adapters.path": MODEL,
    "sample.base": MODEL,                             # another checkpoint of the family, read as weights
    "data.datasets.path": (DATA,),
    "data.datasets.reference_path": (DATA,),
    "data.datasets.mask_path": (DATA,),               # masks are read (and shown) as the images are
    "sample.references": (DATA,),
    "validation.path": (DATA,),                       # held-out images, read as the datasets are
    "data.cache_dir": (RUNS,),                        # a cache several runs share stays the page's
    "output.dir": (RUN,),
    "memory.disk_dir": (RUN, RUNS),                   # the disk tier writes streamed blocks there (issue 39)
    "distributed.deepspeed_config": (DATA, RUN),      # a JSON file of the user's, or beside the config
}
UNLISTED = (DATA, RUN)
# One file-name component inside a path above: no separator, not "." or "..", not empty.
NAMES = frozenset({"output.name"})
TEXT = frozenset({
    "data.datasets.caption_extension", "data.datasets.trigger_word", "data.datasets.default_caption",
    "data.datasets.mask_suffix",                      # part of a file name beside each image
    "full.train", "full.exclude",                     # fnmatch patterns on parameter names
    "memory.streamed_blocks", "memory.vram_budget", "memory.ram_budget",
    "sample.prompts", "sample.negative_prompt",
})


def _textual(annotation) -> bool:
    """Whether a value of this type can be a free string or a path (a Literal cannot)."""
    return annotation is typing.Any or (isinstance(annotation, type) and issubclass(annotation, (str, PurePath, os.PathLike)))


def _keys(annotation, key: tuple) -> typing.Iterator[str]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        for name, field in annotation.model_fields.items():
            if not field.exclude:
                yield from _keys(field.annotation, key + (name,))
    elif _textual(annotation):
        yield ".".join(key)
    elif typing.get_origin(annotation) is not typing.Literal:
        for arg in typing.get_args(annotation):
            yield from _keys(arg, key)


def free_text_keys(model: type[BaseModel]) -> list[str]:
    """The dotted keys ("data.datasets.path") of `model` whose values can be free text or paths."""
    return sorted(set(_keys(model, ())))


def _values(value, loc: tuple, key: tuple) -> typing.Iterator[tuple[tuple, str, str]]:
    """(location, dotted key, value) of every string or path in a validated config value."""
    if isinstance(value, BaseModel):
        for name, field in type(value).model_fields.items():
            if not field.exclude and any(True for _ in _keys(field.annotation, (name,))):     # not a Literal
                yield from _values(getattr(value, name), loc + (name,), key + (name,))
    elif isinstance(value, (str, PurePath)):
        yield loc, ".".join(key), str(value)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _values(item, loc + (i,), key)
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _values(item, loc + (k,), key)


def where(loc: tuple) -> str:
    """The TOML key of a location, as the user wrote it: ('data', 'datasets', 1, 'path') ->
    "[[data.datasets]] #2 path"; ('sample', 'references', 0) -> "[sample] references #1"."""
    *head, last = loc
    index = ""
    if isinstance(last, int):                 # an item of a list of values
        index, (*head, last) = f" #{last + 1}", head
    tables = [i for i, p in enumerate(head) if isinstance(p, int)]
    if tables:                                # inside an array of tables
        i = tables[-1]
        section = f"[[{'.'.join(str(p) for p in head[:i] if not isinstance(p, int))}]] #{head[i] + 1}"
        key = ".".join([str(p) for p in head[i + 1:]] + [str(last)])
    else:
        section, key = (f"[{'.'.join(map(str, head))}]" if head else ""), str(last)
    return f"{section} {key}{index}".strip()


def check(cfg, data_roots: list[Path], run_folder: Path, runs_dir: Path) -> None:
    """Raise OutsideRoots, naming the key and the path, for the first path of `cfg` (a validated
    RunConfig) that lies outside the roots its key may use."""
    from ..config import resolve_path

    roots = {DATA: [Path(r).resolve() for r in data_roots], RUN: [Path(run_folder).resolve()],
             RUNS: [Path(runs_dir).resolve()]}
    words = {DATA: f"the folders this page may use ({', '.join(map(str, roots[DATA]))})",
             RUN: f"this run's folder ({roots[RUN][0]})", RUNS: f"the page's runs folder ({roots[RUNS][0]})"}
    for loc, key, value in _values(cfg, (), ()):
        if key in TEXT:
            continue
        if key in NAMES:
            if not value or value in (".", "..") or "/" in value or os.sep in value:
                raise OutsideRoots(f"{where(loc)} = {value!r}: a name, one file-name component (no '/', not "
                                   f"'..' or empty), inside the run's folder")
            continue
        kinds = PATHS.get(key, UNLISTED)
        if kinds == (ANYWHERE,):
            continue
        given = resolve_path(cfg.base_dir, value)
        real = given.resolve()
        if any(within(real, roots[k]) for k in kinds):
            continue
        link = f" (a link to {real})" if real != Path(os.path.abspath(given)) else ""
        why = "" if key in PATHS else " (a key this page does not know is checked as a path)"
        advice = "; start `leantune ui --data DIR` to add a folder" if DATA in kinds else ""
        raise OutsideRoots(f"{where(loc)} = {value!r}{link}: outside {' or '.join(words[k] for k in kinds)}"
                           f"{why}{advice}")
