"""`leantune plan --model flux2-dev | flux2-klein-4b | flux2-klein-9b` without weights: LoRA, full and
inference plans within their budgets over both block lists, and the text-encoding phase priced beside
them, loaded whole or read from the encoder's files as the host-RAM budget decides."""

from __future__ import annotations

import json

import pytest

from test_planner import _run_plan

GiB = 2**30
BLOCKS = {"flux2-dev": (8, 48), "flux2-klein-4b": (5, 20), "flux2-klein-9b": (8, 24)}


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


def _plan(capsys, *argv):
    rc, out, err = _run_plan(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("model,mode,vram", [("flux2-dev", "lora", "24GiB"), ("flux2-klein-9b", "lora", "8GiB"),
                                             ("flux2-klein-4b", "lora", "6GiB"), ("flux2-klein-4b", "full", "12GiB"),
                                             ("flux2-dev", "inference", "24GiB")])
def test_plans_fit_their_budget_over_both_block_lists(capsys, model, mode, vram):
    doc = _plan(capsys, "--model", model, "--mode", mode, "--resolution", "1024", "--vram", vram, "--ram", "64GiB")
    double, single = BLOCKS[model]
    names = {f"transformer_blocks.{i}" for i in range(double)} | \
        {f"single_transformer_blocks.{i}" for i in range(single)}
    entry = doc["plans"][0]
    plan, notes = entry["plan"], entry["plan"]["notes"]
    assert notes["predicted_peak_vram"] <= entry["budget_bytes"] - notes["margin_vram"]
    assert notes["predicted_peak_host"] <= 64 * GiB
    assert set(plan["streamed_blocks"]) <= names


def test_dev_text_encoding_phase_and_its_host_ram(capsys):
    """Mistral Small 3.x (24B): the embedding table (131072 x 5120) stays on the GPU, one layer at a
    time of the 30 of 40 the pipeline's hidden states (10, 20, 30) need (not the final norm), 31 kept
    hidden states, 30 layers read per encode; host RAM is the whole encoder loaded (44.7 GiB),
    or its largest tensor when it is read from its files."""
    doc = _plan(capsys, "--model", "flux2-dev", "--resolution", "1024", "--vram", "24GiB", "--ram", "64GiB")
    phase = doc["text_encoding"]
    assert phase["resident"] == 131072 * 5120 * 2
    layer = (5120 * 4096 * 2 + 5120 * 1024 * 2 + 3 * 5120 * 32768 + 2 * 5120) * 2
    assert phase["layer"] == layer
    assert (phase["layers"], phase["layers_run"]) == (40, 30)
    assert phase["reads"] == phase["resident"] + 30 * layer
    tokens = 8 * 512
    assert phase["tokens"] == tokens
    assert phase["activations"] == (3 * tokens * 32768 + 6 * tokens * 5120 + 31 * tokens * 5120) * 2
    assert 44 * GiB < phase["host"] < 45 * GiB                 # 24.0 B parameters in bf16
    assert phase["host_streamed"] == 131072 * 5120 * 2         # the embedding table, read once
    # the resident parts, the layer running and the next arriving (the stream's prefetch), activations
    assert phase["device"] == phase["resident"] + 2 * layer + phase["activations"] < 6 * GiB


def test_plan_says_how_the_encoder_is_loaded_under_the_host_ram_budget(capsys):
    rc, loaded, _ = _run_plan(capsys, "--model", "flux2-dev", "--resolution", "1024", "--vram", "24GiB",
                              "--ram", "64GiB")
    assert rc == 0 and "44.72 GiB host RAM while it runs" in loaded and "fits 24GiB" in loaded
    assert "layer by layer, 30 of its 40 layers" in loaded
    rc, streamed, _ = _run_plan(capsys, "--model", "flux2-dev", "--resolution", "1024", "--vram", "24GiB",
                                "--ram", "48GiB")
    assert "1.25 GiB host RAM: the encoder (44.72 GiB) does not fit the host-RAM budget" in streamed


@pytest.mark.parametrize("model,hidden", [("flux2-klein-4b", 2560), ("flux2-klein-9b", 4096)])
def test_klein_text_encoding_phase_is_qwen3(capsys, model, hidden):
    doc = _plan(capsys, "--model", model, "--resolution", "1024", "--vram", "8GiB")
    phase = doc["text_encoding"]
    assert phase["resident"] == 151936 * hidden * 2
    assert (phase["layers"], phase["layers_run"]) == (36, 27)
    assert phase["device"] < 3.5 * GiB < phase["host"] or model == "flux2-klein-4b"
