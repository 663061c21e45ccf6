"""Both experts of Wan 2.2 A14B in one run ([model] expert = "both"): each step trains the expert
that owns its noise levels (WanPipeline's boundary) and leaves the other exactly as it was; with
[lora] experts = "shared" one adapter is both experts'; the memory engine holds one expert at a
time; the two files load through WanPipeline.load_lora_weights into transformer and transformer_2
and give the trained outputs; an interrupted run resumes to the uninterrupted one bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from simulated_cases import GROUP, Call, register, results
from test_simulated import _library_or_skip

from leantune.config import load_config
from leantune.models.wan import experts as wan_experts
from leantune.tiny.wan import BOUNDARY_RATIO, WAN_TINY, save_wan_folder

pytestmark = pytest.mark.usefixtures("one_torch_thread")   # conftest.py: tiny models run best on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny two-expert folder, two images and one shared cache folder."""
    from leantune.demo import draw_shapes

    root = tmp_path_factory.mktemp("two_experts")
    draw_shapes(root / "images", count=2, size=64, seed=5)
    return {"root": root, "folder": save_wan_folder(root / "folder")}


def _config(world, tmp_path, experts: str = "each", steps: int = 4, seed: int = 3, extra: str = "", out="out",
            memory: str = "streamed_blocks = 1"):
    root = world["root"]
    (tmp_path / "run.toml").write_text(f"""
[model]
family = "wan2.2"
path = "{world['folder']}"
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
alpha = 4
experts = "{experts}"

[memory]
{memory}

[train]
steps = {steps}
learning_rate = 1e-2
mixed_precision = "no"
seed = {seed}

[output]
dir = "{out}"
name = "both"
formats = ["diffusers"]
{extra}""")
    return load_config(tmp_path / "run.toml", [])


def _lora(part) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in part.named_parameters() if "lora_" in n}


def _expert_of(sigma: torch.Tensor) -> str:
    return "high" if bool(wan_experts.owns("high", sigma.float() * 1000, BOUNDARY_RATIO).all()) else "low"


def _recording(monkeypatch) -> list:
    """The noise levels of every training call, as one_expert_sigmas returns them."""
    seen = []
    real = wan_experts.one_expert_sigmas

    def record(sigma, ratio, method, **kw):
        out = real(sigma, ratio, method, **kw)
        seen.append(out.clone())
        return out

    monkeypatch.setattr(wan_experts, "one_expert_sigmas", record)
    return seen


def test_one_expert_per_call_keeps_the_configured_distribution():
    """one_expert_sigmas puts every level of a call on one side of the boundary (the side of the first
    draw, which it keeps), picks the high-noise expert with probability equal to its mass under the
    drawing distribution, and leaves each sample's level distributed as drawn (Kolmogorov-Smirnov
    distance < 0.02 against the plain draws)."""
    from leantune.train.flow_matching import sample_sigmas

    g = torch.Generator().manual_seed(0)
    calls = [sample_sigmas(4, "shift", g, shift=3.0) for _ in range(6000)]
    got = [wan_experts.one_expert_sigmas(s, BOUNDARY_RATIO, "shift", shift=3.0) for s in calls]
    sides = []
    for drawn, out in zip(calls, got):
        high = wan_experts.owns("high", out * 1000, BOUNDARY_RATIO)
        assert bool(high.all()) or not bool(high.any())
        assert out[0] == drawn[0]
        sides.append(bool(high[0]))
    plain = torch.cat(calls)
    mass = float((plain >= BOUNDARY_RATIO).float().mean())
    assert 0.05 < mass < 0.95
    assert abs(sum(sides) / len(sides) - mass) < 0.02
    levels = torch.cat(got)
    grid = torch.linspace(0.0, 1.0, 101)
    cdf = lambda s: (s[None, :] <= grid[:, None]).float().mean(dim=1)     # noqa: E731
    assert float((cdf(levels) - cdf(plain)).abs().max()) < 0.02
    one = torch.tensor([0.5])
    assert wan_experts.one_expert_sigmas(one, BOUNDARY_RATIO, "logit_normal") is one   # a batch of one: as drawn


def test_each_step_trains_only_the_expert_that_owns_its_noise_levels(world, tmp_path, monkeypatch):
    """[lora] experts = "each": a step whose levels lie at or above the boundary changes the
    high-noise expert's adapter and leaves the low-noise one's bit for bit (its gradient None), and
    the other way round below it; both kinds of step occur; the memory engine holds the plan on the
    expert in use only (the other has no streaming wrapper and sits on the host)."""
    from leantune.memory.switched import SwitchedMemory
    from leantune.trainer import _build, train_step

    seen = _recording(monkeypatch)
    cfg = _config(world, tmp_path, steps=8)
    t = _build(cfg)
    experts = t.transformer
    assert isinstance(t.memory, SwitchedMemory)
    assert {id(p) for p in t.params} == {id(p) for p in experts.parameters() if p.requires_grad}
    assert len(_lora(experts.high)) == len(_lora(experts.low)) > 0
    owners = []
    for _ in range(cfg.train.steps):
        before = {"high": _lora(experts.high), "low": _lora(experts.low)}
        train_step(t, cfg)
        owner = _expert_of(seen[-1])
        other = "low" if owner == "high" else "high"
        owners.append(owner)
        after = {"high": _lora(experts.high), "low": _lora(experts.low)}
        assert all(torch.equal(after[other][n], v) for n, v in before[other].items()), other
        assert any(not torch.equal(after[owner][n], v) for n, v in before[owner].items()), owner
        part = experts.high if other == "high" else experts.low
        assert all(p.grad is None for n, p in part.named_parameters() if "lora_" in n)
        active = experts.high if owner == "high" else experts.low
        assert t.memory.handle.model is active
        assert any("forward" in b.__dict__ for b in active.blocks)          # its streamed block, wrapped
        assert not any("forward" in b.__dict__ for b in part.blocks)       # the other: a plain model ...
        assert all(p.device.type == "cpu" for n, p in part.named_parameters() if "lora_" not in n)   # ... at home
    assert set(owners) == {"high", "low"}, owners
    assert t.memory.switches >= 1
    t.memory.release()


def test_a_shared_lora_is_one_adapter_for_both_experts(world, tmp_path, monkeypatch):
    """[lora] experts = "shared": the two experts' peft layers hold the same Parameters, the optimizer
    one expert's worth, every step (high or low) changes them, and the run writes one file that
    equals both experts' adapters."""
    from leantune.trainer import RunPaths, _build, train_step
    from leantune.train.lora import lora_weights_from_model

    seen = _recording(monkeypatch)
    cfg = _config(world, tmp_path, experts="shared", steps=8)
    t = _build(cfg)
    experts = t.transformer
    high = dict(experts.high.named_parameters())
    low = dict(experts.low.named_parameters())
    shared = [n for n in high if "lora_" in n]
    assert shared and all(high[n] is low[n] for n in shared)
    assert {id(p) for p in t.params} == {id(high[n]) for n in shared}
    owners = []
    for _ in range(cfg.train.steps):
        before = _lora(experts.high)
        train_step(t, cfg)
        owners.append(_expert_of(seen[-1]))
        assert any(not torch.equal(high[n], v) for n, v in before.items())
    assert set(owners) == {"high", "low"}, owners
    files = t.mode.export(t, RunPaths(tmp_path / "out", "both"), cfg.train.steps, False)
    assert [f.name for f in files] == ["both_diffusers.safetensors"]
    saved = load_file(str(files[0]))
    for part in (experts.high, experts.low):
        mine = lora_weights_from_model(part)
        assert set(mine.modules) and all(torch.equal(mine.modules[k].down, m.down)
                                         for k, m in lora_weights_from_model(experts.high).modules.items())
    assert saved and all(k.startswith("transformer.blocks.") for k in saved)
    t.memory.release()


def test_the_files_load_into_wanpipelines_transformer_and_transformer_2(world, tmp_path):
    """The run's <name>_high_noise / <name>_low_noise files: WanPipeline.load_lora_weights puts the first
    into `transformer` and, with load_into_transformer_2=True, the second into `transformer_2`, and each
    expert then computes what the trained one does (and not what the base does)."""
    from diffusers import WanPipeline

    from leantune.trainer import RunPaths, _build, train_step

    cfg = _config(world, tmp_path, steps=8)
    t = _build(cfg)
    for _ in range(cfg.train.steps):
        train_step(t, cfg)
    files = t.mode.export(t, RunPaths(tmp_path / "out", "both"), cfg.train.steps, False)
    names = sorted(f.name for f in files)
    assert names == ["both_high_noise_diffusers.safetensors", "both_low_noise_diffusers.safetensors"]
    t.memory.remove(device="cpu")
    experts = t.transformer.eval()
    pipe = WanPipeline.from_pretrained(str(world["folder"]), local_files_only=True)
    base_high, base_low = pipe.transformer, pipe.transformer_2
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 1, 8, 8, generator=g)
    text = torch.randn(1, 7, WAN_TINY["text_dim"], generator=g)

    def run(model, timestep):
        with torch.no_grad():
            return model(hidden_states=x, timestep=torch.tensor([timestep]), encoder_hidden_states=text,
                         return_dict=False)[0]

    before = run(base_high, 950.0), run(base_low, 300.0)
    pipe.load_lora_weights(str(tmp_path / "out" / names[0]), adapter_name="trained")
    pipe.load_lora_weights(str(tmp_path / "out" / names[1]), adapter_name="trained", load_into_transformer_2=True)
    for model, mine, timestep, base in ((pipe.transformer, experts.high, 950.0, before[0]),
                                        (pipe.transformer_2, experts.low, 300.0, before[1])):
        want = run(mine, timestep)
        torch.testing.assert_close(run(model, timestep), want, rtol=1e-5, atol=1e-6)
        assert float((want - base).abs().max()) > 1e-4       # the trained adapter is there and matters
    assert float((run(experts, 950.0) - run(experts.high, 950.0)).abs().max()) == 0.0   # routed at the boundary
    assert float((run(experts, 874.0) - run(experts.low, 874.0)).abs().max()) == 0.0


def test_a_resumed_two_expert_run_equals_an_uninterrupted_one(world, tmp_path, monkeypatch):
    """4 steps with both experts trained before and after the cut: stopped after 2 and resumed, the
    losses and both final files equal the uninterrupted run's bit for bit; the samples drawn during
    training call both experts."""
    from leantune.train.lora import lora_layers
    from leantune.trainer import train

    seen = _recording(monkeypatch)
    sampled = []
    route = wan_experts.WanExperts.expert_for

    def routing(self, timestep):
        expert = route(self, timestep)
        if not torch.is_grad_enabled():                 # a preview's call: which expert, with its adapter on
            sampled.append(("high" if expert is self.high else "low", bool(lora_layers(expert, "default"))))
        return expert

    monkeypatch.setattr(wan_experts.WanExperts, "expert_for", routing)
    sample = "\n[sample]\nevery = 4\nprompts = [\"a red square\"]\nsteps = 4\nwidth = 32\nheight = 32\nframes = 1\n"
    (tmp_path / "a").mkdir()
    whole = train(_config(world, tmp_path / "a", seed=0, out="whole", extra=sample), progress=False)
    owners = [_expert_of(s) for s in seen]
    assert set(owners[:2]) == {"high", "low"} and set(owners[2:]) == {"high", "low"}, owners
    assert whole.sample_files and set(sampled) == {("high", True), ("low", True)}, sampled
    (tmp_path / "b").mkdir()
    cfg = _config(world, tmp_path / "b", seed=0, out="cut", extra=sample)
    first = train(cfg, stop_after=2, progress=False)
    assert first.final_step == 2
    second = train(cfg, resume=True, progress=False)
    assert second.final_step == 4 and second.losses == whole.losses
    for a, b in zip(sorted(whole.lora_files), sorted(second.lora_files), strict=True):
        assert a.name == b.name
        wa, wb = load_file(str(a)), load_file(str(b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_switching_experts_under_streaming_computes_what_the_plain_experts_do(world, tmp_path, monkeypatch):
    """Every block and the non-block modules streamed in poison mode (a released slot is NaN) and
    checkpointed: the two-expert run switches experts between steps, and its losses and both
    adapters equal those of the same run on the plain model (the engine removed: no plan, no
    switch), bit for bit: a switch moves the weights home and back without changing a bit of them,
    and no step computes with the other expert's slots."""
    from leantune.trainer import _build, train_step

    seen = _recording(monkeypatch)
    runs = {}
    for name, memory in (("plain", "streamed_blocks = 0"),
                         ("streamed", "streamed_blocks = \"all\"\nstream_non_blocks = true\n"
                                      "checkpointing = \"blocks\"\ndebug_poison = true")):
        (tmp_path / name).mkdir()
        cfg = _config(world, tmp_path / name, steps=6, seed=0, memory=memory)
        torch.manual_seed(cfg.train.seed)         # the adapters' initial values, as train() seeds them
        t = _build(cfg)
        if name == "plain":
            t.memory.remove(device="cpu")
        losses = [train_step(t, cfg) for _ in range(cfg.train.steps)]
        runs[name] = (losses, _lora(t.transformer), t.memory.switches, [_expert_of(s) for s in seen])
        seen.clear()
    (plain, a, _, owners), (streamed, b, switches, owners_b) = runs["plain"], runs["streamed"]
    assert owners == owners_b and set(owners) == {"high", "low"} and switches >= 2
    assert plain == streamed and all(torch.isfinite(torch.tensor(streamed)))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_two_expert_settings_are_checked_naming_the_key(world, tmp_path):
    """[lora] experts without [model] expert = "both", "both" on a one-transformer folder or another
    family, and full fine-tuning of both are refused, naming the key."""
    from leantune.config import ModelConfig, RunConfig
    from leantune.models.family import get_family
    from leantune.models.weights import LoadError

    base = {"model": {"family": "wan2.2", "path": str(world["folder"])}, "data": {"datasets": [{"path": "x"}]}}
    with pytest.raises(ValueError, match=r"\[lora\] experts = 'shared'.*\[model\] expert"):
        RunConfig.model_validate({**base, "lora": {"experts": "shared"}})
    with pytest.raises(ValueError, match=r"\[train\] mode = \"full\" with \[model\] expert = \"both\""):
        RunConfig.model_validate({**base, "model": {**base["model"], "expert": "both"}, "train": {"mode": "full"}})
    with pytest.raises(ValueError, match=r"\[model\] expert = 'both'.*\"wan2.2\""):
        ModelConfig(path=str(world["folder"]), family="z-image", expert="both")
    one = save_wan_folder(tmp_path / "one", experts=1)
    with pytest.raises(LoadError, match=r"\[model\] expert = \"both\".*transformer_2"):
        get_family("wan2.2").resolve_sources(ModelConfig(path=str(one), family="wan2.2", expert="both"), tmp_path)


@pytest.mark.parametrize("experts", ["each", "shared"])
def test_the_planner_prices_one_expert_on_the_device_and_the_other_on_the_host(world, tmp_path, experts):
    """Under a vram_budget a two-expert run is priced as one expert's device plan (what the engine
    holds at a time), plus the other expert on the host as stored (in every phase's peak) and, for
    [lora] experts = "each", the other adapter and its optimizer state on the device; a shared
    LoRA's device bytes are one expert's run."""
    from leantune.memory.plan import Plan
    from leantune.models.family import get_family, loader_options
    from leantune.planner.from_config import planner_for_config
    from leantune.planner.machine import assumed_machine

    family = get_family("wan2.2")
    cfg = _config(world, tmp_path, experts=experts, extra="")
    machine = assumed_machine()

    def planner(expert):
        c = cfg.model_copy(update={"model": cfg.model.model_copy(update={"expert": expert}),
                                   "memory": cfg.memory.model_copy(update={"vram_budget": "1GiB"})})
        sources = family.resolve_sources(c.model, tmp_path)
        meta = family.load_transformer(sources, dtype=torch.float32, device="meta", **loader_options(c.memory))
        return planner_for_config(c, family.spec, meta, machine)[0], meta

    both, meta = planner("both")
    high, _ = planner("high")
    plan = Plan(streamed_blocks=("blocks.1",), ring_slots=2)
    got, want = both.estimate(plan), high.estimate(plan)
    low_bytes = sum(t.numel() * t.element_size() for t in (*meta.low.parameters(), *meta.low.buffers()))
    assert got.host["other experts on the host (as stored)"] == low_bytes
    assert got.peak_host == want.peak_host + low_bytes
    assert got.vram["gradients"] == want.vram["gradients"] and got.vram["activations"] == want.vram["activations"]
    times = 1 if experts == "shared" else 2
    assert got.vram["adapters"] == times * want.vram["adapters"] > 0
    extra = got.peak_vram - want.peak_vram
    assert want.vram["optimizer states"] > 0
    assert extra == (times - 1) * (want.vram["adapters"] + want.vram["optimizer states"])


# -- on the simulated GPU (device != host) --------------------------------------------------------------------

def _simulated_two_experts(experts: str) -> dict:
    """In the fresh process: the tiny two-expert model's LoRA steps on the simulated GPU, against
    the high-noise expert alone under the same plan (every block streamed, checkpointed): what
    each holds on the device after set-up and at each step's peak, and which expert each step ran."""
    import tempfile
    from pathlib import Path

    from leantune.config import ModelConfig, validate
    from leantune.memory.plan import Plan
    from leantune.models.family import get_family
    from leantune.planner.from_config import planner_for_config
    from leantune.planner.machine import assumed_machine
    from leantune.simulated_run import simulate_training
    from leantune.train.modes import make_mode

    root = Path(tempfile.mkdtemp())
    folder = save_wan_folder(root / "folder")
    fam = get_family("wan2.2")
    out = {}
    for expert in ("high", "both"):
        cfg = validate({"model": {"path": str(folder), "family": "wan2.2", "dtype": "bf16", "expert": expert},
                        "data": {"datasets": [{"path": "unused"}], "resolutions": [64], "batch_size": 1,
                                 "max_text_length": 32},
                        "lora": {"rank": 4, **({"experts": experts} if expert == "both" else {})},
                        "train": {"mixed_precision": "bf16", "seed": 0}})
        meta = fam.load_transformer(fam.resolve_sources(ModelConfig(path=str(folder), family="wan2.2",
                                                                    expert=expert), root),
                                    dtype=torch.bfloat16, device="meta")
        make_mode(cfg).prepare(meta, fam.spec)
        plan = Plan(streamed_blocks=tuple(n for n, _ in fam.spec.blocks(meta)), checkpointing="blocks",
                    ring_slots=2)
        planned = cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"vram_budget": "1GiB"})})
        est = planner_for_config(planned, fam.spec, meta, assumed_machine())[0].estimate(plan)
        sim = simulate_training(meta, fam.spec, cfg, plan, (64, 64), steps=3)
        out[expert] = {"after_setup": sim.after_setup, "peaks": sim.peaks, "predicted": est.peak_vram,
                       "active": [r.get("active_part") for r in sim.reports],
                       "switches": [r.get("part_switches") for r in sim.reports]}
        if expert == "both":
            low = [p for n, p in meta.low.named_parameters() if p.requires_grad and "lora_" in n]
            out["low_adapter_bytes"] = sum(p.numel() * p.element_size() for p in low)
    return out


register("wan_two_experts_simulated", {e: Call("test_wan_two_experts", "_simulated_two_experts", {"experts": e})
                                       for e in ("each", "shared")})


@pytest.fixture(scope="module")
def wan_two_experts_simulated(request):
    _library_or_skip()
    return results(request, "wan_two_experts_simulated")


@pytest.mark.xdist_group(GROUP)
@pytest.mark.parametrize("experts", ["each", "shared"])
def test_the_device_holds_one_expert_at_a_time(wan_two_experts_simulated, experts):
    """On the simulated GPU (host RAM another device), a two-expert run's first step switches from the
    high-noise expert the set-up placed to the expert its draw picks (simulated draws read as 0: the
    low-noise one), and the device then holds exactly what the high-noise expert alone holds under the
    same plan (resident set, one ring of slots), plus, for [lora] experts = "each", the other
    expert's adapter (and at the steps' peak its optimizer state): the other expert's weights never
    reach it. The planner predicts the same difference."""
    r = wan_two_experts_simulated[experts]
    both, high = r["both"], r["high"]
    assert both["active"] == ["low_noise"] * 3 and both["switches"] == [1, 1, 1]
    other = r["low_adapter_bytes"] if experts == "each" else 0
    assert both["after_setup"] == high["after_setup"] + other
    for b, h in zip(both["peaks"], high["peaks"], strict=True):
        assert b == h + 3 * other               # its adapter and AdamW's two moments of it
    assert both["predicted"] - high["predicted"] == 3 * other


def test_leantune_plan_prices_both_experts_as_the_trainer_does(world, tmp_path, capsys):
    """`leantune plan RUN` of a [model] expert = "both" run prices the other expert on the host as
    the trainer's planner does (its stored bytes in every phase's peak), `--expert one` plans one
    expert alone, and `--model wan2.2-a14b --expert both` is offered too; one transformer refuses it."""
    import json

    from leantune.cli import main
    from leantune.models.family import get_family, loader_options

    cfg = _config(world, tmp_path, experts="shared")

    def host(*flags):
        assert main(["plan", str(tmp_path / "run.toml"), "--vram", "1GiB", "--json", *flags]) == 0
        (entry,) = json.loads(capsys.readouterr().out)["plans"]
        return entry["plan"]["notes"]["host_breakdown"]

    family = get_family("wan2.2")
    meta = family.load_transformer(family.resolve_sources(cfg.model, tmp_path), dtype=torch.float32, device="meta",
                                   **loader_options(cfg.memory))
    low_bytes = sum(t.numel() * t.element_size() for t in (*meta.low.parameters(), *meta.low.buffers()))
    both, one = host(), host("--expert", "one")
    assert both["other experts on the host (as stored)"] == low_bytes > 0
    assert "other experts on the host (as stored)" not in one or one["other experts on the host (as stored)"] == 0
    assert both["peak"] >= one["peak"] + low_bytes
    assert main(["plan", "--model", "flux-dev", "--vram", "8GiB", "--expert", "both"]) == 2
    assert "--expert both: flux-dev has one transformer" in capsys.readouterr().err
