"""Small things a user hits first: --set indices, budgets checked with the config, demo --steps 0,
convert's output checks, LoRA strengths and non-finite pixels, --vram on the CPU, a full disk in
`cache`, and third-party chatter kept out of the terminal."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_run_toml

from leantune.cli import main
from leantune.config import ConfigError, load_config
from leantune.demo import draw_shapes

REST = """
[train]
steps = 2
mixed_precision = "no"

[output]
dir = "out"
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ux_shapes") / "images"
    draw_shapes(folder, count=2, size=64, seed=2)
    return folder


def _config(tmp_path, model, images, extra: str = "") -> str:
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(model, images, REST + extra))
    return str(p)


@pytest.mark.parametrize("key,expected", [
    ("data.datasets.5.repeats=4", "data.datasets is a list of 1 [[data.datasets]] table(s); use an index from 0 to 0 "
                                  "(got '5')"),
    ("data.datasets.x.repeats=4", "use an index from 0 to 0 (got 'x')"),
    ("train.steps.x=4", "train.steps is a value (2), not a table"),
])
def test_set_with_a_bad_list_index_is_a_clear_error(tmp_path, images, key, expected, capsys):
    config = _config(tmp_path, "unused-model", images)
    assert main(["cache", config, "--set", key]) == 2
    err = capsys.readouterr().err
    assert expected in err and key in err and "Traceback" not in err
    assert load_config(config, ["data.datasets.0.repeats=4"]).data.datasets[0].repeats == 4


@pytest.mark.parametrize("value,message", [("lots", "is not a size like"), ("0GiB", "is not a positive size")])
def test_bad_vram_budget_is_rejected_with_the_config(tmp_path, images, value, message, capsys):
    config = _config(tmp_path, "no-such-model", images, f'\n[memory]\nvram_budget = "{value}"\n')
    assert main(["cache", config]) == 2
    err = capsys.readouterr().err
    assert "[memory]: key 'vram_budget'" in err and message in err
    assert not (tmp_path / "cache").exists()           # rejected before any caching
    with pytest.raises(ConfigError, match="ram_budget"):
        load_config(config, ["memory.vram_budget=auto", "memory.ram_budget=auto"])


def test_demo_steps_zero_is_rejected_before_anything_is_built(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--out", str(tmp_path / "d"), "--steps", "0"])
    assert exit_.value.code == 2
    assert "at least 1 training step" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def _lora_file(path):
    from leantune.io import save_safetensors

    save_safetensors({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 32),
                      "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(32, 2)}, path)
    return path


def test_convert_refuses_missing_folder_wrong_suffix_and_its_own_input(tmp_path, capsys):
    src = _lora_file(tmp_path / "in.safetensors")
    original = src.read_bytes()
    cases = {
        str(tmp_path / "no" / "such" / "out.safetensors"): "does not exist",
        str(tmp_path / "out.txt"): "must be a .safetensors file",
        str(src): "is the input file",
        str(tmp_path / "." / "in.safetensors"): "is the input file",
    }
    for out, message in cases.items():
        assert main(["convert", str(src), out, "--to", "comfyui"]) == 2
        assert message in capsys.readouterr().err
    assert src.read_bytes() == original
    assert not (tmp_path / "no").exists() and not (tmp_path / "out.txt").exists()
    assert main(["convert", str(src), str(tmp_path / "out.safetensors"), "--to", "comfyui"]) == 0


@pytest.mark.parametrize("strength", ["nan", "inf", "-inf", "100"])
def test_lora_strength_must_be_finite_and_sane(strength):
    from leantune.infer.request import parse_lora_arg, validate_request

    data = {"model": {"path": "m"}, "prompts": ["x"], "lora": [parse_lora_arg(f"a.safetensors:{strength}")]}
    with pytest.raises(ConfigError, match=r"\[\[lora\]\] #1: key 'strength'.*LoRA strength"):
        validate_request(data, "command line")
    data["lora"] = [parse_lora_arg("a.safetensors:-1.5")]
    assert validate_request(data, "command line").lora[0].strength == -1.5


def test_non_finite_pixels_are_refused_not_clamped_to_black():
    from leantune.infer.decode import decode_latents
    from leantune import tiny

    vae = tiny.vae()
    good = decode_latents(vae, torch.zeros(1, 16, 4, 4), "cpu")
    assert torch.isfinite(good).all()
    latents = torch.zeros(2, 16, 4, 4)
    latents[1, 0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="image 2 decoded to non-finite pixels"):
        decode_latents(vae, latents, "cpu")


def test_sample_vram_budget_on_cpu_is_ignored_with_a_line(tmp_path, tiny_flux_dir, capsys, caplog):
    out = tmp_path / "samples"
    rc = main(["sample", "--model", str(tiny_flux_dir), "--prompt", "a red circle", "--vram", "1MiB",
               "--device", "cpu", "--steps", "1", "--width", "64", "--height", "64", "--out", str(out)])
    assert rc == 0
    assert len(list(out.glob("*.png"))) == 1
    assert "on the CPU a VRAM budget does not apply; ignored" in caplog.text


def test_disk_full_while_caching_names_the_path_and_bytes(tmp_path, tiny_flux_dir, images, monkeypatch, capsys):
    from leantune.data import cache as cache_mod

    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cache_mod, "save_safetensors", full)
    config = _config(tmp_path, tiny_flux_dir, images)
    assert main(["cache", config]) == 1
    err = capsys.readouterr().err
    assert "disk full writing" in err and str(tmp_path / "cache" / "latents") in err
    assert "about 4.0 KiB needed" in err          # 2 latents of 16 x 8 x 8 in bf16
    assert "every entry already written is intact" in err and "Traceback" not in err


def test_third_party_chatter_is_silenced(tmp_path):
    script = ("import sys; sys.argv = ['leantune']\n"
              "from leantune.quiet import quiet_third_party; quiet_third_party()\n"
              "import torch\nfrom diffusers import FluxPipeline\nfrom leantune import tiny\n"
              "tiny.flux_transformer().to(torch.bfloat16)\n")
    set_by_quiet = ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS",
                    "TRANSFORMERS_NO_ADVISORY_WARNINGS", "LEANTUNE_VERBOSE")    # main() in this process set them
    env = {k: v for k, v in os.environ.items() if k not in set_by_quiet}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    # Both at once (each is one process's imports; neither waits for the other), their stderr in files.
    runs = {}
    for name, e in (("loud", {**env, "LEANTUNE_VERBOSE": "1"}), ("quiet", env)):
        with open(tmp_path / f"{name}.err", "w") as err:
            runs[name] = subprocess.Popen([sys.executable, "-c", script], env=e, stdout=subprocess.DEVNULL, stderr=err)
    codes = {name: p.wait(timeout=300) for name, p in runs.items()}
    loud, quiet = ((tmp_path / f"{name}.err").read_text() for name in ("loud", "quiet"))
    assert codes == {"loud": 0, "quiet": 0}, loud[-3000:] + quiet[-3000:]
    assert "kept in float32" in loud                        # the library does say it
    assert "kept in float32" not in quiet and "torchvision" not in quiet
