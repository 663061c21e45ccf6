import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Planner measurements and calibrations of the tests never land in the user's cache.
os.environ.setdefault("LEANTUNE_CACHE", tempfile.mkdtemp(prefix="leantune-test-cache-"))

import pytest
import torch

# One pytest worker per core (scripts/test.sh runs pytest-xdist): each worker computes on one thread,
# so two workers on two cores never oversubscribe them; a run in one process keeps two threads.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


# -- the fast tier ---------------------------------------------------------------------------------
# `./scripts/test.sh --fast` (pytest --fast) runs the tests that are neither marked slow nor gpu and
# whose recorded time (tests/durations.json, written by a whole run with --record-durations) is at
# most FAST_LIMIT_S; a test missing from the file counts as fast until the file is written again.
# tests/test_fast_tier.py checks that the tier still imports and exercises every module of leantune.
DURATIONS_FILE = Path(__file__).parent / "durations.json"
FAST_LIMIT_S = 1.5


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: no slow or gpu test, none recorded over FAST_LIMIT_S (tests/durations.json)")
    parser.addoption("--record-durations", action="store_true",
                     help="write each test's setup + call + teardown seconds to tests/durations.json at the end")


def recorded_durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS_FILE.read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def fast_tier(items, durations: dict[str, float]):
    """(kept, deselected): the items of the fast tier, and the others."""
    kept, dropped = [], []
    for item in items:
        slow = "slow" in item.keywords or "gpu" in item.keywords or durations.get(item.nodeid, 0.0) > FAST_LIMIT_S
        (dropped if slow else kept).append(item)
    return kept, dropped


# -- the order under pytest-xdist ------------------------------------------------------------------
# xdist hands out its groups first, then single tests in collection order. The browser walk of
# test_ui_browser.py (303 s recorded) came near the end, with ~170 s of tests after it: the other
# worker sat idle for the rest (a replay of tests/durations.json through that scheduler: 1787 s wall
# against 1699 s of even halves; the recorded run took 1788 s). The files whose longest recorded test
# is over LONG_FIRST_S go first, the longest first, each file whole (its module fixtures built once).
LONG_FIRST_S = 60.0


def long_files_first(items, durations: dict[str, float]):
    """`items` with the files of a test over LONG_FIRST_S (tests/durations.json) first, the file of the
    longest first; within a file and among the others, the collection order."""
    def path(item):
        return item.nodeid.split("::")[0]

    longest: dict[str, float] = {}
    for item in items:           # (xdist may have suffixed a grouped test's id with @group already)
        seconds = durations.get(item.nodeid.split("@")[0], 0.0)
        longest[path(item)] = max(longest.get(path(item), 0.0), seconds)
    return sorted(items, key=lambda item: -longest[path(item)] if longest[path(item)] > LONG_FIRST_S else 0.0)


def pytest_collection_modifyitems(config, items):
    durations = recorded_durations()
    if config.getoption("--fast"):
        kept, dropped = fast_tier(items, durations)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    if os.environ.get("PYTEST_XDIST_WORKER"):      # every worker reads the same file: the same order
        items[:] = long_files_first(items, durations)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # The collected test modules, torch, diffusers and transformers leave ~460k objects that live for
    # the whole run; every full collection (the caches' and the sampler's gc.collect() after freeing an
    # encoder, ~0.5-0.8 s each in this process, and the interpreter's own) would walk them all again.
    # Frozen, they are skipped; objects the tests make are still collected.
    _freeze_what_lives()


# Tests import more lazily: one file's run (test_sampler.py) imported 3201 modules after collection
# (torch's dynamo and inductor, deepspeed, sympy, diffusers, peft, transformers...), 377k objects that
# each gc.collect() walked again: 27 collects took 3.7-5.3 s of its 11.7 CPU-s. After a test that
# imported at least REFREEZE_MODULES new modules (its fixtures torn down, its garbage collected),
# what lives is frozen again: modules, and what session and module fixtures hold, which refcounting
# still frees; nothing a test makes is frozen while it runs.
REFREEZE_MODULES = 50
_modules_at_freeze = [0]


def _freeze_what_lives():
    import gc
    import sys

    gc.collect()
    gc.freeze()
    _modules_at_freeze[0] = len(sys.modules)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    import sys

    if len(sys.modules) - _modules_at_freeze[0] >= REFREEZE_MODULES:
        _freeze_what_lives()


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # Under pytest-xdist the controller gets every worker's reports too, so this sees the whole run.
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("--record-durations") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import platform
    import time

    payload = {"recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
               "cores": len(os.sched_getaffinity(0)), "load_average": list(os.getloadavg()),
               "seconds": {k: round(v, 3) for k, v in sorted(_SECONDS.items())}}
    tmp = DURATIONS_FILE.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=0) + "\n")
    os.replace(tmp, DURATIONS_FILE)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A complete tiny Flux-dev model in the diffusers folder layout, written once per session."""
    from leantune import tiny

    return tiny.save_flux_folder(tmp_path_factory.mktemp("tiny_flux") / "flux-tiny")


# The [model] and [data] part every end-to-end test shares: the tiny Flux in fp32 at 64 px.
TINY_RUN_HEAD = """
[model]
path = "{model}"
dtype = "fp32"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "cache"
max_text_length = 32

[[data.datasets]]
path = "{images}"
"""


def tiny_lora_rest(out, name: str, sections: str = "", steps: int = 4, save_every: int = 2) -> str:
    """The [lora], [train] and [output] part of a short LoRA run on the tiny model (rank 4 on every
    block Linear, fp32, seed 3), with the test's own `sections` between [train] and [output]."""
    return (f'\n[lora]\nrank = 4\ntargets = "all"\n\n[train]\nsteps = {steps}\nlearning_rate = 1e-3\n'
            f'mixed_precision = "no"\nsave_every = {save_every}\nseed = 3\n\n{sections}\n'
            f'[output]\ndir = "{out}"\nname = "{name}"\n')


def tiny_run_toml(model, images, rest: str) -> str:
    """A run config for the tiny model: the shared head, then the test's own dataset keys and
    [lora] / [train] / [output] sections (`rest`, which may use no format fields)."""
    return TINY_RUN_HEAD.format(model=model, images=images) + rest


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A complete tiny SD3.5 (Large-style) model in the diffusers folder layout, written once per session."""
    from leantune import tiny

    return tiny.save_sd3_folder(tmp_path_factory.mktemp("tiny_sd3") / "sd3-tiny", style="large")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny-model tests (`pytestmark = pytest.mark.usefixtures(
    "one_torch_thread")`): tiny models are a few microseconds per op, so a second thread only adds
    synchronisation, and on a shared 2-core machine it turns every op into a wait (measured 5 ms vs
    180 ms per tiny transformer forward under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
