#!/usr/bin/env bash
# Checks that need a GPU (about 8 minutes on one H200; torch and transformers, no sglang, no network).
# Run from the repository root on a machine with one GPU and copy the tables into docs/performance.md:
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

# ---------------------------------------------------------------- engine and weight push
# Embedded engine tokens/s against static-batch generate at concurrency 1/16/64 on the same
# 0.5b model, and the weight push (gloo/nccl group with one engine) against a raw broadcast.
$PY bench/engine.py --size 0.5b --device cuda --threads 0
