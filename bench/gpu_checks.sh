#!/bin/bash
# Every GPU check in one command, for a GPU window of about 30 minutes: run it first, then record
# the results in docs/benchmarks.md. From the repository root on a CUDA machine:
#
#   OUT=/some/folder WHEELS=/folder/of/wheels bash bench/gpu_checks.sh     # the whole run
#   bash bench/gpu_checks.sh --dry-run                                     # the parts and their budgets
#   bash bench/gpu_checks.sh --only fp32-stream,oom-step1                  # some parts
#
# Parts run in order of value, each under its own time budget (`timeout`), each writing its raw
# log to $OUT/<part>.log; $OUT/summary.txt gets one line per part (rc, seconds). A part is skipped
# when the time left of TOTAL_S (default 1440 s: 24 minutes, set-up included) is less than its
# budget, so the run ends inside the window even when a part hangs. WHEELS: a folder of wheels
# installed first (no network on the GPU machines), with no dependencies resolved.
set -o pipefail

# name|budget seconds|what it checks|command
PARTS=(
  "setup|90|the machine and the packages: nvidia-smi, torch and the wheels|setup"
  "nccl-collectives|60|issue 20 finding 1: every DistContext collective over a real NCCL group (host tensors on a gloo side group)|python3 -m torch.distributed.run --standalone --nproc_per_node=\$NGPU tests/dist_collectives_worker.py \$OUT/nccl --nccl"
  "gpu-tests|360|the gpu-marked tests|python3 -m pytest -q -p no:cacheprovider -m gpu \$GPU_TEST_FILES -rA --timeout 120"
  "fp32-stream|120|finding 5: full fine-tune step, fp32 weights streamed, bf16 autocast: peak against the plan|python3 bench/gpu_findings.py fp32-stream --blocks 2 2 --size 512"
  "oom-step1|120|findings 6 and 8: OOM injected in step 1 with streaming in full mode: host RSS, the redone step's peak, no stored calibration|python3 bench/gpu_findings.py oom-step1 --blocks 2 2 --size 512"
  "strategies|180|finding 1 end to end: DDP LoRA, FSDP2 and ZeRO-2 full through torchrun and NCCL (needs 2 GPUs)|strategies"
  "two-gpu-guard|45|finding 10: the host-step thread and the unpin finalizer open no context on GPU 0 (needs 2 GPUs)|python3 bench/gpu_findings.py two-gpu-guard"
  "bench-planner|180|owed benchmark: the planner's plan at 8 GiB, 1024 px, against the measured step|python3 bench/bench_planner.py --budgets 8 --resolutions 1024 --sweep none --steps 2 --out \$OUT/bench-planner.md"
  "bench-engine|150|owed benchmark: engine rows (resident and all streamed, fp8) at 1024 px|python3 bench/bench_engine.py --configs resident-fp8 stream-all-fp8 --offload no --resolutions 1024 --steps 2 --warmup 1 --results \$OUT/bench-engine.json --out \$OUT/bench-engine.md"
  "bench-sampler|120|owed benchmark: sampling at 1024 px under an 8 GiB budget|python3 bench/bench_sampler.py --part sampling --size 1024 --steps 4 --budgets 8 --out \$OUT/bench-sampler.md"
)
GPU_TEST_FILES="tests/test_cache.py tests/test_full_finetune.py tests/test_full_host_step.py tests/test_loading.py tests/test_memory_cpu_linear.py tests/test_memory_gpu.py tests/test_memory_streaming_copies.py tests/test_monitor.py tests/test_planner.py tests/test_sampler.py tests/test_sampler_device.py tests/test_sampler_sd3.py"
TOTAL_S=${TOTAL_S:-1440}

dry=0; only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --only) only=",$2,"; shift ;;
    *) echo "usage: bash bench/gpu_checks.sh [--dry-run] [--only part,part]" >&2; exit 2 ;;
  esac
  shift
done

if [ $dry = 1 ]; then
  total=0
  printf "%-17s %7s  %s\n" part budget "what it checks"
  for p in "${PARTS[@]}"; do
    IFS='|' read -r name budget what cmd <<< "$p"
    if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then continue; fi
    printf "%-17s %6ss  %s\n" "$name" "$budget" "$what"
    total=$((total + budget))
  done
  printf "%-17s %6ss  (limit %ss: %s min)\n" total "$total" "$TOTAL_S" "$((TOTAL_S / 60))"
  [ $total -le "$TOTAL_S" ] || { echo "the parts' budgets exceed TOTAL_S" >&2; exit 1; }
  exit 0
fi

OUT=${OUT:-gpu-checks-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false GPU_TEST_FILES
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1; [ "$NGPU" -le 2 ] || NGPU=2
export NGPU

setup() {
  if [ -n "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WHEELS"/*.whl || return 3
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__); print('gpus', torch.cuda.device_count())"
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" || echo "deepspeed: not installed (the ZeRO-2 run is skipped)"
}

strategies() {
  if [ "$NGPU" -lt 2 ]; then
    echo "skipped: one GPU; a one-process run takes the one-process path (no process group), so the"
    echo "nccl-collectives part is the finding-1 check on this machine"
    return 0
  fi
  python3 bench/gpu_strategy_runs.py "$OUT" --gpus "$NGPU"
}

export PYTHONPATH=$PWD
[ -n "$WHEELS" ] && export PYTHONPATH=/tmp/site:$PWD
start=$(date +%s)
: > "$OUT/summary.txt"
for p in "${PARTS[@]}"; do
  IFS='|' read -r name budget what cmd <<< "$p"
  if [ -n "$only" ] && [[ "$only" != *",$name,"* ]]; then continue; fi
  left=$((TOTAL_S - ($(date +%s) - start)))
  if [ "$left" -lt "$budget" ]; then
    echo "$name: skipped (${left}s left of ${TOTAL_S}s, budget ${budget}s)" | tee -a "$OUT/summary.txt"
    continue
  fi
  t0=$(date +%s)
  echo "== $name (budget ${budget}s): $what"
  case "$cmd" in
    setup|strategies) ( $cmd ) > "$OUT/$name.log" 2>&1 & ;;
    *) eval "timeout --kill-after=10 $budget $cmd" > "$OUT/$name.log" 2>&1 & ;;
  esac
  pid=$!
  # setup and strategies are shell functions: bounded here the same way
  ( sleep "$budget"; kill -TERM "$pid" 2>/dev/null ) & watchdog=$!
  wait "$pid"; rc=$?
  kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  secs=$(($(date +%s) - t0))
  echo "$name: rc=$rc ${secs}s (budget ${budget}s)" | tee -a "$OUT/summary.txt"
  tail -5 "$OUT/$name.log"
  [ "$name" = setup ] && [ "$rc" -ne 0 ] && { echo "set-up failed: stopping"; exit 3; }
done
echo "total $(($(date +%s) - start))s; logs in $OUT"
