"""Exact resume of a tiny-Flux LoRA run with each optimizer from its package (train/optim_packages.py):
4 steps straight (saving at step 2) == 2 steps, checkpoint, resume, 2 steps, bitwise in the losses
and in the exported LoRA. Schedule-free AdamW also saves, samples and exports at its averaged
weights while the training point continues unperturbed; Prodigy logs its d estimate."""

import pytest
import torch
from conftest import tiny_run_toml
from safetensors.torch import load_file

from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune.trainer import train

REST = """
[lora]
rank = 4
targets = "all"

[train]
steps = 4
mixed_precision = "no"
save_every = 2
seed = 3
{train}

[sample]
{sample}

[output]
dir = "{out}"
name = "o"
formats = ["comfyui"]
"""

SETTINGS = {
    "prodigy": 'optimizer = "prodigy"\nlearning_rate = 1.0\nprodigy_safeguard_warmup = true\nwarmup_steps = 1',
    "schedulefree_adamw": 'optimizer = "schedulefree_adamw"\nlearning_rate = 2e-3\nwarmup_steps = 2',
    "came": 'optimizer = "came"\nlearning_rate = 1e-3',
    "adamw8bit": 'optimizer = "adamw8bit"\nlearning_rate = 1e-3',
}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("opt") / "images"
    draw_shapes(folder, count=4, size=64, seed=7)
    return folder


def _config(tmp_path, model, images, name: str, out: str, sample: str = ""):
    p = tmp_path / f"{out}.toml"
    p.write_text(tiny_run_toml(model, images, REST.format(train=SETTINGS[name], sample=sample, out=tmp_path / out)))
    return load_config(p)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_resumed_run_is_the_straight_run_bitwise(tmp_path, tiny_flux_dir, images, name):
    straight = train(_config(tmp_path, tiny_flux_dir, images, name, "straight"), progress=False)
    cfg = _config(tmp_path, tiny_flux_dir, images, name, "parts")
    assert train(cfg, stop_after=2, progress=False).final_step == 2
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == straight.losses and len(straight.losses) == 4
    a, b = (load_file(str(r.paths.root / "o_comfyui.safetensors")) for r in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if name == "prodigy":                  # its d estimate in the log line
        assert " d " in straight.paths.log_file.read_text() and " d_lr " in straight.paths.log_file.read_text()


@pytest.mark.slow
def test_schedule_free_samples_and_exports_the_average_and_trains_on_unperturbed(tmp_path, tiny_flux_dir, images):
    """Samples every step (eval/train around each) change nothing in the training: the losses equal
    a run without samples; the saved LoRA is the averaged point x, not the training point y."""
    plain = train(_config(tmp_path, tiny_flux_dir, images, "schedulefree_adamw", "plain"), progress=False)
    sampled = train(_config(tmp_path, tiny_flux_dir, images, "schedulefree_adamw", "sampled",
                            sample='prompts = ["a red square"]\nevery = 1\nsteps = 2\nwidth = 64\nheight = 64'),
                    progress=False)
    assert len(sampled.sample_files) == 4
    assert sampled.losses == plain.losses
    from leantune.train.lora import read_lora
    from leantune.train.state import load_latest

    _, _, state = load_latest(plain.paths.checkpoints)
    y = state["trainable"]
    assert all(g["train_mode"] for g in state["optimizer"]["param_groups"])     # saved at y, in train mode
    exported = read_lora(plain.paths.root / "o_comfyui.safetensors").modules
    pairs = [(m.down, y[f"{name}.lora_A.default.weight"]) for name, m in exported.items()]
    assert pairs and all(a.shape == b.shape for a, b in pairs)
    assert sum(not torch.equal(a, b.to(a.dtype)) for a, b in pairs) > len(pairs) // 2   # the file holds x, not y
