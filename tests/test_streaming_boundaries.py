"""The backward boundary of a streamed call (memory/streamed_forward.py): one pre-hook on the
call's own output nodes, no autograd node of its own, and the holds it takes.

Each case runs a model with every block and the non-block modules streamed in poison mode on a
ring of 2 (a weight read outside its hold turns NaN, or the residency check raises) against the
same model unstreamed, and asks for bitwise equal gradients. The toy model's variants are the
graph shapes the pre-hooks must survive: a block output read again blocks later, an output that is
the block's input passed through (no node of the call's own: the identity-Function fallback), an
output modified in place by the caller, an output nobody uses, a retained graph's second backward,
and `torch.autograd.grad` on part of the graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from test_memory_helpers import block_names, lora_flux, make_batch
from torch import nn

from leantune.memory.engine import apply_memory
from leantune.memory.plan import Plan
from leantune.memory.streaming import apply_streaming
from leantune.models.flux import FLUX_SPEC, predict
from leantune.spec import BlockList, ModelSpec

TOY_SPEC = ModelSpec(family="toy", block_lists=(BlockList("blocks", "block", "blocks"),), fp8_skip=(),
                     non_block_modules=("embed", "head"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, h, passthrough=False, slices=False):
        y = self.out(torch.tanh(self.lin(h)))
        if slices:                                    # as a single Flux block returns its text and image rows
            return y[:, :3], y[:, 3:]
        return (y, h) if passthrough else (y, y * 0.5)


class Toy(nn.Module):
    """embed -> 4 blocks -> head; `variant` picks how the blocks' outputs are wired."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        v = self.variant
        h = self.embed(x)
        first = None
        for i, b in enumerate(self.blocks):
            through = v == "passthrough" and i == 2
            y, z = b(h, passthrough=through, slices=v == "slices")
            if v == "inplace":
                y.mul_(1.5)                           # rebases y's grad_fn after the call
            first = y if first is None else first
            if v == "slices":
                y = h = torch.cat([y, z], dim=1)
            elif through:
                h = z       # block 2's own output is dropped; its input, block 1's output, goes on
            elif v == "passthrough" or (v == "unused" and i == 1):
                h = y       # the block's second output is dropped
            else:
                h = y + z
        if v == "skip":
            h = h + first                             # block 0's output read again after block 3
        return self.head(h)


def _toy(variant: str) -> Toy:
    torch.manual_seed(0)
    model = Toy(variant)
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["lin", "head"], init_lora_weights=False), model)
    return model


def _grads(model, x, loss_fn):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    loss_fn(model, x)
    return [p.grad.clone() if p.grad is not None else None for p in params] + [x.grad.clone()]


def _backward(model, x):
    model(x).square().sum().backward()


def _backward_twice(model, x):
    loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    loss.backward()


def _streamed(model, device="cpu"):
    names = tuple(n for n, _ in TOY_SPEC.blocks(model))
    plan = Plan(streamed_blocks=names, stream_non_blocks=True, ring_slots=2, debug_poison=True)
    handle = apply_streaming(model, TOY_SPEC, plan, device)
    model.to(device)                                  # the adapters: streaming moves only what it streams
    return handle


def _nodes(fn) -> list:
    """Every autograd node reachable from `fn`."""
    seen, todo, out = set(), [fn], []
    while todo:
        n = todo.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        todo.extend(f for f, _ in n.next_functions)
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("variant", ["chain", "skip", "passthrough", "inplace", "unused", "slices"])
@pytest.mark.parametrize("loss_fn", [_backward, _backward_twice], ids=["backward", "retain_graph_twice"])
def test_streamed_gradients_equal_the_plain_model(variant, loss_fn, device):
    """On CUDA the order the boundaries rely on is the device queue's (autograd's device thread):
    GPU-only, in bench/gpu_checks.sh's window 1."""
    plain = _toy(variant).to(device)
    streamed = copy.deepcopy(plain).cpu()
    handle = _streamed(streamed, device)
    x = torch.randn(3, 8, device=device, requires_grad=True)
    want = _grads(plain, x.detach().requires_grad_(), loss_fn)
    for _ in range(2):                                # a second step: the learned order, prefetched
        got = _grads(streamed, x.detach().requires_grad_(), loss_fn)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            assert g is None or torch.equal(g, w)
    eng = handle.engine
    assert eng.held == 0 and not eng.bwd_holds and sum(u.refs for u in handle.units) == 0
    assert handle.engine.stats.held_max <= 2


def test_a_passed_through_input_falls_back_to_an_identity_function():
    """Block 2 returns its input, block 1's output, unchanged, and only that output is used: a
    pre-hook on its node (block 1's) would fire after block 1's boundary and release block 1
    before block 1's backward. The call's outputs go through _Routed instead, and only there.
    (The gradients of this case are compared in the test above.)"""
    model = _toy("passthrough")
    _streamed(model)
    out = model(torch.randn(3, 8, requires_grad=True))
    names = [type(n).__name__ for n in _nodes(out.grad_fn)]
    assert names.count("_RoutedBackward") == 1


def test_outputs_that_are_slices_of_one_tensor_need_one_hook():
    """A block returning two slices of one tensor: the pre-hook goes on the node the slices view
    (made by the call), once; the slices' own nodes read no weight. Each call's boundary then fires
    once per backward: 6 firings for 6 calls (4 blocks, embed, head), not 10."""
    model = _toy("slices")
    eng = _streamed(model).engine
    fired = []
    real = eng.backward_boundary
    eng.backward_boundary = lambda b: (fired.append(b.unit.name), real(b))
    model(torch.randn(3, 8, requires_grad=True)).square().sum().backward()
    assert fired == ["non_blocks", "blocks.3", "blocks.2", "blocks.1", "blocks.0", "non_blocks"]


def test_autograd_grad_of_part_of_the_graph():
    """torch.autograd.grad on block 0's adapter alone: the later boundaries fire, the holds they
    took end with that backward, and the gradient equals the plain model's."""
    plain = _toy("chain")
    streamed = copy.deepcopy(plain)
    handle = _streamed(streamed)
    x = torch.randn(3, 8)

    def grad_of_block0(model):
        p = model.blocks[0].lin.lora_A["default"].weight
        return torch.autograd.grad(model(x).square().sum(), [p])[0]

    assert torch.equal(grad_of_block0(streamed), grad_of_block0(plain))
    assert handle.engine.held == 0 and not handle.engine.bwd_holds


def test_streaming_adds_no_node_to_a_flux_graph():
    """The thinner engine, checked on the real tiny Flux: streaming every block and the non-block
    group leaves the autograd graph exactly as large as the unstreamed model's (before, two
    identity Functions per streamed call: 752 nodes against 740 here), and the gradients equal."""
    base = lora_flux(seed=0)
    x, sigma, embeds, hw, target = make_batch(8, 8, seed=0)
    counts, grads = [], []
    for plan in (Plan(), Plan(streamed_blocks=tuple(block_names(base)), stream_non_blocks=True, debug_poison=True)):
        model = copy.deepcopy(base)
        handle = apply_memory(model, FLUX_SPEC, plan, "cpu")
        loss = torch.nn.functional.mse_loss(predict(model, x, sigma, embeds, hw, guidance=1.0), target)
        counts.append(len(_nodes(loss.grad_fn)))
        loss.backward()
        grads.append([p.grad for n, p in model.named_parameters() if "lora_" in n])
        handle.remove()
    assert counts[0] == counts[1]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
