set -x
export PYTHONPATH=$PWD
bash .real/put.sh 00
source .kit/on-device.sh
timeout 250 python -m cluster.bench speculative --shape llama-3.1-8b --draft-shape llama-3.2-1b --alpha 0.8 --k 2,4 --batch-sizes 16 --beside-fixed --repeats 2 --no-hf --output $OUT/w5_b16.json 2>&1 | grep -v Warning | tail -12
