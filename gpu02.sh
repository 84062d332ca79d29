set -x
export PYTHONPATH=$PWD
timeout 200 python -m pytest -m gpu -q -x -p no:cacheprovider tests/cluster/engine/test_eagle.py tests/workers/test_cuda_graphs.py 2>&1 | tail -25
timeout 150 python -m tools.profile.spec_steps --shape llama-3.1-8b --eagle3-head --batch-sizes 1 --k 4 --alpha 0.8 --output-len 128 --no-hf 2>&1 | grep -v Warn | head -70
timeout 150 python -m cluster.bench speculative --shape llama-3.1-8b --eagle3-head --adaptive --proposer draft --draft-seed 1 --k 4 --batch-sizes 1,8,32 --no-hf --output $OUT/eagle_off.json 2>&1 | grep -v Warning | tail -12
