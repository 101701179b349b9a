#!/usr/bin/env bash
# Checks that need a GPU: one call, at most 8 minutes on one H200 (torch, transformers; no sglang,
# no network). Run from anywhere on a machine with one GPU:
#   bash bench/gpu_check.sh
# It ends with the table docs/performance.md holds (markdown), the raw results beside it.
# The same script checks itself on a CPU with a tiny model (a few minutes on 2 cores):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=tiny bash bench/gpu_check.sh
# and, quicker, its wiring and its table only (CPU, tiny, each bench's --smoke; GPU_CHECK_MODEL: a model folder
# to use instead of building one):
#   bash bench/gpu_check.sh --smoke
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SIZE=${GPU_CHECK_SIZE:-0.5b}
SMOKE=()
if [[ ${1:-} == --smoke ]]; then
  DEVICE=cpu SIZE=tiny SMOKE=(--smoke)
fi
OUT=${GPU_CHECK_OUT:-$(mktemp -d -t agentrl-gpu-check-XXXXXX)}
mkdir -p "$OUT"
echo "gpu_check: $SIZE on $DEVICE${SMOKE:+ (smoke)}; results in $OUT"
STEPS=(--steps 5 --warmup 2)
REPS=(--reps 2)
if [[ $DEVICE == cuda ]]; then
  nvidia-smi -L || true
  BATCH=(--groups 8 --group-size 8 --min-len 512 --max-len 2048 --microbatch-tokens 8192)
  LIMIT_S=(180 210)  # learner, engine: with the model's build, well inside 8 minutes
else  # the CPU self-check: a batch a 2-core machine trains in seconds, more patience
  BATCH=(--groups 2 --group-size 4 --min-len 64 --max-len 256 --microbatch-tokens 2048)
  LIMIT_S=(600 600)
fi
if [[ -n ${SMOKE[*]} ]]; then  # the benches' own smallest sizes
  BATCH=() STEPS=() REPS=()
fi

# One model for every part (building the 0.5b shape takes ~30 s; the benches would each build it).
MODEL=${GPU_CHECK_MODEL:-$OUT/$SIZE}
[[ -f $MODEL/config.json ]] || $PY -m agentrl init-model "$MODEL" --size "$SIZE"

status=0
# ---------------------------------------------------------------- learner (~1 min on the H200)
# Tokens/s and MFU of the learner against a bare loop: Qwen2.5-0.5B's shape, bf16 (FSDP2 mixed
# precision), packed 8k-token micro-batches. Target: MFU >= 40%.
timeout "${LIMIT_S[0]}" $PY bench/learner.py --model-path "$MODEL" --device "$DEVICE" --threads 0 \
    "${BATCH[@]}" "${STEPS[@]}" "${SMOKE[@]}" \
    --json "$OUT/learner.json" || { status=$?; echo "gpu_check: the learner bench failed ($status)"; }

# ---------------------------------------------------------------- engine and weight push (~2-3 min on the H200)
# Embedded engine tokens/s against static-batch generate at concurrency 1/16/64 on the same model;
# the weight push of the same model in bf16 (gloo: on one GPU the learner and the engine cannot
# share an NCCL group) against a raw broadcast of the same tensors.
timeout "${LIMIT_S[1]}" $PY bench/engine.py --model "$MODEL" --device "$DEVICE" --threads 0 \
    --push-model "$MODEL" --push-dtype bfloat16 "${REPS[@]}" "${SMOKE[@]}" \
    --json "$OUT/engine.json" || { status=$?; echo "gpu_check: the engine bench failed ($status)"; }

# ---------------------------------------------------------------- the table
$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None

learner, engine = load("learner.json"), load("engine.json")
rows = []
if engine:
    for r in engine["throughput"]:
        rows.append((f"embedded engine, concurrency {r['concurrency']} (tokens/s)", f"{r['engine_tokens_per_s']:,.0f}",
                     f"{r['engine_tokens_per_s'] / r['generate_tokens_per_s']:.2f}x static `generate`"))
if learner:
    rows.append(("learner (tokens/s)", f"{learner['learner_tokens_per_s']:,.0f}",
                 f"{learner['learner_tokens_per_s'] / learner['bare_tokens_per_s']:.2f}x a bare loop"))
    rows.append(("learner MFU", f"{100 * learner['mfu_learner']:.1f}%",
                 f"bare loop {100 * learner['mfu_bare']:.1f}%; peak {learner['peak_tflops']:.0f} TFLOP/s"))
if engine and engine.get("push"):
    p = engine["push"]
    rows.append((f"weight push, {p['bytes'] / 2**20:,.0f} MiB {p['dtype']} ({p['tensors']} tensors)",
                 f"{p['default']['total_s'] * 1e3:,.0f} ms",
                 f"{p['default']['total_s'] / p['raw_tensors_s']:.2f}x a raw broadcast of the same tensors"))
device = (learner or {}).get("device") or (engine or {}).get("device", "?")
model = (learner or engine or {}).get("model", "?")
print(f"\n### {model} on {device} (`bash bench/gpu_check.sh`)\n")
print("| measure | value | against |")
print("| --- | --- | --- |")
for measure, value, against in rows:
    print(f"| {measure} | {value} | {against} |")
missing = [name for name, r in (("learner", learner), ("engine", engine)) if r is None]
if missing:
    print(f"\nmissing: {', '.join(missing)} (see the output above)")
EOF
exit "$status"
