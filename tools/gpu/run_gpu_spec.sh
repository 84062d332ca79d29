#!/usr/bin/env bash
# The one-GPU speculative decoding runs of docs/benchmarks.md (W5, W5-EAGLE), in one go: the
# GPU tests of speculation and structured outputs, W5's concurrency sweep with a 1B draft, off
# is free (an unrelated draft, an unrelated head, prompt lookup), the EAGLE-3 head at the 8B
# shape and where its verify step's time goes.
# Usage: OUT=<folder> bash tools/gpu/run_gpu_spec.sh   (each stage has its own time limit)
#   ONLY=<regex> runs only the stages whose names match (all of them take longer than one
#   10-minute device call), e.g. ONLY='gpu tests|EAGLE 8B'.
# The default model with a trained head needs its weights on the machine (docs/benchmarks.md).
set -o pipefail
export PYTHONUNBUFFERED=1 TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"
LOG="$OUT/log.txt"; ERR="$OUT/stderr.txt"
stage() { [[ -z "${ONLY:-}" || "$1" =~ $ONLY ]] || return 0; echo "== $1" | tee -a "$LOG"; shift; timeout "$@" 2>>"$ERR" | tee -a "$LOG"; echo "rc=$?" | tee -a "$LOG"; }
W5="python -m cluster.bench speculative --shape llama-3.1-8b --input-len 128 --output-len 256 --no-hf"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee -a "$LOG"
stage "gpu tests" ${TESTS_TIME:-120} python -m pytest -q -p no:cacheprovider -m gpu \
  tests/cluster/engine/test_eagle.py tests/workers/test_cuda_graphs.py \
  tests/workers/structured/test_mask_kernel_gpu.py
stage "W5 sweep" ${SWEEP_TIME:-400} $W5 --draft-shape llama-3.2-1b --k 2,4 --alpha 0.8,0.6 \
  --beside-fixed --batch-sizes 1,4,16,64 --repeats 2 --output "$OUT/w5-sweep.json"
stage "W5 off, unrelated draft" ${OFF_TIME:-200} $W5 --adaptive --draft-shape llama-3.2-1b \
  --draft-seed 1 --proposer draft --batch-sizes 1,8,32,64 --k 4 --repeats 3 \
  --output "$OUT/w5-off-draft.json"
stage "W5 off, prompt lookup" ${OFF_TIME:-200} $W5 --adaptive --proposer ngram \
  --batch-sizes 1,8,32,64 --k 4 --repeats 3 --output "$OUT/w5-off-ngram.json"
stage "EAGLE 8B" ${EAGLE_TIME:-260} $W5 --eagle3-head --alpha 0.8 --k 2,4 --batch-sizes 1,8,32 \
  --beside-fixed --output "$OUT/w5-eagle.json"
stage "EAGLE off" ${OFF_TIME:-200} $W5 --eagle3-head --adaptive --proposer draft --k 4 \
  --batch-sizes 1,8,32 --repeats 2 --output "$OUT/w5-eagle-off.json"
stage "EAGLE off, 1B" ${OFF_TIME:-200} python -m cluster.bench speculative --shape llama-3.2-1b \
  --no-hf --eagle3-head --adaptive --proposer draft --k 4 --batch-sizes 1,8,32 --repeats 2 \
  --output "$OUT/w5-eagle-off-1b.json"
stage "EAGLE verify step" ${PROFILE_TIME:-150} python -m tools.profile.spec_steps \
  --shape llama-3.1-8b --eagle3-head --batch-sizes 1 --k 4 --alpha 0.8 --output-len 128 --no-hf
