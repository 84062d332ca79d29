"""`tandem bench capacity` (W6) end to end on a tiny model: every format's blocks, sequences,
throughput at a concurrency the unquantized cache can't hold, and TPOT at batch 1."""

import json

from cluster.bench.capacity import blocks_per_sequence, default_concurrency
from cluster.cli.main import main


def test_sequences_are_whole_blocks_of_prompt_and_output():
    assert blocks_per_sequence(4096, 512, 16) == 288
    assert blocks_per_sequence(8, 4, 4) == 3 and blocks_per_sequence(8, 5, 4) == 4
    sizing = {"auto": {"max_sequences": 10}, "int8": {"max_sequences": 19},
              "fp8": {"max_sequences": 18}}
    assert default_concurrency(sizing) == 19
    assert default_concurrency({"auto": {"max_sequences": 10}}) == 10


def test_tiny_capacity_run_writes_every_figure(tiny_models, tmp_path, capsys):
    output = tmp_path / "w6.json"
    # 1e-4 GiB: 52 float32 blocks of 4 tokens, 186 of int8 or fp8 with their scales
    code = main(["bench", "capacity", "--model", str(tiny_models["llama"]), "--device", "cpu",
                 "--prompt-len", "8", "--output-len", "4", "--tpot-tokens", "4",
                 "--block-size", "4", "--cpu-kv-cache-gb", "0.0001", "--output", str(output)])
    assert code == 0
    record = json.loads(output.read_text())
    results = record["results"]
    assert list(results) == ["auto", "int8", "fp8"] and record["blocks_per_sequence"] == 3
    assert [results[f]["kv_blocks"] for f in results] == [52, 186, 186]
    assert [results[f]["max_sequences"] for f in results] == [17, 62, 62]
    assert record["concurrency"] == 62
    for result in results.values():
        run = result["throughput"]
        assert run["num_requests"] == 62 and run["output_tokens"] == 62 * 4
        assert result["tpot_batch1_s"]["p50"] > 0
    # the unquantized cache holds 17 of the 62: the rest wait, and some are preempted
    assert results["int8"]["throughput"]["num_preemptions"] == 0
    assert "| int8 | 186 | 62 |" in capsys.readouterr().out
