"""Round three of "every fault a sentence" (issue 41), the cases that end before a model loads: an
[output] name that leaves the output folder, non-finite or absurd floats, image sides without an
upper bound, `--lora FILE:1:2`, kept planner files of the wrong shape, and a folder named
`leantune` in the working folder. Each was accepted or ended in a traceback before."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from leantune.cli import main
from leantune.config import MAX_RESOLUTION, ConfigError, RunConfig, load_config

MINIMAL = """
[model]
path = "model"
[[data.datasets]]
path = "images"
"""


@pytest.fixture
def config(tmp_path) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(MINIMAL + '[output]\ndir = "out"\n')
    return p


def _refused(config: Path, override: str, where: str) -> str:
    """The one error line of `override`, which must name the file and `where` (section and key)."""
    with pytest.raises(ConfigError) as e:
        load_config(config, [override])
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and str(config) in lines[1] and where in lines[1], str(e.value)
    return lines[1]


# -- [output] name and other file-name keys ------------------------------------------------------

@pytest.mark.parametrize("name", ["../victim", "/tmp/victim", "", "  ", ".", "..", "a/b", "a\\b", "x\0y", "C:x"])
def test_output_name_is_one_plain_file_name(config, name):
    """Before: "../victim" wrote the LoRA beside the output folder, an absolute name at that path,
    and "" a file named `_comfyui.safetensors`."""
    line = _refused(config, f"output.name={json.dumps(name)}", "[output]: key 'name'")
    assert "not a plain file name" in line or "is empty" in line
    assert load_config(config, ['output.name="my-lora.v2"']).output.name == "my-lora.v2"


def test_a_bad_name_on_the_command_line_writes_nothing(config, tmp_path, capsys):
    victim = tmp_path / "victim_comfyui.safetensors"
    victim.write_bytes(b"the user's own file")
    assert main(["train", str(config), "--set", "output.name=../victim"]) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "[output]: key 'name'" in err and "Traceback" not in err
    assert victim.read_bytes() == b"the user's own file" and not (tmp_path / "out").exists()


def test_output_name_leaves_room_for_the_step_suffix(config):
    """A 250-byte name trained to the end and failed at the last save (file names have 255 bytes)."""
    _refused(config, f"output.name={'n' * 201}", "[output]: key 'name'")
    assert load_config(config, [f"output.name={'n' * 200}"]).output.name == "n" * 200


@pytest.mark.parametrize("suffix", ["txt", ".", "", "./x", ".a/b", ".a\\b"])
def test_caption_extension_is_a_file_suffix(config, suffix):
    """Before: "txt" passed, and caching died in Path.with_suffix's bare ValueError."""
    _refused(config, f"data.datasets.0.caption_extension={json.dumps(suffix)}",
             "[[data.datasets]] #1: key 'caption_extension'")
    assert load_config(config, ['data.datasets.0.caption_extension=".caption"']).data.datasets[0] \
        .caption_extension == ".caption"


# -- floats: finite everywhere, and bounded where a large value breaks the step --------------------

def _float_keys(model: type, prefix: str) -> list[tuple[str, str]]:
    """(dotted override key, TOML value) for every float of `model`'s sections, tuples included."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        args = typing.get_args(ann)
        inner = [a for a in (ann, *args) if isinstance(a, type) and hasattr(a, "model_fields")]
        if inner:
            nested = prefix + name + (".0." if typing.get_origin(ann) is list else ".")
            out += _float_keys(inner[0], nested)
        elif ann is float or float in args:
            many = typing.get_origin(ann) in (tuple, list)      # [0.5, inf]: betas, [validation] sigmas
            out.append((prefix + name, "[0.5, inf]" if many else "inf"))
    return out


def test_every_float_key_refuses_inf_and_nan(config):
    """One rule (config.STRICT) for every float key, in one wording: before, [train] guidance,
    shift, sigmoid_scale and max_grad_norm and [sample] guidance took inf (step 1: "loss is nan")."""
    keys = _float_keys(RunConfig, "")
    assert {"train.guidance", "train.shift", "train.sigmoid_scale", "sample.guidance", "train.max_grad_norm",
            "train.betas", "lora.alpha", "data.datasets.0.caption_dropout"} <= {k for k, _ in keys}
    for key, value in keys:
        section, _, name = key.rpartition(".")
        where = ("[[data.datasets]] #1" if section == "data.datasets.0" else f"[{section}]") + f": key '{name}'"
        override = lambda v: f"{key}={v}"           # noqa: E731
        if section.endswith(".0") and section != "data.datasets.0":
            # a list of tables the minimal config leaves empty ([model] base_adapters): one entry with the value
            table = section[:-2]
            where = f"[[{table}]] #1: key '{name}'"
            override = lambda v: f'{table}=[{{path = "a.safetensors", {name} = {v}}}]'   # noqa: E731
        assert "finite number" in _refused(config, override(value), where)
        assert "finite number" in _refused(config, override(value.replace('inf', 'nan')), where)


@pytest.mark.parametrize("key,value,bound", [
    ("train.guidance", "1000", "less than or equal to 100"), ("train.shift", "1e3", "less than or equal to 100"),
    ("train.shift", "0", "greater than 0"), ("train.sigmoid_scale", "1e308", "less than or equal to 100"),
    ("sample.guidance", "101", "less than or equal to 100"),
])
def test_guidance_shift_and_sigmoid_scale_have_bounds(config, key, value, bound):
    section, name = key.split(".")
    assert bound in _refused(config, f"{key}={value}", f"[{section}]: key '{name}'")
    assert getattr(getattr(load_config(config, [f"{key}=100"]), section), name) == 100


def test_the_noise_levels_stay_finite_at_the_bounds():
    """What the bounds protect: the timestep draws at sigmoid_scale = shift = 100 are finite noise
    levels in (0, 1) for every sampling method; at 1e308 and inf they were not."""
    import torch

    from leantune.train.flow_matching import sample_sigmas

    for method in ("sigmoid", "shift", "flux_shift", "uniform"):
        s = sample_sigmas(4096, method, torch.Generator().manual_seed(0), sigmoid_scale=100.0, shift=100.0)
        assert torch.isfinite(s).all() and (s > 0).all() and (s < 1).all(), method
    s = sample_sigmas(64, "shift", torch.Generator().manual_seed(0), shift=float("inf"))
    assert torch.isnan(s).any()           # the value the config used to accept


def test_train_with_infinite_guidance_stops_before_anything_is_written(config, tmp_path, capsys):
    assert main(["train", str(config), "--set", "train.guidance=inf"]) == 2
    err = capsys.readouterr().err
    assert "[train]: key 'guidance': Input should be a finite number" in err and str(config) in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


# -- image sides ---------------------------------------------------------------------------------

def _sample(tmp_path, *flags: str) -> list[str]:
    return ["sample", "--model", str(tmp_path / "no-model"), "--family", "flux", "--prompt", "a red circle",
            "--out", str(tmp_path / "samples"), *flags]


def test_sample_sizes_have_an_upper_bound_named_by_key(tmp_path, capsys):
    """Before: `leantune sample --width 100000 --height 100000` ended in an OverflowError in the
    schedule; now it is refused with the request, before any model is read."""
    assert main(_sample(tmp_path, "--width", "100000", "--height", "100000")) == 2
    err = capsys.readouterr().err
    assert "command line: top level: key 'width'" in err and "key 'height'" in err
    assert f"image sides are at most {MAX_RESOLUTION} px" in err and "Traceback" not in err
    assert not (tmp_path / "samples").exists()
    assert main(_sample(tmp_path, "--guidance", "inf")) == 2
    assert "key 'guidance': Input should be a finite number" in capsys.readouterr().err


def test_sample_section_sizes_have_the_same_bound(config):
    for key in ("width", "height"):
        assert "at most 4096 px" in _refused(config, f"sample.{key}=100000", f"[sample]: key '{key}'")
        _refused(config, f"sample.{key}=4112", f"[sample]: key '{key}'")
        assert getattr(load_config(config, [f"sample.{key}=4096"]).sample, key) == 4096


def test_the_pages_forms_go_through_the_same_bound(tmp_path, capsys):
    """The run form's sample size is checked by load_config (RunForm.write), the sample form's by
    `leantune sample`'s request; neither has its own upper bound to drift from the config's."""
    from leantune.ui.form import RunForm
    from leantune.ui.sample_job import command

    form = RunForm(model_path=str(tmp_path / "m"), dataset=str(tmp_path), sample_prompts=["x"], sample_size=100000)
    with pytest.raises(ConfigError, match=r"\[sample\]: key 'height'.*at most 4096 px"):
        form.write(tmp_path / "run.toml")
    cmd = command({"model_path": str(tmp_path / "m"), "family": "flux", "prompts": "x", "width": "100000"},
                  tmp_path / "samples")
    assert cmd[2:4] == ["leantune", "sample"]
    assert main(cmd[3:]) == 2
    assert "key 'width'" in capsys.readouterr().err


def test_plan_resolution_has_the_same_bound(capsys):
    """Before: `leantune plan --resolution 100000` priced a run that `leantune train` refuses."""
    assert main(["plan", "--model", "flux-dev", "--resolution", "4112", "--vram", "8GiB"]) == 2
    assert "--resolution 4112: at most 4096, as [data] resolutions" in capsys.readouterr().err


def test_the_schedule_holds_at_the_largest_side():
    """Why the bound is where it is: every family's schedule is finite at 4096 px per side (the most
    image tokens any family makes of it), where 100000 px overflowed math.exp."""
    import torch

    from leantune.config import FAMILY_NAMES
    from leantune.models.family import get_family
    from leantune.models.schedule import FlowSchedule

    def tokens(side: int) -> int:
        return max(f.image_tokens(side // f.vae_scale_factor, side // f.vae_scale_factor)
                   for f in map(get_family, FAMILY_NAMES))

    schedules = [FlowSchedule.for_variant("dev"), FlowSchedule.for_variant("schnell"), FlowSchedule.sd3(),
                 FlowSchedule.qwen_image(), FlowSchedule(empirical_mu=True)]
    for schedule in schedules:
        sigmas = schedule.sigmas(28, tokens(MAX_RESOLUTION))
        assert torch.isfinite(sigmas).all() and sigmas[0] <= 1 and sigmas[-1] == 0, schedule
    with pytest.raises(OverflowError):
        FlowSchedule.for_variant("dev").sigmas(28, tokens(100000))


# -- --lora --------------------------------------------------------------------------------------------

def test_a_lora_spec_with_two_strengths_says_so(tmp_path, capsys):
    """Before: `--lora FILE:1:2` said "strength '1' is not a number"."""
    from leantune.infer.request import parse_lora_arg

    lora = tmp_path / "a.safetensors"
    lora.write_bytes(b"")
    assert main(_sample(tmp_path, "--lora", f"{lora}:1:2")) == 2
    err = capsys.readouterr().err
    assert f"--lora '{lora}:1:2': too many ':' parts; give FILE or FILE:STRENGTH (e.g. {lora}:0.8)" in err
    assert "is not a number" not in err
    assert parse_lora_arg(f"{lora}:0.8") == {"path": str(lora), "strength": 0.8}
    odd = tmp_path / "b.safetensors:1"              # a file whose own name ends in ':1' stays usable
    odd.write_bytes(b"")
    assert parse_lora_arg(f"{odd}:0.5") == {"path": str(odd), "strength": 0.5}


# -- kept planner files ----------------------------------------------------------------------------

@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))
    return tmp_path / "leantune-cache"


def _plans_freshly(monkeypatch) -> list:
    """`leantune plan`'s planning replaced by a stub that prints a fresh answer: what is tested is
    the kept answer's reading and replay, and the stub says when the question was planned again."""
    from leantune.commands import plan
    from leantune.planner.machine import assumed_machine

    calls = []

    def fresh(args, with_machine=False):
        calls.append(args)
        print(json.dumps({"plans": [{"plan": {"notes": {}}}]}) if args.json else "plan: fresh")
        return (0, assumed_machine()) if with_machine else 0

    monkeypatch.setattr(plan, "_run", fresh)
    monkeypatch.setattr("leantune.planner.machine.gpu_device_visible", lambda: False)
    return calls


@pytest.mark.parametrize("shape,flags", [
    ({"stdout": 5}, []), ({"rc": "zero"}, []), (["stdout", "stderr", "rc", "machine"], []),
    ({"machine": "x"}, []), ({"stdout": "plan: not the JSON --json printed"}, ["--json"]),
])
def test_a_kept_answer_of_the_wrong_shape_is_planned_again(cache, monkeypatch, capsys, caplog, shape, flags):
    """Before: five tracebacks (AttributeError, ValueError, TypeError twice, JSONDecodeError)."""
    calls = _plans_freshly(monkeypatch)
    args = ["plan", "--model", "flux-dev", "--vram", "8GiB", *flags]
    assert main(args) == 0
    fresh = capsys.readouterr().out
    [kept] = (cache / "plan-answers").glob("*.json")
    good = json.loads(kept.read_text())
    kept.write_text(json.dumps({**good, **shape} if isinstance(shape, dict) else shape))
    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert main(args) == 0
    assert capsys.readouterr().out == fresh and len(calls) == 2         # planned again, same answer
    warnings = [r.getMessage() for r in caplog.records if str(kept) in r.getMessage()]
    assert len(warnings) == 1 and "ignoring the kept answer" in warnings[0]
    assert json.loads(kept.read_text())["stdout"] == good["stdout"]      # replaced by the fresh answer
    caplog.clear()
    assert main(args) == 0 and len(calls) == 2 and not caplog.records   # and replayed from now on


def _stock_question():
    import argparse

    from leantune.commands.plan import _from_flags, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    _, source, _, workload = _from_flags(parser.parse_args(["--model", "flux-dev", "--vram", "8GiB"]))
    return source, workload


def _a_measurement(source, workload):
    """A real measurement of the question: its shipped profile (of this code or, while the profiles
    wait to be made again, of an earlier one: the numbers are what matters here)."""
    import gzip

    from leantune.planner import spec_cache

    shape = spec_cache.measurement_key(source, workload)
    for shipped in sorted(spec_cache.SHIPPED_DIR.glob("*.json.gz")):
        entry = json.loads(gzip.decompress(shipped.read_bytes()))
        if {k: entry["key"][k] for k in ("source", "workload")} == {k: shape[k] for k in ("source", "workload")}:
            return spec_cache.MeasuredModel.from_dict(entry["measured"])
    raise AssertionError(f"no shipped profile of {source} at this workload shape")


def _spoil(data: dict, how: str) -> str:
    profile = data["profiles"][0]["profile"]
    if how == "nan":
        profile["pre"] = float("nan")
    elif how == "huge":                       # a number beyond a float: Python reads it as inf
        return re.sub(r'"tokens": \d+', '"tokens": 1e999', json.dumps(data), count=1)
    elif how == "string":
        data["weights"]["blocks"][0]["native_bytes"] = "many"
    elif how == "per_rank":
        if profile["per_rank"] is None:
            profile["per_rank"] = {"rank": 16}
        profile["per_rank"].pop("kinds")
    return json.dumps(data)


@pytest.mark.parametrize("how", ["nan", "huge", "string", "per_rank"])
def test_a_kept_measurement_that_does_not_validate_is_measured_again(cache, tmp_path, monkeypatch, caplog, how):
    """Before: a NaN in a kept measurement ended `leantune plan` in "cannot convert float NaN to
    integer" inside the memory model; a string for a number, or a per-rank share without its
    kinds, in other tracebacks."""
    from leantune.commands.plan import _measured
    from leantune.planner import spec_cache

    source, workload = _stock_question()
    measured = _a_measurement(source, workload)
    monkeypatch.setattr(spec_cache, "SHIPPED_DIR", tmp_path / "no-shipped-profiles")
    path = spec_cache.cache_path(source, workload)
    path.parent.mkdir(parents=True)
    path.write_text(_spoil(measured.to_dict(), how))
    measures = []
    monkeypatch.setattr(spec_cache, "measure_model", lambda spec, model, w: measures.append(model) or measured)
    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert _measured(None, source, lambda: "the model", workload) is measured
    assert measures == ["the model"]                               # measured again ...
    warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warnings) == 1 and "ignoring unreadable cached measurement" in warnings[0]
    caplog.clear()
    assert spec_cache.load_measured(source, workload).to_dict() == measured.to_dict()   # ... and kept
    assert not caplog.records


def test_a_bad_kept_measurement_gives_way_to_the_shipped_profile_and_is_replaced(cache, tmp_path, monkeypatch,
                                                                               caplog):
    from leantune.planner import spec_cache

    source, workload = _stock_question()
    measured = _a_measurement(source, workload)
    monkeypatch.setattr(spec_cache, "SHIPPED_DIR", tmp_path / "profiles")
    spec_cache.ship_measured(source, workload, measured, folder=spec_cache.SHIPPED_DIR)
    path = spec_cache.cache_path(source, workload)
    path.parent.mkdir(parents=True)
    path.write_text(_spoil(measured.to_dict(), "nan"))
    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert spec_cache.load_measured(source, workload).to_dict() == measured.to_dict()
        assert spec_cache.load_measured(source, workload) is not None
    assert sum(str(path) in r.getMessage() for r in caplog.records) == 1      # said once: the file was replaced


@pytest.mark.parametrize("entry", [{"flops_scale": float("nan")}, {"activation_scale": {"512x512": float("nan")}},
                                   {"h2d_pinned": "fast"}, ["not", "a", "table"]])
def test_a_kept_calibration_that_does_not_validate_is_ignored(tmp_path, caplog, entry):
    """A NaN scale reached the memory model's int() as the measurement's NaN did."""
    from leantune.planner.corrections import Calibration, CalibrationStore

    store = CalibrationStore(tmp_path / "calibration.json")
    store.put("good", Calibration({"512x512": 1.1}, 0.9, 2e10))
    data = json.loads(store.path.read_text())
    store.path.write_text(json.dumps({**data, "bad": entry}))
    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert store.get("bad") is None
    assert "ignoring calibration bad in" in caplog.text and str(store.path) in caplog.text
    assert store.get("good") == Calibration({"512x512": 1.1}, 0.9, 2e10)


# -- a folder named leantune ---------------------------------------------------------------------

def test_a_folder_named_leantune_in_the_working_folder_is_named(tmp_path):
    """Before: `python -m leantune plan ...` from such a folder ran until the answer cache's
    `from .. import __version__` raised ImportError (an editable install is found after the path,
    so the folder became a namespace package `leantune`)."""
    import os

    (tmp_path / "leantune").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-m", "leantune", "plan", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    package = Path(__file__).resolve().parents[1] / "leantune"
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"the folder {tmp_path / 'leantune'} shadows the leantune package ({package})" in run.stderr
    assert "run it from another folder" in run.stderr and "Traceback" not in run.stderr
