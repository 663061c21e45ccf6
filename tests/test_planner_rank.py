"""LoRA rank priced without tracing again: the probe keeps the adapters' share per rank unit
(activation_probe._Tracker, ActivationProfile.at_rank), the measurement is kept without the rank
(spec_cache._workload_shape), and adapter parameters, gradients and optimizer state were already
counted from the adapted Linears' shapes (weight_bytes.ModelWeights.adapter_params).

The claim is exactness: the profile priced at rank r from one trace (adapters built at a trace rank,
a prime no other dimension has) equals the probe run with its adapters built at rank r, field by
field: bytes exactly, FLOPs to 1e-12 relative. Then the plans and every predicted number are the
same; and a plan at rank 100000 never builds a rank-100000 adapter.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

from leantune import tiny
from leantune.models.flux import FLUX_SPEC
from leantune.planner.activation_probe import probe_activations, trace_rank
from leantune.planner.meta import build_meta_flux
from leantune.planner.search import Planner
from leantune.planner.spec_cache import measure_model
from leantune.planner.workload import Budget, Workload

GiB = 2**30
FLOPS_TOLERANCE = 1e-12     # relative; bytes must be equal


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


@pytest.fixture(scope="module")
def tiny_model():
    model = tiny.flux_transformer(num_layers=2, num_single_layers=2)
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def flux_dev():
    return build_meta_flux("dev")


def _differences(priced, direct) -> list[str]:
    a, b = asdict(priced), asdict(direct)
    a.pop("per_rank"), b.pop("per_rank")
    out = []

    def same(x, y) -> bool:
        if isinstance(x, float) or isinstance(y, float):
            return abs(x - y) <= FLOPS_TOLERANCE * max(abs(x), abs(y), 1.0)
        return x == y

    for kind in b["kinds"]:
        for field, value in b["kinds"][kind].items():
            if not same(a["kinds"][kind][field], value):
                out.append(f"{kind}.{field}: priced {a['kinds'][kind][field]}, probed {value}")
    for field, value in b.items():
        if field != "kinds" and not same(a[field], value):
            out.append(f"{field}: priced {a[field]}, probed {value}")
    return out


TINY_CASES = [("attention", False, 0.0, 256), ("attention_mlp", True, 0.0, 256), ("all", True, 0.1, 128)]


@pytest.mark.parametrize("targets,autocast,dropout,res", TINY_CASES)
def test_priced_rank_equals_the_probe_at_that_rank_tiny(tiny_model, targets, autocast, dropout, res):
    workload = Workload(rank=16, targets=targets, buckets=((res, res),), text_length=8, dtype=torch.float32,
                        autocast=autocast, lora_dropout=dropout, allow_fp8=False)
    ranked = probe_activations(FLUX_SPEC, tiny_model, workload, (res, res))
    assert ranked.per_rank is not None and ranked.per_rank["rank"] == 16
    for rank in (1, 3, 16, 64, 1000, 100000):
        direct = probe_activations(FLUX_SPEC, tiny_model, replace(workload, rank=rank), (res, res), rank=rank)
        assert _differences(ranked.at_rank(rank), direct) == [], rank
    # The adapters' share grows with the rank: the comparison is not of two rank-free numbers.
    assert ranked.at_rank(64).kinds["double"].saved > ranked.at_rank(1).kinds["double"].saved


FLUX_CASES = [("attention_mlp", True, 0.0, (4, 64, 1000)), ("all", True, 0.1, (300,)), ("attention", False, 0.0, (8,))]


@pytest.mark.parametrize("targets,autocast,dropout,ranks", FLUX_CASES)
def test_priced_rank_equals_the_probe_at_that_rank_flux_dev(flux_dev, targets, autocast, dropout, ranks):
    """Flux-dev's full-size architecture on meta at 512 px, with fp8 storage (the engine's
    dequantisation in the trace) for the first case."""
    workload = Workload(rank=16, targets=targets, buckets=((512, 512),), text_length=512, autocast=autocast,
                        lora_dropout=dropout)
    fp8 = targets == "attention_mlp"
    ranked = probe_activations(FLUX_SPEC, flux_dev, workload, (512, 512), fp8=fp8)
    assert trace_rank(FLUX_SPEC, flux_dev, workload, (512, 512)) not in (16, *ranks)
    for rank in ranks:
        direct = probe_activations(FLUX_SPEC, flux_dev, replace(workload, rank=rank), (512, 512), fp8=fp8, rank=rank)
        assert _differences(ranked.at_rank(rank), direct) == [], rank


def test_plans_at_another_rank_equal_those_of_a_measurement_at_that_rank(flux_dev):
    """A Planner from the measurement of rank 16 asked for rank 64 gives the plan, peaks,
    breakdowns and step time of a Planner whose probe built its adapters at rank 64."""
    import leantune.planner.spec_cache as spec_cache

    base = Workload(rank=16, buckets=((512, 512),), text_length=512, allow_fp8=False)   # one storage: one probe
    measured16 = measure_model(FLUX_SPEC, flux_dev, base)
    at64 = replace(base, rank=64)
    direct = {(b, s): probe_activations(FLUX_SPEC, flux_dev, at64, b, fp8=s[0], modulation=s[1], rank=64)
              for (b, s) in measured16.profiles}
    measured64 = spec_cache.MeasuredModel(measured16.weights, measured16.key, direct)
    for vram in (8, 12, 24):
        budget = Budget(vram=vram * GiB, ram=2**62)
        priced = Planner(FLUX_SPEC, measured16, at64).plan(budget)
        probed = Planner(FLUX_SPEC, measured64, at64).plan(budget)
        assert replace(priced, notes=None) == replace(probed, notes=None)
        for key in ("predicted_peak_vram", "predicted_peak_host", "vram_breakdown", "host_breakdown"):
            assert priced.notes[key] == probed.notes[key], key
        assert priced.notes["predicted_step_s"] == pytest.approx(probed.notes["predicted_step_s"], rel=1e-12)
    # The adapters are the run's: rank 64 costs more than rank 16 at the same budget.
    p16 = Planner(FLUX_SPEC, measured16, base).plan(Budget(vram=24 * GiB, ram=2**62))
    p64 = Planner(FLUX_SPEC, measured16, at64).plan(Budget(vram=24 * GiB, ram=2**62))
    assert p64.notes["vram_breakdown"]["adapters"] == 4 * p16.notes["vram_breakdown"]["adapters"]


@pytest.fixture
def no_huge_adapter(monkeypatch):
    """peft's LoRA layer refuses to be built at a rank above 1000 (the trace rank is a few hundred)."""
    from peft.tuners.lora.layer import LoraLayer

    real = LoraLayer.update_layer

    def update_layer(self, adapter_name, r, *args, **kwargs):
        if r > 1000:
            raise AssertionError(f"built a rank-{r} LoRA layer")
        return real(self, adapter_name, r, *args, **kwargs)

    monkeypatch.setattr(LoraLayer, "update_layer", update_layer)


def test_a_plan_at_rank_100000_builds_no_rank_100000_layer(no_huge_adapter, capsys):
    """`leantune plan --rank 100000`: from the shipped profile (no trace at all), and for a
    workload with no shipped profile (768 px without fp8: measured, its adapters built at the trace
    rank).
    Before, the rank was part of the measurement's key and the probe built its adapters at it."""
    from leantune.cli import main

    for flags in (["--resolution", "1024"], ["--resolution", "768", "--no-fp8"]):
        rc = main(["plan", "--model", "flux-dev", "--rank", "100000", *flags, "--vram", "24GiB"])
        out = capsys.readouterr()
        assert rc == 1                              # 100000-rank adapters fit no 24 GiB budget
        assert "adapters, gradients and optimizer states take" in out.err
        assert "LoRA r100000" in out.err


def test_the_tiny_model_at_rank_100000_is_planned_from_a_trace_at_the_trace_rank(tiny_model, no_huge_adapter):
    workload = Workload(rank=100000, buckets=((256, 256),), text_length=8, dtype=torch.float32, autocast=False,
                        allow_fp8=False)
    planner = Planner(FLUX_SPEC, tiny_model, workload)
    adapters = planner.trainable_bytes()[0]
    assert adapters == 4 * planner.weights.adapter_params(100000)
    plan = planner.plan(Budget(vram=64 * GiB, ram=2**62))
    assert plan.notes["vram_breakdown"]["adapters"] == adapters
