"""`tandem bench serve`'s goodput flag, SLO sweep and capacity bound: limits parsed as vLLM
spells them, goodput counted against them, the sweep's probes and answer from a server whose
latency rises with the rate, and the bound's arithmetic."""

import argparse
import asyncio

import pytest

from cluster.bench.roofline import Ceilings, ModelCost, serving_bound
from cluster.bench.serve_load import Load, Timing, run_loads
from cluster.bench.serve_slo import check_slo_arguments, slo_table, sweep
from cluster.bench.slo import Slo, find_slo_rate, goodput, load_meets, parse_slo
from cluster.cli.main import build_parser

TIMINGS = [
    Timing(start=0.0, chunk_times=[0.1, 0.2], end=0.2, output_tokens=2),  # TTFT 100, TPOT 100
    Timing(start=0.0, chunk_times=[0.3, 0.31], end=0.31, output_tokens=2),  # 300, 10
    Timing(start=0.0, chunk_times=[0.05], end=0.05, output_tokens=1),  # 50, no TPOT
    Timing(start=0.0),  # never answered
]


def test_limits_are_read_as_vllm_spells_them():
    assert parse_slo(["ttft:200", "tpot:20"], "--goodput") == Slo(ttft_s=0.2, tpot_s=0.02)
    assert parse_slo(["e2el:1500"], "--goodput").text == "e2el:1500"
    for pairs, message in [
            (["ttft=200"], "--goodput 'ttft=200': give KEY:MILLISECONDS with KEY one of "
                           "ttft, tpot, e2el"),
            (["itl:5"], "--goodput 'itl:5': give KEY:MILLISECONDS with KEY one of "
                        "ttft, tpot, e2el"),
            (["ttft:fast"], "--goodput 'ttft:fast': 'fast' is not a number of milliseconds"),
            (["tpot:0"], "--goodput 'tpot:0': the limit must be above 0 ms"),
            (["ttft:1", "ttft:2"], "--goodput: ttft is given twice"),
            ([], "--goodput: give at least one KEY:MILLISECONDS")]:
        with pytest.raises(ValueError) as error:
            parse_slo(pairs, "--goodput")
        assert str(error.value) == message


def test_goodput_counts_requests_within_every_limit():
    # 4 s: TTFT < 200 ms keeps the first and third; TPOT < 20 ms then only the third (the
    # one-token answer has no TPOT to miss)
    assert goodput(TIMINGS, 4.0, Slo(ttft_s=0.2)) == 0.5
    assert goodput(TIMINGS, 4.0, Slo(ttft_s=0.2, tpot_s=0.02)) == 0.25
    assert goodput(TIMINGS, 4.0, Slo(e2el_s=0.25)) == 0.5


def test_the_goodput_limits_reach_each_load_and_its_table():
    async def send(prompt: list[int], output_len: int) -> Timing:
        return Timing(start=0.0, chunk_times=[0.15, 0.16], end=0.16, output_tokens=2)

    for goodput_flag, good in ((None, True), (["ttft:100"], False)):
        args = argparse.Namespace(input_len=4, output_len=2, num_requests=4, seed=0,
                                  goodput=goodput_flag)
        results = asyncio.run(run_loads(send, args, [Load(concurrency=4)], vocab=10))
        result = results["concurrency 4"]
        # TTFT 150 ms, TPOT 10 ms: all good at 200 / 20, none at 100 (the sends take no time,
        # so the rate's value is the loop's)
        assert (result["request_goodput"] > 0) == good
        assert result["request_goodput"] == result["goodput_requests_per_s"]
        assert result["goodput_slo"] == ("ttft:200 tpot:20" if goodput_flag is None
                                         else "ttft:100")
        assert result["finished"] == 4 and result["ttft_s"]["p90"] == 0.15


def test_bad_limits_fail_before_anything_starts():
    args = build_parser().parse_args(["bench", "serve", "--goodput", "ttft:200", "tpot:20",
                                      "--find-slo-rate", "--slo", "ttft:500", "tpot:25"])
    assert (args.goodput, args.slo, args.find_slo_rate) == (
        ["ttft:200", "tpot:20"], ["ttft:500", "tpot:25"], True)
    check_slo_arguments(args)
    args.slo = ["ttft:-1"]
    with pytest.raises(ValueError, match=r"^--slo 'ttft:-1': the limit must be above 0 ms$"):
        check_slo_arguments(args)
    args.slo, args.slo_first_rate = None, 0.0
    with pytest.raises(ValueError, match=r"^--slo-first-rate must be above 0, not 0$"):
        check_slo_arguments(args)


def summary(ttft_p90: float, tpot_p90: float, finished: int = 10) -> dict:
    return {"requests": 10, "finished": finished, "ttft_s": {"p90": ttft_p90},
            "tpot_s": {"p90": tpot_p90}, "e2e_s": {"p90": 1.0}}


def test_a_load_meets_the_slo_at_its_90th_percentiles():
    slo = Slo(ttft_s=0.5, tpot_s=0.025)
    assert load_meets(summary(0.4, 0.02), slo)
    assert not load_meets(summary(0.5, 0.02), slo)  # below, not at
    assert not load_meets(summary(0.1, 0.03), slo)
    assert not load_meets(summary(0.1, 0.01, finished=9), slo)  # a request got nothing


def server(capacity: float):
    """Probes of a server whose p90 TTFT is fine below ``capacity`` req/s and not above."""
    rates = []

    async def probe(rate: float) -> dict:
        rates.append(rate)
        return summary(0.1 if rate <= capacity else 2.0, 0.01)

    return probe, rates


def test_the_sweep_doubles_then_bisects_to_the_highest_rate_that_meets_the_slo():
    probe, rates = server(capacity=70.0)
    found = asyncio.run(find_slo_rate(probe, Slo(ttft_s=0.5), start=10.0))
    # 10, 20, 40 meet it, 80 does not; then 60 meets, 70 meets, 75 does not
    assert rates == [10.0, 20.0, 40.0, 80.0, 60.0, 70.0, 75.0]
    assert (found["rate"], found["first_rate_missed"]) == (70.0, 75.0)
    assert [p["meets"] for p in found["probes"]] == [True, True, True, False, True, True, False]
    # from above, it halves until a rate meets it
    probe, rates = server(capacity=70.0)
    found = asyncio.run(find_slo_rate(probe, Slo(ttft_s=0.5), start=200.0, refinements=1))
    assert rates == [200.0, 100.0, 50.0, 75.0] and found["rate"] == 50.0
    # a server that meets nothing: no rate, within the probes allowed
    probe, rates = server(capacity=0.0)
    found = asyncio.run(find_slo_rate(probe, Slo(ttft_s=0.5), start=1.0, max_probes=4))
    assert found["rate"] is None and rates == [1.0, 0.5, 0.25, 0.125]
    with pytest.raises(ValueError, match="first rate must be above 0, not 0"):
        asyncio.run(find_slo_rate(probe, Slo(ttft_s=0.5), start=0.0))


def test_the_sweep_runs_poisson_loads_and_reports_its_share_of_the_bound():
    seen, counts = [], []

    async def runner(prompts, output_len, load, seed):  # type: ignore[no-untyped-def]
        seen.append(load)
        counts.append(len(prompts))
        late = load.rate > 6.0
        return [Timing(start=0.0, chunk_times=[1.0 if late else 0.1, 1.1 if late else 0.11],
                       end=1.1 if late else 0.11, output_tokens=2)
                for _ in prompts], 1.0

    args = argparse.Namespace(input_len=4, output_len=2, num_requests=4, seed=0, goodput=None,
                              slo=["ttft:500"], slo_first_rate=None)
    bound = {"requests_per_s": 16.0}
    found = asyncio.run(sweep("in-process", args, vocab=10, bound=bound, runner=runner))
    # from a quarter of the bound: 4 meets, 8 does not; 6 meets, 7 does not, 6.5 does not
    assert [p["rate"] for p in found["probes"]] == [4.0, 8.0, 6.0, 7.0, 6.5]
    assert (found["rate"], found["share_of_bound"]) == (6.0, 0.375)
    # each probe a warm-up and a measured run of one Poisson load, uncapped, of 8 s of
    # arrivals (at least 32 prompts), not --num-prompts
    assert seen[0] == seen[1] == Load(rate=4.0)
    assert counts[1] == 32
    table = slo_table(bound, {"in-process": found})
    assert "| in-process | ttft:500 | 6 | 6.5 | 16 | 38% | 5 |" in table


def test_the_bound_holds_the_rate_s_prefills_and_decode_steps_in_a_second():
    # 1 GB of weights (500 M parameters), 100 kB of KV a token, 1 TB/s, 100 TFLOP/s
    cost = ModelCost(weight_bytes=10**9, kv_bytes_per_token=10**5, num_params=5 * 10**8)
    ceilings = Ceilings(bandwidth_bytes_per_s=1e12, matmul_flops_per_s=1e14, matmul_dtype="bf16")
    bound = serving_bound(cost, ceilings, input_len=1000, output_len=101, batch=100)
    # prefill: 2 x 5e8 x 1000 = 1e12 FLOP, 10 ms; a decode step of 100 rows at a mean
    # context of 1050: 1e9 + 100 x 1050 x 1e5 = 1.15e10 bytes, 11.5 ms; a request: 10 ms and
    # 100 steps' hundredth of 11.5 ms, 21.5 ms
    assert bound["prefill_s"] == pytest.approx(0.010)
    assert bound["decode_step_s"] == pytest.approx(0.0115)
    assert bound["requests_per_s"] == pytest.approx(1 / 0.0215)
    assert bound["output_tokens_per_s"] == pytest.approx(101 / 0.0215)
    with pytest.raises(ValueError, match="at least 1"):
        serving_bound(cost, ceilings, input_len=0, output_len=1, batch=1)
