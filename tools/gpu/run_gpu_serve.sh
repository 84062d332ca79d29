#!/usr/bin/env bash
# W3 on one GPU, the serving variants side by side: N ingress replicas, through Serve's proxy or
# with direct ingress (RAY_SERVE_THROUGHPUT_OPTIMIZED: the ingress serves HTTP itself; the
# default of `tandem serve`).
# Needs Ray and pydantic: on the GPU machine, `source .kit/on-device.sh` first.
# Usage: OUT=<folder> W3_VARIANTS="4 0;8 1" bash tools/gpu/run_gpu_serve.sh
#   W3_ARGS: more arguments for every variant, e.g. W3_ARGS=--decode-lookahead or
#   W3_ARGS=--no-async-scheduling (beside a run with it, the default, on the same machine)
#   each variant is "<ingress replicas> <throughput-optimized 0|1>" and has W3_TIME seconds; on a
#   fresh machine one variant of the default loads takes ~4.5 minutes (Ray and Serve start, the
#   engine captures its graphs twice, ten loads), so keep a call's variants within its limit.
#   W3_CONCURRENCY (default 1,32,128,256) and W3_POISSON (uncapped Poisson rates, default 80; empty for none).
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
LOG="$OUT/log-serve.txt"; ERR="$OUT/stderr-serve.txt"
# the model's random weights are written once, before the variants and their time limits (on a
# fresh machine that and starting Serve can take a variant's whole limit)
python -c "from cluster.bench.shapes import build_random_model; from cluster import environment; \
build_random_model('llama-3.2-1b', environment.cache_dir() / 'bench-models')" 2>>"$ERR"
IFS=';' read -ra variants <<<"${W3_VARIANTS:-4 1}"
for variant in "${variants[@]}"; do
  read -r ingress optimized <<<"$variant"
  echo "== W3, $ingress ingress replica(s), throughput-optimized Serve: $optimized" | tee -a "$LOG"
  RAY_SERVE_THROUGHPUT_OPTIMIZED=$optimized timeout "${W3_TIME:-480}" python -m cluster.bench \
    serve --shape llama-3.2-1b --concurrency "${W3_CONCURRENCY:-1,32,128,256}" \
    --poisson-rate "${W3_POISSON-80}" \
    --ingress-replicas "$ingress" ${W3_ARGS:-} --output "$OUT/w3-ingress$ingress-opt$optimized.json" \
    2>>"$ERR" | grep -E "^\||GPUs busy" | tee -a "$LOG"
done
