"""The fast tier (`./scripts/test.sh --fast`): which tests it keeps, and that it imports every
module of leantune (an import error anywhere fails the tier, not only the whole suite).

Whether the tier also *exercises* every module is measured, not asserted here: docs/benchmarks.md
records `coverage` of the tier per module (scripts/fast_tier_coverage.py)."""

from __future__ import annotations

import importlib
import pkgutil
from types import SimpleNamespace

import pytest
from conftest import FAST_LIMIT_S, fast_tier

import leantune


def _item(nodeid: str, *marks: str):
    return SimpleNamespace(nodeid=nodeid, keywords={m: True for m in marks})


def test_the_tier_drops_slow_gpu_and_recorded_slow_tests_and_keeps_new_ones():
    items = [_item("a::quick"), _item("a::marked", "slow"), _item("a::cuda", "gpu"), _item("a::measured"),
             _item("a::new"), _item("a::at_limit")]
    durations = {"a::quick": 0.2, "a::measured": FAST_LIMIT_S + 0.01, "a::at_limit": FAST_LIMIT_S}
    kept, dropped = fast_tier(items, durations)
    assert [i.nodeid for i in kept] == ["a::quick", "a::new", "a::at_limit"]
    assert [i.nodeid for i in dropped] == ["a::marked", "a::cuda", "a::measured"]


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(leantune.__path__, "leantune.")
                  if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", _modules())
def test_every_module_imports(name):
    importlib.import_module(name)
