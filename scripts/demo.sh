#!/usr/bin/env bash
# Trains a LoRA on a tiny Flux built offline, on CPU, in about two minutes (environment set up on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/leantune demo "$@"
