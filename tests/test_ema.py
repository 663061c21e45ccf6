"""[ema] (train/ema.py): the bias-corrected average of the adapter weights, in host RAM, written as
its own LoRA file beside the live one, exact on resume, swapped in and out bit for bit."""

import pytest
import torch
from conftest import tiny_lora_rest, tiny_run_toml
from safetensors.torch import load_file

from leantune.config import load_config
from leantune.demo import draw_shapes
from leantune.train.ema import AdapterEma
from leantune.train.lora import read_lora
from leantune.trainer import train

@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ema") / "images"
    draw_shapes(folder, count=4, size=64, seed=6)
    return folder


def _config(tmp_path, model, images, ema: str, out: str, extra=()):
    p = tmp_path / f"{out}.toml"
    p.write_text(tiny_run_toml(model, images, tiny_lora_rest(tmp_path / out, "e", f"[ema]\n{ema}\n")))
    return load_config(p, list(extra))


def test_the_average_is_the_bias_corrected_ema_of_the_weights_after_each_update():
    model = torch.nn.Linear(3, 2)
    ema = AdapterEma(model, decay=0.9, every=2)
    history = []
    for step in range(1, 7):
        with torch.no_grad():
            model.weight.add_(torch.full_like(model.weight, 0.1 * step))
        ema.after_step(step)
        if step % 2 == 0:
            history.append(model.weight.detach().clone())
    shadow = torch.zeros(2, 3)
    for w in history:
        shadow = 0.9 * shadow + 0.1 * w
    expected = shadow / (1 - 0.9 ** len(history))
    assert ema.updates == 3
    assert torch.allclose(ema.averaged()["weight"], expected, rtol=1e-6, atol=1e-7)

    live = model.weight.detach().clone()
    with ema.swapped_in():
        assert torch.allclose(model.weight, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(model.weight, live)                    # restored bit for bit


def test_ema_files_beside_the_live_ones_and_exact_on_resume(tmp_path, tiny_flux_dir, images):
    full = train(_config(tmp_path, tiny_flux_dir, images, "enabled = true\ndecay = 0.5", "full"), progress=False)
    names = {f.name for f in full.lora_files}
    assert names == {"e_comfyui.safetensors", "e_diffusers.safetensors",
                     "e_ema_comfyui.safetensors", "e_ema_diffusers.safetensors"}
    assert (full.paths.root / "e_ema-step000002_comfyui.safetensors").exists()
    live, averaged = (load_file(str(full.paths.root / f"e{s}_comfyui.safetensors")) for s in ("", "_ema"))
    assert live.keys() == averaged.keys() and any(not torch.equal(live[k], averaged[k]) for k in live)
    # leantune's own reader takes the EMA file as it takes the live one
    assert set(read_lora(full.paths.root / "e_ema_comfyui.safetensors").modules) == \
        set(read_lora(full.paths.root / "e_comfyui.safetensors").modules)

    # Killed between step 2's live files and its EMA files: the resume writes the EMA's from the state.
    from leantune.train import ema as ema_module

    real_export = ema_module.export_ema

    def killed(t, paths, step, intermediate):
        if step == 2:
            raise KeyboardInterrupt            # stands in for a kill after the live files are written
        return real_export(t, paths, step, intermediate)

    cfg = _config(tmp_path, tiny_flux_dir, images, "enabled = true\ndecay = 0.5", "parts")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ema_module, "export_ema", killed)
        with pytest.raises(KeyboardInterrupt):
            train(cfg, progress=False)
    parts = tmp_path / "parts"
    assert (parts / "e-step000002_comfyui.safetensors").exists()
    assert not (parts / "e_ema-step000002_comfyui.safetensors").exists()
    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == full.losses
    for name in ("e_ema-step000002_comfyui.safetensors", "e_ema_comfyui.safetensors"):
        written, expected = load_file(str(parts / name)), load_file(str(full.paths.root / name))
        assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)


def test_an_ema_of_decay_near_zero_is_the_live_lora(tmp_path, tiny_flux_dir, images):
    run = train(_config(tmp_path, tiny_flux_dir, images, "enabled = true\ndecay = 1e-12", "zero"), progress=False)
    live, averaged = (load_file(str(run.paths.root / f"e{s}_comfyui.safetensors")) for s in ("", "_ema"))
    assert all(torch.allclose(live[k].float(), averaged[k].float(), rtol=1e-5, atol=1e-7) for k in live)


def test_ema_is_for_adapters(tmp_path, tiny_flux_dir, images):
    with pytest.raises(Exception, match="\\[ema\\] enabled = true: .*\\[train\\] mode = \"full\""):
        _config(tmp_path, tiny_flux_dir, images, "enabled = true", "f", extra=["train.mode=\"full\""])
