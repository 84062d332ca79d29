#!/usr/bin/env bash
# The one-GPU KV tier runs of docs/benchmarks.md (W4-large), in one go: the GPU tests of the
# tiers' copies, the step timer and the start-up load probe; the Qwen2.5-0.5B pair (recompute
# beside a host tier) at 60 and 120 req/s, pass by pass; the same shape at a 0% hit rate (the
# write-through's cost to TPOT); the Llama-3.1-8B pair at 6 req/s with loads in place beside;
# the 0.5B pair at 60 req/s again with each engine step timed by part (tools/profile/tier_steps).
# Usage: OUT=<folder> bash tools/gpu/run_gpu_tiers.sh   (each stage has its own time limit)
#   ONLY=<regex> runs only the stages whose names match (all of them take longer than one
#   10-minute device call), e.g. ONLY='gpu tests|0.5B 60'.
set -o pipefail
export PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
LOG="$OUT/log.txt"; ERR="$OUT/stderr.txt"
stage() { [[ -z "${ONLY:-}" || "$1" =~ $ONLY ]] || return 0; echo "== $1" | tee -a "$LOG"; shift; timeout "$@" 2>>"$ERR" | tee -a "$LOG"; echo "rc=$?" | tee -a "$LOG"; }
W4="python -m cluster.bench prefix --no-hf --prefix-len 2048 --question-len 128"
SMALL="$W4 --shape qwen2.5-coder-0.5b --num-kv-blocks 8192 --host-kv-cache-gb 8 --max-num-seqs 128"
BIG="$W4 --shape llama-3.1-8b --num-kv-blocks 4096 --host-kv-cache-gb 36 --max-num-seqs 64"
PAIRS="--num-groups 256 --group-size 2 --output-len 16 --pass-major"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee -a "$LOG"
stage "gpu tests" ${TESTS_TIME:-120} python -m pytest -q -p no:cacheprovider -m gpu \
  tests/workers/test_rate_probes.py tests/workers/test_step_timer.py \
  tests/workers/test_kv_offload_gpu.py
stage "0.5B 60" ${SMALL_TIME:-150} $SMALL $PAIRS --request-rate 60 --output "$OUT/w4-small-60.json"
stage "0.5B 120" ${SMALL_TIME:-150} $SMALL $PAIRS --request-rate 120 --output "$OUT/w4-small-120.json"
stage "0.5B 0% hits" ${SMALL_TIME:-150} $SMALL --num-groups 512 --group-size 1 --output-len 64 \
  --request-rate 60 --output "$OUT/w4-small-unique.json"
stage "8B 6" ${BIG_TIME:-330} $BIG --num-groups 128 --group-size 2 --output-len 16 --pass-major \
  --request-rate 6 --host-loads-in-place --output "$OUT/w4-big-6.json"
stage "0.5B 60 by step" ${SMALL_TIME:-150} python -m tools.profile.tier_steps --no-hf \
  --prefix-len 2048 --question-len 128 --shape qwen2.5-coder-0.5b --num-kv-blocks 8192 \
  --host-kv-cache-gb 8 --max-num-seqs 128 $PAIRS --request-rate 60 \
  --output "$OUT/w4-small-60-steps.json"
