#!/bin/bash
# The GPU checks in one go: the gpu-marked tests, then one planner benchmark cell on a full-size
# Flux-dev (random weights). Run from the repository root on a CUDA machine; logs go to ${OUT:-.}.
# A machine without diffusers/pydantic installs them from wheels in WHEELS (a folder), if given.
set -o pipefail
OUT=${OUT:-.}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/env.txt"
F="tests/test_cache.py tests/test_full_finetune.py tests/test_full_host_step.py tests/test_loading.py tests/test_memory_cpu_linear.py tests/test_memory_gpu.py tests/test_memory_streaming_copies.py tests/test_monitor.py tests/test_planner.py tests/test_sampler.py tests/test_sampler_device.py tests/test_sampler_sd3.py"
timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider -m gpu $F -rA --timeout 120 > "$OUT/gpu-tests.log" 2>&1
echo "pytest rc=$?"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu-tests.log" | tail -40
timeout ${BENCH_S:-300} python3 bench/bench_planner.py --budgets 8 --resolutions 1024 --sweep none --steps 2 \
  --out "$OUT/bench-planner.md" > "$OUT/bench-planner.log" 2>&1
echo "bench rc=$?"; tail -25 "$OUT/bench-planner.log"
