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
# The browser test of `leantune ui` drives Debian's Chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; }) \
    || echo "setup.sh: could not install chromium; the browser test of leantune ui will be skipped" >&2
fi
