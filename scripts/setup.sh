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
# DeepSpeed on CPU processes (the distributed tests) compiles its shared-memory collective
# (deepspeed_shm_comm) at its first use, with ninja (a pip dependency), the C++ compiler (OpenMP)
# and Python's headers: about 40 s of CPU, once per machine (~/.cache/torch_extensions). Done here,
# so a missing piece shows now with its reason instead of inside a two-process test.
if [ ! -e .venv/.deepspeed-ops-built ] && .venv/bin/python -c "import deepspeed" >/dev/null 2>&1; then
  if ! command -v c++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y --no-install-recommends g++ >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends g++ >/dev/null 2>&1; } || true
  fi
  if PATH="$PWD/.venv/bin:$PATH" .venv/bin/python - >/dev/null 2>&1 <<'PY'
from deepspeed.accelerator import get_accelerator
import deepspeed.ops
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load(verbose=False)
PY
  then
    touch .venv/.deepspeed-ops-built
  else
    echo "setup.sh: DeepSpeed could not compile its CPU communication op (needs g++ with OpenMP, ninja and" \
         "Python's headers); the DeepSpeed tests in tests/test_distributed.py will fail" >&2
  fi
fi
# The browser test of `leantune ui` drives Debian's Chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; }) \
    || echo "setup.sh: could not install chromium; the browser test of leantune ui will be skipped" >&2
fi
