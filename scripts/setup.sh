#!/usr/bin/env bash
# Creates .venv (once) and installs leantune into it with its test dependencies.
# torch is installed as torch==2.13.0 only when absent, so an existing CUDA build is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet "torch==2.13.0"
fi
if ! .venv/bin/python -c "import leantune, pytest" >/dev/null 2>&1 || [ pyproject.toml -nt .venv/.leantune-installed ]; then
  .venv/bin/pip install --quiet -e ".[test]"
  touch .venv/.leantune-installed
fi
