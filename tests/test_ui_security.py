"""`leantune ui` as an attacker meets it, over HTTP: one test per attack.

The server is started as a user starts it (`leantune ui --port P --runs DIR`, in the folder the
user works in, which is the page's dataset root unless `--data` says otherwise) and driven with
raw HTTP requests, so a request can carry any Host, Origin or body a hostile web page or a local
user could send. Each test also makes the legitimate request, so a server that refused everything
would fail it. Every hostile request carries the valid session secret unless the secret is what
the test is about, and each refusal is checked for the words of the check that made it (the guard's
"leantune ui: ..." line, or a route's JSON error), so no test passes only because a request lacked
the secret.
"""

from __future__ import annotations

import http.client
import io
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Page:
    """The running server: its printed address, the secret in it, and a raw HTTP client."""

    def __init__(self, port: int, token: str, root: Path, runs: Path):
        self.port, self.token, self.root, self.runs = port, token, root, runs
        self.origin = f"http://127.0.0.1:{port}"

    def request(self, method: str, path: str, *, host: str | None = None, origin: str | None = None,
                secret: bool = True, cookie: bool = False, body: bytes | None = None,
                headers: dict | None = None) -> tuple[int, bytes]:
        """One request. `secret`: carry the session secret as the page's own script does (a header);
        `cookie`: carry it only as the cookie a browser would attach to any same-site request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        h = {"Host": host or f"127.0.0.1:{self.port}", **(headers or {})}
        if origin:
            h["Origin"] = origin
        if secret and self.token:
            h["X-Leantune-Token"] = self.token
        if cookie and self.token:
            h["Cookie"] = f"leantune_token_{self.port}={self.token}"
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, data

    def json(self, method: str, path: str, payload: dict, **kw) -> tuple[int, bytes]:
        kw.setdefault("origin", self.origin)
        return self.request(method, path, body=json.dumps(payload).encode(),
                            headers={"Content-Type": "application/json"}, **kw)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("work")
    runs = root / "runs"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "leantune", "ui", "--port", str(port), "--runs", str(runs)],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    banner = proc.stdout.readline()
    url = banner.split()[2] if banner.startswith("leantune ui:") else ""
    query = urlsplit(url).query
    token = query.split("token=", 1)[1] if "token=" in query else ""
    p = Page(port, token, root, runs)
    deadline = time.time() + 120
    while True:
        try:
            if p.request("GET", "/api/runs" + (f"?token={token}" if token else ""))[0] == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, (banner, proc.stdout.read() if proc.poll() else "")
        time.sleep(0.3)
    yield p
    proc.terminate()
    proc.wait(30)
    for folder in runs.glob("*"):                    # runs the tests started outlive the server by design
        try:
            info = json.loads((folder / "process.json").read_text())
            os.killpg(info["pid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def route_refusal(status: int, body: bytes) -> str:
    """The error a route gave (JSON), asserting the guard (plain text 'leantune ui: ...') let the
    request through: a refusal for a missing secret would test nothing about the route's check."""
    assert status in (400, 403), (status, body)
    assert not body.startswith(b"leantune ui:"), f"refused by the guard, not the route: {body!r}"
    return json.loads(body)["error"]


def guard_refusal(status: int, body: bytes, words: bytes) -> None:
    """A refusal by the guard's check whose message holds `words` (not by another of its checks)."""
    assert status == 403 and body.startswith(b"leantune ui:") and words in body, (status, body)


def _dataset(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), (200, 0, 0)).save(folder / "a.png")
    (folder / "a.txt").write_text("a red square\n")
    return folder


def _png(size, mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def _sleeper() -> subprocess.Popen:
    """A process the page did not start (what a reused pid points at)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def _run_folder(page: Page, name: str) -> Path:
    folder = page.runs / name
    (folder / "run").mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text("[train]\nsteps = 10\n")
    return folder


def test_the_printed_address_carries_a_secret_and_nothing_answers_without_it(page):
    """A local user of a shared machine who finds the port gets nothing."""
    assert page.token, "the printed address has no ?token= on 127.0.0.1"
    for path in ("/api/runs", "/", f"/api/runs?token={page.token}x"):
        guard_refusal(*page.request("GET", path, secret=False), b"?token=")
    status, body = page.request("GET", f"/?token={page.token}", secret=False)
    assert status == 200 and b"<html" in body
    assert page.request("GET", "/api/runs", secret=False, cookie=True)[0] == 200


def test_a_non_ascii_token_is_refused_not_a_server_error(page):
    guard_refusal(*page.request("GET", "/api/runs?token=" + quote("jeton-é"), secret=False), b"?token=")
    guard_refusal(*page.request("GET", "/api/runs", secret=False, headers={"Cookie": f"leantune_token_{page.port}=%C3%A9"}),
                  b"?token=")
    assert page.request("GET", "/api/runs")[0] == 200


def test_dns_rebinding_a_foreign_host_header_is_refused(page):
    """After rebinding, the attacker's name points at 127.0.0.1 and its page reads our responses;
    only the Host header tells the difference."""
    _dataset(page.root / "rebind")
    for path in ("/", "/api/runs", f"/api/dataset?path={quote(str(page.root / 'rebind'))}"):
        guard_refusal(*page.request("GET", path, host=f"attacker.example:{page.port}", cookie=True),
                      b"is not this page's address")
        assert page.request("GET", path, host=f"localhost:{page.port}")[0] == 200, path
    assert page.request("GET", "/api/runs", host=f"[::1]:{page.port}")[0] == 200


def test_a_cross_site_form_post_cannot_stop_a_run(page):
    """A plain HTML form on any page (no custom header possible) posts to Stop; the browser attaches
    the same-site cookie. The run must keep running. A foreign Origin is refused even with the
    secret's header (so the Origin check is what is tested); a post without an Origin carries only
    the cookie, and the header check refuses it."""
    folder = _run_folder(page, "victim")
    from leantune.ui import launcher

    info = launcher.start(folder, None, command=[sys.executable, "-c", "import time; time.sleep(120)"])
    form = {"body": b"", "headers": {"Content-Type": "application/x-www-form-urlencoded"}, "cookie": True}
    try:
        for origin in ("http://attacker.example", f"http://127.0.0.1:{page.port + 1}"):
            guard_refusal(*page.request("POST", "/api/runs/victim/stop", origin=origin, **form), b"another site")
        guard_refusal(*page.request("POST", "/api/runs/victim/stop", secret=False, **form), b"X-Leantune-Token")
        time.sleep(0.3)
        assert launcher.alive(folder)
        status, body = page.request("POST", "/api/runs/victim/stop", origin=page.origin)
        assert status == 200, body
    finally:
        with contextlib.suppress(ProcessLookupError):      # the accepted Stop may have ended it already
            os.killpg(info["pid"], signal.SIGKILL)


def test_a_json_caption_post_from_a_foreign_origin_is_refused(page):
    folder = _dataset(page.root / "captions")
    body = {"path": str(folder), "name": "a.png", "caption": "pwned"}
    guard_refusal(*page.json("POST", "/api/caption", body, origin="http://attacker.example", cookie=True),
                  b"another site")
    assert (folder / "a.txt").read_text() == "a red square\n"
    assert page.json("POST", "/api/caption", {**body, "caption": "a red box"})[0] == 200
    assert (folder / "a.txt").read_text() == "a red box\n"


def test_datasets_are_confined_to_the_roots_chosen_at_start(tmp_path, page):
    """path= reaches only folders under the page's data roots (here its working folder)."""
    outside = _dataset(tmp_path / "elsewhere")
    inside = _dataset(page.root / "inside")
    outside_words = "outside the folders this page may use"
    for route in ("/api/dataset?path={}", "/api/dataset/image?path={}&name=a.png", "/api/dataset/thumb?path={}&name=a.png"):
        assert outside_words in route_refusal(*page.request("GET", route.format(quote(str(outside)))))
        climbing = inside / ".." / ".." / outside.parent.name / outside.name
        assert outside_words in route_refusal(*page.request("GET", route.format(quote(str(climbing)))))
        assert page.request("GET", route.format(quote(str(inside))))[0] == 200
    caption = {"path": str(outside), "name": "a.png", "caption": "x"}
    assert outside_words in route_refusal(*page.json("POST", "/api/caption", caption))
    assert (outside / "a.txt").read_text() == "a red square\n"
    put = page.request("PUT", f"/api/dataset/image?path={quote(str(outside))}&name=new.png", body=_png((8, 8)),
                       origin=page.origin)
    assert outside_words in route_refusal(*put) and not (outside / "new.png").exists()
    link = page.root / "link-out"
    link.symlink_to(outside)
    assert outside_words in route_refusal(*page.request("GET", f"/api/dataset?path={quote(str(link))}"))


def test_uploads_have_a_size_limit(page):
    folder = _dataset(page.root / "uploads")
    big = _png((8, 8)) + b"\0" * (80 * 2**20)          # 80 MiB that starts as a PNG
    status, body = page.request("PUT", f"/api/dataset/image?path={quote(str(folder))}&name=big.png", body=big,
                                origin=page.origin)
    assert status == 413, body
    assert not (folder / "big.png").exists()
    assert page.request("PUT", f"/api/dataset/image?path={quote(str(folder))}&name=ok.png", body=_png((8, 8)),
                        origin=page.origin)[0] == 200


def test_an_upload_that_decodes_to_too_many_pixels_is_refused(page):
    """16000 x 11000 compresses to a small PNG and decodes to hundreds of MB."""
    folder = _dataset(page.root / "bombs")
    bomb = _png((16000, 11000), mode="1")
    assert len(bomb) < 2**20
    status, body = page.request("PUT", f"/api/dataset/image?path={quote(str(folder))}&name=bomb.png", body=bomb,
                                origin=page.origin)
    assert status == 400 and b"pixels" in body, body
    assert not (folder / "bomb.png").exists()


def test_concurrent_resumes_start_one_trainer(page):
    """Three Resume clicks at once: one process starts, the others are told it runs."""
    folder = _run_folder(page, "raced")
    # a config resume accepts (it is loaded and its paths checked before a trainer starts)
    (folder / "config.toml").write_text(f"[model]\npath = '/models/none'\n[[data.datasets]]\n"
                                        f"path = '{_dataset(page.root / 'raced-data')}'\n[output]\ndir = 'run'\n")
    (folder / "run" / "checkpoints" / "step-000005").mkdir(parents=True)
    results = []

    def resume():
        results.append(page.request("POST", "/api/runs/raced/resume", origin=page.origin))
    threads = [threading.Thread(target=resume) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    console = (folder / "console.log").read_text()
    assert console.count("$ ") == 1, console
    assert sorted(status for status, _ in results) == [200, 400, 400], results
    assert all(b"already running" in body for status, body in results if status == 400)


def test_stop_never_signals_a_process_the_page_did_not_start(page):
    """process.json names a pid that now belongs to another process (pid reuse, or an edited file)."""
    folder = _run_folder(page, "reused")
    other = _sleeper()
    try:
        (folder / "process.json").write_text(json.dumps({"pid": other.pid, "exit_code": None,
                                                         "started": time.time() - 3600}))
        status, body = page.request("GET", "/api/runs/reused")
        assert status == 200 and json.loads(body)["state"] != "running"
        error = route_refusal(*page.request("POST", "/api/runs/reused/stop", origin=page.origin))
        assert f"names process {other.pid}" in error and "not signalled" in error, error
        time.sleep(0.3)
        assert other.poll() is None, "the unrelated process was signalled"
    finally:
        other.kill()
        other.wait()
