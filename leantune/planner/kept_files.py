"""Reading the planner's kept files (answers, measurements, calibrations) as untrusted input.

They are caches in a folder the user can edit, copy between machines or half-write with a full
disk, and a wrong shape used to surface far from the file: `"stdout": 5` as an AttributeError in
the replay, a NaN byte count as "cannot convert float NaN to integer" deep in the memory model.
Here a kept file either has the shape its writer gives it or raises `BadKeptFile` with a short
reason, so the reader can ignore it (saying so once, with the path) and compute the value again,
as it already does for a file that does not parse.

Imports nothing heavy: a replayed answer is read without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any


class BadKeptFile(ValueError):
    """A kept file that parses but does not have the shape its writer gives it."""


def read_json(path: Path) -> Any:
    """The JSON in `path`, with NaN, Infinity and numbers beyond a float refused (ValueError):
    Python writes and reads them, but every number the planner keeps is finite."""
    return loads(path.read_text(encoding="utf-8"))


def read_kept_object(path: Path, what: str) -> dict:
    """The JSON object kept in `path` ({} when there is none yet); an unreadable file or one that
    is not an object is warned of once, naming `what` and the path, and read as {} (its values
    are measured again and the file rewritten)."""
    import logging

    if not path.exists():
        return {}
    try:
        kept = read_json(path)
        if not isinstance(kept, dict):
            raise ValueError("not a JSON object")
        return kept
    except (OSError, ValueError) as e:
        logging.getLogger("leantune").warning("planner: ignoring unreadable %s file %s (%s)", what, path, e)
        return {}


def loads(text: str | bytes) -> Any:
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)


def _no_constant(name: str):
    raise BadKeptFile(f"holds {name}, which no kept number is")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadKeptFile(f"holds {text}, beyond a float")
    return value


def is_number(value: Any) -> bool:
    """A finite int or float (a bool is no number here, though Python's bool is an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_PLAIN = {int: is_number, float: is_number, bool: lambda v: isinstance(v, bool),
          str: lambda v: isinstance(v, str), type(None): lambda v: v is None}


def check_fields(value: Any, hint: Any, where: str) -> None:
    """`value` as its type hint says, recursively through dataclasses, tuples, lists, dicts and
    unions; int and float both mean a finite number. Raises BadKeptFile naming the field."""
    plain = _PLAIN.get(hint) if isinstance(hint, type) else None
    if plain is not None:
        if not plain(value):
            raise BadKeptFile(f"{where} is {value!r}, not a {'number' if hint in (int, float) else hint.__name__}")
        return
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            raise BadKeptFile(f"{where} is not a {hint.__name__}")
        for name, field_hint in _hints(hint).items():
            check_fields(getattr(value, name), field_hint, f"{where}.{name}")
        return
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        reasons = []
        for option in args:
            try:
                return check_fields(value, option, where)
            except BadKeptFile as e:
                reasons.append(str(e))
        raise BadKeptFile(reasons[0])
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, (tuple, list)):
            raise BadKeptFile(f"{where} is {value!r}, not a list")
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) != len(value):
            raise BadKeptFile(f"{where} has {len(value)} items, not {len(args)}")
        for i, item in enumerate(value):
            item_hint = args[0] if args and (origin is list or args[-1] is Ellipsis) else args[i] if args else Any
            check_fields(item, item_hint, f"{where}[{i}]")
    elif origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise BadKeptFile(f"{where} is {value!r}, not a table")
        for k, v in value.items():
            if args:
                check_fields(k, args[0], f"{where} key {k!r}")
                check_fields(v, args[1], f"{where}[{k!r}]")
    elif hint is not Any:
        raise TypeError(f"check_fields: no rule for the type {hint!r} of {where}")


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
