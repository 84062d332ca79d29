#!/usr/bin/env bash
# The one-GPU runs on the default model's real weights (docs/benchmarks.md): its GGUF converted
# on the machine, then the KV formats' accuracy on the GPU (int8 and fp8 against bf16 and
# float32 caches), prompt lookup on code prompts, an EAGLE-3 head trained for it (written to
# $OUT in parts of at most 15 MB: a file back from the device machine is at most 16 MiB) and
# the model with that head against plain decoding.
# Usage: OUT=<folder> GGUF=<the default model's GGUF on this machine> bash tools/gpu/run_gpu_real.sh
#   ONLY=<regex> picks stages (together they take longer than one 10-minute device call);
#   the GGUF goes over in three calls with `../shared/device/carry-model.sh FILE 40`
#   (GGUF=/tmp/real/model): each 40 MiB part alone (a call carries 64 MiB with the working
#   tree, ~23 MB with the shipped head), then a call with .kit (41 MB) and the gguf wheel in a
#   folder of its own (e.g. .real/03); the conversion needs that wheel (GGUF_WHEELS).
#   HEAD_ARGS: more `tandem draft-head train` arguments (default: 4,000 self-written questions,
#   1,024-token packs, 150 s of training); a head trained in an earlier call stays in
#   $HEAD_DIR (default /tmp/head) for the stage that measures it.
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-bench-results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
LOG="$OUT/log-real.txt"; ERR="$OUT/stderr-real.txt"
MODEL=${MODEL_DIR:-/tmp/real/hf}; HEAD=${HEAD_DIR:-/tmp/head}
stage() { [[ -z "${ONLY:-}" || "$1" =~ $ONLY ]] || return 0; echo "== $1" | tee -a "$LOG"; shift; timeout "$@" 2>>"$ERR" | tee -a "$LOG"; echo "rc=$?" | tee -a "$LOG"; }
if [[ ! -f "$MODEL/model.safetensors" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/gguf-wheel \
    "${GGUF_WHEELS:-.real/02}"/gguf-*.whl || exit 1
  PYTHONPATH=$PYTHONPATH:/tmp/gguf-wheel python3 -c "import sys; from pathlib import Path; \
from workers.catalog.gguf_import import convert_gguf; convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))" \
    "${GGUF:?set GGUF to the GGUF file}" "$MODEL" || exit 1
fi
stage "kv accuracy, bf16" ${ACC_TIME:-150} python3 -m cluster.bench kv-accuracy --model "$MODEL" \
  --device cuda --kv-cache-dtype int8 fp8 --output "$OUT/kv-accuracy-bf16.json"
stage "kv accuracy, float32" ${ACC_TIME:-150} python3 -m cluster.bench kv-accuracy --model "$MODEL" \
  --device cuda --dtype float32 --kv-cache-dtype int8 fp8 --chat-prompts 0 \
  --output "$OUT/kv-accuracy-f32.json"
stage "prompt lookup" ${NGRAM_TIME:-120} python3 -m cluster.bench speculative --model "$MODEL" \
  --no-hf --proposer ngram --prompts code --k 4 --batch-sizes 1,8 --adaptive --repeats 2 \
  --output "$OUT/ngram-real.json"
export MODEL HEAD OUT HEAD_ARGS="${HEAD_ARGS:---self-written 4000 --epochs 2 --lr 1e-3 --pack-tokens 1024 --train-seconds 150}"
# shellcheck disable=SC2016  # expanded by the inner shell, from the exported variables
stage "train head" ${TRAIN_TIME:-420} bash -c 'rm -rf "$HEAD" && python3 -m cluster.cli.main \
  draft-head train --model "$MODEL" --output "$HEAD" --max-tokens 192 --k 3 $HEAD_ARGS \
  && (cd "$(dirname "$HEAD")" && tar cf - "$(basename "$HEAD")" | split -b 15M -d - "$OUT/head.tar.")'
stage "head" ${HEAD_TIME:-240} python3 -m cluster.bench speculative --model "$MODEL" \
  --draft-model "$HEAD" --proposer draft --prompts chat --k 3 --beside-fixed --batch-sizes 1,8 \
  --repeats 2 --no-hf --output "$OUT/eagle-real.json"
