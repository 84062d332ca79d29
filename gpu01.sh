set -x
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 200 python -m pytest -m gpu -q -x tests/cluster/engine/test_eagle.py tests/workers/test_cuda_graphs.py 2>&1 | tail -25
timeout 200 python -m cluster.bench speculative --shape llama-3.1-8b --eagle3-head --alpha 0.8 --k 4 --batch-sizes 1,8 --no-hf --output $OUT/eagle_a08.json 2>&1 | grep -v Warning | tail -20
timeout 120 python -m tools.profile.spec_steps --shape llama-3.1-8b --eagle3-head --batch-sizes 1 --k 4 --alpha 0.8 --output-len 128 --no-hf 2>&1 | head -60
