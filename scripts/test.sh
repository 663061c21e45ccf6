#!/usr/bin/env bash
# Runs the CPU test suite in .venv (set up on first use: scripts/setup_test.sh). Extra arguments go to pytest.
#   ./scripts/test.sh            the whole suite, one pytest worker per core (pytest-xdist); what CI runs
#   ./scripts/test.sh --fast     the fast tier (no test marked slow or gpu, none recorded over 1.5 s in
#                                tests/durations.json): every module imported and exercised, for the
#                                edit-test loop; run the whole suite before a commit lands
#   ./scripts/test.sh --record-durations   the whole suite, rewriting tests/durations.json
#   ./scripts/test.sh tests/test_x.py -k name    any pytest selection (still spread over the workers)
# LEANTUNE_TEST_WORKERS sets the number of workers (default: one per core; 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_test.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The venv's tools (ninja, installed with deepspeed, which compiles its CPU ops with it) on PATH.
VENV=${LEANTUNE_VENV:-.venv}
export PATH="$(cd "$VENV" && pwd)/bin:$PATH"
WORKERS=${LEANTUNE_TEST_WORKERS:-$("$VENV/bin/python" -c "import os; print(len(os.sched_getaffinity(0)))")}
# loadgroup: the tests of one xdist_group (the multi-process runs, which share ports and cores) stay on one worker.
exec "$VENV/bin/python" -m pytest -q -n "$WORKERS" --dist loadgroup "$@"
