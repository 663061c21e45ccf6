"""The planner's shipped profiles (planner/profiles/, spec_cache.py) and the kept answers' origin
(answer_cache.py).

A first `leantune plan` of a stock model reads the package's measurement instead of building the
model on meta and tracing it. A shipped profile is found only under the key of the code that
measures it now, so a stale one is never used: after a change to the measuring code the first
test here fails until `python scripts/make_plan_profiles.py` is run, and meanwhile the planner
measures afresh. One cheap case is measured here and compared with its shipped profile field by
field.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from leantune.cli import main
from leantune.planner import spec_cache

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("make_plan_profiles", ROOT / "scripts" / "make_plan_profiles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


def test_every_stock_question_has_a_shipped_profile_of_the_current_code():
    script = _script()
    missing, names = [], set()
    for flags in script.questions():
        _, source, _, workload = script.question_of(flags)
        path = spec_cache.shipped_path(source, workload)
        names.add(path.name)
        if not path.exists():
            missing.append(" ".join(flags))
    assert not missing, (f"no shipped profile of the current measuring code for {missing}: the code or the "
                         f"torch/diffusers/peft versions changed; run python scripts/make_plan_profiles.py")
    orphans = {p.name for p in spec_cache.SHIPPED_DIR.glob("*.json.gz")} - names
    assert not orphans, f"shipped profiles no question uses (stale): {sorted(orphans)}"


def _canonical(measured) -> dict:
    return json.loads(json.dumps(measured.to_dict(), sort_keys=True))


@pytest.mark.slow
def test_a_fresh_measurement_equals_its_shipped_profile():
    script = _script()
    spec, source, build, workload = script.question_of(
        ["--model", "flux-schnell", "--mode", "full", "--resolution", "512", "--vram", "8GiB"])
    shipped = spec_cache.load_shipped(source, workload)
    assert shipped is not None
    spec_cache._PROBE_CACHE.clear()
    assert _canonical(spec_cache.measure_model(spec, build(), workload)) == _canonical(shipped)


def test_a_first_plan_of_a_stock_model_builds_and_traces_nothing(monkeypatch, capsys):
    """With an empty cache, `leantune plan --model flux-dev --vram 8GiB` answers from the shipped
    profile: building the meta model or tracing a probe would raise here."""
    import leantune.planner.activation_probe as probe
    import leantune.planner.meta as meta

    def refuse(*a, **k):
        raise AssertionError("measured instead of using the shipped profile")

    monkeypatch.setattr(meta, "build_meta_packaged", refuse)
    monkeypatch.setattr(probe, "probe_activations", refuse)
    assert main(["plan", "--model", "flux-dev", "--vram", "8GiB"]) == 0
    assert "plan:     stream" in capsys.readouterr().out


def test_a_stale_or_foreign_profile_is_not_used(tmp_path, monkeypatch, caplog):
    script = _script()
    _, source, _, workload = script.question_of(["--model", "flux-dev", "--vram", "8GiB"])
    shipped = spec_cache.shipped_path(source, workload)
    folder = tmp_path / "profiles"
    folder.mkdir()
    shutil.copy(shipped, folder / shipped.name)
    monkeypatch.setattr(spec_cache, "SHIPPED_DIR", folder)
    assert spec_cache.load_measured(source, workload) is not None
    # The measuring code changed: the profile's name is no longer the key's.
    real = spec_cache._code_fingerprint
    monkeypatch.setattr(spec_cache, "_code_fingerprint", lambda *a: real(*a) + "-changed")
    assert spec_cache.load_measured(source, workload) is None
    # A file under the new name whose recorded key is another question's: refused, with a warning.
    shutil.copy(shipped, spec_cache.shipped_path(source, workload))
    assert spec_cache.load_measured(source, workload) is None
    assert "is not the measurement of this question" in caplog.text


def test_a_kept_answer_says_which_checkout_and_version_computed_it(capsys, monkeypatch):
    from leantune import __version__
    from leantune.planner import answer_cache

    monkeypatch.setattr("leantune.planner.machine.gpu_device_visible", lambda: False)
    args = ["plan", "--model", "flux-dev", "--vram", "8GiB"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert main(args) == 0
    again = capsys.readouterr()
    def without_free_ram(text: str) -> list[str]:     # the machine line is read afresh
        return [line for line in text.splitlines() if not line.startswith("machine:")]

    assert without_free_ram(again.out) == without_free_ram(first.out)
    assert "kept answer" not in first.err
    line = again.err.strip().splitlines()[-1]
    assert line.startswith(f"(kept answer from leantune {__version__}, {ROOT}")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert f"at commit {head.stdout.strip()[:12]}" in line
    files = list(answer_cache._cache_dir().glob("*.json"))
    assert len(files) == 1
    origin = json.loads(files[0].read_text())["origin"]
    assert origin["version"] == __version__ and origin["checkout"] == str(ROOT)


def test_the_shipped_step_bytes_are_of_the_current_code_and_equal_a_fresh_measurement():
    """planner/profiles/step_bytes.json: found under the current code's fingerprint, covering every
    setting, and equal to what the update allocates when measured now (a few settings)."""
    from leantune.planner import step_bytes

    step_bytes._shipped = None
    table = step_bytes._shipped_table()
    assert table, ("planner/profiles/step_bytes.json is missing or of other code (step_bytes._STEP_CODE or the "
                   "torch version changed): run python scripts/make_plan_profiles.py")
    names = {step_bytes._name(k) for k in step_bytes.every_setting()}
    assert names - set(table) == set() and set(table) - names == set()
    import torch

    keys = [("adamw", torch.bfloat16, "fp32", True, False, True, False),
            ("adamw", torch.bfloat16, "bf16", True, True, True, False),
            ("adafactor", torch.float32, "fp32", False, False, True, False)]
    if step_bytes._host_kernels_built():       # the shipped host numbers are the kernels' (step_bytes.ship)
        keys.append(("adamw", torch.bfloat16, "fp32", True, False, True, True))
    for key in keys:
        assert tuple(table[step_bytes._name(key)]) == step_bytes.measure(*key), key


def test_a_first_full_plan_runs_no_update_and_imports_no_dynamo(tmp_path):
    """A first `leantune plan --mode full` in a fresh process with an empty cache reads the shipped
    step bytes (measuring them would raise here) and never imports torch._dynamo (1.1-1.4 s of a
    4 s first plan before: the storage tracker, a dispatch mode, and torch's Optimizer.__init__
    import it on first use). Where the host kernels cannot be built the host step's bytes are
    measured (the shipped ones are the kernels'), so this needs them."""
    from leantune.train import host_kernels

    if host_kernels.library() is None:
        pytest.skip(f"host kernels not built here: {host_kernels.unavailable_reason()}")
    code = (
        "import sys\n"
        "import leantune.planner.step_bytes as sb\n"
        "def refuse(*a, **k):\n"
        "    raise AssertionError('measured the step bytes instead of reading the shipped table')\n"
        "sb.measure = refuse\n"
        "from leantune.cli import main\n"
        "rc = main(['plan', '--model', 'flux-dev', '--mode', 'full', '--vram', '8GiB'])\n"
        "assert rc == 0, rc\n"
        "print('DYNAMO', 'torch._dynamo' in sys.modules)\n")
    env = {**__import__("os").environ, "LEANTUNE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CPU optimizer step" in out.stdout
    assert "DYNAMO False" in out.stdout


def test_a_stock_profile_depends_on_its_own_family_folder_only(tmp_path):
    """Adding or editing one family's folder leaves the other families' shipped profiles valid: a
    packaged architecture's measurement key hashes the shared measuring code and the folder of the
    families that ship its config; a checkpoint's key (its family unknown to the key) every folder."""
    from leantune.family_registry import FAMILIES, stock_models

    for name, (family, model) in stock_models().items():
        folders = spec_cache._family_folders_of(spec_cache.source_key(f"packaged:{model.config}", "bf16"))
        assert folders == [FAMILIES[family].module.split(".")[2]], (name, folders)
    for folder in ("a", "b"):                    # a tree with two family folders
        (tmp_path / "models" / folder).mkdir(parents=True)
        (tmp_path / "models" / folder / "__init__.py").write_text("")
        (tmp_path / "models" / folder / "spec.py").write_text("")
    mine = spec_cache._measuring_code(tmp_path, ["a"])
    assert "models/a/spec.py" in mine and not any(rel.startswith("models/b/") for rel in mine)
    assert {"models/a/spec.py", "models/b/spec.py"} <= set(spec_cache._measuring_code(tmp_path))
    assert spec_cache._family_folders_of(str(tmp_path / "model.safetensors") + "|bf16") is None
    # The key of a packaged source names its own folder's code: a change there is a new key.
    key = spec_cache._code_fingerprint(spec_cache.source_key("packaged:flux1_dev", "bf16"))
    assert key != spec_cache._code_fingerprint(spec_cache.source_key("packaged:sd35_large", "bf16"))
