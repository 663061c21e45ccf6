"""The page's Check button: `leantune check` on the form's config, in its own process, line by line.

Before Start, a user can prove the plan's memory techniques on their own model and data: the check
(leantune/check/) runs a few steps without any technique and once per technique the plan uses,
and says of each whether it held. It loads the model several times, so it runs as its own process
(python -m leantune.ui.check_job CONFIG LINES STEPS) in the runs folder's _check/ folder, one at a
time and never beside a training run (the queue counts it as a job: queue.alive); its lines are
written to LINES (JSON, replaced atomically after each) as the check says them, which the page polls.
The config is the form's TOML, checked and confined as a run's is before anything starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FOLDER = "_check"
CONFIG = "check-config.toml"   # not config.toml: the folder is no run (runs.run_folders)
LINES = "check.json"
STEPS = 2


def folder(runs_dir: Path) -> Path:
    return Path(runs_dir) / FOLDER


def command(config: Path, steps: int = STEPS) -> list[str]:
    return [sys.executable, "-m", "leantune.ui.check_job", str(config), str(config.parent / LINES), str(steps)]


def status(runs_dir: Path) -> dict:
    """{"running", "lines", "progress", "done", "rc", "error", "verdict"} of the last check."""
    from . import launcher

    job = folder(runs_dir)
    try:
        said = json.loads((job / LINES).read_text())
    except (OSError, ValueError):
        said = {}
    info = launcher.read_process(job) or {}
    running = launcher.is_alive(info, job)
    out = {"running": running, "lines": said.get("lines", []), "progress": said.get("progress", ""),
           "done": bool(said.get("done")), "rc": said.get("rc"), "error": said.get("error"),
           "verdict": said.get("verdict", "")}
    if not running and not out["done"] and not out["error"] and info:
        code = info.get("exit_code")
        out["error"] = (f"the check stopped (exit code {code}); see {job / launcher.CONSOLE_FILE}" if code is not None
                        else "the check is not running (the page was restarted while it ran?)")
    return out


def verdict(rc: int | None) -> str:
    """The check's exit code in the page's words (commands/check.py's codes)."""
    from ..check.run import REFERENCE_DOES_NOT_FIT

    return {0: "every technique held", 1: "a technique differs: see its line",
            REFERENCE_DOES_NOT_FIT: "not checked: the plain model does not fit this machine"}.get(rc, "")


def main(argv: list[str]) -> int:
    """The check's process: run it, writing each line as it comes."""
    from ..config import ConfigError, load_config
    from ..io import atomic_write_json

    config, lines_path, steps = Path(argv[0]), Path(argv[1]), int(argv[2])
    said: dict = {"lines": [], "progress": "loading the config", "done": False, "rc": None, "error": None}

    def write() -> None:
        atomic_write_json(lines_path, said)

    def emit(line: str) -> None:
        said["lines"].append(line)
        print(line, flush=True)
        write()

    def progress(line: str) -> None:
        said["progress"] = line
        write()

    write()
    try:
        cfg = load_config(config)
        from ..check.run import run_check

        result = run_check(cfg, steps, emit=emit, progress=progress)
    except (ConfigError, ValueError, OSError) as e:
        said.update(error=str(e).replace(str(config), "the form's config"), done=True, rc=2)
        write()
        return 2
    nothing = result.rc == 0 and any(line.startswith("nothing to compare") for line in said["lines"])
    said.update(done=True, rc=result.rc, progress="",
                verdict="nothing to check: the plan uses no memory technique" if nothing else verdict(result.rc))
    write()
    return result.rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
