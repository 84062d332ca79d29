#!/usr/bin/env bash
# The two-GPU runs of docs/benchmarks.md: all-reduce latency (NCCL vs peer memory), W7
# (TP 1 vs 2, TP 2 with NCCL sums and with peer-memory sums), the TP=2 GPU tests and a
# torch.profiler table of every rank of TP 2 at batch 1.
# Needs Ray and pydantic: on the GPU machine, `source .kit/on-device.sh` first.
# Usage: OUT=<folder> bash tools/gpu/run_gpu_tp.sh   (each stage has its own time limit)
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
LOG="$OUT/log-tp.txt"; ERR="$OUT/stderr-tp.txt"
stage() { echo "== $1" | tee -a "$LOG"; shift; timeout "$@" 2>>"$ERR" | tee -a "$LOG"; echo "rc=$?" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee -a "$LOG"
stage "all-reduce in a graph" ${AR_TIME:-120} python -m tools.profile.all_reduce --output "$OUT/all-reduce.json"
stage "W7 tp scaling" ${W7_TIME:-420} python -m cluster.bench tp-scaling --shape llama-3.1-8b \
  --tp 1 2 --batch 1 64 ${W7_ARGS:-} --output "$OUT/w7.json"
stage "gpu tests (TP)" ${TP_TESTS_TIME:-150} python -m pytest -q -p no:cacheprovider -m gpu \
  ${TP_TESTS:-tests/workers/test_cuda_graphs.py tests/workers/test_tp_graphs.py}
stage "W7 TP 2 profile (every rank, batch 1)" ${PROFILE_TIME:-150} python -m cluster.bench tp-scaling \
  --shape llama-3.1-8b --tp 2 --batch 1 --all-reduce symmetric --profile \
  --output "$OUT/w7-profile.json"
