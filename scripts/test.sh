#!/usr/bin/env bash
# Runs the CPU test suite in .venv (set up on first use: scripts/setup_test.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_test.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The venv's tools (ninja, installed with deepspeed, which compiles its CPU ops with it) on PATH.
VENV=${LEANTUNE_VENV:-.venv}
export PATH="$(cd "$VENV" && pwd)/bin:$PATH"
exec "$VENV/bin/python" -m pytest -q "$@"
