set -x
export PYTHONPATH=$PWD
bash .real/put.sh 01 || exit 1
source .kit/on-device.sh
mkdir -p /tmp/gg && python -m zipfile -e .real/01/gguf-*.whl /tmp/gg
[ -f /tmp/real/smollm2/config.json ] || PYTHONPATH=$PWD:/tmp/gg python -c "
from pathlib import Path
from workers.catalog.gguf_import import convert_gguf
convert_gguf(Path('/tmp/real/model'), Path('/tmp/real/smollm2'))" 2>&1 | tail -3
ls /tmp/real/smollm2
timeout 420 python -m cluster.cli.main draft-head train --model /tmp/real/smollm2 --output $OUT/head --self-written 6000 --max-tokens 256 --epochs 4 --k 3 2>&1 | grep -v "Warning\|it/s\]" | tail -40
ls -la $OUT/head
