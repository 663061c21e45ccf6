"""A plan that fails while being applied (an out-of-memory during a re-plan) rolls the model back
to the host, never onto the compute device. Run on the simulated GPU (memory/simulated.py), where
the GPU ("fakegpu:0") and host RAM ("fakegpu:1") are two devices, in a fresh process (the
simulated device must be set up before any backward in a process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from leantune.memory import simulated

CHILD = r'''
import torch
from diffusers import FluxTransformer2DModel
from leantune.memory import engine, simulated
from leantune.memory.plan import Plan
from leantune.simulated_run import fake_parameters
from leantune.models.flux import FLUX_SPEC

device = simulated.enable()
with torch.device("meta"):
    model = FluxTransformer2DModel(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                                   joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
model.requires_grad_(False)
names = tuple(n for n, _ in FLUX_SPEC.blocks(model))

def out_of_memory(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

with simulated.simulation():
    fake_parameters(model)
    real = engine.apply_checkpointing
    engine.apply_checkpointing = out_of_memory
    try:
        engine.apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=names[:2], checkpointing="blocks"), device,
                            host_device=simulated.HOST)
        raise SystemExit("apply_memory did not raise")
    except torch.OutOfMemoryError:
        pass
    engine.apply_checkpointing = real
    where = sorted({str(t.device) for t in list(model.parameters()) + list(model.buffers())})
    print("DEVICES", where)
    assert where == [simulated.HOST], where
    assert not any("forward" in m.__dict__ for m in model.modules())
    handle = engine.apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=names[:2]), device, host_device=simulated.HOST)
    handle.remove(device=simulated.HOST)
print("OK")
'''


def test_failed_apply_rolls_back_to_the_host():
    try:
        simulated.build_library()
    except simulated.SimulatedDeviceUnavailable as e:
        pytest.skip(str(e))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]
