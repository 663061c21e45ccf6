"""The disk tier in a run ([memory] disk_dir, issue 39): the key is checked with the config, the
host budget decides which streamed blocks go to disk (memory/disk_tier.disk_split, applied by the
engine with the real packed sizes), and a tiny Flux LoRA trained through the real train path with
its streamed blocks on disk is bit for bit the run with them in RAM (losses and the saved LoRA)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import tiny_lora_rest, tiny_run_toml
from safetensors.torch import load_file

from leantune.config import ConfigError, load_config
from leantune.memory.disk_tier import disk_split
from leantune.planner.host_model import HOST_BASELINE
from leantune.trainer import train


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from leantune.demo import draw_shapes

    folder = tmp_path_factory.mktemp("shapes") / "images"
    draw_shapes(folder, count=4, size=64, seed=5)
    return folder


def _config(tmp_path, model, images, memory: str, out: str = "out"):
    p = tmp_path / f"{out}.toml"
    p.write_text(tiny_run_toml(model, images, tiny_lora_rest(tmp_path / out, "t", f"[memory]\n{memory}\n",
                                                             steps=2, save_every=0)))
    return load_config(p)


def test_disk_split_puts_the_fewest_blocks_beyond_the_room_on_disk_spread_evenly():
    units = [(f"b{i}", 100) for i in range(6)]
    assert disk_split(units, 600) == ()                      # everything fits: nothing on disk
    assert disk_split(units, 599) == ("b3",)                 # one block too many: one on disk
    assert disk_split(units, 400) == ("b1", "b4")            # spread, not the last ones
    assert disk_split(units, 0) == tuple(n for n, _ in units)
    mixed = [("a", 300), ("b", 100), ("c", 100)]
    assert disk_split(mixed, 250) == ("a", "c")              # the fewest by count: the middle one alone leaves 400


def test_disk_dir_is_checked_with_the_config(tmp_path, tiny_flux_dir, images):
    with pytest.raises(ConfigError, match=r"disk_dir = 'nowhere'.*does not exist"):
        _config(tmp_path, tiny_flux_dir, images, 'disk_dir = "nowhere"')
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"disk_dir = 'afile'.*is not a folder"):
        _config(tmp_path, tiny_flux_dir, images, 'disk_dir = "afile"')
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):                   # (root writes anywhere)
            with pytest.raises(ConfigError, match=r"disk_dir = 'locked'.*not writable"):
                _config(tmp_path, tiny_flux_dir, images, 'disk_dir = "locked"')
    finally:
        locked.chmod(0o700)
    (tmp_path / "fast").mkdir()
    cfg = _config(tmp_path, tiny_flux_dir, images, 'disk_dir = "fast"')    # relative to the config file
    assert cfg.resolve(cfg.memory.disk_dir) == tmp_path / "fast"
    p = tmp_path / "full.toml"
    p.write_text(tiny_run_toml(tiny_flux_dir, images, '\n[train]\nmode = "full"\nsteps = 1\n\n[memory]\ndisk_dir = "fast"\n'))
    with pytest.raises(ConfigError, match=r"disk_dir.*mode = \"full\""):
        load_config(p)


def test_a_run_with_its_streamed_blocks_on_disk_trains_bitwise_as_from_ram(tmp_path, tiny_flux_dir, images, caplog):
    (tmp_path / "fast").mkdir()
    common = 'streamed_blocks = "all"\ndebug_poison = true\n'
    ram = train(_config(tmp_path, tiny_flux_dir, images, common, out="ram"), progress=False)
    # A host budget of the process baseline alone: no streamed block fits in RAM, all go to disk.
    budget = f'ram_budget = "{HOST_BASELINE // 2**20}MiB"\ndisk_dir = "fast"\n'
    with caplog.at_level("INFO", logger="leantune"):
        disk = train(_config(tmp_path, tiny_flux_dir, images, common + budget, out="disk"), progress=False)
    text = caplog.text
    assert "streamed blocks read from disk" in text and "read from disk), ring" in text
    assert len(ram.losses) == 2 and disk.losses == ram.losses
    for a, b in zip(sorted(ram.lora_files), sorted(disk.lora_files)):
        want, got = load_file(a), load_file(b)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert os.listdir(tmp_path / "fast") == []               # the file is gone with the run


def test_the_engine_puts_the_blocks_beyond_its_host_room_on_disk(tmp_path):
    from test_disk_tier import BLOCKS, SPEC, _model, _step

    from leantune.memory.engine import apply_memory
    from leantune.memory.plan import Plan

    plain, model = _model(), _model()
    unit = 2 * (256 * 256 + 256) * 4                      # a block's packed bytes: two fp32 Linears
    handle = apply_memory(model, SPEC, Plan(streamed_blocks=BLOCKS, debug_poison=True), "cpu",
                          disk_dir=tmp_path, disk_room=2 * unit + 100)
    assert handle.plan.disk_blocks == handle.streaming.disk_blocks == ("blocks.1", "blocks.3")
    assert handle.streaming.disk_bytes == 2 * unit and handle.streaming.host_bytes == 2 * unit
    want, got = _step(plain), _step(model)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    handle.release()
