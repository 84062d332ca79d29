#!/usr/bin/env bash
# The one-GPU runs of docs/benchmarks.md, in one go: GPU tests, kernel checks, W1, W2, W4, W2 by
# kind of step, async scheduling beside one step a call, the attention check, the decode kernel sweep and the one-token projection sweep.
# Usage: OUT=<folder> bash tools/gpu/run_gpu.sh   (each stage has its own time limit)
#   ONLY=<regex> runs only the stages whose names match (all stages take longer than one
#   10-minute device call), e.g. ONLY='gpu tests|W1|projections'.
set -o pipefail
export PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
LOG="$OUT/log.txt"; ERR="$OUT/stderr.txt"
stage() { [[ -z "${ONLY:-}" || "$1" =~ $ONLY ]] || return 0; echo "== $1" | tee -a "$LOG"; shift; timeout "$@" 2>>"$ERR" | tee -a "$LOG"; echo "rc=$?" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee -a "$LOG"
stage "gpu tests" ${TESTS_TIME:-90} python -m pytest -q -p no:cacheprovider -m gpu tests/workers/test_cuda_graphs.py \
  tests/workers/test_fused_kernels.py
stage "fused kernels" ${FUSED_TIME:-60} python -m tools.kernels.check_fused
stage "W1 latency" ${W1_TIME:-110} python -m cluster.bench latency --shape llama-3.2-1b \
  --compare-backends --profile --output "$OUT/w1.json"
stage "W1 latency, no lookahead" ${W1_TIME:-110} python -m cluster.bench latency --shape llama-3.2-1b \
  --no-hf --no-decode-lookahead --output "$OUT/w1-no-lookahead.json"
stage "W2 throughput" ${W2_TIME:-170} python -m cluster.bench throughput --shape qwen3-0.6b \
  --hf-batch-sizes ${W2_HF_BATCHES:-256} --hf-max-new-tokens 256 --hf-batch-requests 0 \
  --output "$OUT/w2.json"
stage "W2 vs HF, same work" ${W2_FULL_TIME:-400} python -m cluster.bench throughput --shape qwen3-0.6b \
  --hf-batch-sizes 256 --hf-batch-requests 0 --output "$OUT/w2-hf-same-work.json"
stage "W2 throughput, no lookahead" ${W2_TIME:-170} python -m cluster.bench throughput --shape qwen3-0.6b \
  --no-hf --no-decode-lookahead --output "$OUT/w2-no-lookahead.json"
stage "W1 latency, async, one step a call" ${W1_TIME:-110} python -m cluster.bench latency \
  --shape llama-3.2-1b --no-hf --decode-steps 1 --output "$OUT/w1-async.json"
stage "W1 latency, synchronous, one step a call" ${W1_TIME:-110} python -m cluster.bench latency \
  --shape llama-3.2-1b --no-hf --decode-steps 1 --no-async-scheduling --output "$OUT/w1-one-step.json"
stage "W2 throughput, synchronous" ${W2_TIME:-170} python -m cluster.bench throughput \
  --shape qwen3-0.6b --no-hf --no-async-scheduling --output "$OUT/w2-sync.json"
stage "W4 prefix" ${W4_TIME:-170} python -m cluster.bench prefix --shape llama-3.2-1b \
  --max-num-seqs 1024 --max-num-batched-tokens 8192 --output "$OUT/w4.json"
stage "W2 by step" ${STEPS_TIME:-90} python -m tools.profile.step_times
stage "attention" ${ATTN_TIME:-70} python -m tools.kernels.bench_attention
stage "decode attention tuning" ${TUNE_TIME:-150} python -m tools.kernels.tune_decode
stage "one-token projections" ${GEMV_TIME:-240} python -m tools.kernels.tune_gemv
