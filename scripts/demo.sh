#!/usr/bin/env bash
# Trains a LoRA on a tiny Flux (--family sd3: SD3.5) built offline, on CPU, in about a minute (environment set up on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/leantune demo "$@"
