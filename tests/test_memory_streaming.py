"""Weight streaming schedule on CPU: forward-only residency, poison catching schedule faults,
bytes moved, validation errors, plan resolution and clean removal."""

from __future__ import annotations

import copy
import itertools
import logging

import pytest
import torch
from test_memory_helpers import block_names, lora_flux, make_batch, train

from leantune.config import MemoryConfig
from leantune.memory.checkpointing import remove_checkpointing
from leantune.memory.engine import apply_memory, even_spread, resolve_plan
from leantune.memory.plan import Plan
from leantune.memory.streaming import remove_streaming
from leantune.memory.streaming_units import ALIGN
from leantune.models.flux import FLUX_SPEC, predict


@pytest.fixture(scope="module")
def base():
    return lora_flux(seed=0)


def _sample(model, calls=3, shape=(8, 8)):
    x, sigma, embeds, hw, _ = make_batch(*shape, seed=7, dtype=model.x_embedder.weight.dtype)
    with torch.no_grad():
        return [predict(model, x, sigma * (i + 1) / calls, embeds, hw, guidance=3.5) for i in range(calls)]


# -- forward-only (sampling) -----------------------------------------------------------------------

@pytest.mark.parametrize("streamed,ring", [(4, 2), (2, 2), (4, 3)])
def test_forward_only_keeps_resident_set_and_matches(base, streamed, ring):
    want = _sample(copy.deepcopy(base))
    model = copy.deepcopy(base)
    names = block_names(model)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(even_spread(names, streamed)),
                                                 ring_slots=ring), "cpu")
    handle.forward_only(True)
    x, sigma, embeds, hw, _ = make_batch(8, 8, seed=7)
    total = sum(handle.streaming.unit_bytes().values())
    moved = []
    with torch.no_grad():
        for i in range(3):
            out = predict(model, x, sigma * (i + 1) / 3, embeds, hw, guidance=3.5)
            assert torch.equal(out, want[i])
            moved.append(handle.step_report()["bytes_h2d"])
    # Unit i lives in slot i mod ring: a unit with a slot of its own stays there across steps; the
    # units sharing a slot are each copied exactly once per denoising step; resident blocks never move.
    units = handle.streaming.units
    sharing = sum(u.nbytes for u in units if sum(v.slot == u.slot for v in units) > 1)
    assert moved[1:] == [sharing, sharing]
    if streamed <= ring:
        assert sharing == 0                   # everything fits the ring: nothing moves after step 1
    elif ring == 2:
        assert sharing == total
    with pytest.raises(RuntimeError, match="forward-only"):
        predict(model, x, sigma, embeds, hw, guidance=3.5)     # autograd on while sampling
    handle.forward_only(False)
    handle.remove()


# -- poison catches a broken schedule --------------------------------------------------------------

def _all_streamed(base, **kw):
    model = copy.deepcopy(base)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), debug_poison=True, **kw),
                          "cpu")
    return model, handle


def test_poison_makes_released_weights_nan(base):
    """Outside its hold window a streamed module sees whatever its slot holds: in poison mode, NaN
    until the slot is refilled. Single block 0 (slot 0) is released before single block 1 runs, and
    nothing else needs slot 0 until the next step."""
    model, handle = _all_streamed(base)
    seen = {}

    def look(module, args, kwargs):
        w = model.single_transformer_blocks[0].proj_mlp.base_layer.weight
        seen["released"] = torch.isnan(w).all().item()
        seen["next"] = torch.isfinite(model.single_transformer_blocks[1].proj_mlp.base_layer.weight).all().item()

    hook = model.single_transformer_blocks[1].register_forward_pre_hook(look, with_kwargs=True)
    out = _sample(model, calls=1)[0]
    hook.remove()
    assert seen == {"released": True, "next": True}
    assert torch.isfinite(out).all()
    handle.remove()
    assert torch.isfinite(model.single_transformer_blocks[0].proj_mlp.base_layer.weight).all()


@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_broken_backward_schedule_is_caught(base, monkeypatch, checkpointing):
    """If backward did not take its hold on a unit, the block's backward refuses to start: its
    weights are not resident. Checked once per block, as its backward begins, with or without
    checkpointing (before, only the per-saved-tensor handles checked, so a checkpointed block
    went on with NaN gradients)..."""
    model, handle = _all_streamed(base, checkpointing=checkpointing)
    monkeypatch.setattr(handle.streaming.engine, "backward_begin", lambda unit: None)
    with pytest.raises(RuntimeError, match="not resident"):
        train(model, shapes=[(8, 8)])
    handle.remove()


def test_poison_turns_unguarded_saved_weights_nan(base, monkeypatch):
    """...and without that check (saved weights read from whatever their slot holds), poison turns
    the gradients NaN."""
    model, handle = _all_streamed(base)
    eng = handle.streaming.engine
    monkeypatch.setattr(eng, "backward_begin", lambda unit: None)
    monkeypatch.setattr(eng, "check_resident", lambda unit: None)
    rec = train(model, shapes=[(8, 8)])
    assert torch.isfinite(rec[0]["loss"])                                # the forward was fine
    assert any(torch.isnan(g).any() for g in rec[0]["grads"].values() if g is not None)
    handle.remove()


def test_poison_catches_missing_hold_under_checkpointing(base, monkeypatch):
    """With checkpointing, the recompute fetches the block, but without the backward hold (and
    without the check) it is released (and poisoned) before the block's backward runs: NaN
    gradients."""
    model, handle = _all_streamed(base, checkpointing="blocks")
    eng = handle.streaming.engine
    monkeypatch.setattr(eng, "backward_begin", lambda unit: None)
    monkeypatch.setattr(eng, "check_resident", lambda unit: None)
    rec = train(model, shapes=[(8, 8)])
    assert any(torch.isnan(g).any() for g in rec[0]["grads"].values() if g is not None)
    handle.remove()


def _count_saved(model, step) -> int:
    """How many tensors autograd saves during `step(model)`'s forward, as a saved-tensor hook
    around the whole step sees them (a hook installed deeper, e.g. inside a block, hides the
    tensors saved under it from this one)."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model)
    return count


def test_frozen_streaming_installs_no_saved_tensor_hooks(base):
    """A streamed LoRA block's forward runs under no saved-tensor hook of the engine's: an outer
    hook sees every tensor the plain model saves, and the block's own weights are saved as
    themselves or views of themselves (no handle per saved tensor). Gradients still equal the plain model's
    (test_memory_parity.py)."""
    plain = copy.deepcopy(base)
    plain_handle = apply_memory(plain, FLUX_SPEC, Plan(), "cpu")         # the same Linears, nothing streamed
    want = _count_saved(plain, lambda m: train(m, shapes=[(8, 8)]))
    plain_handle.remove()
    model, handle = _all_streamed(base)
    seen: list = []

    def pack(t):
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        train(model, shapes=[(8, 8)])
    assert len(seen) == want
    weight = model.single_transformer_blocks[1].proj_mlp.base_layer.weight
    assert any(t is weight or t._base is weight for t in seen)          # F.linear saves weight.t()
    handle.remove()


def test_streamed_buffer_keeps_its_own_version_counter(base):
    """A streamed buffer (here an fp8 weight's scale) is an alias of its slot with a version counter
    of its own: refilling the slot (a copy into the whole slot) does not make a saved scale look
    modified in place, which autograd would refuse in backward."""
    model = copy.deepcopy(base)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), fp8=True), "cpu")
    lin = model.single_transformer_blocks[0].proj_mlp.base_layer
    scale = lin.weight_scale
    unit = next(u for u in handle.streaming.units if u.name == "single_transformer_blocks.0")
    slot = handle.streaming.engine.slots[unit.slot]
    assert scale.untyped_storage().data_ptr() == slot.buf.untyped_storage().data_ptr()
    before = scale._version
    slot.buf.fill_(0)
    assert scale._version == before
    handle.remove()


# -- what is streamed, and where it lives -----------------------------------------------------------

def test_streamed_weights_live_in_slots_and_adapters_stay_resident(base):
    model = copy.deepcopy(base)
    names = block_names(model)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=(names[1], names[3])), "cpu")
    slots = {s.buf.untyped_storage().data_ptr() for s in handle.streaming.engine.slots}
    for name, block in FLUX_SPEC.blocks(model):
        for pname, p in block.named_parameters():
            in_slot = p.untyped_storage().data_ptr() in slots
            if "lora_" in pname:
                assert not in_slot and p.requires_grad and p.dtype == torch.float32, pname
            else:
                assert in_slot == (name in (names[1], names[3])), f"{name}.{pname}"
    # one unit = every frozen tensor of the block, each aligned, in one buffer
    block = model.single_transformer_blocks[1]
    frozen = [p for n, p in block.named_parameters() if "lora_" not in n]
    expect = sum(-(-p.numel() * p.element_size() // ALIGN) * ALIGN for p in frozen)
    assert handle.streaming.unit_bytes()[names[3]] == expect
    handle.remove()


def _entry_bytes(handle, model) -> dict[str, int]:
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(e.owners[0][0])]}.{e.owners[0][2]}": e.nbytes
            for u in handle.streaming.units for e in u.entries}


def test_fp8_units_move_fp8_bytes():
    """Block Linear weights travel as 1-byte e4m3 (half their bf16 bytes) plus a small fp32 scale;
    modulation Linears, norms and biases travel in bf16; a forward moves exactly the packed bytes."""
    model = lora_flux(seed=0, dtype=torch.bfloat16)
    names = block_names(model)
    plain_model, fp8_model = copy.deepcopy(model), copy.deepcopy(model)
    plain = apply_memory(plain_model, FLUX_SPEC, Plan(streamed_blocks=tuple(names)), "cpu")
    fp8 = apply_memory(fp8_model, FLUX_SPEC, Plan(streamed_blocks=tuple(names), fp8=True), "cpu")
    b_plain, b_fp8 = _entry_bytes(plain, plain_model), _entry_bytes(fp8, fp8_model)
    quantized = [n[: -len(".weight")] for n, _ in b_fp8.items() if n + "_scale" in b_fp8]
    assert len(quantized) == len(fp8.fp8.linears) == 34
    for lin in quantized:
        assert b_fp8[lin + ".weight"] * 2 == b_plain[lin + ".weight"], lin
    for name, nbytes in b_plain.items():
        if name[: -len(".weight")] not in quantized:
            assert b_fp8[name] == nbytes, name                  # modulation, norms, biases: unchanged
    assert sum(b_fp8.values()) < sum(b_plain.values())
    fp8.forward_only(True)
    fp8.step_report()
    _sample(fp8_model, calls=2)
    assert fp8.step_report()["bytes_h2d"] >= sum(fp8.streaming.unit_bytes().values())
    assert "(fp8," in fp8.streaming.describe()
    plain.remove()
    fp8.remove()


def test_remove_restores_a_plain_model(base):
    want = _sample(copy.deepcopy(base), calls=1)
    model = copy.deepcopy(base)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)), stream_non_blocks=True,
                                                 checkpointing="offload", debug_poison=True), "cpu")
    handle.remove()
    for m in model.modules():
        assert "forward" not in m.__dict__, type(m).__name__
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert torch.equal(_sample(model, calls=1)[0], want[0])
    # and the model can take the engine again
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=("transformer_blocks.0",)), "cpu")
    assert torch.equal(_sample(model, calls=1)[0], want[0])
    handle.remove()


def test_removal_order_is_enforced(base):
    model = copy.deepcopy(base)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=("transformer_blocks.0",), checkpointing="blocks"),
                          "cpu")
    with pytest.raises(RuntimeError, match="remove checkpointing before streaming"):
        remove_streaming(handle.streaming)
    remove_checkpointing(handle.checkpointing)
    handle.checkpointing = None
    handle.remove()


def test_step_report_counts(base):
    model = copy.deepcopy(base)
    names = block_names(model)
    handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(names), ring_slots=3), "cpu")
    train(model, shapes=[(8, 8)])
    rep = handle.step_report()
    assert rep["streamed_units"] == 4 and rep["slots"] == 3
    assert rep["copies"] >= 4 and rep["bytes_h2d"] >= sum(handle.streaming.unit_bytes().values())
    assert rep["copy_s"] > 0 and rep["slots_held_max"] == 1
    assert rep["slot_bytes"] >= max(handle.streaming.unit_bytes().values())
    assert handle.step_report()["bytes_h2d"] == 0          # counters reset per report
    handle.remove()


# -- validation -----------------------------------------------------------------------------------

def test_trainable_base_weight_cannot_stream(base):
    model = copy.deepcopy(base)
    model.transformer_blocks[1].attn.to_q.base_layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"memory\.streamed_blocks: transformer_blocks\.1\.attn\.to_q\.base_layer\.weight is trainable"):
        apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=("transformer_blocks.1",)), "cpu")


@pytest.mark.parametrize("plan,match", [
    (Plan(streamed_blocks=("transformer_blocks.9",)), r"memory\.streamed_blocks: unknown block names \['transformer_blocks\.9'\]"),
    (Plan(streamed_blocks=("transformer_blocks.0", "transformer_blocks.0")), r"memory\.streamed_blocks: a block is listed twice"),
    (Plan(ring_slots=1), r"memory\.ring_slots must be >= 2"),
    (Plan(checkpointing="sometimes"), r"memory\.checkpointing must be"),
])
def test_invalid_plans_name_the_key(base, plan, match):
    with pytest.raises(ValueError, match=match):
        apply_memory(copy.deepcopy(base), FLUX_SPEC, plan, "cpu")


def test_diffusers_checkpointing_conflicts(base):
    model = copy.deepcopy(base)
    model.enable_gradient_checkpointing()
    with pytest.raises(ValueError, match=r"memory\.checkpointing: .*diffusers' own gradient checkpointing"):
        apply_memory(model, FLUX_SPEC, Plan(checkpointing="blocks"), "cpu")


def test_applying_twice_is_refused(base):
    model = copy.deepcopy(base)
    handle = apply_memory(model, FLUX_SPEC, Plan(), "cpu")
    with pytest.raises(ValueError, match="already has the memory engine applied"):
        apply_memory(model, FLUX_SPEC, Plan(), "cpu")
    handle.remove()
    apply_memory(model, FLUX_SPEC, Plan(), "cpu").remove()


# -- plan resolution ------------------------------------------------------------------------------

def test_even_spread():
    names = [f"b{i}" for i in range(57)]
    for n in (0, 1, 14, 24, 28, 56, 57):
        got = even_spread(names, n)
        assert len(got) == len(set(got)) == n
        idx = [names.index(g) for g in got]
        assert idx == sorted(idx)
        if n > 1:                                              # gaps differ by at most one block
            gaps = [b - a for a, b in itertools.pairwise(idx)]
            assert max(gaps) - min(gaps) <= 1
    assert even_spread(names[:4], 2) == ["b1", "b3"]


def test_resolve_plan(base):
    names = block_names(base)
    p = resolve_plan(MemoryConfig(streamed_blocks=2, fp8=True, checkpointing="offload", ring_slots=3,
                                  pin_memory=False, debug_poison=True, stream_non_blocks=True), FLUX_SPEC, base)
    assert p.streamed_blocks == (names[1], names[3])
    assert (p.fp8, p.checkpointing, p.ring_slots, p.pin_memory, p.debug_poison, p.stream_non_blocks) == \
        (True, "offload", 3, False, True, True)
    assert resolve_plan(MemoryConfig(streamed_blocks="all"), FLUX_SPEC, base).streamed_blocks == tuple(names)
    assert resolve_plan(MemoryConfig(), FLUX_SPEC, base).streamed_blocks == ()
    listed = resolve_plan(MemoryConfig(streamed_blocks=[names[3], names[0]]), FLUX_SPEC, base)
    assert listed.streamed_blocks == (names[0], names[3])      # execution order
    with pytest.raises(ValueError, match=r"memory\.streamed_blocks = 5, but this model has only 4 blocks"):
        resolve_plan(MemoryConfig(streamed_blocks=5), FLUX_SPEC, base)
    with pytest.raises(ValueError, match=r"memory\.streamed_blocks: unknown block names \['double\.0'\]"):
        resolve_plan(MemoryConfig(streamed_blocks=["double.0"]), FLUX_SPEC, base)
    with pytest.raises(ValueError, match=r"memory\.streamed_blocks: blocks listed twice"):
        resolve_plan(MemoryConfig(streamed_blocks=[names[0], names[0]]), FLUX_SPEC, base)


def test_one_log_line_per_technique(base, caplog):
    model = copy.deepcopy(base)
    with caplog.at_level(logging.INFO, logger="leantune.memory"):
        handle = apply_memory(model, FLUX_SPEC, Plan(streamed_blocks=tuple(block_names(model)[:2]), fp8=True,
                                                     checkpointing="offload"), "cpu")
    lines = [r.getMessage() for r in caplog.records if r.name == "leantune.memory"]
    assert len(lines) == 3
    assert lines[0].startswith("fp8: 34 Linear weights in 4 blocks stored as e4m3")
    assert lines[1] == "checkpointing: 4/4 blocks, non-reentrant, inputs offloaded to host memory (pinned on CUDA)"
    assert lines[2].startswith("streaming: 2/4 blocks (fp8, 0.0 GB host), ring 2")
    handle.remove()
