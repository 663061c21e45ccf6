#!/usr/bin/env bash
# What the test suite needs on top of scripts/setup.sh: the [test] extras (pytest, DeepSpeed,
# ninja, FastAPI, Playwright), DeepSpeed's compiled CPU communication op and Debian's Chromium.
# None of these is used by `leantune demo`, so scripts/demo.sh does not run this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=${LEANTUNE_VENV:-.venv}
have() { "$VENV/bin/python" -I -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@" >/dev/null 2>&1; }
if ! have pytest xdist deepspeed fastapi playwright ninja uvicorn tomli_w bitsandbytes \
    || [ pyproject.toml -nt "$VENV/.leantune-test-installed" ]; then
  echo "setup (tests): installing the test dependencies into $VENV (once)" >&2
  "$VENV/bin/pip" install --quiet -e ".[test]"
  touch "$VENV/.leantune-test-installed"
fi
# DeepSpeed on CPU processes (the distributed tests) compiles its shared-memory collective
# (deepspeed_shm_comm) at its first use, with ninja (a pip dependency), the C++ compiler (OpenMP)
# and Python's headers: about 40 CPU-s, once per machine (~/.cache/torch_extensions). Done here,
# so a missing piece shows now with its reason instead of inside a two-process test.
if [ ! -e "$VENV/.deepspeed-ops-built" ] && have deepspeed; then
  echo "setup (tests): compiling DeepSpeed's CPU communication op (once per machine; about 40 CPU-s," \
       "5 minutes on a busy 2-core machine)" >&2
  if ! command -v c++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y --no-install-recommends g++ >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends g++ >/dev/null 2>&1; } || true
  fi
  if PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" - >/dev/null 2>&1 <<'PY'
from deepspeed.accelerator import get_accelerator
import deepspeed.ops
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
    builder.load(verbose=False)
PY
  then
    touch "$VENV/.deepspeed-ops-built"
  else
    echo "setup (tests): DeepSpeed could not compile its CPU communication op (needs g++ with OpenMP, ninja and" \
         "Python's headers); the DeepSpeed tests in tests/test_distributed.py will fail" >&2
  fi
fi
# The browser test of `leantune ui` drives Debian's Chromium (never a downloaded browser).
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup (tests): installing Debian's chromium for the browser test of leantune ui (once)" >&2
  (apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 \
    || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends chromium >/dev/null 2>&1; }) \
    || echo "setup (tests): could not install chromium; the browser test of leantune ui will be skipped" >&2
fi
