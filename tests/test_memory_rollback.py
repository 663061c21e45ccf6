"""A plan that fails while being applied (an out-of-memory during a re-plan) rolls the model back
to the host, never onto the compute device. Run on the simulated GPU (memory/simulated.py), where
the GPU ("fakegpu:0") and host RAM ("fakegpu:1") are two devices, in a fresh process (the
simulated device must be set up before any backward in a process): the one of
tests/simulated_cases.py, which the simulated test modules share."""

from __future__ import annotations

import pytest
from simulated_cases import GROUP, Call, register, results

from leantune.memory import simulated


def _failed_apply() -> dict:
    """In the fresh process: apply_memory of a streaming + checkpointing plan whose checkpointing
    step runs out of memory; where the model's tensors are then, whether a wrapper was left on a
    module, and whether a second plan then applies and is removed."""
    import torch
    from diffusers import FluxTransformer2DModel

    from leantune.memory import engine
    from leantune.memory.plan import Plan
    from leantune.models.flux import FLUX_SPEC
    from leantune.simulated_run import fake_parameters

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
        raised = False
        try:
            engine.apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=names[:2], checkpointing="blocks"), device,
                                host_device=simulated.HOST)
        except torch.OutOfMemoryError:
            raised = True
        finally:
            engine.apply_checkpointing = real
        where = sorted({str(t.device) for t in list(model.parameters()) + list(model.buffers())})
        wrapped = [n for n, m in model.named_modules() if "forward" in m.__dict__]
        handle = engine.apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=names[:2]), device,
                                     host_device=simulated.HOST)
        handle.remove(device=simulated.HOST)
    return {"raised": raised, "devices": where, "wrapped": wrapped}


register("rollback", {"failed_apply": Call("test_memory_rollback", "_failed_apply")})


@pytest.fixture(scope="module")
def rollback(request):
    try:
        simulated.build_library()
    except simulated.SimulatedDeviceUnavailable as e:
        pytest.skip(str(e))
    return results(request, "rollback")["failed_apply"]


@pytest.mark.xdist_group(GROUP)
def test_failed_apply_rolls_back_to_the_host(rollback):
    assert rollback["raised"], "apply_memory did not raise"
    assert rollback["devices"] == [simulated.HOST], rollback
    assert not rollback["wrapped"], rollback      # no module keeps a wrapper of the failed plan
