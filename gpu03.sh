set -x
export PYTHONPATH=$PWD

timeout 260 python -m cluster.bench speculative --shape llama-3.1-8b --eagle3-head --alpha 0.8 --k 2,4 --batch-sizes 1,8,32 --beside-fixed --no-hf --output $OUT/eagle_sweep.json 2>&1 | grep -v Warning | tail -16
