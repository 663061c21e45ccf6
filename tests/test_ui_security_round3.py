"""`leantune ui` against the holes of issue 41, round three: each test makes the hostile request
and the legitimate one beside it, so a page that refused everything would fail too.

- Confinement over the merged config: the extra TOML can add datasets, references, a cache or an
  output folder anywhere, so every path of the validated config is checked against the page's
  roots (ui/confine.py), and a key the config gains later is checked as a path until it is listed.
- The links a dataset's scan follows (a sub-folder, an image, a caption, a reference) stay in the
  data roots: a run whose datasets link out is refused before it starts (ui/links.py).
- A caption (or image) of a dataset that is a symlink out of the data roots is not read.
- Stop signals only the process the page started in that folder (command line and working folder,
  not only the pid and start time a hand-edited process.json can name).
- Two page servers on one runs folder start one trainer at a time from one queue.
HTTP cases go through a real `leantune ui` carrying the valid session secret (test_ui_security.py's
page), so each is refused by the check it names, never by the secret check.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import quote

import pytest
from PIL import Image
from progress_wait import wait_until
from test_ui import FIELDS, _endpoint
from test_ui_security import _dataset, _run_folder, _sleeper, page, route_refusal  # noqa: F401  (page: the module's server)

from leantune.config import DataConfig, RunConfig, SampleConfig, validate, validate_model
from leantune.ui import confine, dataset_view, launcher, queue, runs

ROOT = Path(__file__).resolve().parents[1]


# -- every path of the merged config ------------------------------------------------------------

def _roots(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """(data root, runs folder, this run's folder, a folder outside all of them), resolved."""
    data, runs_dir, outside = tmp_path / "data", tmp_path / "runs", tmp_path / "outside"
    for p in (data, runs_dir / "cats", outside):
        p.mkdir(parents=True, exist_ok=True)
    return data.resolve(), runs_dir.resolve(), (runs_dir / "cats").resolve(), outside.resolve()


def _base(data: Path) -> dict:
    _dataset(data / "cats")
    return {"model": {"path": "/models/flux", "family": "flux"},
            "data": {"datasets": [{"path": str(data / "cats")}]}, "output": {"dir": "run", "name": "cats"}}


def _edit(doc: dict) -> dict:
    doc["model"]["family"] = "qwen-image-edit"
    return doc


def _image(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32)).save(path)
    return str(path)


def _json(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    return str(path)


def _full_deepspeed(doc: dict, where: str) -> dict:
    doc.pop("lora", None)
    doc["train"] = {"mode": "full"}
    doc["distributed"] = {"strategy": "deepspeed", "deepspeed_config": where}
    return doc


# key -> (the config with the key at `place`, the section and key the refusal names): each confined
# key of confine.PATHS, set once inside its roots (accepted) and once outside (refused by name)
CASES = {
    "data.datasets.path": (lambda doc, place: {**doc, "data": {"datasets": [doc["data"]["datasets"][0],
                                                                            {"path": str(_dataset(place / "more"))}]}},
                           "[[data.datasets]] #2 path"),
    "data.datasets.reference_path": (lambda doc, place: _edit({**doc, "data": {"datasets": [
        {**doc["data"]["datasets"][0], "reference_path": str(_dataset(place / "refs"))}]}}),
        "[[data.datasets]] #1 reference_path"),
    "data.datasets.mask_path": (lambda doc, place: {**doc, "data": {"datasets": [
        {**doc["data"]["datasets"][0], "mask_path": str(_dataset(place / "masks"))}]}},
        "[[data.datasets]] #1 mask_path"),
    "validation.path": (lambda doc, place: {**doc, "validation": {"path": str(_dataset(place / "held-out"))}},
                        "[validation] path"),
    "sample.references": (lambda doc, place: _edit({**doc, "sample": {"references": [_image(place / "r.png")]}}),
                          "[sample] references #1"),
    "data.cache_dir": (lambda doc, place: {**doc, "data": {**doc["data"], "cache_dir": str(place / "cache")}},
                       "[data] cache_dir"),
    "output.dir": (lambda doc, place: {**doc, "output": {**doc["output"], "dir": str(place / "run")}}, "[output] dir"),
    "distributed.deepspeed_config": (lambda doc, place: _full_deepspeed(doc, _json(place / "ds.json")),
                                     "[distributed] deepspeed_config"),
    "memory.disk_dir": (lambda doc, place: {**doc, "memory": {**doc.get("memory", {}), "disk_dir": str(_made(place / "disk"))}},
                        "[memory] disk_dir"),
}


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _inside(key: str, data: Path, runs_dir: Path, run: Path) -> Path:
    """A place the key may name: the data roots for what is read, the run (or runs) folder for
    what is written."""
    roots = confine.PATHS[key]
    return {confine.DATA: data, confine.RUN: run, confine.RUNS: runs_dir}[roots[0]]


def test_every_free_text_key_of_the_config_is_listed_as_a_path_or_as_text():
    """The config's paths are plain strings: a key the config gains is found here (and checked as a
    path until it is listed), so confinement cannot silently miss it."""
    keys = set(confine.free_text_keys(RunConfig))
    assert {"model.path", "model.vae", "data.datasets.path", "data.datasets.reference_path", "data.cache_dir",
            "lora.init_from", "sample.references", "output.dir", "distributed.deepspeed_config",
            "sample.prompts", "data.datasets.trigger_word"} <= keys
    assert not {"model.family", "model.dtype", "train.mode", "base_dir"} & keys      # Literal or not a key
    listed = set(confine.PATHS) | set(confine.TEXT) | set(confine.NAMES)
    assert keys - listed == set(), "config keys the page does not know as a path or as text"
    assert listed - keys == set(), "listed keys the config no longer has"
    confined = {k for k, roots in confine.PATHS.items() if roots != (confine.ANYWHERE,)}
    assert confined == set(CASES), "every confined key needs its case here"


@pytest.mark.parametrize("key", sorted(CASES))
def test_each_path_key_outside_its_roots_is_refused_naming_the_key_and_the_path(tmp_path, key):
    data, runs_dir, run, outside = _roots(tmp_path)
    build, where = CASES[key]
    good = validate(build(_base(data), _inside(key, data, runs_dir, run)), "config.toml", base_dir=run)
    confine.check(good, [data], run, runs_dir)                         # inside its roots: accepted
    bad = validate(build(_base(data), outside), "config.toml", base_dir=run)
    with pytest.raises(dataset_view.OutsideRoots) as e:
        confine.check(bad, [data], run, runs_dir)
    message = str(e.value)
    assert message.startswith(where + " = ") and str(outside) in message, message
    # a symlink inside the roots that points outside is outside
    (_inside(key, data, runs_dir, run) / "way-out").symlink_to(outside)
    linked = validate(build(_base(data), _inside(key, data, runs_dir, run) / "way-out"), "config.toml", base_dir=run)
    with pytest.raises(dataset_view.OutsideRoots, match="a link to " + str(outside)):
        confine.check(linked, [data], run, runs_dir)


def test_model_weights_may_lie_anywhere_and_names_stay_one_component(tmp_path):
    """The allow-list's other answers: model files are read as weights only, from any folder (the
    form's model field and `leantune sample` take any path); the output name is one file-name
    component inside the run's folder, never a path."""
    data, runs_dir, run, outside = _roots(tmp_path)
    doc = _base(data)
    doc["model"].update(path=str(outside / "flux"), vae=str(outside / "vae.safetensors"))
    doc["lora"] = {"init_from": str(outside / "old.safetensors")}
    cfg = validate(doc, "config.toml", base_dir=run)
    confine.check(cfg, [data], run, runs_dir)
    for name in ("../victim", "/abs/victim", "", "a/b", ".."):
        named = cfg.model_copy(update={"output": cfg.output.model_copy(update={"name": name})})
        with pytest.raises(dataset_view.OutsideRoots, match=r"\[output\] name = "):
            confine.check(named, [data], run, runs_dir)


def test_a_cache_shared_by_the_pages_runs_stays_under_the_runs_folder(tmp_path):
    data, runs_dir, run, outside = _roots(tmp_path)
    shared = validate({**_base(data), "data": {**_base(data)["data"], "cache_dir": "../shared-cache"}},
                      "config.toml", base_dir=run)
    confine.check(shared, [data], run, runs_dir)
    into_data = validate({**_base(data), "data": {**_base(data)["data"], "cache_dir": str(data / "c")}},
                         "config.toml", base_dir=run)
    with pytest.raises(dataset_view.OutsideRoots, match=r"\[data\] cache_dir = .*outside the page's runs folder"):
        confine.check(into_data, [data], run, runs_dir)


def test_a_key_the_config_gains_later_is_checked_as_a_path_until_it_is_listed(tmp_path):
    """A future [sample] masks = "..." (str) or [data] priors (a Path): not in the lists, so either
    must lie under the data roots or the run's folder."""
    class FutureSample(SampleConfig):
        masks: str | None = None

    class FutureData(DataConfig):
        priors: Path | None = None

    class FutureConfig(RunConfig):
        sample: FutureSample = FutureSample()
        data: FutureData

    data, runs_dir, run, outside = _roots(tmp_path)
    assert {"sample.masks", "data.priors"} <= set(confine.free_text_keys(FutureConfig))
    for section, key in (("sample", "masks"), ("data", "priors")):
        for place, refused in ((data / "m", False), (run / "m", False), (outside / "m", True)):
            doc = _base(data)
            doc.setdefault(section, {})[key] = str(place)
            cfg = validate_model(FutureConfig, doc, "config.toml", run, "configuration")
            if not refused:
                confine.check(cfg, [data], run, runs_dir)
                continue
            with pytest.raises(dataset_view.OutsideRoots, match=rf"\[{section}\] {key} = .*{outside}"):
                confine.check(cfg, [data], run, runs_dir)


def _fake_trainer(monkeypatch, tmp_path: Path) -> None:
    """`leantune train` replaced by a process that exits at once: what is tested is the decision
    to start it."""
    monkeypatch.setattr(launcher, "train_command", lambda config, resume=False: [sys.executable, "-c", "pass"])


def test_a_run_whose_extra_toml_adds_an_outside_dataset_is_refused_and_leaves_no_folder(tmp_path, monkeypatch):
    """Issue 41's case: the form's dataset lies inside --data, the extra TOML adds one outside."""
    from leantune.ui.app import create_app

    _fake_trainer(monkeypatch, tmp_path)
    data, runs_dir, _, outside = _roots(tmp_path)
    inside, elsewhere = _dataset(data / "cats"), _dataset(outside / "secret-images")
    start = _endpoint(create_app(runs_dir, "t", [data]), "/api/runs", "POST")
    extra = f"[[data.datasets]]\npath = '{inside}'\n\n[[data.datasets]]\npath = '{elsewhere}'\n"
    with pytest.raises(dataset_view.OutsideRoots, match=rf"^\[\[data.datasets\]\] #2 path = '{elsewhere}'"):
        start({**FIELDS, "name": "tabby", "dataset": str(inside), "extra_toml": extra})
    assert not (runs_dir / "tabby").exists()
    more = _dataset(data / "dogs")
    answer = start({**FIELDS, "name": "tabby", "dataset": str(inside),
                    "extra_toml": f"[[data.datasets]]\npath = '{inside}'\n\n[[data.datasets]]\npath = '{more}'\n"})
    assert answer["started"] is True


def test_resume_checks_the_runs_config_too(tmp_path, monkeypatch):
    """A run folder's config.toml that names a folder outside the roots (written by hand, or by a
    page before this check) is not resumed."""
    from leantune.ui.app import create_app

    _fake_trainer(monkeypatch, tmp_path)
    data, runs_dir, run, outside = _roots(tmp_path)
    (run / "config.toml").write_text(f"[model]\npath = '/models/flux'\n[[data.datasets]]\npath = '{_dataset(outside / 'x')}'\n"
                                     f"[output]\ndir = 'run'\nname = 'cats'\n")
    resume = _endpoint(create_app(runs_dir, "t", [data]), "/api/runs/{name}/resume", "POST")
    with pytest.raises(dataset_view.OutsideRoots, match=r"\[\[data.datasets\]\] #1 path"):
        resume("cats")
    assert launcher.read_process(run) is None
    (run / "config.toml").write_text((run / "config.toml").read_text().replace(str(outside / "x"), str(_dataset(data / "y"))))
    assert resume("cats")["started"] is True


def test_over_http_an_outside_dataset_in_the_extra_toml_is_refused_by_the_route(page, tmp_path):
    inside, elsewhere = _dataset(page.root / "r3-inside"), _dataset(tmp_path / "r3-elsewhere")
    fields = {**FIELDS, "name": "r3-extra", "model_path": str(tmp_path / "model"), "dataset": str(inside),
              "vram_budget": "", "extra_toml": f"[[data.datasets]]\npath = '{inside}'\n\n[[data.datasets]]\npath = '{elsewhere}'\n"}
    status, body = page.json("POST", "/api/runs", fields)
    error = route_refusal(status, body)
    # named under the extra TOML's label, in the TOML's own words (the user wrote that table there)
    from leantune.ui.labels import labels
    assert error.startswith(f"{labels()['extra_toml']}: [[data.datasets]] #2 path = ") and str(elsewhere) in error, error
    assert json.loads(body)["field"] == "extra_toml"
    assert not (page.runs / "r3-extra").exists()
    # the same form with both datasets inside: accepted, and queued behind a run that is alive (so
    # no trainer starts here)
    busy = _run_folder(page, "r3-busy")
    info = launcher.start(busy, None, command=[sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ok = {**fields, "extra_toml": f"[[data.datasets]]\npath = '{inside}'\n"}
        status, body = page.json("POST", "/api/runs", ok)
        assert status == 200 and json.loads(body)["queued"] is True, body
        assert page.request("POST", "/api/runs/r3-extra/stop", origin=page.origin)[0] == 200     # leaves the line
    finally:
        os.killpg(info["pid"], signal.SIGKILL)


# -- the links a dataset's scan follows stay inside the data roots --------------------------------

def _links_out(data: Path, outside: Path, kind: str) -> tuple[Path, Path]:
    """data/dogs, a dataset of the page's, holding one link of `kind` that points out of the data
    roots (the folder, image or caption the trainer's scan would follow); (the link, its target)."""
    dogs = _dataset(data / "dogs")
    if kind == "folder":
        target = _dataset(outside / "secret-images")
        link = dogs / "more"
    elif kind == "image":
        target = outside / "far.png"
        Image.new("RGB", (32, 32)).save(target)
        link = dogs / "c.png"
    else:
        target = outside / "secret.txt"
        target.write_text("the secret of another folder\n")
        Image.new("RGB", (32, 32)).save(dogs / "b.png")
        link = dogs / "b.txt"                                           # b's caption
    link.symlink_to(target)
    return link, target


@pytest.mark.parametrize("kind", ["folder", "image", "caption"])
def test_a_dataset_whose_scan_follows_a_link_out_of_data_is_refused_and_leaves_no_folder(tmp_path, monkeypatch, kind):
    """Every path of the config lies inside --data, but the scan the trainer runs follows a
    symlinked sub-folder, image or caption inside the dataset to a file outside: refused naming
    the dataset's key, the link and where it points."""
    from leantune.ui.app import create_app

    _fake_trainer(monkeypatch, tmp_path)
    data, runs_dir, _, outside = _roots(tmp_path)
    cats = _dataset(data / "cats")
    link, target = _links_out(data, outside, kind)
    start = _endpoint(create_app(runs_dir, "t", [data]), "/api/runs", "POST")
    extra = f"[[data.datasets]]\npath = '{cats}'\n\n[[data.datasets]]\npath = '{data / 'dogs'}'\n"
    with pytest.raises(dataset_view.OutsideRoots) as e:
        start({**FIELDS, "name": "tabby", "dataset": str(cats), "extra_toml": extra})
    message = str(e.value)
    assert message.startswith("[[data.datasets]] #2 path") and str(link) in message and str(target) in message, message
    assert "secret" not in message.replace(str(outside / "secret"), "")      # the file's name, never its text
    assert not (runs_dir / "tabby").exists()


def test_links_that_stay_inside_data_are_followed_and_the_run_starts(tmp_path, monkeypatch):
    """A symlinked sub-folder (and caption) pointing at another folder under --data is the common
    way to reuse images: accepted."""
    from leantune.ui.app import create_app

    _fake_trainer(monkeypatch, tmp_path)
    data, runs_dir, _, outside = _roots(tmp_path)
    cats, dogs = _dataset(data / "cats"), _dataset(data / "dogs")
    (cats / "more").symlink_to(dogs)
    Image.new("RGB", (32, 32)).save(cats / "b.png")
    (cats / "b.txt").symlink_to(dogs / "a.txt")
    start = _endpoint(create_app(runs_dir, "t", [data]), "/api/runs", "POST")
    assert start({**FIELDS, "name": "tabby", "dataset": str(cats), "extra_toml": ""})["started"] is True


def test_resume_refuses_a_reference_file_that_links_out_of_data(tmp_path, monkeypatch):
    """The reference folder is scanned too (the trainer's index of it), and Resume checks as Start does."""
    from leantune.ui.app import create_app

    _fake_trainer(monkeypatch, tmp_path)
    data, runs_dir, run, outside = _roots(tmp_path)
    refs = data / "refs"
    refs.mkdir()
    Image.new("RGB", (32, 32)).save(outside / "far.png")
    (refs / "a.png").symlink_to(outside / "far.png")
    (run / "config.toml").write_text(f"[model]\npath = '/models/qwen'\nfamily = 'qwen-image-edit'\n[[data.datasets]]\n"
                                     f"path = '{_dataset(data / 'y')}'\nreference_path = '{refs}'\n"
                                     f"[output]\ndir = 'run'\nname = 'cats'\n")
    resume = _endpoint(create_app(runs_dir, "t", [data]), "/api/runs/{name}/resume", "POST")
    with pytest.raises(dataset_view.OutsideRoots,
                       match=rf"^\[\[data.datasets\]\] #1 reference_path.*{re.escape(str(refs / 'a.png'))}"
                             rf".*{re.escape(str(outside / 'far.png'))}"):
        resume("cats")
    assert launcher.read_process(run) is None
    (refs / "a.png").unlink()
    Image.new("RGB", (32, 32)).save(refs / "a.png")
    assert resume("cats")["started"] is True


# -- the dataset view reads nothing through a link out of the roots ------------------------------

def _linked_dataset(root: Path, outside: Path) -> Path:
    folder = _dataset(root / "linked")                                  # a.png, a.txt: its own
    (outside / "secret.txt").write_text("the secret of another folder\n")
    Image.new("RGB", (64, 48)).save(outside / "far.png")
    Image.new("RGB", (32, 32)).save(folder / "b.png")
    (folder / "b.txt").symlink_to(outside / "secret.txt")               # b's caption links out
    (folder / "c.png").symlink_to(outside / "far.png")                   # c links out itself
    return folder


def test_a_caption_or_image_that_links_outside_the_roots_is_not_read(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    folder = _linked_dataset(data, outside)
    entries = {e["name"]: e for e in dataset_view.scan(str(folder), roots=[data.resolve()])}
    assert entries["a.png"]["caption"] == "a red square" and entries["a.png"]["warnings"] == []
    assert entries["b.png"]["caption"] == "" and "secret" not in json.dumps(entries)
    assert any("b.txt" in w and "links outside" in w for w in entries["b.png"]["warnings"]), entries["b.png"]
    assert (entries["c.png"]["width"], entries["c.png"]["height"]) == (None, None)
    assert any("links outside" in w for w in entries["c.png"]["warnings"]), entries["c.png"]
    # a link that stays inside the roots is read
    (folder / "b.txt").unlink()
    (folder / "b.txt").symlink_to(folder / "a.txt")
    entries = {e["name"]: e for e in dataset_view.scan(str(folder), roots=[data.resolve()])}
    assert entries["b.png"]["caption"] == "a red square" and entries["b.png"]["warnings"] == []


def test_writing_a_caption_over_a_link_out_writes_in_the_folder_not_through_the_link(tmp_path):
    data, outside = tmp_path / "data", tmp_path / "outside"
    outside.mkdir()
    folder = _linked_dataset(data, outside)
    written = dataset_view.write_caption(str(folder), "b.png", "a black square", roots=[data.resolve()])
    assert written == folder.resolve() / "b.txt" and not written.is_symlink()
    assert written.read_text() == "a black square\n"
    assert (outside / "secret.txt").read_text() == "the secret of another folder\n"


def test_over_http_the_dataset_view_does_not_show_a_caption_linked_from_outside(page, tmp_path):
    outside = tmp_path / "far"
    outside.mkdir()
    folder = _linked_dataset(page.root / "r3-captions", outside)
    status, body = page.request("GET", f"/api/dataset?path={quote(str(folder))}")
    assert status == 200, body
    entries = {e["name"]: e for e in json.loads(body)["images"]}
    assert entries["a.png"]["caption"] == "a red square"
    assert b"the secret" not in body and any("links outside" in w for w in entries["b.png"]["warnings"])
    image = f"/api/dataset/image?path={quote(str(folder))}&name="
    assert "links outside" in route_refusal(*page.request("GET", image + "c.png"))      # the image linked out
    assert page.request("GET", image + "a.png")[0] == 200


# -- Stop signals only the page's own process -----------------------------------------------------

def _cmdline(pid: int) -> list[str]:
    return [os.fsdecode(a) for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]


def _forged_record(folder: Path, other: subprocess.Popen, command: list[str]) -> None:
    """process.json as a hostile edit writes it: another process's pid with its real start time."""
    (folder / launcher.PROCESS_FILE).write_text(json.dumps({
        "pid": other.pid, "proc_start": launcher.start_time(other.pid), "command": command,
        "started": time.time(), "resume": False, "exit_code": None}))


def _stand_in(folder: Path) -> list[str]:
    script = folder / "stand_in.py"
    script.write_text("import signal, sys, time\nsignal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
                      "print('up', flush=True)\ntime.sleep(120)\n")
    return [sys.executable, str(script)]


def test_a_process_is_the_runs_only_with_its_command_line_and_working_folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    info = launcher.start(folder, None, command=_stand_in(folder))
    other = _sleeper()
    try:
        assert launcher.is_alive(launcher.read_process(folder), folder)
        assert not launcher.is_alive(launcher.read_process(folder), tmp_path)           # another folder
        assert not launcher.is_alive({**info, "command": info["command"] + ["--resume"]}, folder)
        assert not launcher.is_alive({k: v for k, v in info.items() if k != "command"}, folder)
        same_cmd = {"pid": other.pid, "proc_start": launcher.start_time(other.pid), "command": _cmdline(other.pid),
                    "exit_code": None}
        assert not launcher.is_alive(same_cmd, folder)           # its command, but not run in this folder
    finally:
        os.killpg(info["pid"], signal.SIGKILL)
        other.kill()
        other.wait()


def test_over_http_stop_refuses_an_edited_process_record_naming_a_live_process(page):
    """The hostile edit copies the other process's pid, start time and even its command line."""
    folder = _run_folder(page, "r3-forged")
    other = _sleeper()
    try:
        for command in (_cmdline(other.pid), launcher.train_command(folder / "config.toml")):
            _forged_record(folder, other, command)
            error = route_refusal(*page.request("POST", "/api/runs/r3-forged/stop", origin=page.origin))
            assert f"process {other.pid}" in error and "not signalled" in error, error
            status, body = page.request("GET", "/api/runs/r3-forged")
            assert status == 200 and json.loads(body)["state"] != "running"
        time.sleep(0.3)
        assert other.poll() is None, "the unrelated process was signalled"
    finally:
        other.kill()
        other.wait()
    (folder / launcher.PROCESS_FILE).unlink()
    info = launcher.start(folder, None, command=_stand_in(folder))         # the page's own: stopped
    try:
        wait_until(lambda: "up" in (folder / launcher.CONSOLE_FILE).read_text(), what="the stand-in to start")
        status, body = page.request("POST", "/api/runs/r3-forged/stop", origin=page.origin)
        assert status == 200, body
        wait_until(lambda: launcher.read_process(folder).get("exit_code") is not None, what="the stand-in's exit")
        assert launcher.read_process(folder)["exit_code"] == 130
    finally:
        if launcher.is_alive(launcher.read_process(folder), folder):
            os.killpg(info["pid"], signal.SIGKILL)


# -- one queue, two page servers -------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import leantune.io  # noqa: F401  (what the first process.json write imports, torch with it: before the race)
    from leantune.ui import launcher, queue

    runs_dir, fake, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    launcher.train_command = lambda config, resume=False: [sys.executable, fake, config.parent.name]
    (go.parent / f"ready-{os.getpid()}").write_text("")
    while not go.exists():
        time.sleep(0.01)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            queue.advance(runs_dir)
        except Exception as e:             # a lost race may raise; what counts is what started
            print(type(e).__name__, e, flush=True)
        if not queue.waiting(runs_dir) and not queue.alive(runs_dir):
            break
""")

FAKE_TRAINER = textwrap.dedent("""
    import sys, time
    log = sys.argv[0].rsplit("/", 1)[0] + "/trainers.log"
    with open(log, "a") as f:
        f.write(f"start {sys.argv[1]} {time.time():.6f}\\n")
    time.sleep(0.25)
    with open(log, "a") as f:
        f.write(f"end {sys.argv[1]} {time.time():.6f}\\n")
""")


def test_two_page_servers_racing_one_queue_start_each_run_once_and_one_at_a_time(tmp_path):
    """Two processes advance one runs folder's line as fast as they can: each queued run starts
    exactly once and no two trainers run at once (a stand-in trainer logs when it runs)."""
    runs_dir = tmp_path / "runs"
    names = [f"q{i}" for i in range(8)]
    for i, name in enumerate(names):
        folder = runs_dir / name
        (folder / "run").mkdir(parents=True)
        (folder / "config.toml").write_text("[train]\nsteps = 1\n")
        (folder / runs.QUEUED_FILE).write_text(json.dumps({"queued_at": 1000.0 + i, "resume": False}))
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "fake.py").write_text(FAKE_TRAINER)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(runs_dir), str(tmp_path / "fake.py"),
                                 str(go)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, what="both workers to import leantune",
               alive=lambda: all(w.poll() is None for w in workers))
    go.write_text("")
    outs = [w.communicate(timeout=120)[0] for w in workers]
    wait_until(lambda: not queue.alive(runs_dir), what="the last stand-in trainer to end")
    assert [w.returncode for w in workers] == [0, 0], outs
    log = (tmp_path / "trainers.log").read_text().split("\n")[:-1]
    started = sorted(line.split()[1] for line in log if line.startswith("start"))
    assert started == names, (started, outs)                              # each once
    running = 0
    for line in sorted(log, key=lambda line: float(line.split()[2])):
        running += 1 if line.startswith("start") else -1
        assert running <= 1, f"two trainers at once: {log}"
    for name in names:
        assert (runs_dir / name / launcher.CONSOLE_FILE).read_text().count("$ ") == 1, name
