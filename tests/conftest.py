import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(2)


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
    from leantune.models import tiny

    return tiny.save_flux_folder(tmp_path_factory.mktemp("tiny_flux") / "flux-tiny")
