"""The order the xdist workers run (tests/conftest.py long_files_first): a file with a test recorded
over LONG_FIRST_S goes first, the longest first, each file whole and in its own order; the rest keep
the collection order."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import LONG_FIRST_S, long_files_first


def test_files_with_a_long_test_run_first_whole_longest_first():
    ids = ["tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/b.py::t2@multiprocess",
           "tests/c.py::t1", "tests/d.py::t1", "tests/d.py::t2"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    durations = {"tests/b.py::t2": LONG_FIRST_S + 5, "tests/d.py::t2": LONG_FIRST_S + 50,
                 "tests/a.py::t1": 1.0, "tests/c.py::t1": LONG_FIRST_S}       # c: not over the bound
    got = [i.nodeid for i in long_files_first(items, durations)]
    assert got == ["tests/d.py::t1", "tests/d.py::t2", "tests/b.py::t1", "tests/b.py::t2@multiprocess",
                   "tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t1"]
    assert [i.nodeid for i in long_files_first(items, {})] == ids            # nothing recorded: unchanged
