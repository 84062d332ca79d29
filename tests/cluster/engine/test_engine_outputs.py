"""Streaming deltas rebuild exactly the outputs that whole snapshots give, step by step."""

from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import OutputAccumulator
from router.sampling_params import SamplingParams


def engine(folder):
    return LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                  num_kv_blocks=64, max_num_batched_tokens=16))


def test_deltas_rebuild_the_snapshots_and_only_finished_skips_the_rest(tiny_models):
    folder = tiny_models["llama"]
    full, streamed, final = engine(folder), engine(folder), engine(folder)
    requests = [([1, 2, 3, 4, 5] * 4, SamplingParams(max_tokens=6, logprobs=2)),
                ([9, 8, 7], SamplingParams(max_tokens=9, n=2, temperature=1.0, seed=3))]
    for e in (full, streamed, final):
        for prompt, params in requests:
            e.add_request(prompt, params)
    accumulators: dict[str, OutputAccumulator] = {}
    finished_outputs = []
    while full.has_unfinished():
        snapshots = full.step()
        rebuilt = [accumulators.setdefault(d.request_id, OutputAccumulator()).add(d)
                   for d in streamed.step_deltas()]
        assert [vars_of(o) for o in rebuilt] == [vars_of(o) for o in snapshots]
        finished_outputs += final.step(only_finished=True)
        assert all(o.finished for o in finished_outputs)
    assert not streamed.has_unfinished() and not final.has_unfinished()
    assert sorted(o.request_id for o in finished_outputs) == ["req-0", "req-1"]
    by_id = {o.request_id: o for o in finished_outputs}
    assert [vars_of(by_id[r]) for r in ("req-0", "req-1")] == [
        vars_of(accumulators[r].output) for r in ("req-0", "req-1")]
    full.scheduler.kv.check_integrity()


def vars_of(output):
    return (output.request_id, output.prompt_token_ids, output.finished,
            [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs)
             for c in output.outputs])


def test_a_multi_step_call_spreads_its_time_over_its_tokens(tiny_models):
    engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), device="cpu",
                                    dtype="float32", num_kv_blocks=64, decode_steps=4))
    gaps: list[float] = []
    engine.metrics.inter_token_latency.observe = lambda value, times=1: gaps.extend([value] * times)
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    calls, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            calls.append(len(out.outputs[0].token_ids))
            last = out
    assert calls == [1, 5, 9]  # the prefill's token, then two calls of 4 steps
    # each call's time, spread evenly over its 4 tokens: no zero gaps
    assert len(gaps) == 8 and min(gaps) > 0
    assert max(gaps[:4]) - min(gaps[:4]) < 1e-9 and max(gaps[4:]) - min(gaps[4:]) < 1e-9
    total = last.metrics.finished_time - last.metrics.first_token_time
    assert abs(sum(gaps) - total) < 1e-9
