"""Full fine-tuning on the tiny Flux: the optimizer step inside backward against the plain loop.

The reference is `loss.backward(); opt.step()` with torch's SGD (single-tensor) / AdamW (fused:
a CPU weight steps with torch's fused kernel, train/fused_optim.py) on a plain copy of the model. The fused loop steps every weight from its post-accumulate-grad
hook, with none / some / all blocks (+ the non-block group) streamed in poison mode, with and
without checkpointing and activation offload. Equality is bitwise for SGD and AdamW (same
operations in the same order); Adafactor is torch's formula too and also compared bitwise, on the
torch-op path (`host_kernels=False`): a CPU weight's Adafactor step otherwise runs the host kernels,
within a stated tolerance of torch's Adafactor (tests/test_host_kernels.py), and what this matrix
checks is the in-backward machinery, bit for bit.

One thing streaming changes is the association of a sum: the time embedding `temb` feeds every
block, and a streamed block routes its inputs through one identity node, so its two contributions
to temb's gradient are added together before joining the others ((c1 + c2) + rest instead of
(rest + c1) + c2). Only the time-embedder weights see that (a last-bit difference), so the bitwise
matrix freezes them (`EXCLUDE`) and a separate test trains everything within a stated tolerance.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from test_memory_helpers import make_batch, synchronizes_beyond_the_profiler

from leantune.memory.engine import apply_memory, even_spread
from leantune.memory.plan import Plan
from leantune.memory.trainable_streaming import TrainableStreamingEngine, WeightAccess
from leantune import tiny
from leantune.models.flux import FLUX_SPEC, predict
from leantune.train.trainable import select_trainable
from leantune.train.fused_optim import FusedOptimizer, _owner
from leantune.train.in_backward import InBackwardStep

SHAPES = ((8, 8), (8, 12), (8, 8))
EXCLUDE = ["time_text_embed.*"]
LR = {"sgd": 0.05, "adamw": 1e-3, "adafactor": 1e-2}


def _model(exclude=()):
    model = tiny.flux_transformer(seed=0)
    model.requires_grad_(False)
    for p in select_trainable(model, ["*"], list(exclude)).values():
        p.requires_grad_(True)
    return model


def _loss(model, step: int, scale: float = 1.0, micro: int = 0, device="cpu"):
    h, w = SHAPES[step % len(SHAPES)]
    x, sigma, embeds, hw, target = make_batch(h, w, seed=100 * step + micro, device=device)
    pred = predict(model, x, sigma, embeds, hw, guidance=1.0)
    loss = torch.nn.functional.mse_loss(pred.float(), target)
    (loss * scale).backward()
    return float(loss.detach())


def plain_run(kind: str, steps: int = 3, accumulation: int = 1, weight_decay: float = 0.0, exclude=tuple(EXCLUDE)):
    model = _model(exclude)
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":
        opt = torch.optim.SGD(params, lr=LR[kind], weight_decay=0.0)
    elif kind == "adamw":
        opt = torch.optim.AdamW(params, lr=LR[kind], weight_decay=weight_decay, fused=True)
    else:
        opt = torch.optim.Adafactor(params, lr=LR[kind], foreach=False)
    losses = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        losses.append(sum(_loss(model, s, 1.0 / accumulation, m) for m in range(accumulation)))
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def fused_run(kind: str, plan: Plan | None = None, steps: int = 3, accumulation: int = 1, weight_decay: float = 0.0,
              probe=None, exclude=tuple(EXCLUDE), device="cpu"):
    model = _model(exclude)
    named = select_trainable(model, ["*"], list(exclude))
    opt = FusedOptimizer(model, named, kind, lr=LR[kind], weight_decay=weight_decay, host_kernels=kind != "adafactor")
    handle = None
    if plan is not None:
        handle = apply_memory(model, FLUX_SPEC, plan, device, offload_min_bytes=0,
                              streaming_engine=TrainableStreamingEngine)
    else:
        model.to(device)
    engine = handle.streaming.engine if handle is not None and handle.streaming is not None else None
    if probe is not None:
        probe(model)                             # registered before the optimizer's hooks: sees live grads
    stepper = InBackwardStep(opt, list(named.values()), accumulation=accumulation,
                             on_step=engine.mark_stepped if engine else None)
    losses = run_steps(model, stepper, steps, accumulation, device)
    return losses, trained_values(handle, model, named), handle, model, opt


def run_steps(model, stepper: InBackwardStep, steps: int, accumulation: int, device="cpu",
              autocast: torch.dtype | None = None, start: int = 0) -> list[float]:
    """`steps` optimizer steps of `accumulation` micro-batches, the update inside backward (steps
    `start` ... of the run: each step's batch follows from its index)."""
    losses = []
    for s in range(start, start + steps):
        stepper.begin_step()
        total = 0.0
        for m in range(accumulation):
            stepper.micro = m
            with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                total += _loss(model, s, 1.0 / accumulation, m, device=device)
        stepper.finish_step()
        losses.append(total)
    return losses


def trained_values(handle, model, named) -> dict:
    """The trained weights where they live (host buffers of streamed ones), copied."""
    access = WeightAccess(handle)
    return {n: access.get(*_owner(model, n)).clone() for n in named}


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), f"{n}: max diff {(got[n] - want[n]).abs().max().item()}"


_REF: dict = {}


def assert_close(got: dict, want: dict, rtol: float, atol: float):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def reference(kind: str, **kw):
    key = (kind, tuple(sorted(kw.items())))
    if key not in _REF:
        _REF[key] = plain_run(kind, **kw)
    return _REF[key]


def _plan(streaming: str, checkpointing: str, names: list[str]) -> Plan | None:
    if streaming == "none" and checkpointing == "none":
        return None
    extra = {}
    if streaming == "some":
        extra = {"streamed_blocks": tuple(even_spread(names, 2)), "debug_poison": True}
    elif streaming == "all":
        extra = {"streamed_blocks": tuple(names), "stream_non_blocks": True, "debug_poison": True}
    return Plan(checkpointing=checkpointing, **extra)


@pytest.mark.parametrize("checkpointing", ["none", "blocks", "offload"])
@pytest.mark.parametrize("streaming", ["none", "some", "all"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_in_backward_step_equals_the_plain_loop_bitwise(kind, streaming, checkpointing):
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    want_losses, want = reference(kind)
    losses, got, handle, _, _ = fused_run(kind, _plan(streaming, checkpointing, names))
    assert losses == want_losses
    assert_same(got, want)
    if streaming != "none":
        rep = handle.step_report()
        assert rep["bytes_h2d"] > 0 and rep["bytes_d2h"] > 0


def test_pageable_host_buffers_through_the_staging_worker_match_the_plain_loop():
    """pin_memory = false: fetches go through the staging worker thread (on CUDA: pageable host
    buffers, synchronous write-backs), with poison; still bitwise the plain loop."""
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    want_losses, want = reference("adamw")
    plan = Plan(checkpointing="blocks", streamed_blocks=tuple(names), stream_non_blocks=True, debug_poison=True,
                pin_memory=False)
    losses, got, handle, _, _ = fused_run("adamw", plan)
    assert not any(u.pinned for u in handle.streaming.units) and handle.streaming.engine.copies.stager is not None
    assert losses == want_losses
    assert_same(got, want)


def test_adafactor_and_weight_decay_and_accumulation_match_torch():
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    want_losses, want = reference("adafactor")
    losses, got, *_ = fused_run("adafactor", _plan("some", "blocks", names))
    assert losses == want_losses
    assert_same(got, want)
    # AdamW with decoupled weight decay, 3 micro-batches accumulated in host memory, all streamed.
    want_losses, want = reference("adamw", accumulation=3, weight_decay=0.1)
    losses, got, *_ = fused_run("adamw", _plan("all", "none", names), accumulation=3, weight_decay=0.1)
    assert losses == want_losses
    assert_same(got, want)


def test_training_the_time_embedder_too_streamed_matches_within_last_bits():
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    want_losses, want = reference("adamw", exclude=())
    losses, got, *_ = fused_run("adamw", _plan("all", "blocks", names), exclude=())
    assert losses == pytest.approx(want_losses, rel=1e-6)
    # AdamW divides each gradient by its running RMS, so a last-bit difference in the gradient of an
    # element whose second moment is tiny moves its update by a small fraction of lr (1e-3 here):
    # allow 1e-3 * lr absolute, far below one step's size.
    assert_close(got, want, rtol=1e-5, atol=1e-3 * LR["adamw"])
    # and without streaming (no re-association), bitwise again
    losses, got, *_ = fused_run("adamw", _plan("none", "offload", names), exclude=())
    assert losses == want_losses
    assert_same(got, want)


def _grad_probe(record: list):
    """A post-accumulate hook on every parameter, registered first: at each call it adds up the
    bytes of every `.grad` that exists at that moment."""
    def install(model):
        params = list(model.parameters())

        def hook(_):
            record.append(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None))
        for p in params:
            p.register_post_accumulate_grad_hook(hook)
    return install


def test_gradients_never_coexist():
    model = _model()
    block_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in FLUX_SPEC.blocks(model))
    blocks = {id(p) for _, b in FLUX_SPEC.blocks(model) for p in b.parameters()}
    non_block_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in blocks)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    fused: list = []
    fused_run("adamw", steps=1, probe=_grad_probe(fused), exclude=())
    assert fused and max(fused) <= block_bytes + non_block_bytes
    assert max(fused) <= max(p.numel() * p.element_size() for p in model.parameters())   # in fact one at a time
    # The plain loop, probed the same way, ends backward holding every gradient of the model.
    plain: list = []
    model = _model()
    _grad_probe(plain)(model)
    _loss(model, 0)
    assert max(plain) == total and total > 3 * (block_bytes + non_block_bytes) / 2


def test_streamed_weights_are_written_back_and_the_host_holds_the_trained_model():
    """After training, removing the engine restores the trained values (not the initial ones)."""
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    _, want = reference("adamw")
    _, got, handle, model, _ = fused_run("adamw", _plan("all", "blocks", names))
    handle.remove(device="cpu")
    assert_same({n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, want)


def _stepped_after_backward(hold: bool):
    """SGD, 2 micro-batches of which only the first reaches the weights: every weight steps in
    finish_step, after backward, when its streamed block is no longer resident."""
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    model = _model(EXCLUDE)
    named = select_trainable(model, ["*"], EXCLUDE)
    opt = FusedOptimizer(model, named, "sgd", lr=LR["sgd"])
    handle = apply_memory(model, FLUX_SPEC, _plan("all", "none", names), "cpu", offload_min_bytes=0,
                          streaming_engine=TrainableStreamingEngine)
    engine = handle.streaming.engine
    stepper = InBackwardStep(opt, list(named.values()), accumulation=2, on_step=engine.mark_stepped,
                             hold=engine.holding if hold else None)
    stepper.begin_step()
    stepper.micro = 0
    _loss(model, 0, 0.5, 0)
    stepper.micro = 1                             # a micro-batch whose loss reaches no weight
    stepper.finish_step()
    return trained_values(handle, model, named), model


def test_a_weight_stepped_after_backward_updates_its_streamed_block():
    model = _model(EXCLUDE)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR["sgd"])
    _loss(model, 0, 0.5, 0)
    opt.step()
    want = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    got, streamed = _stepped_after_backward(hold=True)
    assert_same(got, want)
    with torch.no_grad():                         # and the engine computes with the stepped weights
        x, sigma, embeds, hw, _ = make_batch(8, 8, seed=7)
        torch.testing.assert_close(predict(streamed, x, sigma, embeds, hw, guidance=1.0),
                                   predict(model, x, sigma, embeds, hw, guidance=1.0), rtol=0, atol=0)
    # Without the hold the update lands in whatever the slot holds and never reaches the host.
    stale, _ = _stepped_after_backward(hold=False)
    assert any(not torch.equal(stale[n], want[n]) for n in want)


def test_an_out_of_memory_error_inside_a_block_keeps_its_stepped_weights_on_restore():
    """An OOM between two weight updates of one streamed block leaves that block held, with the
    weights stepped so far updated only in its slot. The re-plan restores the model from the host
    (remove) and the redone step skips those weights, so the restore must carry their update."""
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    model = _model(EXCLUDE)
    named = select_trainable(model, ["*"], EXCLUDE)
    opt = FusedOptimizer(model, named, "sgd", lr=LR["sgd"])
    handle = apply_memory(model, FLUX_SPEC, _plan("all", "none", names), "cpu", offload_min_bytes=0,
                          streaming_engine=TrainableStreamingEngine)
    engine = handle.streaming.engine
    updated = {}

    def stepped(p):
        engine.mark_stepped(p)
        updated[p] = p.detach().clone()          # the value the step wrote (its block is held here)

    stepper = InBackwardStep(opt, list(named.values()), on_step=stepped, hold=engine.holding)
    victim = model.transformer_blocks[0].attn.to_q.weight
    block0 = {id(p) for p in model.transformer_blocks[0].parameters()}

    def oom(p):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated, inside backward)")

    victim.register_post_accumulate_grad_hook(oom)
    stepper.begin_step()
    with pytest.raises(torch.OutOfMemoryError):
        _loss(model, 0)
    assert victim in updated and sum(id(p) in block0 for p in updated) > 1   # stepped inside the held block
    stepper.drop_partial()
    handle.remove(device="cpu")                  # what the OOM guard's re-plan does first
    for p, value in updated.items():
        assert torch.equal(p.detach(), value), next(n for n, q in named.items() if q is p)


def test_a_step_after_an_interrupted_backward_ends_its_backward_normally():
    """The engine stays usable without a re-plan after an exception inside backward: the next
    backward releases every hold at its end (its end-of-backward callback is queued again)."""
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    model = _model(EXCLUDE)
    named = select_trainable(model, ["*"], EXCLUDE)
    opt = FusedOptimizer(model, named, "sgd", lr=LR["sgd"])
    handle = apply_memory(model, FLUX_SPEC, _plan("all", "none", names), "cpu", offload_min_bytes=0,
                          streaming_engine=TrainableStreamingEngine)
    engine = handle.streaming.engine
    stepper = InBackwardStep(opt, list(named.values()), on_step=engine.mark_stepped, hold=engine.holding)
    fired = []

    def oom_once(p):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, inside backward)")

    model.transformer_blocks[0].attn.to_q.weight.register_post_accumulate_grad_hook(oom_once)
    stepper.begin_step()
    with pytest.raises(torch.OutOfMemoryError):
        _loss(model, 0)
    stepper.drop_partial()
    stepper.begin_step()                          # the redo, on the same engine
    loss = _loss(model, 0)
    stepper.finish_step()
    assert loss == loss and engine.held == 0 and engine.phase == "idle"
    # Stepped units are written back when their slot is claimed: only those still in a slot wait.
    assert all(engine.slots[u.slot].owner is u for u in engine.units if id(u) in engine.dirty)
    engine._drain()                               # as before a save or a teardown
    assert not engine.dirty


def test_write_backs_the_thread_waits_for_count_as_stall(monkeypatch):
    """A synchronous write-back (CPU; on CUDA a pageable host buffer) holds the thread like a fetch
    does, so calibration must see it in stall_s. A clock that advances 1000 s per reading makes
    each write-back count exactly 1000 s."""
    from leantune.memory import trainable_streaming

    ticks = itertools.count(step=1000.0)
    readings = []
    monkeypatch.setattr(trainable_streaming, "_clock", lambda: readings.append(1) or next(ticks))
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    _, _, handle, _, _ = fused_run("sgd", _plan("all", "none", names), steps=1)
    units = handle.streaming.units
    rep = handle.step_report()
    write_backs = len(readings) // 2                                   # two readings per write-back
    assert write_backs >= len(units) and rep["bytes_d2h"] >= sum(u.nbytes for u in units)
    assert 1000.0 * write_backs <= rep["stall_s"] < 1000.0 * write_backs + 60


# -- bf16 weights: stochastic rounding, bf16 states, master weights ---------------------------------------

def _tiny_updates(sr: bool, master: bool = False, steps: int = 200, n: int = 20000):
    """A bf16 weight of ones under `steps` SGD updates of -1e-4 each: bf16's spacing just below 1 is
    2**-8 = 0.0039, so each update is far below half a step."""
    model = torch.nn.Linear(n, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    named = {"weight": model.weight}
    opt = FusedOptimizer(model, named, "sgd", lr=1e-4, stochastic_rounding=sr, master_weights=master, seed=0)
    grad = torch.ones(1, n, dtype=torch.bfloat16)
    for _ in range(steps):
        opt.step_param(model.weight, grad)
    return model.weight.detach().float(), opt


def test_stochastic_rounding_keeps_tiny_updates_in_expectation():
    exact = 1.0 - 200 * 1e-4                                    # 0.98: what fp32 arithmetic gives
    nearest, _ = _tiny_updates(sr=False)
    assert torch.all(nearest == 1.0)                            # round-to-nearest loses every update
    w, _ = _tiny_updates(sr=True)
    assert abs(w.mean().item() - exact) < 2e-4                  # unbiased: the mean moves as fp32 would
    assert w.unique().numel() > 1 and w.std().item() < 0.01      # each weight a random walk around it
    m, opt = _tiny_updates(sr=False, master=True)               # fp32 master weights on the host
    assert opt.masters["weight"].device.type == "cpu"
    assert torch.allclose(opt.masters["weight"], torch.full_like(opt.masters["weight"], exact), atol=1e-6)
    assert torch.all(m == torch.tensor(exact).to(torch.bfloat16).float())


def test_stochastic_rounding_is_unbiased_per_value():
    from leantune.train.fused_optim import stochastic_round_to_bf16

    g = torch.Generator().manual_seed(0)
    for v in (1.0 + 2**-9, -3.3e-3, 1234.567):
        x = torch.full((200_000,), v)
        r = stochastic_round_to_bf16(x, g).float()
        lo, hi = r.min().item(), r.max().item()
        assert lo <= v <= hi and r.unique().numel() <= 2         # only the two neighbours
        assert r.mean().item() == pytest.approx(v, rel=2e-4)


def test_bf16_weights_and_bf16_adam_state_train_like_fp32():
    """AdamW on a bf16 model with bf16 moments (stochastically rounded) follows the fp32 run."""
    model32 = _model(EXCLUDE)
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    runs = []
    for model, state_dtype in ((model32, "fp32"), (model16, "bf16")):
        named = select_trainable(model, ["*"], EXCLUDE)
        opt = FusedOptimizer(model, named, "adamw", lr=1e-3, state_dtype=state_dtype)
        assert all(t.dtype == (torch.float32 if state_dtype == "fp32" else torch.bfloat16)
                   for h in opt.holders.values() for t in h.tensors().values())
        stepper = InBackwardStep(opt, list(named.values()))
        losses = []
        for s in range(3):
            stepper.begin_step()
            h, w = SHAPES[s]
            x, sigma, embeds, hw, target = make_batch(h, w, seed=100 * s)
            pred = predict(model, x.to(model.dtype), sigma, embeds.to("cpu", model.dtype), hw, guidance=1.0)
            loss = torch.nn.functional.mse_loss(pred.float(), target)
            loss.backward()
            stepper.finish_step()
            losses.append(loss.item())
        runs.append((losses, {n: p.detach().float() for n, p in named.items()}))
    (l32, w32), (l16, w16) = runs
    assert l16 == pytest.approx(l32, rel=0.03)
    init = {n: p.detach().float() for n, p in _model(EXCLUDE).named_parameters() if p.requires_grad}
    moved32 = sum((w32[n] - init[n]).abs().sum() for n in init)
    moved16 = sum((w16[n] - init[n]).abs().sum() for n in init)
    assert moved16 == pytest.approx(moved32.item(), rel=0.05)     # the bf16 run made the same progress


def test_adafactor_off_the_cpu_reads_nothing_on_the_host_and_matches_torch(monkeypatch):
    """Off the CPU, Adafactor's two norms per weight stay device tensors (a `.item()` inside backward
    would wait for every queued kernel, twice per weight). Run that path on the CPU with `.item()`
    forbidden: it follows torch's Adafactor to float rounding (the CPU torch-op path is bitwise, above)."""
    from leantune.train import fused_optim

    g = torch.Generator().manual_seed(0)
    ref = torch.nn.Linear(32, 16)
    model = copy.deepcopy(ref)
    topt = torch.optim.Adafactor(ref.parameters(), lr=LR["adafactor"], weight_decay=0.1, foreach=False)
    fopt = FusedOptimizer(model, dict(model.named_parameters()), "adafactor", lr=LR["adafactor"], weight_decay=0.1,
                          host_kernels=False)         # the path a device runs
    grads = [{n: torch.randn(p.shape, generator=g) for n, p in ref.named_parameters()} for _ in range(4)]
    for step in grads:
        for n, p in ref.named_parameters():
            p.grad = step[n].clone()
        topt.step()
    monkeypatch.setattr(fused_optim, "_host_scalars", lambda t: False)

    def no_host_read(self):
        raise AssertionError("a device value was read on the host inside the step")

    monkeypatch.setattr(torch.Tensor, "item", no_host_read)
    for step in grads:
        for n, p in model.named_parameters():
            fopt.step_param(p, step[n])
    monkeypatch.undo()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(model.get_parameter(n).detach(), p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
def test_adamw8bit_in_backward_never_synchronizes_the_device(monkeypatch):
    """bitsandbytes' Optimizer8bit.step() calls torch.cuda.synchronize() after each parameter; the
    fused step, called per weight inside backward, must not."""
    pytest.importorskip("bitsandbytes")
    model = _model(EXCLUDE).cuda()
    named = select_trainable(model, ["*"], EXCLUDE)
    stepper = InBackwardStep(FusedOptimizer(model, named, "adamw8bit", lr=1e-3), list(named.values()))
    syncs = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (syncs.append(1), real(*a, **k)))
    for s in range(2):
        x, sigma, embeds, hw, target = make_batch(*SHAPES[s], seed=100 * s, device="cuda")
        stepper.begin_step()
        torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0).float(), target).backward()
        stepper.finish_step()
    assert syncs == []


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
@pytest.mark.parametrize("pin_memory", [True, False])
@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_trainable_streaming_on_cuda_matches_the_unstreamed_run(kind, pin_memory, checkpointing):
    """Streamed trainable weights on CUDA: fetch on the copy stream, step on the compute stream,
    write-back on its own stream before the slot is refilled (pinned: asynchronous; pageable: the
    synchronous path). Poison makes any use of a slot outside its hold, or a refill before the
    write-back, a NaN; the host must hold the trained weights at the end."""
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    want_losses, want, *_ = fused_run(kind, None, device="cuda")
    plan = Plan(checkpointing=checkpointing, streamed_blocks=tuple(names), stream_non_blocks=True,
                debug_poison=True, pin_memory=pin_memory)
    losses, got, handle, _, _ = fused_run(kind, plan, device="cuda")
    assert all(u.pinned for u in handle.streaming.units) == pin_memory
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert_close({n: t.cpu() for n, t in got.items()}, {n: t.cpu() for n, t in want.items()},
                 rtol=1e-5, atol=1e-3 * LR[kind])
    rep = handle.step_report(wait=True)
    assert rep["bytes_d2h"] > 0 and rep["bytes_h2d"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_trainable_streaming_step_never_synchronizes(kind):
    """One full fine-tune step with every block streamed (pinned): no device-, stream- or event-wide
    synchronize (a host read inside the step, e.g. .item(), shows as one)."""
    names = [n for n, _ in FLUX_SPEC.blocks(_model())]
    model = _model(EXCLUDE)
    named = select_trainable(model, ["*"], EXCLUDE)
    opt = FusedOptimizer(model, named, kind, lr=LR[kind])
    handle = apply_memory(model, FLUX_SPEC, Plan(checkpointing="blocks", streamed_blocks=tuple(names)), "cuda",
                          streaming_engine=TrainableStreamingEngine)
    stepper = InBackwardStep(opt, list(named.values()), on_step=handle.streaming.engine.mark_stepped,
                             hold=handle.streaming.engine.holding)
    batch = make_batch(8, 8, seed=0, device="cuda")

    def step():
        x, sigma, embeds, hw, target = batch
        stepper.begin_step()
        torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0).float(), target).backward()
        stepper.finish_step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
    torch.cuda.synchronize()
    assert not synchronizes_beyond_the_profiler(prof.events()), "a full fine-tune step synchronized"


@pytest.mark.gpu
def test_adamw8bit_in_backward_equals_bitsandbytes_plain_loop():
    """bitsandbytes' 8-bit AdamW stepped per parameter inside backward equals its own plain loop
    (its blockwise-quantized state is per tensor, so the order of tensors does not matter)."""
    bnb = pytest.importorskip("bitsandbytes")
    plain = _model(EXCLUDE).cuda()
    fused = copy.deepcopy(plain)
    opt = bnb.optim.AdamW8bit([p for p in plain.parameters() if p.requires_grad], lr=1e-3)
    named = select_trainable(fused, ["*"], EXCLUDE)
    fopt = FusedOptimizer(fused, named, "adamw8bit", lr=1e-3)
    stepper = InBackwardStep(fopt, list(named.values()))
    for s in range(3):
        h, w = SHAPES[s]
        for model in (plain, fused):
            x, sigma, embeds, hw, target = make_batch(h, w, seed=100 * s, device="cuda")
            if model is fused:
                stepper.begin_step()
            loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0).float(), target)
            loss.backward()
            if model is plain:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                stepper.finish_step()
    a = {n: p for n, p in plain.named_parameters() if p.requires_grad}
    assert_same({n: p.detach() for n, p in named.items()}, {n: p.detach() for n, p in a.items()})


def test_a_frozen_part_in_fp8_trains_the_rest_like_the_plain_loop():
    """[full] exclude freezes the single blocks and [memory] fp8 stores them in e4m3: fp8 storage
    converts only the frozen block Linears (the trained ones keep their dtype), and the in-backward
    step with streaming (poison) and checkpointing trains like the plain loop on the same fp8 model.

    Not bitwise: with the single blocks frozen, the in-backward step differs from the plain loop in
    the last bits even without fp8 and without any plan (about 1e-5 relative in the loss after one
    step; measured), so the comparison uses the tolerance of the time-embedder test above."""
    from leantune.memory.fp8 import FP8_DTYPE, apply_fp8_storage

    exclude = (*EXCLUDE, "single_transformer_blocks.*")
    model = _model(exclude)
    handle = apply_fp8_storage(model, FLUX_SPEC, keep_trainable=True)
    assert handle.linears and all(n.startswith("single_transformer_blocks.") for n in handle.linears)
    assert handle.trained and all(n.startswith("transformer_blocks.") for n in handle.trained)
    with pytest.raises(ValueError, match="is trainable"):          # a LoRA base must never meet one
        apply_fp8_storage(_model(exclude), FLUX_SPEC)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR["adamw"], foreach=False)
    want_losses = []
    for s in range(3):
        opt.zero_grad(set_to_none=True)
        want_losses.append(_loss(model, s))
        opt.step()
    want = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    names = [n for n, _ in FLUX_SPEC.blocks(model)]
    plan = Plan(streamed_blocks=(names[1], names[-1]), fp8=True, checkpointing="blocks", debug_poison=True)
    losses, got, mem, fused_model, _ = fused_run("adamw", plan, exclude=exclude)
    assert mem.fp8 is not None and mem.fp8.trained
    frozen = fused_model.single_transformer_blocks[0].proj_mlp
    assert frozen.weight.dtype == FP8_DTYPE and fused_model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float32
    assert losses[0] == want_losses[0] and losses == pytest.approx(want_losses, rel=1e-4)
    assert_close(got, want, rtol=1e-4, atol=2e-3 * LR["adamw"])
