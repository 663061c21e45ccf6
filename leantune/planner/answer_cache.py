"""`leantune plan --model ...` answers kept, so that asking the same question again costs no torch.

What it trades: one small JSON file per question in the leantune cache for a repeated
`leantune plan --model flux-dev ...` on a machine without a GPU that imports neither torch nor the
planner: it reads the answer it printed before and prints it again. Such an answer is a function
of the flags, of the packaged architecture and of leantune's code alone: without a GPU the planner
uses assumed rates, no calibration and no host-RAM limit (unless --ram is given, which is a flag).
The only thing that changes is this machine's free host RAM in the "machine" line, which is read
again and put in. (A full fine-tune whose streamed blocks step on the host is timed with this
machine's CPU optimizer rate, full_model.host_step_rate: the kept answer keeps the rate measured
when it was computed, on this same machine.) The key covers every flag, the source of the planner, engine, models and the
plan command, and the torch/diffusers/peft versions, so a change to any of them answers afresh.

Only answers computed with assumed rates are kept, and they are used only where no GPU device
node is visible (`machine.gpu_device_visible`); with a GPU the planner measures it every time.
The config form (`leantune plan my.toml`) is not kept here: its answer depends on files the
config names, which only the family's loader can resolve (the measurement cache, spec_cache.py,
still spares it the model build and the probes).

Each answer records where it came from (`origin`: leantune's version, the checkout its code was
read from, that checkout's commit when it is a git checkout, and when it was saved), and a replayed
answer says so on stderr: with several checkouts of leantune sharing one cache folder (two clones,
an installed copy and a working tree), an answer is traceable to the code that computed it.

A kept file that is not such an answer (hand-edited, half-written, another program's) is ignored
with one warning naming it, and the question is planned again, which replaces it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from importlib import metadata
from pathlib import Path

log = logging.getLogger("leantune")

# Code whose change can change an answer (relative to the leantune package; folders: every .py/.json in them).
# train/fused_optim.py and train/in_backward.py: a full fine-tune's update is measured by running them.
_ANSWERING_CODE = ("planner", "memory", "models", "commands/plan.py", "config.py", "train/lora.py",
                   "train/fused_optim.py", "train/in_backward.py")


def _cache_dir() -> Path:
    base = os.environ.get("LEANTUNE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "leantune")
    return Path(base) / "plan-answers"


def _code_fingerprint() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for rel in _ANSWERING_CODE:
        path = root / rel
        files = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".json")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes() if f.exists() else b"-")
    for dist in ("torch", "diffusers", "peft"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    return h.hexdigest()


def answer_path(question: dict) -> Path:
    """Where the answer to `question` (every flag of the command, JSON-able) is kept."""
    blob = json.dumps({"question": question, "code": _code_fingerprint()}, sort_keys=True, default=str)
    return _cache_dir() / f"{hashlib.sha256(blob.encode()).hexdigest()[:24]}.json"


def load_answer(question: dict) -> dict | None:
    """The kept answer ({"stdout", "stderr", "rc", "machine"}) or None (none yet, or unreadable)."""
    from .kept_files import read_json

    path = answer_path(question)
    try:
        return _checked(read_json(path), bool(question.get("json")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:          # kept_files.BadKeptFile is a ValueError
        log.warning("plan: ignoring the kept answer %s (%s); planning again", path, e)
    return None


def _checked(answer, as_json: bool) -> dict:
    """`answer` if it has the shape `save_answer` writes and the replay reads, else BadKeptFile."""
    from .kept_files import BadKeptFile, loads

    if not isinstance(answer, dict):
        raise BadKeptFile(f"a JSON {type(answer).__name__}, not an answer's table")
    for key, kind in (("stdout", str), ("stderr", str), ("rc", int), ("machine", dict)):
        if not isinstance(answer.get(key), kind) or isinstance(answer.get(key), bool):
            raise BadKeptFile(f"'{key}' is {answer.get(key)!r}, not a {kind.__name__}")
    if not isinstance(answer["machine"].get("describe"), str):
        raise BadKeptFile("'machine' has no 'describe' text")
    if not isinstance(answer.get("origin", {}), dict):
        raise BadKeptFile(f"'origin' is {answer['origin']!r}, not a table")
    if as_json:                                   # the replay puts this machine into the JSON it printed
        try:
            out = loads(answer["stdout"])
        except ValueError:
            out = None
        plans = out.get("plans", []) if isinstance(out, dict) else None
        if not isinstance(plans, list) or not all(isinstance(e, dict) and isinstance(e.get("plan", {}), dict)
                                                  for e in plans):
            raise BadKeptFile("'stdout' is not the JSON of a --json plan")
    return answer


def origin() -> dict:
    """Which leantune computed an answer: version, checkout folder, commit (None outside git), time."""
    from .. import __version__

    root = Path(__file__).resolve().parent.parent.parent
    return {"version": __version__, "checkout": str(root), "commit": _git_commit(root),
            "saved": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _git_commit(root: Path) -> str | None:
    """HEAD's commit of the checkout at `root`, read from its files (no git process), or None."""
    git = root / ".git"
    try:
        if git.is_file():                                   # a worktree: "gitdir: <path>"
            git = Path(git.read_text().split("gitdir:", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:12]
        ref = head[4:].strip()
        for gitdir in (git, _common_dir(git)):
            ref_file = gitdir / ref
            if ref_file.is_file():
                return ref_file.read_text().strip()[:12]
            packed = gitdir / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0][:12]
    except (OSError, IndexError):
        return None
    return None


def _common_dir(git: Path) -> Path:
    common = git / "commondir"
    return (git / common.read_text().strip()).resolve() if common.is_file() else git


def describe_origin(answer: dict) -> str:
    """The line a replayed answer prints on stderr."""
    o = answer.get("origin") or {}
    where = o.get("checkout", "an unknown checkout")
    commit = f" at commit {o['commit']}" if o.get("commit") else ""
    return (f"(kept answer from leantune {o.get('version', '?')}, {where}{commit}, saved {o.get('saved', '?')}; "
            f"asked again with the same flags and code it is reused without planning)")


def save_answer(question: dict, answer: dict) -> None:
    """Keep `answer`, with its origin; a cache that cannot be written only costs time next time."""
    from ..io import atomic_write_json
    from ..native import make_private_folders

    path = answer_path(question)
    try:
        make_private_folders(path.parent)           # the cache's folders only this user can write (native.py)
        atomic_write_json(path, {**answer, "origin": origin()})
    except OSError as e:
        log.warning("plan: cannot keep the answer in %s (%s)", path, e)
