import copy

import pytest
import torch

from leantune.config import TrainConfig
from leantune.train.optim import build_optimizer, build_scheduler, lr_factor


def test_warmup_then_cosine_and_linear_decay_to_zero():
    cos = TrainConfig(steps=110, warmup_steps=10, lr_scheduler="cosine")
    assert [lr_factor(s, cos) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, cos) == pytest.approx(1.0) and lr_factor(60, cos) == pytest.approx(0.5)
    assert lr_factor(110, cos) == pytest.approx(0.0, abs=1e-12)
    lin = TrainConfig(steps=100, lr_scheduler="linear")
    assert lr_factor(25, lin) == pytest.approx(0.75)
    const = TrainConfig(steps=100, warmup_steps=4)
    assert lr_factor(1, const) == pytest.approx(0.5) and lr_factor(50, const) == 1.0


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_optimizers_minimise_a_quadratic_and_resume_from_state(name):
    cfg = TrainConfig(optimizer=name, learning_rate=0.05, steps=200)
    w = torch.nn.Parameter(torch.full((4, 8), 3.0))
    opt = build_optimizer([w], cfg)
    sched = build_scheduler(opt, cfg)
    for _ in range(60):
        opt.zero_grad()
        (w ** 2).sum().backward()
        opt.step()
        sched.step()
    assert (w ** 2).sum().item() < 0.5 * 9.0 * 32
    # A copy restored from the state dicts continues identically.
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = build_optimizer([w2], cfg)
    sched2 = build_scheduler(opt2, cfg)          # built first, then both loaded: the trainer's order
    # Deep copies, as a checkpoint on disk gives: load_state_dict keeps some state tensors by reference.
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched2.load_state_dict(copy.deepcopy(sched.state_dict()))
    for p, o, s in ((w, opt, sched), (w2, opt2, sched2)):
        o.zero_grad()
        (p ** 2).sum().backward()
        o.step()
        s.step()
    assert torch.equal(w, w2) and sched.get_last_lr() == sched2.get_last_lr()
