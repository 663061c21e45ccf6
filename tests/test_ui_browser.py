"""`leantune ui` end to end in a real headless Chromium (Debian's, driven by Playwright).

One test walks the main screens as a user would: load the demo's dataset, edit a caption (the
.txt changes on disk), set a budget below the smallest plan and see "does not fit", then one that
fits, start a 20-step run of the tiny Flux, see the loss curve and a sample grid appear, stop it
(the trainer saves at the step) and resume it to the end, with the LoRA files offered for download,
then sample with that LoRA through the Sample form.
Set LEANTUNE_UI_SCREENSHOTS=docs to refresh the screenshots in docs/.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _browser_or_skip():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is not installed (Debian package chromium; scripts/setup.sh installs it as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[test]')")
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "leantune", "ui", "--port", str(port), "--runs",
                             str(tmp_path / "runs")], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(url + "api/runs", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"leantune ui did not start: {(tmp_path / 'server.log').read_text()}")
            time.sleep(0.3)
    yield url, tmp_path / "runs"
    proc.terminate()
    proc.wait(30)
    log.close()


def _shot(page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("LEANTUNE_UI_SCREENSHOTS") or tmp_path)
    if not folder.is_absolute():
        folder = Path(__file__).resolve().parents[1] / folder
    page.screenshot(path=str(folder / f"ui-{name}.png"), full_page=False)


@pytest.mark.slow
def test_page_prepares_plans_trains_watches_stops_and_resumes(tmp_path, server):
    sync_playwright = _browser_or_skip()
    from leantune.demo import prepare

    demo = tmp_path / "demo"
    prepare(demo)
    images = demo / "images"
    url, runs_dir = server
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(180_000)
        page.goto(url)

        # 1. dataset: load, edit a caption, the .txt changes
        page.fill("#dataset", str(images))
        page.fill("#trigger_word", "lnt")
        page.click("#load-dataset")
        page.wait_for_function("document.querySelectorAll('#grid .item').length === 24")
        first = page.locator("#grid textarea.caption").first
        name = first.get_attribute("data-name")
        assert first.input_value() == (images / name).with_suffix(".txt").read_text().strip()
        first.fill("a hand-edited caption of a shape")
        first.press("Tab")                          # change fires on blur
        page.locator("#grid .item .note.saved").first.wait_for()
        assert (images / name).with_suffix(".txt").read_text() == "a hand-edited caption of a shape\n"
        _shot(page, "dataset", tmp_path)

        # 2. model and budget: a budget below the smallest plan, then one that fits
        for key, value in {"name": "shapes", "model_path": str(demo / "model"), "rank": "4", "resolutions": "64",
                           "batch_size": "2", "max_text_length": "32", "steps": "20", "learning_rate": "0.002",
                           "save_every": "0", "log_every": "1", "sample_every": "10", "sample_steps": "2",
                           "sample_size": "64", "ram_budget": "16GiB",
                           "sample_prompts": "lnt, a red circle on a white background"}.items():
            page.fill(f"#{key}", value)
        page.select_option("#dtype", "fp32")
        page.select_option("#mixed_precision", "no")
        page.fill("#vram_budget", "1MiB")
        page.wait_for_function("document.querySelector('#plan-message').textContent.startsWith('does not fit')")
        assert "the smallest budget is" in page.inner_text("#plan-message")
        page.fill("#vram_budget", "1GiB")
        page.wait_for_function("document.querySelector('#plan-message').textContent.startsWith('fits')")
        assert "predicted peak VRAM" in page.inner_text("#plan-message")
        assert 'vram_budget = "1GiB"' in page.locator("#toml").text_content()
        page.locator("#plan").scroll_into_view_if_needed()
        _shot(page, "plan", tmp_path)

        # 3-4. start, watch the loss curve and a sample grid appear, stop, resume
        page.click("#start")
        page.wait_for_function("document.querySelector('#watch-state').textContent === 'running'")
        page.wait_for_function("document.querySelectorAll('#loss-chart polyline').length === 1 && "
                               "document.querySelector('#loss-chart polyline').getAttribute('points').split(' ').length >= 2")
        page.wait_for_selector("#samples img")
        page.wait_for_function("document.querySelector('#samples img').naturalWidth > 0")
        page.locator("#watch-section").scroll_into_view_if_needed()
        _shot(page, "watch", tmp_path)
        page.click("#stop")
        page.wait_for_function("['stopped', 'failed'].includes(document.querySelector('#watch-state').textContent)")
        folder = runs_dir / "shapes"
        assert page.inner_text("#watch-state") == "stopped", (folder / "console.log").read_text()[-2000:]
        assert (folder / "run" / "checkpoints").is_dir() and any((folder / "run" / "checkpoints").iterdir())
        stopped_at = max(int(p.name.split("-")[-1]) for p in (folder / "run" / "checkpoints").iterdir())
        assert 10 <= stopped_at < 20
        page.click("#resume")
        page.wait_for_function("['finished', 'failed'].includes(document.querySelector('#watch-state').textContent)")
        assert page.inner_text("#watch-state") == "finished", (folder / "console.log").read_text()[-2000:]
        links = page.locator("#downloads a").all_inner_texts()
        assert "shapes_comfyui.safetensors" in links and "shapes_diffusers.safetensors" in links
        log = (folder / "run" / "train.log").read_text()
        assert f"resumed from" in log and "step 20 loss" in log
        page.locator("#watch-section").scroll_into_view_if_needed()
        _shot(page, "finished", tmp_path)

        # 5. sample with the finished LoRA
        page.fill("#s_model", str(demo / "model"))
        page.fill("#s_prompts", "lnt, a blue square on a black background")
        for key, value in {"s_steps": "2", "s_width": "64", "s_height": "64", "s_guidance": "3.5",
                           "s_loras": f"{folder / 'run' / 'shapes_comfyui.safetensors'}:0.8"}.items():
            page.fill(f"#{key}", value)
        page.click("#sample")
        page.wait_for_function("document.querySelector('#sample-images img') && "
                               "document.querySelector('#sample-images img').naturalWidth === 64")
        page.locator("#sample-section").scroll_into_view_if_needed()
        _shot(page, "sample", tmp_path)
        browser.close()
