"""The memory engine on fake tensors: the seams that let its real code run on a simulated device.

Fake tensors (torch's FakeTensorMode) carry shapes, dtypes and devices but no data, and every fake
storage reports data_ptr() 0. The engine must tell its ring slots apart by storage identity, and
checkpoint offload must treat the host as a device of its own.
"""

from __future__ import annotations

import torch
from test_memory_helpers import lora_flux, lora_params, make_batch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.models.flux import FLUX_SPEC, predict


def _faked(model: torch.nn.Module, mode: FakeTensorMode) -> torch.nn.Module:
    """Replace every parameter and buffer by a fake tensor of the same shape, dtype and device."""
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(mode.from_tensor(p.data), requires_grad=p.requires_grad)
        for k, b in m._buffers.items():
            if b is not None:
                m._buffers[k] = mode.from_tensor(b)
    return model


def _step(model):
    x, sigma, embeds, hw, target = make_batch(8, 8, seed=0)
    loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0), target)
    return loss


def test_streaming_without_checkpointing_runs_on_fake_storages():
    """Saved slot views are recognised by storage identity: with data_ptr() (0 for every fake
    storage) every saved activation looked like a slot view and backward failed."""
    mode = FakeTensorMode()
    model = _faked(lora_flux(seed=0), mode)
    names = tuple(n for n, _ in FLUX_SPEC.blocks(model))
    with mode:
        handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=names, ring_slots=2), "cpu")
        _step(model).backward()
        grads = {n: p.grad for n, p in lora_params(model).items()}
        rep = handle.step_report()
    assert grads and all(isinstance(g, FakeTensor) and g.shape == p.shape
                         for g, p in zip(grads.values(), lora_params(model).values(), strict=True))
    assert rep["streamed_units"] == len(names)
    assert rep["copies"] >= len(names)


def test_offloaded_inputs_go_to_the_host_device_and_come_back():
    """Checkpoint offload keeps block inputs on the host device and restores them to the compute
    device, also when neither is CUDA (here: host "meta", compute "cpu")."""
    mode = FakeTensorMode()
    model = _faked(lora_flux(seed=0), mode)
    with mode:
        handle = apply_memory(model, FLUX_SPEC, Plan(checkpointing="offload"), "cpu", offload_min_bytes=0,
                              host_device="meta")
        loss = _step(model)
        group = handle.checkpointing.offloader._last()        # the last block's group, alive until backward
        assert group.handles and {h.host.device.type for h in group.handles} == {"meta"}
        loss.backward()
        rep = handle.step_report()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in lora_params(model).values())
    assert rep["offload_tensors"] > 0 and rep["offload_bytes_h2d"] == rep["offload_bytes_d2h"]
