export PYTHONPATH=$PWD:$PYTHONPATH
timeout 110 python -m cluster.bench speculative --shape llama-3.2-1b --eagle3-head --adaptive --proposer draft --k 4 --batch-sizes 1,8,32 --repeats 2 --no-hf --output $OUT/off_1b.json 2>&1 | grep -v Warning | tail -7
timeout 90 python -m tools.profile.spec_steps --shape llama-3.2-1b --eagle3-head --batch-sizes 1 --k 4 --alpha 0.8 --output-len 128 --no-hf 2>&1 | grep -v Warn | head -62
