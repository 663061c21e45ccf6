"""The command line as a user meets it: bad input ends in one paragraph naming the file and the
key (exit status 1, no traceback), leantune's warnings read as messages, and `leantune demo`
never deletes or trains on files it did not write."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import tiny_run_toml

from leantune.cli import _format_warning, main
from leantune.demo import MARKER, DemoFolderError, draw_shapes, prepare, quickstart_text

RUN_REST = """
[lora]
rank = 4
targets = "attention"
{lora_extra}

[train]
steps = 2
mixed_precision = "no"

[output]
dir = "out"
name = "t"
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_shapes") / "images"
    draw_shapes(folder, count=4, size=64, seed=2)
    return folder


def write_config(tmp_path, model, images, lora_extra="") -> str:
    p = tmp_path / "run.toml"
    p.write_text(tiny_run_toml(model, images, RUN_REST.format(lora_extra=lora_extra)))
    return str(p)


def broken_folder(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    for i in range(2):
        (folder / f"b{i}.png").write_bytes(b"not a png at all")
    return folder


@pytest.mark.parametrize("case", ["missing image folder", "only broken images", "pickle model", "missing model",
                                  "truncated init_from LoRA"])
def test_train_input_errors_are_one_paragraph_with_exit_status_1(case, tmp_path, tiny_flux_dir, images, capsys):
    model, data, named, lora_extra = tiny_flux_dir, images, None, ""
    if case == "missing image folder":
        data = named = tmp_path / "no-such-folder"
    elif case == "only broken images":
        data = named = broken_folder(tmp_path)
    elif case == "pickle model":
        model = named = tmp_path / "flux1-dev.ckpt"
        model.write_bytes(b"\x80\x04 pickled")
    elif case == "missing model":
        model = named = tmp_path / "no-such-model"
    else:
        from leantune.io import save_safetensors

        named = save_safetensors({"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.ones(4, 32)},
                                 tmp_path / "init.safetensors")
        named.write_bytes(named.read_bytes()[:60])
        lora_extra = f'init_from = "{named}"'
    config = write_config(tmp_path, model, data, lora_extra)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the unreadable-image warning has its own test below
        rc = main(["train", config, "--no-progress"])   # an escaping exception fails the test

    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    error = err.strip().splitlines()[-1]               # after any progress log lines: the one-line error
    assert error.startswith("leantune train: ") and str(named) in error
    key = {"missing image folder": "[[data.datasets]] #1", "only broken images": "[[data.datasets]] #1",
           "truncated init_from LoRA": "[lora] init_from"}.get(case, "[model] path")
    assert key in error


def test_resume_errors_name_the_checkpoint_and_the_weight(tmp_path, tiny_flux_dir, images, capsys):
    from leantune.train.state import save_checkpoint

    config = write_config(tmp_path, tiny_flux_dir, images)
    # No checkpoint yet.
    assert main(["train", config, "--resume", "--no-progress"]) == 1
    assert "--resume: no checkpoint in" in capsys.readouterr().err

    # A checkpoint saved with rank 8 where this run has rank 4: refused, naming the weight and shapes.
    name = "transformer_blocks.0.attn.to_q.lora_A.default.weight"
    ckpt = save_checkpoint(tmp_path / "out" / "checkpoints", 1, {"trainable": {name: torch.zeros(8, 32)}})
    assert main(["train", config, "--resume", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert str(ckpt) in err and repr(name) in err and "(8, 32)" in err and "(4, 32)" in err and "[lora]" in err


def test_warnings_name_the_file_once_and_print_without_source_lines(tmp_path, tiny_flux_dir, images, capsys):
    data = tmp_path / "mixed"
    data.mkdir()
    for src in sorted(images.iterdir())[:2]:
        (data / src.name).write_bytes(src.read_bytes())
    (data / "zz.png").write_bytes(b"not a png at all")
    config = write_config(tmp_path, tiny_flux_dir, data)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["cache", config]) == 0
    [w] = [w for w in caught if "unreadable" in str(w.message)]
    msg = str(w.message)
    assert str(data / "zz.png") in msg and "not an image format PIL can read" in msg
    assert "BytesIO" not in msg                      # PIL's text names its in-memory buffer, not the file
    assert _format_warning(w.message, w.category, w.filename, w.lineno) == f"warning: {msg}\n"
    # Other libraries' warnings keep Python's format (file and line).
    assert "test_cli.py" in _format_warning("x", UserWarning, "test_cli.py", 1)

    # A corrupt cache entry: recomputed, and the warning names its file exactly once.
    entry = min((tmp_path / "cache" / "latents").glob("*.safetensors"))
    entry.write_bytes(entry.read_bytes()[:100])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["cache", config]) == 0
    [w] = [w for w in caught if "corrupt" in str(w.message)]
    assert str(w.message).count(str(entry)) == 1
    assert "1 recomputed" in capsys.readouterr().out


def test_demo_refuses_a_folder_it_did_not_make(tmp_path, capsys):
    mine = tmp_path / "my-project"
    (mine / "images").mkdir(parents=True)
    (mine / "images" / "holiday.png").write_bytes(b"precious")
    (mine / "quickstart.toml").write_text("# mine")
    for fresh in (True, False):                      # neither starting fresh nor --keep may touch it
        with pytest.raises(DemoFolderError, match="not made by `leantune demo`"):
            prepare(mine, fresh=fresh)
    assert main(["demo", "--out", str(mine)]) == 1
    assert "nothing was changed" in capsys.readouterr().err
    assert (mine / "images" / "holiday.png").read_bytes() == b"precious"
    assert sorted(p.name for p in mine.iterdir()) == ["images", "quickstart.toml"]


@pytest.mark.parametrize("made_by", ["demo with marker", "demo from before the marker"])
def test_demo_fresh_start_removes_only_its_own_files(made_by, tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "model").mkdir(parents=True)           # what an earlier demo left
    (out / "model" / "stale.json").write_text("{}")
    if made_by == "demo with marker":
        (out / MARKER).write_text("")
    else:                                           # recognised by the unchanged shipped config beside a model
        (out / "model" / "model_index.json").write_text("{}")
        (out / "quickstart.toml").write_text(quickstart_text())
    (out / "run").mkdir()
    (out / "run" / "old.safetensors").write_bytes(b"x")
    (out / "run2").mkdir()                          # a user's own run beside the demo's
    (out / "notes.txt").write_text("keep me")
    prepare(out, fresh=True)                        # the demo's fresh start, without the training
    assert not (out / "run").exists()
    assert (out / "run2").is_dir() and (out / "notes.txt").read_text() == "keep me"
    assert not (out / "model" / "stale.json").exists()
    assert (out / "model" / "model_index.json").exists() and any((out / "images").glob("*.png"))
