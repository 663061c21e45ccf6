"""The planner prices what the recipe options cost beyond the step (issue 37): [ema]'s host shadow,
DOP's base prediction on the prior steps and [validation]'s passes (planner/from_config.recipe_terms,
timing.simulate_step's extra forwards, host_model's EMA line)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from leantune.memory.plan import Plan
from leantune.planner.workload import Workload

WORKLOAD = Workload(rank=4, targets="all", buckets=((64, 64),), text_length=8, dtype=torch.float32,
                    autocast=False, allow_fp8=False)


@pytest.fixture(scope="module")
def tiny_lora_model(tmp_path_factory):
    """The tiny Flux (2 double, 2 single blocks) with rank-4 LoRA on every block Linear."""
    from leantune import tiny
    from leantune.config import LoraConfig
    from leantune.models.flux import FLUX_SPEC
    from leantune.train.lora import add_lora

    mp = pytest.MonkeyPatch()
    mp.setenv("LEANTUNE_CACHE", str(tmp_path_factory.mktemp("leantune-cache")))
    torch.manual_seed(0)
    model = tiny.flux_transformer(num_layers=2, num_single_layers=2)
    model.requires_grad_(False)
    add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="all"))
    yield model
    mp.undo()


def _planner(model, **terms):
    from leantune.models.flux import FLUX_SPEC
    from leantune.planner.search import Planner

    return Planner(FLUX_SPEC, model, replace(WORKLOAD, **terms))


def test_the_ema_shadow_is_priced_as_the_bytes_the_average_holds(tiny_lora_model):
    """The host line "EMA of the adapter (fp32)" equals the bytes train/ema.AdapterEma allocates for
    the same model, and the steps' holdings grow by exactly that."""
    from leantune.train.ema import AdapterEma

    shadow = sum(t.numel() * t.element_size() for t in AdapterEma(tiny_lora_model, 0.99, 1).shadow.values())
    plan = Plan()
    with_ema = _planner(tiny_lora_model, ema=True).estimate(plan).host
    without = _planner(tiny_lora_model).estimate(plan).host
    assert with_ema["EMA of the adapter (fp32)"] == shadow > 0
    assert "EMA of the adapter (fp32)" not in without
    assert with_ema["peak"] - without["peak"] in (0, shadow)       # the steps' phase grows; the peak if it is theirs


@pytest.mark.parametrize("streamed", [0, 3])
def test_dop_and_validation_add_the_plans_own_forward_per_step(tiny_lora_model, streamed):
    """dop_share + validation_forwards_per_step forwards, each the plan's forward without a graph,
    are added to the step: a streamed plan fetches again each streamed unit not still in its ring slot
    (the engine's ring: 3 units in 2 slots, the middle one stays from the forward before)."""
    from leantune.planner.timing import recipe_forward

    plain = _planner(tiny_lora_model)
    names = tuple(b.name for b in plain.weights.blocks)[:streamed]
    plan = Plan(streamed_blocks=names, ring_slots=2)
    recipe = _planner(tiny_lora_model, dop_share=0.25, validation_forwards_per_step=0.5)
    units = plain.units(plan)
    base, extra = plain.timing(plan, (64, 64), units), recipe.timing(plan, (64, 64), units)
    prof, ref = plain.profiles[plan.storage][(64, 64)], plain.profiles[(False, False)][(64, 64)]
    forward = recipe_forward(plain.machine, plain.calibration, plan, prof, ref, plain.kinds, plain.ordered(plan), units)
    assert 0 < forward.compute_s < base.compute_s          # a forward is less than forward + backward
    assert extra.step_s == pytest.approx(base.step_s + 0.75 * forward.step_s, rel=1e-12)
    assert extra.compute_s == pytest.approx(base.compute_s + 0.75 * forward.compute_s, rel=1e-12)
    if streamed:
        assert units and forward.h2d_bytes == units[0] + units[2]
    else:
        assert forward.h2d_bytes == 0 and not units
    assert extra.h2d_bytes == int(base.h2d_bytes + 0.75 * forward.h2d_bytes)


def _images(folder, n, seed):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i:02d}.png")
        (folder / f"{i:02d}.txt").write_text(f"image {i}")


def _config(tmp_path, extra: str):
    from leantune.config import load_config

    path = tmp_path / "run.toml"
    path.write_text(f"""[model]
family = "flux"
path = "model"
[data]
batch_size = 2
resolutions = [64]
prior_ratio = 0.2
prior_loss = "dop"
[[data.datasets]]
path = "images"
[[data.datasets]]
path = "prior"
role = "prior"
default_caption = "a shape"
{extra}""")
    return load_config(path)


def test_recipe_terms_count_the_held_out_images_the_trainer_holds_out(tmp_path):
    """[validation] fraction's count equals data/held_out.split_held_out's on the same folder, and
    the forwards per step are its batches x noise levels / every; DOP's share is prior_ratio."""
    from leantune.data.dataset import scan_dataset
    from leantune.data.held_out import split_held_out
    from leantune.models.family import get_family
    from leantune.planner.from_config import recipe_terms

    _images(tmp_path / "images", 9, 0)
    _images(tmp_path / "prior", 3, 1)
    cfg = _config(tmp_path, "[ema]\nenabled = true\n[validation]\nfraction = 0.4\nevery = 10\n"
                            "sigmas = [0.2, 0.5, 0.8]\n")
    items, _ = scan_dataset(cfg.data.datasets[0], 0, tmp_path)
    _, held_out = split_held_out(items, cfg.validation, cfg.data, tmp_path, get_family("flux"))
    assert len(held_out) == 3
    assert recipe_terms(cfg) == {"ema": True, "dop_share": 0.2,
                                 "validation_forwards_per_step": math.ceil(3 / 2) * 3 / 10}


def test_a_validation_folder_is_counted_and_no_recipe_prices_nothing(tmp_path):
    from leantune.planner.from_config import recipe_terms

    _images(tmp_path / "images", 4, 0)
    _images(tmp_path / "prior", 2, 1)
    _images(tmp_path / "held", 5, 2)
    cfg = _config(tmp_path, '[validation]\npath = "held"\nevery = 5\n')
    assert recipe_terms(cfg) == {"dop_share": 0.2, "validation_forwards_per_step": 3 * 5 / 5}
    plain = _config(tmp_path, "").model_copy(update={"data": _config(tmp_path, "").data.model_copy(
        update={"prior_loss": "plain"})})
    assert recipe_terms(plain) == {}


def test_the_plan_report_says_what_the_step_time_includes(tiny_lora_model):
    from leantune.planner.report import format_plan
    from leantune.planner.workload import Budget

    plan = _planner(tiny_lora_model, dop_share=0.25, validation_forwards_per_step=0.5).plan(Budget(vram=8 << 30))
    text = format_plan(plan)
    assert 'one more forward on 25% of the steps ([data] prior_loss = "dop"' in text
    assert "0.5 forwards per step on average ([validation]'s passes)" in text
    assert "included:" not in format_plan(_planner(tiny_lora_model).plan(Budget(vram=8 << 30)))


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_dora_base_adapter_keeps_the_plan_off_fp8(tmp_path, kind):
    """The engine refuses a DoRA over fp8 weights (it reads the base weight): with a DoRA file in
    [model] base_adapters the planner must not store the base in fp8, as for a trained DoRA; a
    plain LoRA file leaves fp8 to the planner."""
    from leantune import tiny
    from leantune.config import LoraConfig, load_config
    from leantune.models.flux import FLUX_SPEC
    from leantune.planner.from_config import workload_from_config
    from leantune.train.lora import add_lora, lora_weights_from_model
    from leantune.train.lora_formats import save_lora

    model = tiny.flux_transformer(num_layers=1, num_single_layers=1)
    add_lora(model, FLUX_SPEC, LoraConfig(rank=4, targets="all", type=kind))
    adapter = save_lora(lora_weights_from_model(model), tmp_path / f"turbo_{kind}.safetensors", "comfyui",
                        keys=FLUX_SPEC.lora_keys)
    path = tmp_path / "run.toml"
    path.write_text(f"""[model]
family = "flux"
path = "model"
base_adapters = [{{path = "{adapter}", strength = 1.0}}]
[data]
[[data.datasets]]
path = "images"
""")
    workload = workload_from_config(load_config(path))
    assert (workload.allow_fp8, workload.fp8_modulation) == ((False, False) if kind == "dora" else (True, None))
