"""The optimizers from their packages (train/optim_packages.py): leantune's built optimizer steps
bitwise as the package's own optimizer constructed directly; its state round-trips; the planner's
state bytes (planner/optimizer_state.py) are the bytes the real optimizer holds; the schedule-free
evaluation point; the config refusals, each naming its key."""

import copy

import pytest
import torch

from leantune.config import ConfigError, TrainConfig, load_config
from leantune.planner.optimizer_state import lora_shapes, state_bytes
from leantune.train.optim import build_optimizer, build_scheduler, lr_factor
from leantune.train.optim_packages import evaluation_point, scalars

PACKAGED = ["prodigy", "schedulefree_adamw", "came", "adamw8bit"]


def _package_optimizer(name: str, params, cfg: TrainConfig):
    """The package's optimizer built here from its own documented arguments (not leantune's builder)."""
    if name == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                       d_coef=cfg.prodigy_d_coef, use_bias_correction=cfg.prodigy_use_bias_correction,
                       safeguard_warmup=cfg.prodigy_safeguard_warmup)
    if name == "schedulefree_adamw":
        from schedulefree import AdamWScheduleFree

        opt = AdamWScheduleFree(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps)
        opt.train()
        return opt
    if name == "came":
        from came_pytorch import CAME

        return CAME(params, lr=cfg.learning_rate, betas=(cfg.betas[0], cfg.betas[1], 0.9999),
                    weight_decay=cfg.weight_decay)
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps,
                               weight_decay=cfg.weight_decay)


def _params(seed=0):
    """A LoRA-like pair (A random, B zero: as peft starts one), a 64x128 matrix past bitsandbytes'
    4096-value 8-bit threshold, and a vector (CAME's unfactored case)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 24, generator=g)), torch.nn.Parameter(torch.zeros(16, 4)),
            torch.nn.Parameter(torch.randn(64, 128, generator=g)), torch.nn.Parameter(torch.randn(16, generator=g))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * (1 + p.detach().abs()) for p in params]


def _config(name, **kw):
    extra = {"prodigy": dict(learning_rate=1.0, prodigy_d_coef=2.0, prodigy_use_bias_correction=True,
                             prodigy_safeguard_warmup=True),
             "schedulefree_adamw": dict(learning_rate=2e-3, warmup_steps=3),
             "came": dict(learning_rate=2e-4, betas=(0.9, 0.99)),
             "adamw8bit": dict(learning_rate=1e-3, eps=1e-7)}[name]
    return TrainConfig(optimizer=name, weight_decay=0.01, steps=10, **{**extra, **kw})


def _run(opt, params, sched, steps, start=0):
    for s in range(start, start + steps):
        for p, g in zip(params, _grads(params, s)):
            p.grad = g.clone()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", PACKAGED)
def test_built_optimizer_steps_bitwise_as_the_package_and_resumes_exactly(name):
    cfg = _config(name)
    ours_p, theirs_p = _params(), _params()
    ours = build_optimizer(ours_p, cfg)
    sched = build_scheduler(ours, cfg)
    assert type(ours).__module__.split(".")[0] == type(_package_optimizer(name, _params(), cfg)).__module__.split(".")[0]
    theirs = _package_optimizer(name, theirs_p, cfg)
    _run(ours, ours_p, sched, 6)
    _run(theirs, theirs_p, None, 6)          # the LambdaLR is 1 throughout for these settings
    assert all(torch.equal(a, b) for a, b in zip(ours_p, theirs_p))
    assert any(not torch.equal(a, b) for a, b in zip(ours_p, _params()))        # it trained
    # Resume: a fresh optimizer on copies loads deep copies of the state dicts (as a checkpoint
    # gives them) and continues as the straight one.
    again_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    again = build_optimizer(again_p, cfg)
    again_sched = build_scheduler(again, cfg)
    again.load_state_dict(copy.deepcopy(ours.state_dict()))
    again_sched.load_state_dict(copy.deepcopy(sched.state_dict()))
    _run(ours, ours_p, sched, 4, start=6)
    _run(again, again_p, again_sched, 4, start=6)
    assert all(torch.equal(a, b) for a, b in zip(ours_p, again_p))


def test_prodigy_reports_its_d_estimate_and_the_effective_rate():
    cfg = _config("prodigy")
    params = _params()
    opt = build_optimizer(params, cfg)
    for _ in range(20):                                  # descend 0.5 |p - 1|^2: a steady direction
        for p in params:
            p.grad = p.detach() - 1.0
        opt.step()
    d = opt.param_groups[0]["d"]
    assert d > 1e-5                                      # grew from d0 = 1e-6
    assert scalars(opt) == {"prodigy/d": d, "prodigy/d_lr": d * 1.0}
    assert scalars(build_optimizer(_params(), TrainConfig())) == {}


def test_prodigy_warns_of_a_warmup_without_its_safeguard(caplog):
    """A warm-up without safeguard_warmup made the demo's Prodigy run overestimate d and blow up
    (docs/benchmarks.md): the builder says so, naming the keys; with the safeguard, or no warm-up, not."""
    with caplog.at_level("WARNING", logger="leantune"):
        build_optimizer(_params(), _config("prodigy", warmup_steps=20, prodigy_safeguard_warmup=False))
    assert "warmup_steps = 20" in caplog.text and "prodigy_safeguard_warmup = true" in caplog.text
    for quiet in (dict(warmup_steps=20), dict(warmup_steps=0, prodigy_safeguard_warmup=False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="leantune"):
            build_optimizer(_params(), _config("prodigy", **quiet))
        assert "safeguard" not in caplog.text


def test_schedule_free_evaluation_point_holds_x_and_restores_y_bit_for_bit():
    cfg = _config("schedulefree_adamw")
    params = _params()
    opt = build_optimizer(params, cfg)
    _run(opt, params, None, 5)
    y = [p.detach().clone() for p in params]
    beta1 = cfg.betas[0]
    x = [yi.lerp(opt.state[p]["z"], 1 - 1 / beta1) for yi, p in zip(y, params)]   # the package's eval()
    with evaluation_point(opt):
        assert all(torch.equal(p, xi) for p, xi in zip(params, x))
        assert not opt.param_groups[0]["train_mode"]
    assert all(torch.equal(p, yi) for p, yi in zip(params, y)) and opt.param_groups[0]["train_mode"]
    # no warmup twice: the LambdaLR is 1, warmup_steps is the optimizer's own
    assert [lr_factor(s, cfg) for s in (0, 1, 5)] == [1.0, 1.0, 1.0]
    assert opt.param_groups[0]["warmup_steps"] == 3


def test_evaluation_point_leaves_other_optimizers_alone():
    params = _params()
    opt = build_optimizer(params, TrainConfig())
    _run(opt, params, None, 2)
    before = [p.detach().clone() for p in params]
    with evaluation_point(opt):
        assert all(torch.equal(p, b) for p, b in zip(params, before))


def _device_bytes(opt) -> int:
    """Bytes of the state tensors the optimizer holds, each storage once (bitsandbytes shares its
    quantization maps); torch's 0-dim `step` counters live in host memory and are left out."""
    seen, total = set(), 0
    for state in opt.state.values():
        for key, v in state.items():
            if not torch.is_tensor(v) or (key == "step" and v.dim() == 0):
                continue
            ptr = v.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += v.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("name", ["adamw", "adafactor", *PACKAGED])
def test_priced_state_bytes_are_what_the_optimizer_holds(name):
    params = _params()
    opt = build_optimizer(params, _config(name) if name in PACKAGED else TrainConfig(optimizer=name))
    _run(opt, params, None, 1)
    zeros = [not bool(p.any()) for p in _params()]
    assert state_bytes(name, [tuple(p.shape) for p in params], zeros) == _device_bytes(opt) > 0


@pytest.mark.parametrize("name", ["adamw", "prodigy", "came", "adamw8bit"])
def test_the_planner_prices_the_lora_optimizer_state_of_a_tiny_model(name, tiny_lora_model):
    """The planner's LoRA state (memory_model.trainable_bytes) against the real optimizer on the tiny
    Flux's adapters after one step (B random, as after [lora] init_from: Prodigy's p0 full size)."""
    from leantune.models.flux import FLUX_SPEC
    from leantune.planner.search import Planner
    from leantune.planner.workload import Workload

    model = tiny_lora_model
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.normal_()
    opt = build_optimizer(params, _config(name) if name in PACKAGED else TrainConfig(optimizer=name))
    _run(opt, params, None, 1)
    planner = Planner(FLUX_SPEC, model, Workload(rank=4, targets="all", optimizer=name, buckets=((64, 64),),
                                                  text_length=8, dtype=torch.float32, autocast=False,
                                                  allow_fp8=False))
    assert planner.trainable_bytes()[2] == _device_bytes(opt)
    assert state_bytes(name, lora_shapes(planner.weights.adapters, 4)) == _device_bytes(opt)


@pytest.fixture
def tiny_lora_model(tmp_path, monkeypatch):
    """The tiny Flux with rank-4 LoRA on every block Linear; the planner's caches in the test's folder."""
    from leantune import tiny
    from leantune.config import LoraConfig
    from leantune.models.flux import FLUX_SPEC
    from leantune.train.lora import add_lora

    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))
    model = tiny.flux_transformer(num_layers=1, num_single_layers=1)
    model.requires_grad_(False)
    add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="all"))
    return model


# -- the config ------------------------------------------------------------------------------------

MINIMAL = """[model]
path = "m"
[data]
[[data.datasets]]
path = "d"
"""


@pytest.mark.parametrize("extra, message", [
    ('[train]\nmode = "full"\noptimizer = "prodigy"\n', r"\[train\] optimizer = 'prodigy' is for \[train\] mode = \"lora\""),
    ('[train]\nmode = "full"\noptimizer = "came"\n', r"\[train\] optimizer = 'came' is for \[train\] mode = \"lora\""),
    ('[train]\nprodigy_d_coef = 2.0\n', r"\[train\] prodigy_d_coef: set, but \[train\] optimizer = 'adamw'"),
    ('[train]\noptimizer = "schedulefree_adamw"\nlr_scheduler = "cosine"\n',
     r"\[train\] lr_scheduler = 'cosine' with \[train\] optimizer = \"schedulefree_adamw\""),
    ('[train]\noptimizer = "came"\neps = 1e-6\n', r"\[train\] eps: set, but \[train\] optimizer = \"came\""),
    ('[train]\noptimizer = "lion"\n', r"\[train\]: key 'optimizer'"),
])
def test_optimizer_combinations_that_make_no_sense_name_the_key(tmp_path, extra, message):
    p = tmp_path / "run.toml"
    p.write_text(MINIMAL + extra)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(p)
    assert str(p) in str(e.value)


def test_the_new_optimizers_load_in_lora_mode_and_adamw8bit_too(tmp_path):
    p = tmp_path / "run.toml"
    for opt, more in (("prodigy", "learning_rate = 1.0\nprodigy_safeguard_warmup = true\n"),
                      ("schedulefree_adamw", "warmup_steps = 10\n"), ("came", ""), ("adamw8bit", "")):
        p.write_text(MINIMAL + f'[train]\noptimizer = "{opt}"\n{more}')
        assert load_config(p).train.optimizer == opt


def test_the_page_and_the_planner_offer_every_optimizer():
    from leantune.commands.plan import _optimizers
    from leantune.ui.form import choices

    assert choices("train", "optimizer") == _optimizers() == [
        "adamw", "adafactor", "adamw8bit", "prodigy", "schedulefree_adamw", "came"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", PACKAGED)
def test_gpu_only_built_optimizer_steps_bitwise_as_the_package_on_cuda(name):
    """The same parity on CUDA tensors (bitsandbytes' CUDA 8-bit kernels; the others' device paths)."""
    cfg = _config(name)
    ours_p = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    theirs_p = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    ours, theirs = build_optimizer(ours_p, cfg), _package_optimizer(name, theirs_p, cfg)
    for opt, params in ((ours, ours_p), (theirs, theirs_p)):
        for s in range(4):
            for p, g in zip(params, _grads([q.detach().cpu() for q in params], s)):
                p.grad = g.cuda()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(ours_p, theirs_p))
    assert any(not torch.equal(a.cpu(), b) for a, b in zip(ours_p, _params()))
    if name == "adamw8bit":                       # 8-bit moments on the device, as priced
        assert _device_bytes(ours) == state_bytes(name, [tuple(p.shape) for p in ours_p])
