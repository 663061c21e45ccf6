#!/usr/bin/env bash
# Runs the CPU test suite in .venv (set up on first use). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The venv's tools (ninja, installed with deepspeed, which compiles its CPU ops with it) on PATH.
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q "$@"
