"""`leantune ui` end to end in a real headless Chromium (Debian's, driven by Playwright).

One test walks the main screens as a user would: load the demo's dataset, edit a caption (the
.txt changes on disk), set a budget below the smallest plan and see "does not fit", then one that
fits, start a 20-step run of the tiny Flux, see the loss curve and a sample grid appear, stop it
(the trainer saves at the step) and resume it to the end, with the LoRA files offered for download
(one is fetched and compared byte for byte), then sample with that LoRA through the Sample form.
A second, shorter test covers what that run cannot show on a CPU: the page behind a token,
uploads (decoded, never overwriting), the family and mode choices with the planner's "not planned"
answer, and the watch screen of a run with measured VRAM drawn against the plan's predicted lines,
read from a run folder written by hand.
Set LEANTUNE_UI_SCREENSHOTS=docs to refresh the screenshots in docs/.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from progress_wait import file_size, logged_steps, wait_until

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _browser_or_skip():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is not installed (Debian package chromium; scripts/setup_test.sh installs it as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install -e '.[test]')")
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path: Path, token: str | None = None):
    """`leantune ui` on a free localhost port; yields (url, runs dir). With `token`, the server asks
    for it as it does when bound beyond localhost."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "leantune", "ui", "--port", str(port), "--runs",
                             str(tmp_path / "runs")] + (["--token", token] if token else []),
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"

    def answers() -> bool:
        try:
            urllib.request.urlopen(url + "api/runs" + (f"?token={token}" if token else ""), timeout=2)
            return True
        except OSError:
            return False

    try:   # as long as the server process lives (it imports torch: slow on a busy machine), up to the safety net
        wait_until(answers, what="leantune ui to answer", alive=lambda: proc.poll() is None,
                   detail=lambda: (tmp_path / "server.log").read_text(), poll_s=0.3)
    except AssertionError as e:
        proc.kill()
        pytest.fail(f"leantune ui did not start: {e}")
    try:
        yield url, tmp_path / "runs"
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        _kill_runs(tmp_path / "runs")


def _kill_runs(runs_dir: Path) -> None:
    """End the training runs the page started (they outlive the server by design): a test that fails
    mid-run must not leave a trainer taking the CPU from the tests after it."""
    import signal

    from leantune.ui import launcher

    for folder in runs_dir.glob("*"):
        info = launcher.read_process(folder) if folder.is_dir() else None
        if launcher.is_alive(info) and info.get("command", [""])[0] == sys.executable:
            os.killpg(info["pid"], signal.SIGKILL)


@pytest.fixture
def server(tmp_path):
    yield from _serve(tmp_path)


@pytest.fixture
def token_server(tmp_path):
    yield from _serve(tmp_path, token="s3cret-token")


def _page_wait(page, expression: str, progress, what: str, detail=lambda: "") -> None:
    """page.wait_for_function(expression), for as long as `progress()` moves (progress_wait.py):
    what a training run shows arrives after its steps, which a busy machine runs slower."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    def done() -> bool:
        try:
            page.wait_for_function(expression, timeout=1000)
            return True
        except PlaywrightTimeout:
            return False

    wait_until(done, progress, what=what, poll_s=0, detail=detail)


def _run_progress(folder: Path):
    """What moves while a run started from the page works: the steps its log reports and the size
    of its console (model loading, caching and sampling write there without a step)."""
    return lambda: (logged_steps(folder / "run" / "train.log"), file_size(folder / "console.log"))


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
        # Safety net for each interaction; what waits on the run's steps follows them (_page_wait).
        page.set_default_timeout(600_000)
        page.goto(url)
        page.wait_for_function("document.querySelectorAll('#family option').length > 0")

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
                           "batch_size": "2", "max_text_length": "32", "steps": "600", "learning_rate": "0.002",
                           "save_every": "0", "log_every": "1", "sample_every": "20", "sample_steps": "2",
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

        # 3-4. start, watch the loss curve and a sample grid appear, stop, resume (600 steps: a step
        # of this model takes ~10 ms here, and a run that ends before Stop is clicked cannot stop)
        folder = runs_dir / "shapes"
        moving = _run_progress(folder)
        console = lambda: (folder / "console.log").read_text()[-2000:] if (folder / "console.log").exists() else ""
        page.click("#start")
        page.wait_for_function("document.querySelector('#watch-state').textContent === 'running'")
        _page_wait(page, "document.querySelectorAll('#loss-chart polyline').length === 1 && "
                   "document.querySelector('#loss-chart polyline').getAttribute('points').split(' ').length >= 2",
                   moving, "the loss curve", console)
        _page_wait(page, "document.querySelector('#samples img') && "
                   "document.querySelector('#samples img').naturalWidth > 0", moving, "the first sample grid", console)
        # measured host RSS against the plan's predicted lines (no VRAM is measured on a CPU run)
        page.wait_for_function("document.querySelector('#mem-chart polyline[data-series=rss]')")
        for series in ("predicted-vram", "predicted-host"):
            assert float(page.get_attribute(f"#mem-chart polyline[data-series={series}]", "data-value")) > 0
        assert "predicted VRAM" in page.inner_text("#mem-legend") and "RSS" in page.inner_text("#mem-legend")
        assert " s/it" in page.inner_text("#speed") and " INFO step " in page.inner_text("#log")
        page.locator("#watch-section").scroll_into_view_if_needed()
        _shot(page, "watch", tmp_path)
        page.click("#stop")
        _page_wait(page, "['stopped', 'failed'].includes(document.querySelector('#watch-state').textContent)",
                   moving, "the run to stop", console)
        assert page.inner_text("#watch-state") == "stopped", (folder / "console.log").read_text()[-2000:]
        assert (folder / "run" / "checkpoints").is_dir() and any((folder / "run" / "checkpoints").iterdir())
        stopped_at = max(int(p.name.split("-")[-1]) for p in (folder / "run" / "checkpoints").iterdir())
        assert 20 <= stopped_at < 600
        page.click("#resume")
        _page_wait(page, "['finished', 'failed'].includes(document.querySelector('#watch-state').textContent)",
                   moving, "the resumed run to finish", console)
        assert page.inner_text("#watch-state") == "finished", (folder / "console.log").read_text()[-2000:]
        links = page.locator("#downloads a").all_inner_texts()
        assert "shapes_comfyui.safetensors" in links and "shapes_diffusers.safetensors" in links
        download = page.request.get(page.locator("#downloads a", has_text="shapes_comfyui.safetensors")
                                    .evaluate("a => a.href"))
        assert download.body() == (folder / "run" / "shapes_comfyui.safetensors").read_bytes()
        log = (folder / "run" / "train.log").read_text()
        assert f"resumed from" in log and "step 600 loss" in log
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


def _png(path: Path, size: int, color) -> bytes:
    from PIL import Image

    Image.new("RGB", (size, size), color).save(path)
    return path.read_bytes()


def _finished_run(runs_dir: Path) -> Path:
    """A finished run's folder as the page and the trainer write it, with VRAM in its step lines."""
    import json

    folder = runs_dir / "watched"
    (folder / "run" / "samples").mkdir(parents=True)
    (folder / "config.toml").write_text("[train]\nsteps = 4\n")
    (folder / "plan.json").write_text(json.dumps({"peak_vram_gib": 5.5, "peak_host_gib": 12.0, "step_s": 1.4,
                                                 "message": "fits: predicted peak VRAM 5.50 GiB"}))
    (folder / "process.json").write_text(json.dumps({"pid": 1, "exit_code": 0}))
    (folder / "run" / "train.log").write_text("".join(
        f"2026-11-24 08:26:2{i},000 INFO step {i} loss {0.9 - 0.1 * i:.5f} lr 0.0001 {1.5 - 0.05 * i:.2f}s/it "
        f"vram 4.80/5.90 GiB (peak {5.0 + 0.1 * i:.2f}) rss {10.0 + 0.2 * i:.1f} GiB\n" for i in range(1, 5))
        + "2026-11-24 08:26:30,000 INFO saved watched_comfyui.safetensors\n")
    _png(folder / "run" / "samples" / "step000004.png", 64, (10, 120, 200))
    (folder / "run" / "watched_comfyui.safetensors").write_bytes(b"weights of the finished run")
    return folder


def test_page_behind_a_token_uploads_plans_full_mode_and_watches_vram_against_the_plan(tmp_path, token_server,
                                                                                       tiny_flux_dir):
    sync_playwright = _browser_or_skip()
    from leantune.ui.form import families

    url, runs_dir = token_server
    images = tmp_path / "images"
    images.mkdir()
    original = _png(images / "a.png", 96, (200, 0, 0))
    (images / "a.txt").write_text("a red square\n")
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    new = _png(uploads / "new.png", 80, (0, 200, 0))
    _png(uploads / "a.png", 80, (0, 0, 0))                       # same name as the dataset's: refused
    (uploads / "broken.png").write_bytes(b"this is not an image")  # does not decode: refused
    folder = _finished_run(runs_dir)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(60_000)

        # the token: refused without it, then the page works from the cookie the address sets
        assert page.goto(url).status == 403
        assert "token" in page.inner_text("body")
        page.goto(url + "?token=s3cret-token")
        page.wait_for_function("document.querySelectorAll('#family option').length > 0")
        assert page.locator("#family option").all_inner_texts() == families()
        assert page.locator("#mode option").all_inner_texts() == ["lora", "full"]
        assert page.input_value("#ram_budget") == "auto"

        # uploads: the image lands byte for byte; a taken name and a file that does not decode are refused
        page.fill("#dataset", str(images))
        page.click("#load-dataset")
        page.wait_for_function("document.querySelectorAll('#grid .item').length === 1")
        page.set_input_files("#upload", [str(uploads / "new.png"), str(uploads / "a.png"), str(uploads / "broken.png")])
        page.wait_for_function("document.querySelector('#upload-message').textContent.includes('added')")
        message = page.inner_text("#upload-message")
        assert "1 image(s) added" in message and "exists already" in message and "not a readable image" in message
        page.wait_for_function("document.querySelectorAll('#grid .item').length === 2")
        assert (images / "new.png").read_bytes() == new
        assert (images / "a.png").read_bytes() == original and not (images / "broken.png").exists()
        assert sorted(p.name for p in images.iterdir()) == ["a.png", "a.txt", "new.png"]

        # full mode: no rank; the plan box shows the planner's full fine-tune plan, which prices the
        # optimizer state of every weight and so needs more VRAM than the LoRA plan of the same model
        page.fill("#model_path", str(tiny_flux_dir))
        page.fill("#resolutions", "64")
        page.fill("#vram_budget", "12GiB")
        page.wait_for_function("document.querySelector('#plan-message').textContent.startsWith('fits')")
        lora_message = page.inner_text("#plan-message")
        page.select_option("#mode", "full")
        assert page.locator("#rank").is_disabled()
        page.wait_for_function("document.querySelector('#toml').textContent.includes('mode = \\\"full\\\"')")
        page.wait_for_function(f"document.querySelector('#plan-message').textContent.startsWith('fits') && "
                               f"document.querySelector('#plan-message').textContent !== {lora_message!r}")
        toml = page.text_content("#toml")
        assert "[lora]" not in toml and 'vram_budget = "12GiB"' in toml and "\nram_budget" not in toml
        assert page.get_attribute("#plan", "class").split()[-1] == "fits"
        mib = lambda text: float(text.split("predicted peak VRAM ")[1].split(" MiB")[0])   # a tiny model's plans
        assert mib(page.inner_text("#plan-message")) > mib(lora_message)
        page.select_option("#mode", "lora")
        assert not page.locator("#rank").is_disabled()

        # watch a finished run: loss, s/it, VRAM and RSS against the predicted lines, log, samples, downloads
        page.wait_for_selector("#runs tbody tr")
        page.locator("#runs tbody tr", has_text="watched").locator("button").click()
        page.wait_for_function("document.querySelector('#watch-state').textContent === 'finished'")
        assert len(page.get_attribute("#loss-chart polyline[data-series=loss]", "points").split()) == 4
        chart = "#mem-chart polyline"
        assert page.locator(chart).count() == 4
        for series in ("rss", "vram"):
            assert len(page.get_attribute(f"{chart}[data-series={series}]", "points").split()) == 4
            assert page.get_attribute(f"{chart}[data-series={series}]", "stroke-dasharray") is None
        for series, value in (("predicted-vram", "5.5"), ("predicted-host", "12")):
            line = page.locator(f"{chart}[data-series={series}]")
            assert line.get_attribute("data-value") == value and line.get_attribute("stroke-dasharray")
            (x0, y0), (x1, y1) = [tuple(map(float, p.split(","))) for p in line.get_attribute("points").split()]
            assert y0 == y1 and x0 < x1                               # flat, across the whole run
        # measured VRAM peaks 5.1..5.4 GiB sit below the predicted 5.5 line (SVG y grows downwards)
        vram_ys = [float(p.split(",")[1]) for p in page.get_attribute(f"{chart}[data-series=vram]", "points").split()]
        predicted_y = float(page.get_attribute(f"{chart}[data-series=predicted-vram]", "points").split()[0].split(",")[1])
        assert all(y > predicted_y for y in vram_ys)
        legend = page.inner_text("#mem-legend")
        assert "predicted VRAM 5.50 GiB" in legend and "predicted host RAM 12.00 GiB" in legend
        assert "VRAM peak 5.40 GiB" in legend and "RSS 10.80 GiB" in legend
        speed = page.inner_text("#speed")
        assert "step 4/4" in speed and "1.30 s/it" in speed and "predicted 1.40 s/it" in speed
        assert page.inner_text("#log").endswith("saved watched_comfyui.safetensors")
        page.wait_for_function("document.querySelector('#samples img') && "
                               "document.querySelector('#samples img').naturalWidth === 64")
        links = page.locator("#downloads a")
        assert links.all_inner_texts() == ["config.toml", "watched_comfyui.safetensors"]
        download = page.request.get(links.nth(1).evaluate("a => a.href"))     # with the cookie
        assert download.ok and download.body() == (folder / "run" / "watched_comfyui.safetensors").read_bytes()
        assert "attachment" in download.headers["content-disposition"]
        browser.close()


@pytest.mark.slow
def test_sample_form_shows_the_negative_prompt_for_cfg_families(tmp_path, server):
    """The Sample form's negative-prompt field is visible for a family with classifier-free guidance
    (SD3.5: chosen, or named by the model folder's metadata) and hidden for Flux."""
    import json

    sync_playwright = _browser_or_skip()
    url, _ = server
    sd3 = tmp_path / "sd3" / "transformer"
    sd3.mkdir(parents=True)
    (sd3 / "config.json").write_text(json.dumps({"_class_name": "SD3Transformer2DModel"}))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page()
        page.set_default_timeout(30_000)
        page.goto(url)
        page.wait_for_function("document.querySelectorAll('#s_family option').length > 1")
        negative = page.locator("#s_negative")
        assert not negative.is_visible()
        page.select_option("#s_family", "sd3")
        negative.wait_for(state="visible")
        page.select_option("#s_family", "flux")
        negative.wait_for(state="hidden")
        page.select_option("#s_family", "")
        page.fill("#s_model", str(sd3.parent))
        page.locator("#s_model").press("Tab")          # change fires on blur
        negative.wait_for(state="visible")
        browser.close()
