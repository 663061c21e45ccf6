#!/usr/bin/env bash
# Trains a LoRA on a tiny Flux (--family sd3: SD3.5; --family qwen-image: Qwen-Image; --family z-image: Z-Image; --family wan: Wan video) built offline,
# on CPU. The environment is set up on first use by scripts/setup.sh, which installs only what the demo runs (not the test tools).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${LEANTUNE_VENV:-.venv}/bin/leantune" demo "$@"
