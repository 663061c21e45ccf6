"""Atomic saves: the file appears whole under its name, with the permissions a plain open() gives."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from leantune.io import UnreadableFileError, atomic_write_bytes, load_safetensors, save_safetensors


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_new_files_follow_the_umask_and_replaced_files_keep_their_mode(tmp_path):
    old = os.umask(0o022)
    try:
        lora = save_safetensors({"w": torch.ones(2)}, tmp_path / "my-lora.safetensors")
        # A temporary file is created 0o600; a LoRA or a sample must not stay private to its writer.
        assert _mode(lora) == 0o644
        os.umask(0o077)
        assert _mode(atomic_write_bytes(tmp_path / "private.json", b"{}")) == 0o600
    finally:
        os.umask(old)
    lora.chmod(0o640)
    save_safetensors({"w": torch.zeros(2)}, lora)
    assert _mode(lora) == 0o640
    assert torch.equal(load_safetensors(lora)[0]["w"], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left


def test_truncated_safetensors_is_a_named_unreadable_file_error(tmp_path):
    path = save_safetensors({"w": torch.ones(64)}, tmp_path / "x.safetensors")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(UnreadableFileError, match=r"x\.safetensors: not a readable safetensors file"):
        load_safetensors(path)
