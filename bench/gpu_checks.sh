#!/bin/bash
# Every GPU check, in windows that each fit one device session: a session is lent 15 minutes of
# device time (a machine's start, 1-2 minutes, included) and one command may run 10 minutes, so a
# window is at most TOTAL_S = 510 s. Run the next window not yet recorded in docs/benchmarks.md
# ("GPU status" lists what each window found), then record what it measured. From the repository
# root on a CUDA machine:
#
#   OUT=/some/folder WHEELS=/folder/of/wheels bash bench/gpu_checks.sh --window 1   # one window
#   bash bench/gpu_checks.sh --dry-run                                              # every window's parts
#   bash bench/gpu_checks.sh --only fp32-stream,oom-step1                           # some parts (no set-up)
#
# Window 1 re-runs the GPU findings' checks, the short ones first (NCCL collectives, fp32 streaming,
# OOM in step 1), then the gpu-marked tests of the files that failed or changed since the H100 run; window 2 measures what the planner
# and the engine promise (FLUX.2 klein-4B at 6 GiB, the file-read text encoder's copy rate, the
# quantize-at-read load on a GPU host's CPUs, the planner at 8 GiB); window 3 the engine and
# sampler benchmarks and issue 40's single-GPU checks (the fp8 dequantize rate, a full-width host
# step, the layer-major text-encoder pass); window 4 issue 40's checks (FSDP2 with CPU offload under NCCL, cuDNN attention off for
# every command, the CUDA RNG state of the run's device, the round-two tests on a GPU); window 5
# needs two GPUs (the strategies end to end, the two-GPU context guard): run it on a two-GPU lease.
#
# Parts run in order of value, each under its own time budget (`timeout`), each writing its raw
# log to $OUT/<part>.log; $OUT/summary.txt gets one line per part (rc, seconds). A part is skipped
# when the time left of TOTAL_S is less than its budget, so the run ends inside the window even
# when a part hangs. WHEELS: a folder of wheels installed first (no network on the GPU machines),
# with no dependencies resolved.
set -o pipefail

# window|name|budget seconds|what it checks|command   (window 0: every window's set-up)
PARTS=(
  "0|setup|60|the machine and the packages: nvidia-smi, torch and the wheels|setup"
  "1|nccl-collectives|45|issue 20 finding 1: every DistContext collective over a real NCCL group (host tensors on a gloo side group)|python3 -m torch.distributed.run --standalone --nproc_per_node=\$NGPU tests/dist_collectives_worker.py \$OUT/nccl --nccl"
  "1|fp32-stream|75|finding 5: full fine-tune step, fp32 weights streamed, bf16 autocast: peak against the plan|python3 bench/gpu_findings.py fp32-stream --blocks 2 2 --size 512"
  "1|oom-step1|75|findings 6 and 8: OOM injected in step 1 with streaming in full mode: host RSS, the redone step's peak, no stored calibration|python3 bench/gpu_findings.py oom-step1 --blocks 2 2 --size 512"
  "1|gpu-tests|240|the gpu-marked tests (hook-free frozen streaming, the per-block residency check and the one-pre-hook backward boundary included)|python3 -m pytest -q -p no:cacheprovider -m gpu \$GPU_TEST_FILES -rA"
  "2|flux2-klein4b|180|issue 23: FLUX.2 klein-4B (full size, random e4m3 weights) LoRA r16 at 1024 px under a 6 GiB plan: device peak and step time against the planner|flux2_klein"
  "2|text-encoder-read|75|issue 23: klein-4B's Qwen3 read from its file layer by layer onto the GPU: read rate against the pinned H2D rate|python3 bench/text_encoder_read.py --device cuda --layers 12 --out \$OUT/text-encoder-read.json"
  "2|load-gpu-host|75|issue 21: a bf16 Flux file loaded straight into fp8 on the GPU host's CPUs (leantune beside the old path and diffusers)|python3 bench/load.py --files flux-bf16 --loaders leantune leantune-old diffusers --out \$OUT/load.json"
  "2|bench-planner|120|owed benchmark: the planner's plan at 8 GiB, 1024 px, against the measured step|python3 bench/bench_planner.py --budgets 8 --resolutions 1024 --sweep none --steps 2 --out \$OUT/bench-planner.md"
  "3|bench-engine|150|owed benchmark: engine rows (resident and all streamed, fp8) at 1024 px|python3 bench/bench_engine.py --configs resident-fp8 stream-all-fp8 --offload no --resolutions 1024 --steps 2 --warmup 1 --results \$OUT/bench-engine.json --out \$OUT/bench-engine.md"
  "3|bench-sampler|120|owed benchmark: sampling at 1024 px under an 8 GiB budget|python3 bench/bench_sampler.py --part sampling --size 1024 --steps 4 --budgets 8 --out \$OUT/bench-sampler.md"
  "3|dequant-rate|45|issue 40 finding 5 on one GPU: fp8 dequantize formed in its bf16 output: bits against the fp32 product, bytes allocated above the output, rate beside the fp32-temporary way and a bf16 copy|python3 bench/gpu_round2.py dequant-rate"
  "3|host-step|60|issue 40 finding 10 on one GPU: a full-width host AdamW step (37.7M parameters) on the cores less one: pinned D2H of the gradient, the kernel's time, its update against torch's AdamW|python3 bench/gpu_round2.py host-step"
  "3|encoder-pass|60|issue 40 finding 6 on one GPU: the layer-major text pass on CUDA, blocks prefetched through pinned staging on the copy stream, equal to the plain model|python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_text_pass.py -rA"
  "5|strategies|135|finding 1 end to end: DDP LoRA, FSDP2 and ZeRO-2 full through torchrun and NCCL (needs 2 GPUs)|strategies"
  "5|two-gpu-guard|45|finding 10: the host-step thread and the unpin finalizer open no context on GPU 0 (needs 2 GPUs)|python3 bench/gpu_findings.py two-gpu-guard"
  "4|offload-nccl|60|issue 40 finding 1: FSDP2 + CPUOffloadPolicy under the group leantune starts (cuda:nccl,cpu:gloo): backward, clipping, full state dict; CPU DTensors clip and gather|python3 -m torch.distributed.run --standalone --nproc_per_node=\$NGPU tests/dist_offload_worker.py \$OUT --nccl"
  "4|cudnn-attention|60|issue 40 finding 4: the per-process guard turns cuDNN attention off; bf16 SDPA fwd+bwd at encoder and Flux shapes with cuDNN and without (finite, difference)|python3 bench/gpu_round2.py cudnn-attention"
  "4|rng-device|30|issue 40 finding 9: a save's CUDA RNG state is the run's device's and resumes onto cuda:0|python3 bench/gpu_round2.py rng"
  "4|round2-tests|120|issue 40: tests/test_gpu_nccl_round2.py and the gpu-marked streaming boundaries (finding 8's guards on a CUDA backward)|python3 -m pytest -q -p no:cacheprovider tests/test_gpu_nccl_round2.py tests/test_streaming_boundaries.py -rA"
)
# GPU_CHECKS_PARTS_FILE: the parts from this file instead (one a line, as above): the CPU test of
# the runner (tests/test_gpu_checks_runner.py) gives it a part that hangs with a child.
if [ -n "$GPU_CHECKS_PARTS_FILE" ]; then mapfile -t PARTS < "$GPU_CHECKS_PARTS_FILE"; fi
GPU_TEST_FILES="tests/test_attention_report.py tests/test_cache.py tests/test_check.py tests/test_disk_tier.py tests/test_flux_split_block.py tests/test_nf4.py tests/test_offload_slabs.py tests/test_int8.py tests/test_qwen_image21_split_block.py tests/test_full_finetune.py tests/test_full_host_step.py tests/test_gguf.py tests/test_gguf_decode.py tests/test_loading.py tests/test_lora_host_step.py tests/test_memory_cpu_linear.py tests/test_memory_gpu.py tests/test_memory_streaming_copies.py tests/test_monitor.py tests/test_optimizers_recipe.py tests/test_planner.py tests/test_sampler.py tests/test_sampler_device.py tests/test_sampler_sd3.py tests/test_streaming_boundaries.py"
TOTAL_S=${TOTAL_S:-510}

dry=0; only=""; window=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --only) only=",$2,"; shift ;;
    --window) window="$2"; shift ;;
    *) echo "usage: bash bench/gpu_checks.sh [--dry-run] [--window N] [--only part,part]" >&2; exit 2 ;;
  esac
  shift
done

# A part runs when --only names it, else when it belongs to the window (set-up always).
selected() {  # window name
  if [ -n "$only" ]; then [[ "$only" == *",$2,"* ]]; else [ "$1" = 0 ] || [ "$1" = "$window" ]; fi
}

if [ $dry = 1 ]; then
  status=0
  windows="1 2 3 4 5"; [ -n "$only" ] && windows=only
  for w in $windows; do
    total=0; window=$w
    printf "window %s\n%-18s %7s  %s\n" "$w" part budget "what it checks"
    for p in "${PARTS[@]}"; do
      IFS='|' read -r pw name budget what cmd <<< "$p"
      selected "$pw" "$name" || continue
      printf "%-18s %6ss  %s\n" "$name" "$budget" "$what"
      total=$((total + budget))
    done
    printf "%-18s %6ss  (limit %ss: %s min)\n\n" total "$total" "$TOTAL_S" "$((TOTAL_S / 60))"
    [ $total -le "$TOTAL_S" ] || { echo "window $w: the parts' budgets exceed TOTAL_S" >&2; status=1; }
  done
  exit $status
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
  python3 -c "import pytest, safetensors, accelerate" || return 5     # what the parts import: fail now, not in a part
  python3 -c "import torch, diffusers, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__); print('gpus', torch.cuda.device_count())"
  python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" || echo "deepspeed: not installed (the ZeRO-2 run is skipped)"
}

flux2_klein() {
  # klein-4B at full size with random e4m3 block weights (about 4.5 GB on disk), then the LoRA step
  python3 bench/cpu_flux2.py write /tmp/gpu-klein4b --model flux2-klein-4b || return 4
  python3 bench/cpu_flux2.py train-step /tmp/gpu-klein4b --model flux2-klein-4b --vram 6 --size 1024 \
    --text-length 512 --device cuda --steps 3 --rss-cap 60 | tee "$OUT/flux2-klein4b.json"
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
set -m      # every background job its own process group: the watchdog stops a part's whole tree
for p in "${PARTS[@]}"; do
  IFS='|' read -r pw name budget what cmd <<< "$p"
  selected "$pw" "$name" || continue
  left=$((TOTAL_S - ($(date +%s) - start)))
  if [ "$left" -lt "$budget" ]; then
    echo "$name: skipped (${left}s left of ${TOTAL_S}s, budget ${budget}s)" | tee -a "$OUT/summary.txt"
    continue
  fi
  t0=$(date +%s)
  echo "== $name (budget ${budget}s): $what"
  if declare -F "$cmd" > /dev/null; then        # a shell function (setup, flux2_klein, strategies)
    ( $cmd ) > "$OUT/$name.log" 2>&1 &
  else
    eval "timeout --kill-after=10 $budget $cmd" > "$OUT/$name.log" 2>&1 &
  fi
  pid=$!
  # the shell-function parts (setup, flux2_klein, strategies) are bounded here the same way
  ( sleep "$budget"; kill -TERM -- "-$pid" 2>/dev/null; sleep 10; kill -KILL -- "-$pid" 2>/dev/null ) & watchdog=$!
  wait "$pid"; rc=$?
  kill -- "-$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  kill -KILL -- "-$pid" 2>/dev/null     # what the part left running (a child that outlived it)
  secs=$(($(date +%s) - t0))
  echo "$name: rc=$rc ${secs}s (budget ${budget}s)" | tee -a "$OUT/summary.txt"
  tail -5 "$OUT/$name.log"
  [ "$name" = setup ] && [ "$rc" -ne 0 ] && { echo "set-up failed: stopping"; exit 3; }
done
echo "total $(($(date +%s) - start))s; logs in $OUT"
