"""The parts of `leantune ui` that are not the page: the form's TOML, caption write-back, the run
folder reading, the plan answer, the launcher's process record, and the HTTP routes (without a
browser; tests/test_ui_browser.py drives the real page)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from PIL import Image
from progress_wait import wait_until

from leantune.config import ConfigError, load_config
from leantune.ui import dataset_view, launcher, plan_answer, runs
from leantune.ui.form import FormError, RunForm, choices
from leantune.ui.labels import labels

FIELDS = {"name": "cats", "model_path": "/models/flux", "dataset": "/data/cats", "trigger_word": "ohwx",
          "rank": "8", "resolutions": "512, 768", "steps": "300", "learning_rate": "2e-4", "vram_budget": "8GiB",
          "sample_prompts": "ohwx, a cat\n\nohwx, a dog\n", "sample_every": "100"}


def test_form_writes_the_toml_train_loads(tmp_path):
    form = RunForm.from_fields(FIELDS)
    cfg = load_config(form.write(tmp_path / "config.toml"))
    assert cfg.model.path == "/models/flux" and cfg.model.family == "flux"
    assert cfg.data.resolutions == [512, 768] and cfg.data.datasets[0].trigger_word == "ohwx"
    assert Path(cfg.data.datasets[0].path) == Path("/data/cats")
    assert (cfg.lora.rank, cfg.lora.alpha) == (8, None)            # alpha unset: the config's default, = rank
    assert cfg.train.steps == 300 and cfg.train.learning_rate == pytest.approx(2e-4)
    assert cfg.memory.vram_budget == "8GiB" and cfg.memory.ram_budget is None
    assert cfg.sample.prompts == ["ohwx, a cat", "ohwx, a dog"] and cfg.sample.every == 100
    assert Path(cfg.resolve(cfg.output.dir)) == tmp_path / "run" and cfg.output.name == "cats"


def test_form_without_prompts_or_budget_leaves_those_sections_out(tmp_path):
    form = RunForm.from_fields({**FIELDS, "sample_prompts": "", "vram_budget": ""})
    doc = form.to_dict()
    assert "sample" not in doc and "memory" not in doc
    cfg = load_config(form.write(tmp_path / "c.toml"))
    assert cfg.memory.vram_budget is None and not cfg.sample.prompts


def test_form_full_mode_has_no_lora_section():
    assert "full" in choices("train", "mode")
    doc = RunForm.from_fields({**FIELDS, "mode": "full"}).to_dict()
    assert doc["train"]["mode"] == "full" and "lora" not in doc


@pytest.mark.parametrize("key,value,words", [
    ("rank", "eight", "rank"), ("rank", "0", "rank"), ("steps", 2.5, "steps"), ("family", "sdxl", "family"),
    ("name", "../evil", "name"), ("model_path", " ", "model_path"), ("resolutions", "", "resolutions"),
    ("learning_rate", "-1", "learning_rate"), ("bogus", "1", "bogus")])
def test_form_errors_name_the_field(key, value, words):
    with pytest.raises(FormError, match=words):
        RunForm.from_fields({**FIELDS, key: value})


def test_form_bad_budget_is_refused_by_the_config_check_and_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="vram_budget"):
        RunForm.from_fields({**FIELDS, "vram_budget": "lots"}).write(tmp_path / "c.toml")


def _images(folder: Path) -> Path:
    folder.mkdir()
    Image.new("RGB", (64, 48), (200, 0, 0)).save(folder / "a.png")
    (folder / "a.txt").write_text("a red\nbox\n")
    Image.new("RGB", (300, 300), (0, 0, 200)).save(folder / "b.jpg")
    (folder / "c.png").write_bytes(b"not a png")
    (folder / "notes.md").write_text("ignored")
    return folder


def test_scan_lists_images_with_captions_and_the_trainers_warnings(tmp_path):
    entries = {e["name"]: e for e in dataset_view.scan(str(_images(tmp_path / "d")), min_resolution=256)}
    assert sorted(entries) == ["a.png", "b.jpg", "c.png"]
    assert entries["a.png"]["caption"] == "a red box" and (entries["a.png"]["width"], entries["a.png"]["height"]) == (64, 48)
    assert any("smaller than 256" in w for w in entries["a.png"]["warnings"])
    assert entries["b.jpg"]["warnings"] == ["no caption (.txt): trains with the trigger word only"]
    assert any(w.startswith("unreadable") for w in entries["c.png"]["warnings"])


def test_caption_write_back_is_atomic_and_stays_in_the_folder(tmp_path, monkeypatch):
    folder = _images(tmp_path / "d")
    written = dataset_view.write_caption(str(folder), "b.jpg", "  a blue\n square ")
    assert written == folder.resolve() / "b.txt" and written.read_text() == "a blue square\n"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]      # no temp file left
    for bad in ("../a.png", "/etc/passwd", "notes.md", "missing.png", ".hidden.png", ""):
        with pytest.raises(dataset_view.DatasetViewError):
            dataset_view.write_caption(str(folder), bad, "x")
    # a failing write leaves the old caption intact
    import leantune.io as lio

    def boom(tmp):
        Path(tmp).write_text("half")
        raise OSError("disk full")
    monkeypatch.setattr(lio, "atomic_write_bytes", lambda path, data: lio.atomic_write(path, boom))
    with pytest.raises(OSError):
        dataset_view.write_caption(str(folder), "a.png", "new")
    assert (folder / "a.txt").read_text() == "a red\nbox\n"


def test_scan_of_a_missing_folder_names_it(tmp_path):
    with pytest.raises(dataset_view.DatasetViewError, match="nowhere"):
        dataset_view.scan(str(tmp_path / "nowhere"))


LOG = """\
2026-11-24 08:26:19,908 INFO memory plan: stream 0 blocks
2026-11-24 08:26:21,000 INFO step 1 loss 0.81234 lr 0.002 1.52s/it rss 2.4 GiB
2026-11-24 08:26:22,000 INFO step 2 loss 0.71000 lr 0.002 1.40s/it vram 5.21/5.62 GiB (peak 5.40) rss 11.3 GiB, streamed 1.2 GB
2026-11-24 08:26:23,000 INFO interrupted at step 2: saving a resumable state
2026-11-24 08:26:30,000 INFO step 2 loss 0.70000 lr 0.002 1.30s/it rss 2.5 GiB
2026-11-24 08:26:31,000 INFO step 3 loss nan lr 0.002 1.30s/it rss 2.5 GiB
"""


def test_parse_log_reads_loss_speed_and_memory_keeping_the_last_of_a_resumed_step():
    steps = runs.parse_log(LOG)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[0] == {"step": 1, "loss": 0.81234, "s_it": 1.52, "vram": None, "vram_peak": None, "rss": 2.4}
    assert steps[1]["loss"] == 0.7 and steps[1]["rss"] == 2.5          # the resumed run's line
    assert runs.parse_log(LOG.replace("1.30s/it rss 2.5", "1.30s/it vram 5.21/5.62 GiB (peak 5.40) rss 2.5"))[1][
        "vram_peak"] == 5.4
    assert str(steps[2]["loss"]) == "nan"


def test_parse_log_reads_the_held_out_losses_and_lines_with_an_optimizers_scalars(tmp_path, caplog):
    """The trainer's own lines: its validation line (trainer._validate) and a step line with
    Prodigy's d after the lr (the step still parses, its speed and memory too)."""
    import logging

    from leantune import trainer

    with caplog.at_level(logging.INFO, logger="leantune"):
        trainer.log.info("step %d validation loss %.5f (%d held-out sample(s), %d noise levels)", 50, 0.41234, 3, 5)
        trainer.log.info("step %d validation loss %.5f (%d held-out sample(s), %d noise levels)", 100, 0.38, 3, 5)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert runs.parse_validation(text) == [[50, 0.41234], [100, 0.38]]
    assert runs.parse_log(text) == []                                  # not training steps
    line = "2026-12-02 12:00:00,000 INFO step 7 loss 0.50000 lr 1 d 2.1e-06 d_lr 2.1e-06 0.25s/it rss 1.0 GiB"
    assert runs.parse_log(line) == [{"step": 7, "loss": 0.5, "s_it": 0.25, "vram": None, "vram_peak": None,
                                     "rss": 1.0}]


def _run(runs_dir: Path, name: str, steps: int = 10) -> Path:
    folder = runs_dir / name
    (folder / "run").mkdir(parents=True)
    (folder / "config.toml").write_text(f"[train]\nsteps = {steps}\n")
    return folder


def test_run_states_from_the_folder(tmp_path):
    new = _run(tmp_path, "a-new")
    stopped = _run(tmp_path, "b-stopped")
    (stopped / "run" / "checkpoints" / "step-000005").mkdir(parents=True)
    (stopped / "run" / "b-stopped-step000005_comfyui.safetensors").write_bytes(b"x")
    (stopped / "run" / "train.log").write_text(LOG)
    done = _run(tmp_path, "c-done")
    (done / "run" / "c-done_comfyui.safetensors").write_bytes(b"x")
    failed = _run(tmp_path, "d-failed")
    (failed / launcher.PROCESS_FILE).write_text(json.dumps({"pid": 1, "exit_code": 1}))
    failed_resume = _run(tmp_path, "e-failed-resume")
    (failed_resume / "run" / "checkpoints" / "step-000005").mkdir(parents=True)
    (failed_resume / launcher.PROCESS_FILE).write_text(json.dumps({"pid": 1, "exit_code": 2}))
    interrupted = _run(tmp_path, "f-interrupted")
    (interrupted / "run" / "checkpoints" / "step-000005").mkdir(parents=True)
    (interrupted / launcher.PROCESS_FILE).write_text(json.dumps({"pid": 1, "exit_code": 130}))
    (tmp_path / "not-a-run").mkdir()
    listing = runs.listing(tmp_path)
    assert [(r["name"], r["state"], r["step"], r["total_steps"]) for r in listing] == [
        ("a-new", "new", 0, 10), ("b-stopped", "stopped", 3, 10), ("c-done", "finished", 0, 10),
        ("d-failed", "failed", 0, 10), ("e-failed-resume", "failed", 0, 10), ("f-interrupted", "stopped", 0, 10)]
    p = runs.progress(stopped)
    assert p["weights"] == ["b-stopped-step000005_comfyui.safetensors"] and p["checkpoints"] == ["step-000005"]
    assert p["log"].endswith("rss 2.5 GiB") and p["predicted"] == {}


def test_run_names_cannot_leave_the_runs_folder(tmp_path):
    with pytest.raises(FormError):
        runs.run_folder(tmp_path, "../x")


def test_launcher_records_the_process_and_stop_sends_sigint(tmp_path):
    """A stand-in for `leantune train` that exits 130 on SIGINT, as the trainer does after saving."""
    folder = tmp_path / "r"
    folder.mkdir()
    script = folder / "fake.py"
    script.write_text("import signal, sys, time\nprint('started', flush=True)\n"
                      "signal.signal(signal.SIGINT, lambda *a: sys.exit(130))\ntime.sleep(60)\n")
    info = launcher.start(folder, None, command=[sys.executable, str(script)])
    assert launcher.alive(folder)
    with pytest.raises(launcher.LaunchError, match="already running"):
        launcher.start(folder, folder / "config.toml")
    alive = lambda: launcher.alive(folder)
    wait_until(lambda: "started" in (folder / launcher.CONSOLE_FILE).read_text(), what="the stand-in to start",
               alive=alive)
    launcher.stop(folder)
    wait_until(lambda: launcher.read_process(folder).get("exit_code") is not None, what="the stand-in's exit code")
    record = launcher.read_process(folder)
    assert record["exit_code"] == 130 and record["pid"] == info["pid"]
    assert not launcher.is_alive(record, folder)
    with pytest.raises(launcher.LaunchError, match="not running"):
        launcher.stop(folder)


def test_train_command_resumes_with_the_flag(tmp_path):
    cmd = launcher.train_command(tmp_path / "c.toml", resume=True)
    assert cmd[1:4] == ["-m", "leantune", "train"] and cmd[-1] == "--resume"
    assert launcher.train_command(tmp_path / "c.toml")[-1] == str(tmp_path / "c.toml")


ANSWER_FITS = {"workload": "LoRA r8", "machine": {"name": "assumed GPU"}, "plans": [
    {"vram": "8GiB", "budget_bytes": 8 * 2**30, "plan": {
        "streamed_blocks": ["double.0", "double.1"], "fp8": False, "checkpointing": "blocks",
        "notes": {"predicted_peak_vram": 6 * 2**30, "predicted_peak_host": 20 * 2**30,
                  "vram_breakdown": {"weights resident": 5 * 2**30, "activations": 2**30},
                  "host_breakdown": {"process baseline": 2**31, "peak": 20 * 2**30}, "predicted_step_s": 3.5,
                  "total_blocks": 57, "machine_measured": False}}}]}


def test_summary_of_a_plan_that_fits():
    s = plan_answer.summarize(ANSWER_FITS)
    assert s["fits"] is True and s["message"] == "fits: predicted peak VRAM 6.00 GiB, host RAM 20.00 GiB"
    assert (s["streamed_blocks"], s["total_blocks"], s["step_s"]) == (2, 57, 3.5)
    assert s["vram_breakdown_gib"] == {"weights resident": 5.0, "activations": 1.0}
    assert "peak" not in s["host_breakdown_gib"]


def test_summary_of_a_budget_that_does_not_fit():
    answer = {"workload": "LoRA", "machine": {"name": "m"}, "plans": [
        {"vram": "1GiB", "budget_bytes": 2**30, "error": "no memory plan fits ...", "needed_vram": 3 * 2**30 // 2,
         "needed_ram": None}]}
    s = plan_answer.summarize(answer)
    assert s["fits"] is False and s["message"] == "does not fit: the smallest budget is 1.50 GiB"
    assert s["smallest_gib"] == 1.5 and s["detail"] == "no memory plan fits ..."


@pytest.mark.slow
def test_plan_answer_is_leantune_plans_answer(tmp_path, tiny_flux_dir):
    """In-process, through the command: a fitting budget and one below the smallest."""
    images = _images(tmp_path / "d")
    form = RunForm.from_fields({**FIELDS, "model_path": str(tiny_flux_dir), "dataset": str(images), "dtype": "fp32",
                                "resolutions": "64", "max_text_length": "16"})
    config = form.write(tmp_path / "c.toml")
    fits = plan_answer.summarize(plan_answer.plan_json(config, "1GiB"))
    assert fits["fits"] is True and 0 < fits["peak_vram_gib"] < 1
    assert f"predicted peak VRAM {fits['peak_vram_gib'] * 1024:.1f} MiB," in fits["message"]   # below 1 GiB: MiB
    tight = plan_answer.summarize(plan_answer.plan_json(config, "1MiB"))
    assert tight["fits"] is False and tight["smallest_gib"] > 0.001
    assert tight["message"].startswith("does not fit: the smallest budget is ")
    # the form's fields reach the answer: a larger resolution, a larger rank each predict more VRAM
    for key, value, part in (("resolutions", "128", "activations"), ("rank", "64", "adapters")):
        bigger = RunForm.from_fields({**FIELDS, "model_path": str(tiny_flux_dir), "dataset": str(images),
                                      "dtype": "fp32", "resolutions": "64", "max_text_length": "16", key: value})
        other = plan_answer.summarize(plan_answer.plan_json(bigger.write(tmp_path / f"{key}.toml"), "1GiB"))
        assert other["vram_breakdown_gib"][part] > fits["vram_breakdown_gib"][part], (key, other, fits)
        assert other["peak_vram_gib"] > fits["peak_vram_gib"]


def _serve(args: list[str], tmp_path: Path):
    import subprocess
    import urllib.request

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "leantune", "ui", "--runs", str(tmp_path / "runs"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    banner = proc.stdout.readline()
    return proc, banner, urllib.request


def test_bound_beyond_localhost_the_page_needs_the_printed_token(tmp_path):
    import socket
    import urllib.error

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, banner, request = _serve(["--host", "0.0.0.0", "--port", str(port)], tmp_path)
    try:
        assert "?token=" in banner, banner
        token = banner.split("?token=")[1].split()[0]
        base = f"http://127.0.0.1:{port}"
        refusals = []

        def refused() -> bool:
            try:
                request.urlopen(f"{base}/api/runs", timeout=2)
                pytest.fail("answered without the token")
            except urllib.error.HTTPError as e:
                refusals.append(e.code)
                return True
            except OSError:
                return False

        wait_until(refused, what="leantune ui to answer", alive=lambda: proc.poll() is None)
        assert refusals == [403]
        with request.urlopen(f"{base}/api/runs?token={token}", timeout=5) as r:
            assert json.loads(r.read()) == {"runs": []}
            cookie = r.headers["set-cookie"].split(";")[0]
        with request.urlopen(request.Request(f"{base}/api/choices", headers={"Cookie": cookie}), timeout=5) as r:
            assert "lora" in json.loads(r.read())["mode"]
        with pytest.raises(urllib.error.HTTPError):
            request.urlopen(f"{base}/api/runs?token={token}x", timeout=5)
    finally:
        proc.terminate()
        err = proc.communicate(timeout=30)[1]
    assert "warning: leantune ui is bound to 0.0.0.0" in err


def test_addresses_and_which_hosts_are_local(tmp_path):
    from leantune.ui.command import address, is_local

    assert [h for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "0.0.0.0", "::", "192.168.1.5", "myhost")
            if is_local(h)] == ["127.0.0.1", "127.0.0.2", "localhost", "::1"]
    assert address("127.0.0.1", 7860, "t") == "http://127.0.0.1:7860/?token=t"
    assert address("::", 80, "t") == "http://[::]:80/?token=t"


def test_upload_adds_a_decodable_image_and_never_overwrites(tmp_path):
    import io

    folder = _images(tmp_path / "d")
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (0, 200, 0)).save(buf, format="PNG")
    written = dataset_view.save_upload(str(folder), "new.png", buf.getvalue())
    assert written.read_bytes() == buf.getvalue()
    assert "new.png" in [e["name"] for e in dataset_view.scan(str(folder))]
    before = (folder / "a.png").read_bytes()
    for name, data, words in (("a.png", buf.getvalue(), "exists"), ("bad.png", b"garbage", "not a readable image"),
                              ("../up.png", buf.getvalue(), "not an image file name"),
                              ("x.exe", buf.getvalue(), "not an image file name")):
        with pytest.raises(dataset_view.DatasetViewError, match=words):
            dataset_view.save_upload(str(folder), name, data)
    assert (folder / "a.png").read_bytes() == before
    assert not (folder / "bad.png").exists() and not (tmp_path / "up.png").exists()


def test_sample_form_becomes_the_sample_command(tmp_path):
    from leantune.ui import sample_job

    cmd = sample_job.command({"model_path": "/m", "prompts": "a cat\n\na dog", "seed": "3", "steps": "",
                              "guidance": "3.5", "loras": "my.safetensors:0.8\n", "vram": "6GiB"}, tmp_path)
    assert cmd[1:4] == ["-m", "leantune", "sample"]
    args = cmd[4:]
    assert args == ["--model", "/m", "--out", str(tmp_path), "--prompt", "a cat", "--prompt", "a dog", "--seed", "3",
                    "--guidance", "3.5", "--lora", "my.safetensors:0.8", "--vram", "6GiB"]
    with pytest.raises(FormError, match="prompts"):
        sample_job.command({"model_path": "/m", "prompts": " "}, tmp_path)
    with pytest.raises(FormError, match="seed"):
        sample_job.command({"model_path": "/m", "prompts": "x", "seed": "abc"}, tmp_path)


def _sample_request(cmd: list[str]):
    """The SampleRequest `leantune sample` builds from the form's command (nothing loaded)."""
    import argparse

    from leantune.commands.sample import configure, request_data
    from leantune.infer.request import validate_request

    parser = argparse.ArgumentParser()
    configure(parser)
    return validate_request(*request_data(parser.parse_args(cmd[4:])))


def _model_folder(tmp_path: Path, cls: str) -> Path:
    folder = tmp_path / cls
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": cls}))
    return folder


def test_sample_form_negative_prompt_only_for_families_with_cfg(tmp_path):
    """The negative prompt reaches `leantune sample`'s request for a family sampling with
    classifier-free guidance (chosen, or named by the model's metadata), and is refused, naming
    the field, for one with distilled guidance; the page is told which families show the field."""
    from leantune.ui import sample_job
    from leantune.ui.app import create_app

    sd3, flux = _model_folder(tmp_path, "SD3Transformer2DModel"), _model_folder(tmp_path, "FluxTransformer2DModel")
    out = tmp_path / "out"
    fields = {"prompts": "a cat", "negative_prompt": " blurry, low quality "}
    cmd = sample_job.command({**fields, "model_path": str(sd3), "family": "sd3"}, out)
    assert cmd[cmd.index("--family") + 1] == "sd3" and cmd[cmd.index("--negative-prompt") + 1] == "blurry, low quality"
    request = _sample_request(cmd)
    assert request.negative_prompt == "blurry, low quality" and request.model.family == "sd3"
    guessed = sample_job.command({**fields, "model_path": str(sd3)}, out)          # family from the model
    assert "--family" not in guessed and _sample_request(guessed).negative_prompt == "blurry, low quality"
    for given in ({"model_path": str(flux)}, {"model_path": str(sd3), "family": "flux"}):
        with pytest.raises(FormError, match="negative_prompt: family 'flux'"):
            sample_job.command({**fields, **given}, out)
    plain = sample_job.command({"prompts": "a cat", "negative_prompt": "  ", "model_path": str(flux)}, out)
    assert "--negative-prompt" not in plain and _sample_request(plain).negative_prompt == ""
    with pytest.raises(FormError, match="family: 'sdxl'"):
        sample_job.command({**fields, "model_path": str(sd3), "family": "sdxl"}, out)

    routes = {r.path: r.endpoint for r in create_app(tmp_path / "runs", "t").routes if hasattr(r, "endpoint")}
    assert routes["/api/choices"]()["cfg_families"] == ["flux2-klein-4b", "flux2-klein-9b", "krea2", "qwen-image",
                                                        "qwen-image-2.1", "qwen-image-edit", "sd3", "wan2.2", "wan2.2-ti2v",
                                                        "z-image"]
    assert routes["/api/model-family"](str(sd3)) == {"family": "sd3"}
    assert routes["/api/model-family"](str(flux)) == {"family": "flux"}
    assert routes["/api/model-family"](str(tmp_path / "missing")) == {"family": None}
    page = (Path(sample_job.__file__).parent / "static" / "index.html").read_text()
    assert 'id="s_negative"' in page and 'id="s_family"' in page


def test_family_choices_come_from_the_family_registry(monkeypatch):
    from leantune.models import family
    from leantune.ui import form as form_module

    assert form_module.families() == sorted(family._MODULES) and "flux" in form_module.families()
    monkeypatch.setitem(family._MODULES, "newfam", "leantune.models.newfam")
    assert "newfam" in form_module.families()
    assert RunForm.from_fields({**FIELDS, "family": "newfam"}).to_dict()["model"]["family"] == "newfam"
    monkeypatch.delitem(family._MODULES, "newfam")
    with pytest.raises(FormError, match="family 'newfam'"):
        RunForm.from_fields({**FIELDS, "family": "newfam"})


@pytest.mark.parametrize("name", __import__("leantune.ui.form", fromlist=["families"]).families())
def test_every_registered_family_makes_a_config_train_loads(tmp_path, name):
    cfg = load_config(RunForm.from_fields({**FIELDS, "family": name}).write(tmp_path / "c.toml"))
    assert cfg.model.family == name


# Every field the issue names, and where it lands in the TOML (the plan reads that TOML).
WIRED = [("model_path", "/models/flux1-dev.safetensors", ("model", "path"), "/models/flux1-dev.safetensors"),
         ("family", "flux", ("model", "family"), "flux"), ("mode", "full", ("train", "mode"), "full"),
         ("rank", "32", ("lora", "rank"), 32), ("resolutions", "512 768,1024", ("data", "resolutions"), [512, 768, 1024]),
         ("steps", "1234", ("train", "steps"), 1234), ("learning_rate", "3e-5", ("train", "learning_rate"), 3e-5),
         ("vram_budget", "auto", ("memory", "vram_budget"), "auto"), ("vram_budget", "12GiB", ("memory", "vram_budget"), "12GiB"),
         ("ram_budget", "24GiB", ("memory", "ram_budget"), "24GiB")]


@pytest.mark.parametrize("key,value,where,expected", WIRED)
def test_each_issue_field_reaches_the_toml_train_loads(tmp_path, key, value, where, expected):
    form = RunForm.from_fields({**FIELDS, key: value})
    section, name = where
    assert form.to_dict()[section][name] == expected
    cfg = load_config(form.write(tmp_path / "c.toml"))
    assert getattr(getattr(cfg, section), name) == expected


def test_host_ram_auto_is_the_configs_default(tmp_path):
    assert RunForm().ram_budget == "auto"
    for auto in ("auto", "AUTO", ""):
        form = RunForm.from_fields({**FIELDS, "ram_budget": auto})
        assert "ram_budget" not in form.to_dict()["memory"]
        assert load_config(form.write(tmp_path / "c.toml")).memory.ram_budget is None


def test_full_mode_form_is_a_config_train_loads(tmp_path):
    cfg = load_config(RunForm.from_fields({**FIELDS, "mode": "full"}).write(tmp_path / "c.toml"))
    assert cfg.train.mode == "full"


def _endpoint(app, path: str, method: str):
    for route in app.routes:
        if getattr(route, "path", None) == path and method in getattr(route, "methods", ()):
            return route.endpoint
    raise AssertionError(f"no route {method} {path}")


def test_a_config_the_planner_declines_is_its_answer_not_an_error(tmp_path, monkeypatch):
    """E.g. a mode the planner does not price yet: the page shows the planner's words as "not planned"."""
    from leantune.ui.app import create_app

    def declines(config, vram, ram=None, stock=None, gpu=""):
        raise ConfigError("the planner does not plan this yet")

    def cannot(config, vram, ram=None, stock=None, gpu=""):
        raise ValueError("the planner cannot build a probe copy of a newfam model")
    monkeypatch.setattr(plan_answer, "plan_json", declines)
    plan = _endpoint(create_app(tmp_path / "runs", "t"), "/api/plan", "POST")
    answer = plan({**FIELDS, "mode": "full"})
    assert answer == {"fits": None, "planned": False, "message": "not planned: the planner does not plan this yet",
                      "field": None}
    with pytest.raises(ConfigError, match="vram_budget"):        # a field the config refuses stays an error
        plan({**FIELDS, "vram_budget": "lots"})
    monkeypatch.setattr(plan_answer, "plan_json", cannot)
    assert plan({**FIELDS, "rank": "3"})["message"] == "not planned: the planner cannot build a probe copy of a newfam model"


def test_full_mode_plan_answer_is_the_planners_full_fine_tune_plan(tmp_path, tiny_flux_dir):
    """Through the real planner: full mode prices every trained weight's optimizer state, so its
    plan needs more VRAM than a LoRA plan of the same model and budget; a missing model is refused
    as the planner's answer (naming the path), not raised."""
    from leantune.ui.app import create_app

    plan = _endpoint(create_app(tmp_path / "runs", "t"), "/api/plan", "POST")
    fields = {**FIELDS, "model_path": str(tiny_flux_dir), "dataset": str(_images(tmp_path / "d")), "dtype": "fp32",
              "resolutions": "64", "max_text_length": "16", "vram_budget": "1GiB"}
    full, lora = plan({**fields, "mode": "full"}), plan(fields)
    assert full["fits"] is True and full["message"].startswith("fits: predicted peak VRAM")
    assert full["peak_vram_gib"] > lora["peak_vram_gib"] > 0
    missing = plan({**FIELDS, "mode": "full"})
    assert missing["planned"] is False and "/models/flux" in missing["message"]
    assert missing["field"] == "model_path" and "[model]" not in missing["message"]        # the page's words
    assert missing["message"].startswith(f'not planned: "{labels()["model_path"]}"')


def test_a_refused_run_form_leaves_no_run_folder(tmp_path):
    from leantune.ui.app import create_app

    start = _endpoint(create_app(tmp_path / "runs", "t", [tmp_path]), "/api/runs", "POST")
    with pytest.raises(ConfigError):
        start({**FIELDS, "dataset": str(_images(tmp_path / "d")), "vram_budget": "lots"})
    assert not (tmp_path / "runs" / "cats").exists()


def _tiny_fields(tmp_path, tiny_flux_dir, **more):
    return {**FIELDS, "model_path": str(tiny_flux_dir), "dataset": str(_images(tmp_path / "d")), "dtype": "fp32",
            "resolutions": "64", "max_text_length": "16", "vram_budget": "1GiB", **more}


@pytest.mark.slow
def test_host_ram_auto_is_this_machines_ram_checked(tmp_path, tiny_flux_dir, monkeypatch):
    """On a machine without a GPU the command leaves host RAM unchecked; the page trains here, so
    "auto" is this machine's RAM: a small machine's plan does not fit, and says it is host RAM."""
    from leantune import host as machine
    from leantune.ui.app import create_app

    plan = _endpoint(create_app(tmp_path / "runs", "t"), "/api/plan", "POST")
    fields = _tiny_fields(tmp_path, tiny_flux_dir, ram_budget="auto")
    monkeypatch.setattr(machine, "host_ram", lambda: (4 * 2**30, 2 * 2**30 + 200 * 2**20))    # 4 GiB, 2.2 free
    small = plan(fields)
    assert small["fits"] is False, small
    assert "host RAM" in small["message"] and "this machine's" in small["ram"]
    monkeypatch.setattr(machine, "host_ram", lambda: (512 * 2**30, 500 * 2**30))
    big = plan(fields)
    assert big["fits"] is True and "this machine's" in big["ram"]
    assert plan({**fields, "ram_budget": "100MiB"})["fits"] is False     # a size given is that size


@pytest.mark.slow
def test_the_plan_is_said_in_words_and_offers_the_smallest_budget(tmp_path, tiny_flux_dir, monkeypatch):
    from leantune.ui import system
    from leantune.ui.app import create_app

    monkeypatch.setattr(system, "gpus", lambda: [])               # a machine without a GPU
    plan = _endpoint(create_app(tmp_path / "runs", "t"), "/api/plan", "POST")
    fields = _tiny_fields(tmp_path, tiny_flux_dir, ram_budget="64GiB", steps="1000")
    fits = plan(fields)
    assert fits["fits"] is True
    assert fits["words"].startswith("the whole model stays on the GPU; ") and "for 1000 steps on" in fits["words"]
    assert fits["ram_budget_gib"] == 64 and fits["budget_gib"] == 1            # the bars' scales: the budgets
    assert fits["assumed_machine"] and fits["words"].endswith("this machine has no GPU, so a run here trains on the "
                                                              "CPU, many times slower (choose your GPU under “Plan "
                                                              "for GPU”)")
    monkeypatch.setattr(system, "gpus", lambda: [{"name": "GPU", "used": 0, "total": 2**34, "utilization": 0.0}])
    with_gpu = _endpoint(create_app(tmp_path / "runs2", "t"), "/api/plan", "POST")(fields)
    assert "no GPU" not in with_gpu["words"]
    assert "about under" not in fits["words"]
    tight = plan({**fields, "vram_budget": "1MiB"})
    assert tight["fits"] is False and tight["smallest_budget"].endswith("MiB")
    assert "--" not in tight["detail"] and "[memory]" not in tight["detail"]      # no advice naming a CLI flag
    taken = plan({**fields, "vram_budget": tight["smallest_budget"]})            # the one click
    assert taken["fits"] is True, taken
    assert "stream from host RAM" in taken["words"] or "stays on the GPU" in taken["words"]


@pytest.mark.slow
def test_a_stock_model_is_planned_without_weights_and_cannot_start(tmp_path):
    from leantune.ui.app import create_app

    app = create_app(tmp_path / "runs", "t", [tmp_path])
    plan = _endpoint(app, "/api/plan", "POST")
    answer = plan({**FIELDS, "model_path": "flux-dev", "dataset": "", "resolutions": "1024", "rank": "16",
                   "max_text_length": "512", "vram_budget": "8GiB", "ram_budget": "128GiB", "steps": "1000"})   # no images
    assert answer["fits"] is True, answer
    assert "of 57 blocks stream from host RAM" in answer["words"] or "all 57 blocks" in answer["words"], answer
    assert answer["total_blocks"] == 57 and 0 < answer["peak_vram_gib"] < 8
    with pytest.raises(ValueError, match="stock architecture"):
        _endpoint(app, "/api/runs", "POST")({**FIELDS, "model_path": "flux-dev", "dataset": str(_images(tmp_path / "d"))})


def test_a_preset_whose_model_folder_is_missing_says_so_and_offers_the_stock_name(tmp_path):
    """The examples name model folders of their authors' machines: importing one says the folder is
    not here and offers the stock architecture it most likely is, which plans without files."""
    from leantune.ui.app import create_app

    imported = _endpoint(create_app(tmp_path / "runs", "t"), "/api/import", "POST")
    for preset, stock in (("example: flux-dev-lora", "flux-dev"), ("example: flux-schnell-lora", "flux-schnell")):
        answer = imported({"preset": preset, "fields": {}})
        path = answer["fields"]["model_path"]
        assert not Path(path).exists(), path
        assert answer["stock"] == stock and any(f"{path!r} is not on this machine" in n and repr(stock) in n
                                                for n in answer["notes"]), answer["notes"]
    model = tmp_path / "FLUX.1-dev"
    model.mkdir()
    relative = imported({"toml": "[model]\npath = 'm'\n[[data.datasets]]\npath = 'd'\n", "fields": {}})["notes"]
    assert relative == [f'"{labels()["model_path"]}" = \'m\' is relative to its file: give the model\'s folder',
                        f'"{labels()["dataset"]}" = \'d\' is relative to its file: give the image folder']
    here = imported({"toml": f"[model]\npath = '{model}'\n", "fields": {}})
    assert here["stock"] is None and not any("not on this machine" in n for n in here["notes"])
    assert plan_answer.stock_for("/models/stable-diffusion-3.5-large", "sd3") == "sd3.5-large"
    assert plan_answer.stock_for("/m/x", "no-such-family") is None


def test_every_config_key_is_reachable_through_the_extra_toml(tmp_path):
    """The fields hold the common keys; the rest is TOML merged over them and validated as
    `leantune train` validates it, errors naming the key."""
    form = RunForm.from_fields({**FIELDS, "extra_toml": "[train]\nmax_grad_norm = 0.5\nkeep_last = 5\n"
                                                         "[lora]\ndropout = 0.1\n"})
    cfg = load_config(form.write(tmp_path / "c.toml"))
    assert cfg.train.max_grad_norm == 0.5 and cfg.train.keep_last == 5 and cfg.lora.dropout == 0.1
    assert cfg.lora.rank == 8                                   # the fields' keys stay
    with pytest.raises(ConfigError, match="bogus"):
        RunForm.from_fields({**FIELDS, "extra_toml": "[train]\nbogus = 1\n"}).write(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="max_grad_norm"):
        RunForm.from_fields({**FIELDS, "extra_toml": "[train]\nmax_grad_norm = -1\n"}).write(tmp_path / "c.toml")
    with pytest.raises(FormError, match="extra_toml: .*line 2"):
        RunForm.from_fields({**FIELDS, "extra_toml": "[train]\nmax_grad_norm = = 1\n"})
    with pytest.raises(FormError, match=r"\[output\] dir"):
        RunForm.from_fields({**FIELDS, "extra_toml": "[output]\ndir = '/elsewhere'\n"}).to_dict()


@pytest.mark.parametrize("preset", sorted(__import__("leantune.ui.form", fromlist=["presets"]).presets()))
def test_a_preset_imported_into_the_form_is_the_same_config(tmp_path, preset):
    """Import (fields + extra TOML), then save: the config `leantune train` loads is the preset's,
    but for the paths the user gives and the output folder the page owns."""
    import tomllib

    from leantune.ui.form import presets

    source = presets()[preset]
    doc = tomllib.loads(source.read_text())
    form, notes = RunForm.from_toml(source.read_text(), RunForm(model_path="/m", dataset="/d"))
    assert form.model_path == "/m" and any("relative" in n for n in notes) or form.model_path.startswith("/")
    doc["model"]["path"] = form.model_path
    doc["data"]["datasets"][0]["path"] = form.dataset
    doc.setdefault("output", {}).update(dir="run", name=form.name)
    import tomli_w

    (tmp_path / "want.toml").write_text(tomli_w.dumps(doc))
    want = load_config(tmp_path / "want.toml").model_dump()
    got = load_config(form.write(tmp_path / "got.toml")).model_dump()
    assert got == want


def test_a_runs_config_comes_back_as_the_form_clone(tmp_path):
    form = RunForm.from_fields({**FIELDS, "lora_targets": "all_linear", "lr_scheduler": "cosine", "warmup_steps": "20",
                                "timestep_sampling": "uniform", "caption_dropout": "0.05", "repeats": "3",
                                "sample_guidance": "1.0", "sample_seed": "4", "extra_toml": "[train]\nkeep_last = 2\n"})
    again, notes = RunForm.from_toml(form.to_toml())
    assert again.as_fields() == form.as_fields() and notes == []


@pytest.mark.slow
def test_captioning_with_a_local_image_to_text_model(tmp_path):
    """A tiny random BLIP built offline captions the images without a caption; existing captions
    stay unless asked; a folder that is not a model is refused with words, not a traceback."""
    from tests.tiny_captioner import WORDS, save_tiny_blip

    from leantune.ui import captioner

    model = save_tiny_blip(tmp_path / "blip")
    folder = _images(tmp_path / "d")
    status = tmp_path / "status.json"
    assert captioner.caption_folder(str(model), str(folder), status) == 0
    written = (folder / "b.txt").read_text().strip()
    assert written and set(written.split()) <= set(WORDS), written       # the model's own words
    assert (folder / "a.txt").read_text() == "a red\nbox\n"                # had a caption: kept
    assert json.loads(status.read_text())["done"] == 1
    assert captioner.caption_folder(str(model), str(folder), status, overwrite=True) == 0
    assert (folder / "a.txt").read_text().strip() != "a red box"
    assert captioner.caption_folder(str(tmp_path / "d"), str(folder), status) == 2
    error = json.loads(status.read_text())["error"]
    assert "not a local image-to-text model" in error and "Traceback" not in error


def test_a_second_start_waits_in_line_and_starts_when_the_first_ends(tmp_path, monkeypatch):
    """One job at a time: a run submitted while another is alive is queued, and the line moves
    when the machine is free (a stand-in trainer that exits when its folder holds a 'done' file)."""
    from leantune.ui import queue

    script = tmp_path / "fake.py"
    script.write_text("import pathlib, time\nwhile not pathlib.Path('done').exists():\n    time.sleep(0.05)\n")
    monkeypatch.setattr(launcher, "train_command", lambda config, resume=False: [sys.executable, str(script)])
    runs_dir = tmp_path / "runs"
    first, second = _run(runs_dir, "first"), _run(runs_dir, "second")
    assert queue.submit(runs_dir, first, resume=False)["started"] is True
    answer = queue.submit(runs_dir, second, resume=False)
    assert answer == {"started": False, "queued": True, "position": 1, "running": ["first"]}
    assert runs.state(second) == "queued" and queue.advance(runs_dir) is None        # first still runs
    third = _run(runs_dir, "third")
    assert queue.submit(runs_dir, third, resume=True)["position"] == 2
    assert queue.leave(third) and runs.state(third) == "new" and not queue.leave(third)   # Stop while waiting
    (first / "done").write_text("")
    wait_until(lambda: not launcher.alive(first), what="the first run ending", poll_s=0.05)
    assert queue.advance(runs_dir) == "second"
    assert launcher.alive(second) and runs.state(second) == "running"
    (second / "done").write_text("")


def test_the_machine_line_reads_host_ram_and_nvidia_smi(tmp_path, monkeypatch):
    """Host RAM always; GPU memory and utilisation from nvidia-smi where there is one (a stand-in
    script here), none without it."""
    from leantune.ui import system

    monkeypatch.setenv("PATH", str(tmp_path))                 # no nvidia-smi on this PATH
    assert system.gpus() == []
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 1024, 81559, 37'\n")
    fake.chmod(0o755)
    assert system.gpus() == [{"name": "NVIDIA H100 80GB HBM3", "used": 1024 * 2**20, "total": 81559 * 2**20,
                              "utilization": 37.0}]
    host = system.host()
    assert 0 < host["available"] <= host["total"]


def test_the_toml_preview_names_the_refused_key_without_temp_paths(tmp_path):
    import tempfile

    from leantune.ui.app import create_app

    preview = _endpoint(create_app(tmp_path / "runs", "t"), "/api/toml", "POST")
    answer = preview({**FIELDS, "extra_toml": "[train]\nbogus = 1\n"})
    assert "bogus" in answer["error"] and "[train]" in answer["error"] and tempfile.gettempdir() not in answer["error"]
    assert answer["field"] == "extra_toml" and answer["error"].startswith(labels()["extra_toml"])
    assert preview(FIELDS)["error"] is None
    empty = preview({})                   # a first view: nothing typed yet is no error
    assert empty["error"] is None and empty["field"] is None


def test_watching_says_what_the_trainer_does_before_step_1_then_elapsed_and_eta(tmp_path):
    folder = _run(tmp_path, "w", steps=100)
    (folder / launcher.CONSOLE_FILE).write_text("$ python -m leantune train config.toml\n"
                                                "caching captions:  50%|#####     | 12/24\rcaching captions: 100%|##########| 24/24\n")
    before = runs.progress(folder)
    assert before["steps"] == [] and before["activity"] == "caching captions: 100%|##########| 24/24"
    (folder / "run" / "train.log").write_text("2026-11-24 08:26:19,908 INFO model: Flux (tiny) from /m (fp32)\n")
    assert runs.progress(folder)["activity"] == "model: Flux (tiny) from /m (fp32)"       # the log, no timestamp
    (folder / "run" / "train.log").write_text(LOG)
    info = launcher.start(folder, None, command=[sys.executable, "-c", "import time; time.sleep(60)"])
    try:           # the run alive (its own process, in its folder), launched at t=1000 s
        (folder / launcher.PROCESS_FILE).write_text(json.dumps({**info, "started": 1000.0}))
        t = runs.timing(folder, runs.parse_log(LOG), 100, now=1060.0)
    finally:
        os.kill(info["pid"], 9)
    assert t["elapsed_s"] == 60.0 and t["eta_s"] == pytest.approx((100 - 3) * (1.52 + 1.30 + 1.30) / 3)


def test_the_runs_time_adds_up_across_stop_and_resume(tmp_path):
    """A run that trained 30 s, then 60 s (stopped), then resumed: its time carries on from 90 s,
    not from 0; a fresh start (not a resume) counts from 0 again."""
    folder = _run(tmp_path, "r", steps=100)
    (folder / launcher.PROCESS_FILE).write_text(json.dumps({"pid": 1, "exit_code": 0, "started": 100.0,
                                                            "ended": 160.0, "before_s": 30.0}))
    assert runs.timing(folder, [], 100)["elapsed_s"] == 90.0                  # stopped: the two launches
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    info = launcher.start(folder, None, resume=True, command=sleeper)
    try:
        assert info["before_s"] == 90.0
        (folder / launcher.PROCESS_FILE).write_text(json.dumps({**info, "started": 1000.0}))
        assert runs.timing(folder, [], 100, now=1012.0)["elapsed_s"] == 102.0   # 90 before + 12 now
    finally:
        os.kill(info["pid"], 9)
    wait_until(lambda: not launcher.alive(folder), what="the sleeper to end")
    (folder / launcher.PROCESS_FILE).write_text(json.dumps({"pid": 1, "exit_code": 0, "started": 1.0, "ended": 2.0,
                                                            "before_s": "forged"}))
    assert launcher.time_before(launcher.read_process(folder)) == 0.0          # a record without numbers: 0
    fresh = launcher.start(folder, None, resume=False, command=sleeper)
    try:
        assert fresh["before_s"] == 0.0
    finally:
        os.kill(fresh["pid"], 9)


def test_the_gallery_cuts_each_prompts_image_out_of_the_grids(tmp_path):
    """A trainer's sample grid (3 prompts of 16 px, two to a row, its PNG metadata saying the size)
    gives back prompt i's image at each step."""
    from leantune.infer.images import make_grid, save_png

    folder = _run(tmp_path, "g")
    (folder / "config.toml").write_text("[train]\nsteps = 10\n[sample]\nprompts = ['red', 'green', 'blue']\n")
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
    (folder / "run" / "samples").mkdir()
    for step in (5, 10):
        grid = make_grid([Image.new("RGB", (16, 16), c) for c in colours])
        save_png(grid, folder / "run" / "samples" / f"step-{step:06d}.png", {"width": 16, "height": 16, "prompt": []})
    p = runs.progress(folder)
    assert p["gallery"] == {"prompts": ["red", "green", "blue"], "steps": [
        {"step": 5, "file": "step-000005.png", "video": False}, {"step": 10, "file": "step-000010.png", "video": False}]}
    import io

    for i, colour in enumerate(colours):
        tile = Image.open(io.BytesIO(runs.sample_tile(folder, "step-000010.png", i)))
        assert tile.size == (16, 16) and tile.getpixel((8, 8)) == colour
    with pytest.raises(ValueError, match="no image 4"):
        runs.sample_tile(folder, "step-000010.png", 4)


def test_a_run_reads_only_a_dataset_under_the_pages_roots(tmp_path):
    from leantune.ui.app import create_app

    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    start = _endpoint(create_app(tmp_path / "runs", "t", [inside]), "/api/runs", "POST")
    with pytest.raises(dataset_view.OutsideRoots, match="outside the folders this page may use"):
        start({**FIELDS, "dataset": str(_images(outside))})
    assert not (tmp_path / "runs" / "cats").exists()


def test_the_dataset_view_gets_small_thumbnails_made_once_and_remade_when_the_image_changes(tmp_path):
    """A 1200x900 photo-like PNG comes back as a JPEG of at most 160 px a side and a few KB (1000 of
    them under 5 MB), the image as the trainer reads it (EXIF turned); the second ask reads the kept
    file, and an edited image gets a new thumbnail. Kept under the runs folder, not the dataset's."""
    import io
    import random

    from leantune.ui import thumbs
    from leantune.ui.app import create_app

    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(0)
    photo = Image.new("RGB", (1200, 900))
    # gradients with grain (a photo's mix of smooth areas and texture; pure noise is no photo)
    photo.putdata([(x * 255 // 1200, y * 255 // 900, 128 + rng.randrange(-24, 25)) for y in range(900) for x in range(1200)])
    exif = Image.Exif()
    exif[0x0112] = 6                         # "rotate 90° clockwise to display": shown 900 wide, 1200 high
    photo.save(data / "a.jpg", exif=exif.tobytes(), quality=90)
    app = create_app(tmp_path / "runs", "t", [data])
    thumb = _endpoint(app, "/api/dataset/thumb", "GET")
    first = thumb(str(data), "a.jpg")
    assert first.media_type == "image/jpeg"
    shown = Image.open(io.BytesIO(first.body))
    assert shown.format == "JPEG" and shown.size == (120, 160)            # turned as displayed, longer side 160
    assert len(first.body) < 5_000_000 // 1000, len(first.body)
    kept = list((tmp_path / "runs" / thumbs.FOLDER).iterdir())
    assert len(kept) == 1 and kept[0].read_bytes() == first.body
    assert sorted(p.name for p in data.iterdir()) == ["a.jpg"]            # nothing written beside the images
    kept[0].write_bytes(b"\xff\xd8kept\xff\xd9")                          # the second ask reads the kept file
    assert thumb(str(data), "a.jpg").body == b"\xff\xd8kept\xff\xd9"
    kept[0].write_bytes(first.body[:100])                                 # one cut short (a crash): made again
    assert thumb(str(data), "a.jpg").body == first.body == kept[0].read_bytes()
    Image.new("RGB", (64, 32), (0, 200, 0)).save(data / "a.jpg")        # edited: a new thumbnail
    os.utime(data / "a.jpg", ns=(1, 1))
    again = Image.open(io.BytesIO(thumb(str(data), "a.jpg").body))
    assert again.size == (64, 32) and again.getpixel((32, 16))[1] > 150
    with pytest.raises(dataset_view.OutsideRoots):
        thumb(str(_images(tmp_path / "elsewhere")), "a.png")


@pytest.mark.slow
def test_a_plan_for_the_gpu_the_user_names(tmp_path, monkeypatch):
    """Plan for GPU (planner/cards.py): the stock model's plan takes the named card's speed and says
    its name; "auto" is that card's memory; the config the run would get has no trace of it; a card
    the page does not offer is named by its field."""
    from leantune.ui import system
    from leantune.ui.app import create_app
    from leantune.ui.form import RunForm

    monkeypatch.setattr(system, "gpus", lambda: [])
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "cache"))
    plan = _endpoint(create_app(tmp_path / "runs", "t", [tmp_path]), "/api/plan", "POST")
    stock = {**FIELDS, "model_path": "flux-schnell", "dataset": "", "resolutions": "512", "max_text_length": "256",
             "vram_budget": "auto", "ram_budget": "128GiB", "steps": "1000"}
    small, big = plan({**stock, "plan_gpu": "rtx3060-12gb"}), plan({**stock, "plan_gpu": "rtx4090"})
    assert small["fits"] is True and big["fits"] is True, (small, big)
    assert (small["budget_gib"], big["budget_gib"]) == (12, 24)
    assert "on RTX 3060 12 GB (assumed)" in small["words"] and "on RTX 4090 24 GB (assumed)" in big["words"]
    assert small["step_s"] > 3 * big["step_s"]                    # 25.6 against 165.2 TFLOP/s
    assert "choose your GPU" not in small["words"]
    assert "plan_gpu" not in RunForm.from_fields({**stock, "plan_gpu": "rtx3090"}, complete=False).to_toml()
    with pytest.raises(ValueError, match="plan_gpu 'gtx1080': one of rtx3060-12gb"):
        plan({**stock, "plan_gpu": "gtx1080"})


@pytest.mark.slow
def test_a_video_models_stock_plan_prices_the_longest_clip(tmp_path, monkeypatch):
    """A stock video model (wan2.2-a14b) is planned at the form's Longest clip: more frames, more
    activations (the plan used to price one frame, an image)."""
    from leantune.ui import system
    from leantune.ui.app import create_app

    monkeypatch.setattr(system, "gpus", lambda: [])
    monkeypatch.setenv("LEANTUNE_CACHE", str(tmp_path / "cache"))
    plan = _endpoint(create_app(tmp_path / "runs", "t", [tmp_path]), "/api/plan", "POST")
    wan = {**FIELDS, "model_path": "wan2.2-a14b", "family": "wan2.2", "dataset": "", "resolutions": "480",
           "max_text_length": "512", "vram_budget": "24GiB", "ram_budget": "256GiB"}
    short, long = plan({**wan, "max_frames": "17"}), plan({**wan, "max_frames": "49"})
    assert short["fits"] is True and long["fits"] is True, (short, long)
    assert long["vram_breakdown_gib"]["activations"] > 2 * short["vram_breakdown_gib"]["activations"]
