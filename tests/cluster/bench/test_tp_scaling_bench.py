"""W7's command line and its roofline at each TP, on the CPU (its speed needs GPUs: the run on
4 and 8 H200s is one command, `python -m cluster.bench tp-scaling --shape llama-3-70b ...`)."""

import argparse
import math

import pytest

from cluster.bench import roofline, shapes
from cluster.bench.args import add_bench_parsers
from cluster.bench.tp_scaling import run_bounds

H200 = roofline.Ceilings(4.3e12, 790e12, "bfloat16")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem")
    add_bench_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "tp-scaling", *argv])


def test_the_70b_shape_is_llama_3_70b():
    config = shapes.SHAPES["llama-3-70b"]
    assert shapes.num_parameters(config) == 70_553_706_496
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["intermediate_size"]) == (80, 8192, 64, 8,
                                                                          28672)


def test_tp_4_and_8_of_the_70b_shape_with_100_requests_of_256_tokens_parse():
    args = parse("--shape", "llama-3-70b", "--tp", "4", "8", "--batch", "1", "100",
                 "--output-len", "256")
    assert (args.shape, args.tp, args.batch, args.output_len) == ("llama-3-70b", [4, 8],
                                                                  [1, 100], 256)
    from cluster.bench.args import tp_scaling_problem

    assert tp_scaling_problem(args) is None


@pytest.mark.parametrize("tp", ["0", "16"])
def test_a_tp_beyond_one_node_is_refused_by_the_parser(tp, capsys):
    with pytest.raises(SystemExit):
        parse("--tp", "1", tp)
    assert f"argument --tp: {tp}: shards of one replica share a node, 1 to 8" in \
        capsys.readouterr().err


def test_a_tp_that_does_not_split_the_shape_is_refused_before_anything_is_built(capsys):
    args = parse("--shape", "qwen2.5-coder-1.5b", "--tp", "2", "4", "8")  # 12 heads, 2 kv heads
    assert args.handler(args) == 2
    assert capsys.readouterr().err == (
        "tandem bench tp-scaling: error: --tp 8: does not split qwen2.5-coder-1.5b (12 "
        "attention heads over 2 kv heads); choose from 1, 2, 4\n")


def test_the_roofline_at_tp_8_is_each_rank_s_share():
    """Per rank at TP 8: an eighth of the weights and one of the 8 kv heads."""
    config = shapes.SHAPES["llama-3-70b"]
    params = shapes.num_parameters(config)
    cost = roofline.ModelCost(2 * params, 2 * 80 * 8 * 128 * 2, params)
    args = argparse.Namespace(prompt_len=128, output_len=256)
    rank_weights, rank_kv = 2 * params // 8, 2 * 80 * 128 * 2
    batch_1 = run_bounds(cost, 8, 8, 1, args, H200)
    mean_context = 128 + 255 / 2
    assert batch_1["tpot_ms"] == pytest.approx(1e3 * (rank_weights + mean_context * rank_kv)
                                               / 4.3e12)
    assert round(batch_1["tpot_ms"], 2) == 4.10
    # 100 requests at once: 256 steps of the weights, every context's KV, KV written, at
    # least the FLOPs of all 100 x 384 tokens
    batch_100 = run_bounds(cost, 8, 8, 100, args, H200)
    assert batch_100["tpot_ms"] is None
    memory_s = (256 * rank_weights + 100 * (256 * 128 + 256 * 255 // 2) * rank_kv
                + 100 * 384 * rank_kv) / 4.3e12
    compute_s = 2 * (params // 8) * 100 * 384 / 790e12
    assert batch_100["output_tok_per_s"] == pytest.approx(100 * 256 / max(memory_s, compute_s))
    # at TP 4 a rank reads twice the weights and two kv heads
    assert run_bounds(cost, 8, 4, 1, args, H200)["tpot_ms"] == pytest.approx(
        2 * batch_1["tpot_ms"], rel=1e-9)


def test_a_shape_over_4_gib_is_written_in_files_of_at_most_4_gib():
    """The 70B shape's 141 GB never sit in memory at once: one file of bf16 at a time."""
    big = shapes.parameter_shapes(shapes.SHAPES["llama-3-70b"])
    files = shapes.shard_files(big, shapes.SHARD_BYTES)
    assert len(files) == 36 and next(iter(files)) == "model-00001-of-00036.safetensors"
    assert [name for names in files.values() for name in names] == list(big)
    assert max(sum(2 * math.prod(big[n]) for n in names) for names in files.values()) \
        <= 4 << 30
    small = shapes.parameter_shapes(shapes.SHAPES["llama-3.2-1b"])
    assert shapes.shard_files(small, shapes.SHARD_BYTES) == {"model.safetensors": list(small)}
