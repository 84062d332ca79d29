"""kv_cache_dtype through the engine: quantized blocks behind prefix hits, chunked prefill and
preemption give the tokens that recomputing them gives, and bad names fail at start-up."""

import pytest
import torch

from cluster import LLM, EngineConfig, SamplingParams
from cluster.engine.engine_setup import worker_config
from kvstore.kv_format import ACCURACY_NOTES
from workers.attention.key_centers import centers_digest
from workers.layers.parallel import TensorParallelGroup

PREFIX = list(range(40, 73))  # 33 tokens: 8 full blocks of 4 shared, one token past them
PROMPTS = [PREFIX + [5, 6, 7], PREFIX + [900, 3], PREFIX + [11, 12, 13, 14, 15]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def generate(llm: LLM, prompts) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]


def engine(tiny_models, kv_cache_dtype: str, **options) -> LLM:
    return LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", block_size=4,
               kv_cache_dtype=kv_cache_dtype, **{"num_kv_blocks": 128} | options)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_prefix_hits_on_quantized_blocks_give_the_recomputed_tokens(tiny_models, kv_cache_dtype):
    recomputed = engine(tiny_models, kv_cache_dtype, enable_prefix_caching=False)
    want = [generate(recomputed, [p])[0] for p in PROMPTS]
    cached = engine(tiny_models, kv_cache_dtype)
    got = [generate(cached, [p])[0] for p in PROMPTS]  # the second and third hit the first's
    assert got == want
    stats = cached.stats()
    # the last two prompts found the 8 shared blocks: 32 of their tokens each
    assert stats.prefix_cache_hits == 2 * 32
    worker = cached.engine.executor.worker
    layer = worker.kv_caches[0]
    assert layer.k.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert layer.k_scale is not None and layer.k_scale.dtype == torch.float16
    # int8's blocks hold rotated keys (head_dim 16), fp8's unrotated; both less the centers
    assert (layer.key_rotation is not None) == (kv_cache_dtype == "int8")
    assert torch.equal(layer.key_center, worker.key_centers[0])


def test_fp8_says_at_start_up_what_it_costs_against_int8(tiny_models, caplog):
    with caplog.at_level("WARNING", logger="cluster.engine.llm_engine"):
        llm = engine(tiny_models, "fp8")
    notes = [r.getMessage() for r in caplog.records if "kv_cache_dtype 'fp8'" in r.getMessage()]
    assert notes == [ACCURACY_NOTES["fp8"]] and "96.6% against int8's 99.5%" in notes[0]
    digest = centers_digest(llm.engine.executor.worker.key_centers, TensorParallelGroup.single())
    assert llm.engine.kv_hash_keys[1] == (str(tiny_models["llama"]),
                                          "kv_cache_dtype=fp8+centered-keys",
                                          f"key-centers={digest}")
    caplog.clear()
    with caplog.at_level("WARNING", logger="cluster.engine.llm_engine"):
        engine(tiny_models, "int8")
    assert not [r for r in caplog.records if "kv_cache_dtype" in r.getMessage()]


def test_chunked_prefill_and_preemption_on_int8_blocks_change_no_token(tiny_models):
    want = generate(engine(tiny_models, "int8", enable_prefix_caching=False), PROMPTS)
    chunked = engine(tiny_models, "int8", max_prefill_chunk=5)
    assert generate(chunked, PROMPTS) == want
    # 12-14 blocks each, unshared: the three can't all run at once
    tight = engine(tiny_models, "int8", num_kv_blocks=20, enable_prefix_caching=False)
    assert generate(tight, PROMPTS) == want
    assert tight.stats().num_preemptions > 0


def test_kv_cache_dtype_reaches_the_workers_and_the_block_hashes(tiny_models):
    config = EngineConfig(model=str(tiny_models["llama"]), kv_cache_dtype="int8")
    # the shard actors of a tensor-parallel replica are built from this WorkerConfig too
    assert worker_config(config, tiny_models["llama"]).kv_cache_dtype == "int8"
    llm = engine(tiny_models, "int8")
    # the format's key names the keys' rotation and centering, and the centers' digest the
    # centers this process calibrated: blocks of another int8 never match
    worker = llm.engine.executor.worker
    digest = centers_digest(worker.key_centers, TensorParallelGroup.single())
    want = (str(tiny_models["llama"]), "kv_cache_dtype=int8+hadamard-keys+centered-keys",
            f"key-centers={digest}")
    assert llm.engine.kv_hash_keys[1] == want and len(worker.key_centers) == 2
    assert engine(tiny_models, "auto").engine.kv_hash_keys[1] == (str(tiny_models["llama"]),)


@pytest.mark.parametrize("name", ["int4", "float8", "Int8"])
def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices(name):
    message = f"unknown kv_cache_dtype {name!r} (choose from auto, int8, fp8)"
    with pytest.raises(ValueError) as error:
        EngineConfig(kv_cache_dtype=name)
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        LLM("no-such-model-is-loaded", kv_cache_dtype=name)
    assert str(error.value) == message
