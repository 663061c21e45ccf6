"""One fresh process for every simulated-device job of a test run (this module holds no tests).

The simulated GPU (leantune/memory/simulated.py) must be set up in a process before autograd ran any
backward there, so its tests run their work in a fresh process. Each launch costs a Python start,
torch's and diffusers' imports and the device's set-up (3-5 CPU-s), and the first cases in a new
process pay torch's warm-up on fake tensors besides (a module's cases took 24 CPU-s alone, 16 after
the other modules' cases in the same process). The suite used to start eight such processes: the
planned cases of test_simulated.py, test_simulated_full.py, test_simulated_sd3.py and
test_simulated_flux2.py, two autocast workers and a silu worker (test_simulated.py) and a rollback
child (test_memory_rollback.py). Now it starts one.

How: each test module registers its jobs under the name of the module fixture its tests read
them through (`register`). The first of those fixtures set up in a test process (`results`) runs,
in one fresh process, the jobs of every registered fixture that a test selected in this session
uses, and keeps all the results for the rest of the session: `-m "not slow"` runs only the jobs of
the tests it keeps, one test file alone only its own. A job is a dict of `planned_case` arguments
(leantune/simulated_run.py) or a `Call` of a function defined in a test module (a job that is not
a planned case); each runs as it did in its own process, after `simulated.enable()`. A job that
raises fails the tests of its own fixture, with the child's traceback; the others keep theirs.

Under pytest-xdist the tests that read these results carry `xdist_group("simulated")` (GROUP); as
this pytest/xdist pair may spread a group over workers anyway, the first worker to ask runs the
process and the others read its results (`_once_per_run`), so it is started once per run.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass, field

GROUP = "simulated"         # the xdist_group of every test that reads these results


@dataclass(frozen=True)
class Call:
    """A job that is not a planned case: `module.function(**kwargs)` in the fresh process (after
    the simulated device is enabled); it returns something JSON can hold (the results are shared
    between test processes as JSON)."""

    module: str
    function: str
    kwargs: dict = field(default_factory=dict)


_JOBS: dict[str, dict[str, dict | Call]] = {}     # fixture -> job name -> job
_RESULTS: dict[str, dict] = {}                    # fixture -> job name -> result, or _Failed


@dataclass(frozen=True)
class _Failed:
    traceback: str


def register(fixture: str, jobs: dict[str, dict | Call]) -> None:
    """The jobs whose results the module fixture named `fixture` returns (called at import)."""
    _JOBS[fixture] = dict(jobs)


def results(request, fixture: str) -> dict:
    """{job name: result} of `fixture`'s jobs. The first call in a test run runs the jobs of every
    registered fixture that a selected test of the session uses, in one fresh process; under
    pytest-xdist the other workers wait for it and read its results (JSON beside the workers' temp
    folders), so the process is started once per run wherever the tests land."""
    if fixture not in _RESULTS:
        used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
        pending = [f for f in _JOBS if f not in _RESULTS and (f in used or f == fixture)]
        payload = [(f, name, job) for f in pending for name, job in _JOBS[f].items()]
        _RESULTS.update({f: {} for f in pending})
        _store(payload, _once_per_run(request, pending, payload))
    out = _RESULTS[fixture]
    failed = {name: r.traceback for name, r in out.items() if isinstance(r, _Failed)}
    if failed:
        raise RuntimeError("simulated job(s) failed in the fresh process:\n"
                           + "\n".join(f"--- {name}\n{tb}" for name, tb in failed.items()))
    return out


def _once_per_run(request, pending: list[str], payload: list) -> list:
    """The payload's results, computed by the first test process of the run that asks for this set
    of fixtures and shared through a JSON file under a lock (every xdist worker collects the same
    items, so asks for the same set)."""
    import fcntl
    import hashlib
    import json
    import os

    factory = request.getfixturevalue("tmp_path_factory")
    root = factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else factory.getbasetemp()
    name = "simulated-" + hashlib.sha256(json.dumps(sorted(pending)).encode()).hexdigest()[:12]
    result = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            try:
                outs = _in_fresh_process(payload)
            except BaseException:                 # the process died: every fixture of it fails
                outs = [_Failed(traceback.format_exc())] * len(payload)
            encoded = [{"failed": o.traceback} if isinstance(o, _Failed) else {"result": o} for o in outs]
            result.write_text(json.dumps(encoded))
    return [_Failed(o["failed"]) if "failed" in o else o["result"] for o in json.loads(result.read_text())]


def _store(payload: list, outs: list) -> None:
    for (f, name, _), out in zip(payload, outs, strict=True):
        _RESULTS[f][name] = out


def _in_fresh_process(payload: list) -> list:
    """The jobs' results from one new process, started by leantune's own run_in_fresh_process
    (a spawned single-worker executor: a worker that dies raises instead of hanging), with this
    module's `_run_jobs` as what the worker runs in place of its planned-case loop."""
    from unittest import mock

    from leantune import simulated_run

    with mock.patch.object(simulated_run, "_run_cases", _run_jobs):
        return simulated_run.run_in_fresh_process(payload)


def _run_jobs(payload: list) -> list:
    """In the fresh process: enable the simulated device first, then run each job. The small
    jobs (Calls) run before the planned cases, as next after the set-up as in their own process."""
    from leantune.memory.simulated import enable
    from leantune.simulated_run import planned_case

    enable()
    order = sorted(range(len(payload)), key=lambda i: not isinstance(payload[i][2], Call))
    out: list = [None] * len(payload)
    for i in order:
        job = payload[i][2]
        try:
            if isinstance(job, Call):
                out[i] = getattr(importlib.import_module(job.module), job.function)(**job.kwargs)
            else:
                out[i] = planned_case(**job)
        except Exception:
            out[i] = _Failed(traceback.format_exc())
    return out
