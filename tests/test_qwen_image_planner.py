"""`leantune plan --model qwen-image | qwen-image-edit` without weights: plans within the budget
over the 60 joint blocks, and the text-encoding phase priced beside them."""

from __future__ import annotations

import json

import pytest

from test_planner import _run_plan

GiB = 2**30


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "leantune-cache"))


def test_plan_qwen_image_without_weights(capsys):
    rc, out, _ = _run_plan(capsys, "--model", "qwen-image", "--mode", "lora", "--rank", "16", "--resolution", "1024",
                           "--vram", "6GiB", "--vram", "24GiB", "--json")
    assert rc == 0
    doc = json.loads(out)
    names = {f"transformer_blocks.{i}" for i in range(60)}
    streamed = []
    for entry in doc["plans"]:
        plan, notes = entry["plan"], entry["plan"]["notes"]
        assert notes["predicted_peak_vram"] <= entry["budget_bytes"] - notes["margin_vram"]
        assert set(plan["streamed_blocks"]) <= names
        streamed.append(len(plan["streamed_blocks"]))
    assert streamed[0] > streamed[1]
    phase = doc["text_encoding"]
    # The embedding table (152064 x 3584 bf16) stays; one of 28 layers at a time; all of it on the host.
    assert phase["resident"] == (152064 * 3584 + 3584) * 2
    assert phase["device"] < 2.5 * GiB < phase["host"]
    rc, text, _ = _run_plan(capsys, "--model", "qwen-image", "--resolution", "1024", "--vram", "6GiB")
    assert rc == 0 and "text 512 tokens" in text and "text encoding (caching phase" in text and "fits 6GiB" in text


def test_plan_qwen_image_edit_prices_the_reference_tokens(capsys):
    """An edit step at 1024 px carries a reference's 4096 tokens too: more activations than Qwen-Image's."""
    def activations(model):
        rc, out, _ = _run_plan(capsys, "--model", model, "--mode", "lora", "--resolution", "1024", "--vram", "24GiB",
                               "--no-fp8", "--json")
        assert rc == 0
        return json.loads(out)["plans"][0]["plan"]["notes"]["vram_breakdown"]["activations"]

    assert activations("qwen-image-edit") > 1.5 * activations("qwen-image")
