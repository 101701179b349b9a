#!/usr/bin/env bash
# Checks that need a GPU. Run from the repository root on a machine with one GPU:
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}

# ---------------------------------------------------------------- learner
# Tokens/s and MFU of the learner against a bare loop: 0.5b (Qwen2.5-0.5B shape), bf16
# (FSDP2 mixed precision), packed 8k-token micro-batches. Target: MFU >= 40%.
$PY bench/learner.py --size 0.5b --device cuda --threads 0 --microbatch-tokens 8192 \
    --groups 8 --group-size 8 --min-len 512 --max-len 2048 --steps 5 --warmup 2
