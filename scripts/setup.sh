#!/usr/bin/env bash
# Creates the venv (once) and installs what `leantune` itself runs: torch (torch==2.13.0, only when
# absent, so an existing CUDA build is kept) and leantune with its runtime dependencies. Nothing
# for the tests: scripts/setup_test.sh adds those (pytest, DeepSpeed and its compiled CPU op,
# Playwright's Chromium), so the demo does not wait for them.
# LEANTUNE_VENV picks the venv (default .venv; bench/demo_time.py times a fresh one under /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${LEANTUNE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV (once)" >&2
  "$PY" -m venv "$VENV"
fi
# Whether a module is installed, without importing it (importing torch, diffusers and peft costs
# several CPU-seconds, which every later ./scripts/demo.sh would pay again).
have() { "$VENV/bin/python" -I -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@" >/dev/null 2>&1; }
if ! have torch; then
  echo "setup: installing torch==2.13.0 into $VENV (once; about 1-2 minutes, longer on a busy machine)" >&2
  "$VENV/bin/pip" install --quiet "torch==2.13.0"
fi
if ! have leantune diffusers peft transformers accelerate safetensors prodigyopt schedulefree came_pytorch gguf av \
    || [ pyproject.toml -nt "$VENV/.leantune-installed" ]; then
  echo "setup: installing leantune and its dependencies into $VENV (once; about a minute)" >&2
  "$VENV/bin/pip" install --quiet -e .
  touch "$VENV/.leantune-installed"
fi
