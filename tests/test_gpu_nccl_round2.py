"""Issue 40: what a GPU and NCCL would break that plain CPU runs do not show, emulated on the CPU
(a default group with no CPU backend, a device with fewer GPUs than the save saw, ...). What only a
GPU can show is in bench/gpu_checks.sh."""

from __future__ import annotations

import datetime
import types

import pytest
import torch
import torch.distributed as dist

from leantune import distributed as ltd


@pytest.fixture
def one_rank_gloo(tmp_path):
    """A one-process gloo default group (destroyed after the test)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- finding 2: the host-side gloo group gets [distributed] timeout_minutes --------------------------

def test_the_host_group_beside_an_nccl_default_gets_the_runs_timeout(one_rank_gloo, monkeypatch):
    monkeypatch.setattr(ltd, "_serves", lambda group, device_type: False)    # as under NCCL alone
    group = ltd.host_group_for_default(90)
    assert group._get_backend(torch.device("cpu")).options._timeout == datetime.timedelta(minutes=90)


def test_from_config_passes_timeout_minutes_to_the_host_group(monkeypatch):
    from leantune import accelerate_setup
    from leantune.config import validate

    cfg = validate({"model": {"path": "m"}, "data": {"datasets": [{"path": "d"}]},
                    "distributed": {"timeout_minutes": 240}}, "run.toml")
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ltd, "die_with_launcher", lambda: None)
    fake = types.SimpleNamespace(state=types.SimpleNamespace(backend="nccl"), num_processes=2, process_index=0,
                                 local_process_index=0, device=torch.device("cpu"))
    monkeypatch.setattr(accelerate_setup, "make_accelerator", lambda *a, **k: (fake, {}))
    asked = []
    monkeypatch.setattr(ltd, "host_group_for_default", lambda *a, **k: asked.append((a, k)))
    ltd.DistContext.from_config(cfg, torch.device("cpu"))
    assert asked == [((240,), {})]
