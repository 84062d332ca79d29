#!/usr/bin/env bash
# W3 on one GPU, the serving variants side by side: one or four ingress replicas, through Serve's
# proxy or with direct ingress (RAY_SERVE_THROUGHPUT_OPTIMIZED: the ingress serves HTTP itself).
# Needs Ray and pydantic: on the GPU machine, `source .kit/on-device.sh` first.
# Usage: OUT=<folder> bash cluster/bench/run_gpu_serve.sh   (each variant has its own time limit)
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
LOG="$OUT/log-serve.txt"; ERR="$OUT/stderr-serve.txt"
for variant in "1 0" "4 0" "1 1" "4 1"; do
  read -r ingress optimized <<<"$variant"
  echo "== W3, $ingress ingress replica(s), throughput-optimized Serve: $optimized" | tee -a "$LOG"
  RAY_SERVE_THROUGHPUT_OPTIMIZED=$optimized timeout "${W3_TIME:-150}" python -m cluster.bench \
    serve --shape llama-3.2-1b --concurrency 1,32 --ingress-replicas "$ingress" \
    --output "$OUT/w3-ingress$ingress-opt$optimized.json" 2>>"$ERR" | grep "^|" | tee -a "$LOG"
done
