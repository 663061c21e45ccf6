"""A LoRA's optimizer step on the host ([lora] optimizer_step, train/lora_host_step.py).

On a CPU device the host step's arithmetic is the device step's when AdamW runs torch's single-tensor
loop on both (lora_host_step.FUSED_ADAMW = False) and for Adafactor: the tiny-Flux runs must then
give bitwise the same losses and exported LoRA. With torch's fused CPU AdamW (the default) they are
within a few fp32 ulp. Resume of a host-step run is exact. The planner takes the host step where
only it fits, prices the state in host RAM instead of VRAM, and says so.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_run_toml
from safetensors.torch import load_file

from leantune.config import ConfigError, load_config
from leantune.demo import draw_shapes
from leantune.models.flux import FLUX_SPEC
from leantune.planner.meta import build_meta_flux
from leantune.planner.search import Planner
from leantune.planner.workload import Budget, InfeasibleBudget, Workload
from leantune.trainer import train
from leantune.train import lora_host_step

GiB = 2**30

REST = """
[lora]
rank = 4
targets = "all"
{lora}

[train]
steps = {steps}
mixed_precision = "no"
save_every = 2
seed = 3
learning_rate = 1e-3
max_grad_norm = {clip}
optimizer = "{optimizer}"

[output]
dir = "{out}"
name = "o"
formats = ["comfyui"]
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_host") / "images"
    draw_shapes(folder, count=4, size=64, seed=7)
    return folder


def _config(tmp_path, model, images, out: str, step: str, optimizer: str = "adamw", steps: int = 3,
            clip: float = 0.05):
    p = tmp_path / f"{out}.toml"
    lora = f'optimizer_step = "{step}"'
    p.write_text(tiny_run_toml(model, images, REST.format(lora=lora, steps=steps, clip=clip, optimizer=optimizer,
                                                          out=tmp_path / out)))
    return load_config(p)


def _lora(result) -> dict:
    return load_file(str(result.paths.root / "o_comfyui.safetensors"))


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_host_step_equals_the_device_step_bitwise(tmp_path, tiny_flux_dir, images, monkeypatch, optimizer):
    """Same arithmetic on the CPU (AdamW's single-tensor loop, torch's Adafactor, the global-norm
    clip, which is active at max_grad_norm 0.05): the same losses and adapter weights, bit for bit;
    and the host step really ran (its optimizer's parameters are host copies, not the adapters)."""
    monkeypatch.setattr(lora_host_step, "FUSED_ADAMW", False)
    device = train(_config(tmp_path, tiny_flux_dir, images, "device", "device", optimizer), progress=False)
    built = []
    real = lora_host_step.LoraHostStep.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        built.append(self)

    monkeypatch.setattr(lora_host_step.LoraHostStep, "__init__", spy)
    host = train(_config(tmp_path, tiny_flux_dir, images, "host", "host", optimizer), progress=False)
    assert len(built) == 1 and built[0].host_params[0] is not built[0].device_params[0]
    assert len(host.losses) == 3 and host.losses == device.losses
    a, b = _lora(device), _lora(host)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    moved = [k for k in a if k.endswith("lora_up.weight") and a[k].abs().max() > 0]
    assert moved                       # lora_B starts at zero: the steps moved it


def test_fused_host_adamw_is_within_fp32_rounding_of_the_device_step(tmp_path, tiny_flux_dir, images):
    device = train(_config(tmp_path, tiny_flux_dir, images, "device", "device"), progress=False)
    host = train(_config(tmp_path, tiny_flux_dir, images, "host", "host"), progress=False)
    assert host.losses == pytest.approx(device.losses, rel=1e-5)
    a, b = _lora(device), _lora(host)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6), k


def test_a_resumed_host_step_run_is_the_straight_run_bitwise(tmp_path, tiny_flux_dir, images):
    """4 steps straight (saving at 2) == 2 steps, checkpoint, resume, 2 steps: the host copies are
    the saved adapters again and the host optimizer's state is the saved one."""
    straight = train(_config(tmp_path, tiny_flux_dir, images, "straight", "host", steps=4), progress=False)
    cfg = _config(tmp_path, tiny_flux_dir, images, "parts", "host", steps=4)
    assert train(cfg, stop_after=2, progress=False).final_step == 2
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == straight.losses and len(straight.losses) == 4
    a, b = _lora(straight), _lora(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_host_step_config_errors_name_the_key(tmp_path, tiny_flux_dir, images):
    with pytest.raises((ConfigError, ValueError), match="optimizer_step"):
        _config(tmp_path, tiny_flux_dir, images, "bad", "gpu")
    with pytest.raises((ConfigError, ValueError), match=r"\[lora\] optimizer_step = \"host\" with \[train\] optimizer"):
        _config(tmp_path, tiny_flux_dir, images, "bnb", "host", optimizer="adamw8bit")


# -- the planner -------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


@pytest.fixture(scope="module")
def flux_dev():
    return build_meta_flux("dev")


def _planner(model, step: str, optimizer: str = "adamw") -> Planner:
    w = Workload(mode="lora", rank=256, targets="all", optimizer=optimizer, buckets=((1024, 1024),),
                 lora_step=step)
    return Planner(FLUX_SPEC, model, w)


def _need(planner: Planner) -> int:
    with pytest.raises(InfeasibleBudget) as e:
        planner.plan(Budget(vram=GiB, ram=2**62))
    return e.value.needed_vram


def test_plan_steps_on_the_host_only_where_only_it_fits(flux_dev, monkeypatch):
    """Flux-dev LoRA r256 on every Linear at 1024 px: the AdamW state (fp32 moments, 8 bytes per
    adapter parameter) is off the device in a host-step plan, so the host step fits a smaller
    budget. Between the two smallest budgets "device" refuses, naming [lora] optimizer_step, and
    "auto" plans the host step and says why; at a budget both fit with the CPU priced slow, "auto"
    keeps the device step."""
    monkeypatch.setattr(lora_host_step, "measured_rate", lambda *a, **k: 200e6)
    device, host = _planner(flux_dev, "device"), _planner(flux_dev, "host")
    d_need, h_need = _need(device), _need(host)
    n = device.trainable_bytes()[1] // 4                 # adapter parameters
    assert d_need - h_need >= 8 * n * 0.9                # at least the moments leave the device
    budget = Budget(vram=(d_need + h_need) // 2, ram=2**62)
    with pytest.raises(InfeasibleBudget, match=r"\[lora\] optimizer_step = \"host\""):
        device.plan(budget)
    auto_planner = _planner(flux_dev, "auto")
    auto = auto_planner.plan(budget)
    notes = auto.notes
    assert auto.optimizer_on_host and notes["lora_host_step"]
    assert notes["vram_breakdown"]["optimizer states"] == 0 and notes["vram_breakdown"]["optimizer step"] == 0
    assert notes["host_breakdown"]["LoRA optimizer step on the host (fp32 adapters, gradients, state)"] == 16 * n
    assert notes["lora_step"]["other_needs_vram"] == d_need
    # the CPU step priced: gradients down, the step at the rate, adapters up; not hidden
    machine = auto_planner.machine
    want = 4 * n / machine.d2h + n / 200e6 + 4 * n / machine.h2d_pinned
    assert notes["host_step_s"] == pytest.approx(want, rel=1e-6)
    from leantune.planner.report import format_plan

    text = format_plan(auto)
    assert "optimizer step on the host" in text and "no plan stepping on the GPU fits" in text
    assert "LoRA optimizer step on the host" in next(line for line in text.splitlines() if line.startswith("plan:"))
    roomy = Budget(vram=d_need + 4 * GiB, ram=2**62)
    assert not auto_planner.plan(roomy).optimizer_on_host
    assert _planner(flux_dev, "auto", optimizer="adamw8bit").step_places() == (False,)


def test_a_kept_step_place_holds_for_re_plans(flux_dev, monkeypatch):
    monkeypatch.setattr(lora_host_step, "measured_rate", lambda *a, **k: 200e6)
    planner = _planner(flux_dev, "auto")
    d_need = _need(_planner(flux_dev, "device"))
    plan = planner.plan(Budget(vram=d_need - GiB // 8, ram=2**62))
    assert plan.optimizer_on_host
    planner.keep_step_place(plan)
    assert planner.step_places() == (True,)
    assert planner.plan(Budget(vram=d_need + 4 * GiB, ram=2**62)).optimizer_on_host


def test_plan_command_lora_step_flag(capsys):
    """`--lora-step` is a LoRA flag, its host step is for adamw / adafactor, and it keys the kept answers."""
    import argparse

    from leantune.cli import main
    from leantune.commands.plan import _question, configure
    from leantune.planner.answer_cache import answer_path

    rc = main(["plan", "--model", "flux-dev", "--mode", "full", "--lora-step", "host", "--vram", "8GiB"])
    assert rc == 2 and "--lora-step" in capsys.readouterr().err
    rc = main(["plan", "--model", "flux-dev", "--optimizer", "adamw8bit", "--lora-step", "host", "--vram", "8GiB"])
    assert rc == 2 and "--lora-step host with --optimizer adamw8bit" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    configure(parser)
    base = ["--model", "flux-dev", "--vram", "8GiB"]
    keys = {answer_path(_question(parser.parse_args(base + extra)))
            for extra in ([], ["--lora-step", "device"], ["--lora-step", "host"])}
    assert len(keys) == 3


def test_the_cpu_rate_is_timed_once_per_machine_and_kept(monkeypatch):
    """A second process (here: a second call) reads the kept rate, so its plans are the first's."""
    from leantune.planner.lora_host_rate import lora_host_rate

    calls = []
    monkeypatch.setattr(lora_host_step, "measured_rate", lambda *a: calls.append(a) or 123e6)
    assert lora_host_rate("adamw") == 123e6 and lora_host_rate("adamw") == 123e6 and len(calls) == 1
    assert lora_host_rate("adafactor") == 123e6 and len(calls) == 2          # another setting: timed apart


def test_the_plan_puts_the_step_on_the_host_under_auto():
    """Under a budget the trainer hands the mode its plan (LoraMode.use_plan): "auto" builds the host
    optimizer exactly when the plan steps on the host; "device" and "host" as asked without a budget."""
    from leantune.config import LoraConfig, TrainConfig
    from leantune.memory.plan import Plan
    from leantune.train.lora_mode import LoraMode

    params = [torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.zeros(8, 4))]
    for step, plan, on_host in (("auto", Plan(optimizer_on_host=True), True), ("auto", Plan(), False),
                                ("host", Plan(), True), ("device", Plan(), False)):
        mode = LoraMode(LoraConfig(optimizer_step=step), TrainConfig(), ["comfyui"])
        mode.use_plan(plan)
        opt = mode.build_optimizer(params)
        held = opt.param_groups[0]["params"]
        assert (mode.host_step is not None) == on_host
        assert (held[0] is params[0]) == (not on_host)
        if on_host:
            assert torch.equal(held[0], params[0]) and held[0].data_ptr() != params[0].data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_step_on_cuda_adapters_copies_pinned_and_in_order():
    """CUDA only (what no CPU test sees): the staging and host copies are pinned, the gradients'
    non-blocking copies are waited for before the CPU reads them, the updated adapters' non-blocking
    copies land before the next kernel on the stream reads them; the result is the CPU fused AdamW's
    on the same gradients, bitwise (the host arithmetic is the same), and no optimizer state is on the GPU."""
    from leantune.config import TrainConfig

    torch.manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(32, 3072) * 0.02), torch.nn.Parameter(torch.zeros(3072, 32))]
    dev = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    cfg = TrainConfig(learning_rate=1e-3)
    step = lora_host_step.LoraHostStep(dev, cfg)
    ref = torch.optim.AdamW(cpu, lr=cfg.learning_rate, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                            fused=True)
    assert all(h.is_pinned() for h in step.host_params) and all(g.is_pinned() for g in step.staging)
    before = torch.cuda.memory_allocated()
    for i in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for p in cpu]
        for d, c, g in zip(dev, cpu, grads):
            d.grad = (g.cuda() * 1.0).contiguous()        # made by a kernel, as backward makes them
            c.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(cpu, 1.0)
        ref.step()
        step.step(1.0)
        used = [(d * 1.0).cpu() for d in dev]             # a kernel reading the adapters right after
        assert all(torch.equal(u, c.detach()) for u, c in zip(used, cpu))
    assert torch.cuda.memory_allocated() <= before


@pytest.mark.parametrize("experts", ["each", "shared"])
def test_two_expert_host_step_equals_the_device_step_bitwise(tmp_path_factory, monkeypatch, experts):
    """Wan 2.2 A14B's two experts in one run ([model] expert = "both", train/parts_lora.py): each step
    trains one expert's adapter (the other's gradient is None and is skipped on the host as on the
    device); the host step's runs equal the device step's bit for bit in losses and in every file."""
    from leantune.tiny.wan import save_wan_folder

    monkeypatch.setattr(lora_host_step, "FUSED_ADAMW", False)
    root = tmp_path_factory.mktemp("two_experts_host")
    draw_shapes(root / "images", count=2, size=64, seed=5)
    folder = save_wan_folder(root / "folder")
    runs = {}
    for step in ("device", "host"):
        (root / f"{step}.toml").write_text(f"""
[model]
family = "wan2.2"
path = "{folder}"
dtype = "fp32"
expert = "both"

[data]
resolutions = [64]
batch_size = 2
cache_dir = "{root / 'cache'}"
max_text_length = 32

[[data.datasets]]
path = "{root / 'images'}"

[lora]
rank = 4
experts = "{experts}"
optimizer_step = "{step}"

[memory]
streamed_blocks = 1

[train]
steps = 4
learning_rate = 1e-2
mixed_precision = "no"
seed = 3

[output]
dir = "{root / step}"
name = "both"
formats = ["diffusers"]
""")
        runs[step] = train(load_config(root / f"{step}.toml"), progress=False)
    device, host = runs["device"], runs["host"]
    assert len(host.losses) == 4 and host.losses == device.losses
    files = sorted(p.name for p in device.paths.root.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in host.paths.root.glob("*.safetensors"))
    for name in files:
        a, b = load_file(str(device.paths.root / name)), load_file(str(host.paths.root / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_timing_the_cpu_rate_leaves_the_run_s_random_numbers_alone():
    """The planner times the CPU step before the adapters are initialised: drawing its tensors from
    the global generator changed every later draw (a run under a budget trained other adapters)."""
    lora_host_step._RATE.clear()
    before = torch.random.get_rng_state()
    lora_host_step.measured_rate("adamw", clip=True)
    assert torch.equal(torch.random.get_rng_state(), before)
