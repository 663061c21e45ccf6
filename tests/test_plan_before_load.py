"""Under a [memory] vram_budget the trainer plans on the meta-built model before reading a weight,
then loads with the plan's fp8 choice, so block Linears the plan keeps in fp8 are quantized as they
are read (a bf16 file never sits in host RAM in bf16). The plan chosen on the meta build is the
plan the loaded, prepared model got on the old path (plan after load), for the tiny model and for
a meta Flux.1-dev at budgets that pick fp8 and budgets that do not; the run trains as before.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_planner import one_thread  # noqa: F401  (fixture)
from test_train import make_config

from leantune import trainer as trainer_mod
from leantune.config import LoraConfig
from leantune.memory.fp8 import FP8_DTYPE, block_linears
from leantune.models.flux import loading as flux_loading
from leantune.models.family import fp8_load_options, get_family, loader_options
from leantune.models.flux.spec import FLUX_SPEC
from leantune.planner import search as planner_mod
from leantune.planner.from_config import planner_for_config, workload_from_config
from leantune.planner.machine import assumed_machine
from leantune.planner.search import Planner
from leantune.planner.workload import Budget
from leantune.train.modes import make_mode


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from leantune.demo import draw_shapes

    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=6, size=64, seed=5)
    return folder


def _priced(weights):
    """What the estimates read of measured weights: everything but native_bytes ("as the model holds
    them now", which no estimate reads; after full mode's prepare it also counts the optimizer-state
    buffers the model then carries, so it is the one field the meta build and the prepared model
    differ in)."""
    return ([replace(b, native_bytes=0) for b in weights.blocks], replace(weights.non_blocks, native_bytes=0),
            weights.adapters)


def _same_plan(a, b):
    assert a.to_dict() == b.to_dict()
    assert a.notes == b.notes


FULL_REST = """
[train]
mode = "full"
steps = 3
seed = 3

[full]
exclude = ["single_transformer_blocks.*"]

[output]
dir = "out"
"""


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_the_plan_from_the_meta_build_is_the_plan_of_the_loaded_model(tmp_path, tiny_flux_dir, images, mode):
    """The tiny Flux, LoRA and full mode: plans from the meta build equal the plans the old path
    made on the real, loaded model after mode.prepare (adapters attached, trainable weights marked)."""
    from conftest import tiny_run_toml

    from leantune.config import load_config

    if mode == "lora":
        cfg = make_config(tmp_path, tiny_flux_dir, images, extra=["memory.vram_budget=1GiB"])
    else:
        (tmp_path / "run.toml").write_text(tiny_run_toml(tiny_flux_dir, images, FULL_REST))
        cfg = load_config(tmp_path / "run.toml", ["memory.vram_budget=1GiB"])
    family = get_family(cfg.model.family)
    sources = family.resolve_sources(cfg.model, Path(cfg.base_dir))
    meta = family.load_transformer(sources, dtype=torch.float32, device="meta", **loader_options(cfg.memory))
    real = family.load_transformer(sources, dtype=torch.float32, device="cpu", **loader_options(cfg.memory))
    make_mode(cfg).prepare(real, family.spec)
    machine = assumed_machine()
    from_meta, budget = planner_for_config(cfg, family.spec, meta, machine)
    from_real, _ = planner_for_config(cfg, family.spec, real, machine)
    # The host-RAM limit read once for both: left to each plan() (no ram_budget), it is this
    # process's resident set plus the RAM available, and the first planner's caches can grow the
    # resident set by a page before the second plans: a difference of the process, not of the model.
    budget = replace(budget, ram=budget.ram_limit(machine))
    assert from_meta.key == from_real.key and _priced(from_meta.weights) == _priced(from_real.weights)
    fits = 0
    for vram in (0.26, 0.27, 0.3, 0.5, 1.0, 4.0):
        b = replace(budget, vram=int(vram * 2**30))
        try:
            want = from_real.plan(b)
        except Exception as e:                            # nothing fits: the meta plan must say so too
            with pytest.raises(type(e)):
                from_meta.plan(b)
            continue
        _same_plan(from_meta.plan(b), want)
        fits += 1
    assert fits >= 2


def test_a_meta_flux_dev_plans_the_same_with_or_without_the_run_s_adapters(tmp_path, tiny_flux_dir, images):
    """Flux.1-dev at full size (meta): the bare build against the build with the run's LoRA attached
    (what mode.prepare gave the old path's planner), at budgets from fp8 + streaming to neither."""
    from leantune.planner.meta import build_meta_flux
    from leantune.train.lora import LoraRankWarning, add_lora

    cfg = make_config(tmp_path, tiny_flux_dir, images, extra=["memory.vram_budget=8GiB", "lora.rank=16",
                                                             "data.resolutions=[512]", "model.dtype=\"bf16\""])
    workload = workload_from_config(cfg)
    bare = build_meta_flux("dev")
    prepared = build_meta_flux("dev")
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", LoraRankWarning)
        add_lora(prepared.requires_grad_(False), FLUX_SPEC, LoraConfig(rank=16, targets=cfg.lora.targets))
    machine = assumed_machine()
    a, b = Planner(FLUX_SPEC, bare, workload, machine), Planner(FLUX_SPEC, prepared, workload, machine)
    assert a.key == b.key and _priced(a.weights) == _priced(b.weights)
    seen_fp8 = set()
    for vram in (3.5, 4, 8, 12, 16, 24, 40, 80):
        budget = Budget(vram=int(vram * 2**30), ram=64 * 2**30)     # the loading peak is priced in bf16
        got, want = a.plan(budget), b.plan(budget)
        _same_plan(got, want)
        seen_fp8.add(got.fp8)
    assert seen_fp8 == {True, False}                      # budgets on both sides of fp8


def test_load_options_follow_the_plan_under_a_budget():
    from leantune.config import MemoryConfig
    from leantune.memory.plan import Plan

    budget = MemoryConfig(vram_budget="8GiB")
    assert fp8_load_options(budget) == {}                                   # no plan yet: nothing quantized
    assert fp8_load_options(budget, plan=Plan()) == {}
    assert fp8_load_options(budget, plan=Plan(fp8=True)) == {"quantize_fp8": True}
    assert fp8_load_options(budget, plan=Plan(fp8=True, fp8_modulation=True)) == {"quantize_fp8": True,
                                                                                 "quantize_modulation": True}
    # the budget's plan decides, not [memory] fp8 (which a budget leaves to the planner)
    assert fp8_load_options(MemoryConfig(vram_budget="8GiB", fp8=True), plan=Plan()) == {}


def _force_fp8(monkeypatch):
    """The tiny model is too small for fp8 to pay at any budget: every plan the planner makes stores fp8."""
    real_plan = planner_mod.Planner.plan
    monkeypatch.setattr(planner_mod.Planner, "plan", lambda self, budget: replace(real_plan(self, budget), fp8=True))


def _spy_loads(monkeypatch) -> list:
    """For each real load: the weight dtypes, as the loader returned them, of the block Linears an fp8
    plan (without fp8 modulation) stores in e4m3."""
    seen: list = []
    real = flux_loading.load_transformer

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        if kwargs.get("device") != "meta":
            seen.append([lin.weight.dtype for _, rel, lin in block_linears(FLUX_SPEC, model)
                         if not FLUX_SPEC.keeps_compute_dtype(rel, fp8_modulation=False)])
        return model

    monkeypatch.setattr(flux_loading, "load_transformer", spy)
    return seen


def test_a_budget_run_whose_plan_picks_fp8_loads_quantized_and_trains_as_before(tmp_path, tiny_flux_dir, images,
                                                                                 monkeypatch, one_thread):
    """vram_budget with a plan that stores fp8: the loader hands back every block Linear already
    e4m3 (none held in the run's dtype in between), the plan applied is the one chosen before
    loading, and the run trains as on the old path (load in the run's dtype, plan on the loaded
    model, the engine quantizes): first loss bitwise, later ones within the LoRA-init tolerance of
    tests/test_load_into_fp8.py."""
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "cache"))
    _force_fp8(monkeypatch)
    seen = _spy_loads(monkeypatch)
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    extra = ["memory.vram_budget=1GiB", "model.dtype=\"bf16\"", "train.mixed_precision=\"bf16\""]
    cfg = make_config(tmp_path / "new", tiny_flux_dir, images, extra=extra)
    new = trainer_mod.train(cfg, progress=False, stop_after=3)
    assert len(seen) == 1 and seen[0] and all(d == FP8_DTYPE for d in seen[0]), seen
    assert "fp8=on" in new.paths.log_file.read_text()

    # The old path: plan on the loaded model, load unquantized, the engine quantizes. It reads the
    # latents and text embeddings the new path cached (keyed by content, encoder and dtype: the same
    # entries it would compute), so it loads no VAE or text encoder again.
    monkeypatch.setattr(trainer_mod, "_plan_before_load", lambda *a, **k: None)
    old_cfg = make_config(tmp_path / "old", tiny_flux_dir, images,
                          extra=[*extra, f'data.cache_dir="{tmp_path / "new" / "cache"}"'])
    old = trainer_mod.train(old_cfg, progress=False, stop_after=3)
    assert all(d == torch.bfloat16 for d in seen[-1])                       # loaded unquantized
    assert new.losses[0] == old.losses[0]
    assert new.losses == pytest.approx(old.losses, rel=1e-3)


def test_an_oom_replan_after_a_quantizing_load_keeps_training(tmp_path, tiny_flux_dir, images, monkeypatch,
                                                              one_thread):
    """An out-of-memory error in a run that loaded fp8 weights: the guard re-plans with the planner
    chosen before loading (stream more, checkpoint) and the run finishes its steps, the base still e4m3."""
    from test_train import _oom_on_call

    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "cache"))
    real_plan = planner_mod.Planner.plan
    calls = {"n": 0}

    def plan(self, budget):
        calls["n"] += 1
        first = replace(real_plan(self, replace(budget, vram=2**30)), fp8=True)
        if calls["n"] == 1:
            return first
        return replace(first, checkpointing="blocks", debug_poison=True,
                       streamed_blocks=("transformer_blocks.1", "single_transformer_blocks.0"))

    monkeypatch.setattr(planner_mod.Planner, "plan", plan)
    seen = _spy_loads(monkeypatch)
    _oom_on_call(monkeypatch, 3)
    cfg = make_config(tmp_path, tiny_flux_dir, images, extra=["memory.vram_budget=1GiB", "model.dtype=\"bf16\"",
                                                              "train.mixed_precision=\"bf16\""])
    result = trainer_mod.train(cfg, progress=False, stop_after=4)
    assert len(seen) == 1 and all(d == FP8_DTYPE for d in seen[0])         # loaded once, quantized
    log_text = result.paths.log_file.read_text()
    assert "out of memory at step" in log_text and "memory plan now: stream 2 blocks" in log_text
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
