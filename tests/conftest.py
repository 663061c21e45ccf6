import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Planner measurements and calibrations of the tests never land in the user's cache.
os.environ.setdefault("LEANTUNE_CACHE", tempfile.mkdtemp(prefix="leantune-test-cache-"))

import pytest
import torch

# One pytest worker per core (scripts/test.sh runs pytest-xdist): each worker computes on one thread,
# so two workers on two cores never oversubscribe them; a run in one process keeps two threads.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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


def tiny_run_toml(model, images, rest: str) -> str:
    """A run config for the tiny model: the shared head, then the test's own dataset keys and
    [lora] / [train] / [output] sections (`rest`, which may use no format fields)."""
    return TINY_RUN_HEAD.format(model=model, images=images) + rest


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory):
    """A complete tiny SD3.5 (Large-style) model in the diffusers folder layout, written once per session."""
    from leantune import tiny

    return tiny.save_sd3_folder(tmp_path_factory.mktemp("tiny_sd3") / "sd3-tiny", style="large")
