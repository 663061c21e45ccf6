"""`leantune plan --gpu CARD` (planner/cards.py): a plan for a named card this machine lacks, its
memory, host link and compute from its spec sheet, said to be assumed; a kept answer replays with
the same card."""

from __future__ import annotations

import json

import pytest

from leantune.cli import main
from leantune.planner.cards import CARDS, card_machine
from leantune.planner.machine import ASSUMED, GiB

QUESTION = ["plan", "--model", "flux-schnell", "--resolution", "512", "--json"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("leantune-cache")


@pytest.fixture(autouse=True)
def _cache(cache, monkeypatch):
    monkeypatch.setenv("LEANTUNE_CACHE", str(cache))     # one measurement of the model for the module


def _plan(capsys, *flags) -> dict:
    main([*QUESTION, *flags])
    return json.loads(capsys.readouterr().out)


def test_the_4090_card_is_the_assumed_machine_and_others_scale_from_their_spec_sheets():
    m = card_machine("rtx4090")
    assert (m.flops, m.h2d_pinned, m.h2d_pageable) == pytest.approx(
        (ASSUMED["flops"], ASSUMED["h2d_pinned"], ASSUMED["h2d_pageable"]))
    slow = card_machine("rtx4060ti-16gb")
    assert slow.h2d_pinned == pytest.approx(ASSUMED["h2d_pinned"] / 2)        # eight PCIe lanes
    assert slow.vram_total == 16 * GiB and not slow.measured
    assert card_machine("rtx5090").h2d_pinned == pytest.approx(2 * ASSUMED["h2d_pinned"])   # PCIe Gen5
    with pytest.raises(ValueError, match="no GPU named 'gtx1080'"):
        card_machine("gtx1080")


def test_a_plan_for_a_card_takes_its_compute_and_says_so(capsys):
    fast = _plan(capsys, "--vram", "12GiB", "--gpu", "rtx4090")["plans"][0]["plan"]["notes"]
    slow = _plan(capsys, "--vram", "12GiB", "--gpu", "rtx3060-12gb")["plans"][0]["plan"]["notes"]
    ratio = CARDS["rtx4090"].tensor_tflops / CARDS["rtx3060-12gb"].tensor_tflops
    assert slow["compute_s"] == pytest.approx(fast["compute_s"] * ratio, rel=1e-6)
    assert slow["machine"].startswith("RTX 3060 12 GB") and "--gpu rtx3060-12gb" in slow["machine"]
    assert slow["machine_assumed_from"] == "its spec sheet: --gpu rtx3060-12gb"


def test_auto_is_all_of_the_cards_memory(capsys):
    entry = _plan(capsys, "--vram", "auto", "--gpu", "rtx3060-12gb")["plans"][0]
    assert entry["budget_bytes"] == 12 * GiB


def test_the_text_report_names_where_its_rates_come_from(capsys):
    main(["plan", "--model", "flux-schnell", "--resolution", "512", "--vram", "8GiB", "--gpu", "rtx3090"])
    out = capsys.readouterr().out
    assert "machine:  RTX 3090 24 GB: 24.0/24.0 GiB free" in out
    assert "(rates assumed, not measured: its spec sheet: --gpu rtx3090)" in out


def test_a_kept_answer_replays_with_its_card(capsys, monkeypatch):
    import leantune.commands.plan as plan_command

    first = _plan(capsys, "--vram", "10GiB", "--gpu", "rtx4080")
    monkeypatch.setattr(plan_command, "_run", lambda *a, **k: pytest.fail("planned again instead of replaying"))
    again = _plan(capsys, "--vram", "10GiB", "--gpu", "rtx4080")
    assert again["machine"]["name"] == "RTX 4080 16 GB" == first["machine"]["name"]
    said = again["plans"][0]["plan"]["notes"]["machine"]          # host RAM as it is now; the card as planned
    assert said.startswith("RTX 4080 16 GB: 16.0/16.0 GiB free") and said.endswith("(its spec sheet: --gpu rtx4080)]")
