"""EAGLE heads in the engine: whatever a random head drafts, greedy output equals
transformers' greedy output of the target, token for token, in each layout, under chunked
prefill, preemption and prefix hits; the target's features are the streams the head names."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from tests.cluster.engine.test_kv_tiers import GREEDY as TIER_GREEDY
from tests.cluster.engine.test_kv_tiers import PROMPTS as TIER_PROMPTS
from tests.cluster.engine.test_speculative import MAX_TOKENS, PROMPTS
from tests.eagle_heads import write_head
from workers.attention.reference import ReferenceAttentionBackend
from workers.layers.parallel import TensorParallelGroup
from workers.loader import load_model
from workers.speculative.config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
# the tiny target has 2 layers: an EAGLE-3 head names the streams it reads
SMALL_TARGET = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}


@pytest.fixture(scope="module")
def expected(tiny_models):
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in PROMPTS]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle-heads")
    return {
        "eagle1": write_head(folder / "eagle1", "eagle1", fc_bias=True, vocab=1001) and
        folder / "eagle1",
        "eagle3": write_head(folder / "eagle3", "eagle3", vocab=1001,
                             config_extra=SMALL_TARGET) and folder / "eagle3",
        "speculators": write_head(folder / "speculators", "speculators", bin_file=True,
                                  vocab=1001, norm_before_residual=True,
                                  config_extra=SMALL_TARGET) and folder / "speculators",
    }


def eagle(head, k: int, adaptive: bool = False) -> dict:
    return {"model": str(head), "num_speculative_tokens": k, "adaptive": adaptive}


def run(folder, prompts=PROMPTS, **engine_args):
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, **engine_args)
    outputs = llm.generate(prompts, GREEDY)
    kv = llm.engine.scheduler.kv
    kv.check_integrity()
    assert kv.num_used_blocks == 0
    return llm, [out.token_ids for out in outputs]


@pytest.mark.parametrize("layout", ["eagle1", "eagle3", "speculators"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_transformers_with_a_random_head(tiny_models, expected, heads, layout, k):
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=256,
                      speculative_config=eagle(heads[layout], k))
    assert tokens == expected
    stats = llm.stats()
    # decode steps drafted k (fixed k; fewer where a sequence's end is nearer): the head ran
    drafts = stats.spec_decode_num_drafts
    assert drafts > 0
    assert (k - 1) * drafts < stats.spec_decode_num_draft_tokens <= k * drafts


def test_the_method_is_read_from_the_head(tiny_models, heads):
    config = SpeculativeConfig.from_dict({"model": "/heads/EAGLE3-LLaMA3.1-Instruct-8B"})
    assert config.method == "eagle3"
    assert SpeculativeConfig.from_dict({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}).method \
        == "eagle"
    with pytest.raises(ValueError, match="speculative method 'eagle' asked for, but .* holds "
                                         "an EAGLE-3 head"):
        LLM(str(tiny_models["llama"]), device="cpu", dtype="float32",
            speculative_config={"method": "eagle", "model": str(heads["eagle3"])})
    with pytest.raises(ValueError, match="method 'eagle3' drafts from the target's own hidden "
                                         "states: placement 'worker' only"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "placement": "actor"})


def test_chunked_prefill_preemption_and_prefix_hits_keep_the_tokens(tiny_models, expected,
                                                                    heads):
    # chunks of 8 tokens; 24 blocks of 4 for 4 sequences: some are preempted and come back
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=24, max_num_batched_tokens=8,
                      speculative_config=eagle(heads["eagle3"], 3))
    assert tokens == expected
    assert llm.stats().num_preemptions > 0
    # the same prompts again on the same engine, then the first alone twice (the second time
    # its blocks, just computed, are cached whichever blocks the preemptions evicted): prefix
    # hits, whose features the head reads where the blocks are
    again = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert again == expected
    for _ in range(2):
        assert llm.generate(PROMPTS[:1], GREEDY)[0].token_ids == expected[0]
    assert llm.stats().prefix_cache_hits > 0


def test_adaptive_speculation_decides_for_a_head_too(tiny_models, expected, heads):
    llm, tokens = run(tiny_models["llama"], num_kv_blocks=256,
                      speculative_config=eagle(heads["eagle1"], 4, adaptive=True))
    assert tokens == expected


def test_the_target_keeps_the_streams_an_eagle3_head_reads(tiny_models):
    model, _ = load_model(tiny_models["llama"], torch.float32, "cpu",
                          TensorParallelGroup.single(), ReferenceAttentionBackend(), fused=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    prompt = torch.tensor([PROMPTS[1]])
    streams = hf(prompt, output_hidden_states=True).hidden_states  # [i]: entering layer i
    model.model.aux_layers = (1, 0, 1)
    from workers.input_batch import build_input_batch
    from workers.kv_cache import allocate_kv_caches
    from workers.step_input import ScheduledRequest

    class Row:
        token_ids, block_ids = PROMPTS[1], [0, 1, 2, 3, 4]

    batch = build_input_batch([ScheduledRequest("a", 0, len(PROMPTS[1]))], {"a": Row()}, 4,
                              torch.device("cpu"))
    caches = allocate_kv_caches(model.config, 1, 8, 4, torch.float32, torch.device("cpu"))
    model(batch.input_ids, batch.positions, caches, batch.meta)
    wanted = torch.cat([streams[1][0], streams[0][0], streams[1][0]], dim=-1)
    torch.testing.assert_close(model.model.aux_features, wanted, rtol=1e-5, atol=1e-5)


def test_the_drafter_catches_up_and_chains_as_the_reference_does(tiny_models, tmp_path):
    """A row of n known tokens and a newest one: the first draft is the head's output at
    n - 1 over the target's streams (as transformers gives them), the next ones the head's
    chain fed its own drafts and output streams; the same after the target verified a step."""
    from tests.workers.speculative.test_eagle_head import eagle3_logits, eagle3_stream
    from workers.input_batch import build_input_batch
    from workers.kv_cache import allocate_kv_caches
    from workers.speculative.eagle.drafter import EagleDrafter
    from workers.step_input import ScheduledRequest

    weights = write_head(tmp_path / "head", "eagle3", vocab=1001, config_extra=SMALL_TARGET)
    backend = ReferenceAttentionBackend()
    target, config = load_model(tiny_models["llama"], torch.float32, "cpu",
                                TensorParallelGroup.single(), backend, fused=False)
    drafter = EagleDrafter(str(tmp_path / "head"), "eagle3", target, config, torch.float32,
                           torch.device("cpu"), backend, 3, 4)
    drafter.allocate(16)
    drafter.build_rotary_table(64)
    caches = allocate_kv_caches(config, 1, 16, 4, torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32)
    embedding = hf.model.embed_tokens.weight.detach()

    class Row:
        def __init__(self, tokens):
            self.token_ids, self.block_ids = tokens, [3, 9, 1, 12, 5, 7]

    def target_forward(tokens, start):  # the target computes tokens[start:], keeps features
        batch = build_input_batch([ScheduledRequest("a", start, len(tokens) - start)],
                                  {"a": Row(tokens)}, 4, torch.device("cpu"))
        drafter.store(batch.meta.slot_mapping,
                      target(batch.input_ids, batch.positions, caches, batch.meta))

    def reference_drafts(tokens, k):
        with torch.no_grad():
            streams = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
            features = torch.cat([streams[i][0] for i in (0, 1, 1)], -1)
            hidden, inputs, drafts = features @ weights["fc.weight"].T, list(tokens[1:]), []
            for _ in range(k):
                stream = eagle3_stream(weights, "midlayer.", embedding, torch.tensor(inputs),
                                       hidden, False)
                drafts.append(int(eagle3_logits(weights, stream, 1001)[-1].argmax()))
                hidden, inputs = torch.cat([hidden, stream[-1:]]), inputs + drafts[-1:]
        return drafts

    prompt = PROMPTS[1]
    target_forward(prompt, 0)
    tokens = prompt + [17]  # the newest token: the target computes it in the drafting step
    drafts = drafter.draft(["a"], [Row(tokens)], [3])
    assert drafts == [reference_drafts(tokens, 3)]
    assert drafter.take_caught_up() == len(prompt)
    # the target verifies 17 and the drafts; say it kept the first and sampled 23: the head
    # catches up on the two positions it has true features for now, and drafts again
    target_forward(tokens + drafts[0], len(prompt))
    tokens = tokens + drafts[0][:1] + [23]
    assert drafter.draft(["a"], [Row(tokens)], [2]) == [reference_drafts(tokens, 2)]
    assert drafter.take_caught_up() == 2


@pytest.mark.ray
def test_tensor_parallel_2_drafts_with_the_whole_embedding(ray_session, tiny_models, expected,
                                                          heads):
    """Rank 0's head reads the target's whole embedding and lm_head (its shard holds half),
    and the features every rank computes alike."""
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=128, tensor_parallel_size=2, distributed_executor_backend="ray",
              speculative_config=eagle(heads["eagle1"], 3))
    one_rank, _ = run(tiny_models["llama"], num_kv_blocks=128,
                      speculative_config=eagle(heads["eagle1"], 3))
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
        assert [out.token_ids for out in outputs] == expected
        llm.engine.scheduler.kv.check_integrity()
        # the same drafts as on one rank: as many made and as many kept
        stats, alone = llm.stats(), one_rank.stats()
        assert stats.spec_decode_num_draft_tokens == alone.spec_decode_num_draft_tokens > 0
        assert stats.spec_decode_num_accepted_tokens == alone.spec_decode_num_accepted_tokens
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
def test_on_a_gpu_graphs_keep_the_heads_features(tiny_models, heads):
    """The target's CUDA graphs hand back each bucket's features: the head drafts what it
    drafts eagerly (as many kept), and the tokens are the eager run's."""
    def drafted(enforce_eager: bool):  # type: ignore[no-untyped-def]
        llm = LLM(str(tiny_models["llama"]), device="cuda", dtype="float32", block_size=16,
                  enforce_eager=enforce_eager,
                  speculative_config=eagle(heads["eagle3"], 3))
        worker = llm.engine.executor.worker
        # graphed: the target's and the head's (its chain and its catch-up); eager: neither
        assert (worker.graphs is None, worker.eagle.graphs is None) == (enforce_eager,) * 2
        tokens = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        stats = llm.stats()
        llm.engine.shutdown()
        return tokens, stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens

    assert drafted(enforce_eager=False) == drafted(enforce_eager=True)


def test_the_heads_step_buffers_hold_the_largest_graph_bucket(tiny_models, heads):
    """Graphs of 5 sequences capture a bucket of 8 rows: the head's static feature buffers
    are made for 8 (capture itself needs a GPU; the sizes are the CPU's to check)."""
    from workers.cuda_graphs import capture_sizes
    from workers.speculative.eagle.drafter import EagleDrafter

    backend = ReferenceAttentionBackend()
    target, config = load_model(tiny_models["llama"], torch.float32, "cpu",
                                TensorParallelGroup.single(), backend, fused=False)
    drafter = EagleDrafter(str(heads["eagle3"]), "eagle3", target, config, torch.float32,
                           torch.device("cpu"), backend, 3, 4)
    rows = capture_sizes(5)[-1]
    chain, catch_up = drafter._steps(rows)
    assert rows == 8 and chain.features.shape == (8, 64) and catch_up.features.shape == (8, 192)


def test_blocks_loaded_from_the_host_tier_bring_their_features(tiny_models, heads):
    """A sequence's first draft catches the head up over the features of every position
    before it: for prefix blocks loaded back from the host tier those are the features the
    target made when it computed them (the tiers copy them with the K/V), not whatever the
    slots the blocks landed in held since."""
    block_bytes = 4096  # a tiny llama block's K/V (2,048 B) and its head features, rounded up
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=12, max_num_seqs=1, host_kv_cache_gb=100 * block_bytes / (1 << 30),
              speculative_config=eagle(heads["eagle3"], 2))
    drafter = llm.engine.executor.worker.eagle
    first_drafts: list[dict] = [{}, {}]  # per pass: prompt -> features of its positions
    draft = drafter.draft_table

    def recording(request_ids, states, counts):  # type: ignore[no-untyped-def]
        for request_id, state in zip(request_ids, states, strict=True):
            if request_id not in drafter.computed:  # the catch-up reads every position
                positions = torch.arange(len(state.token_ids) - 1)
                slots = torch.tensor(state.block_ids)[positions // 4] * 4 + positions % 4
                first_drafts[passes].setdefault(tuple(state.prompt_token_ids),
                                                drafter.features[slots].clone())
        return draft(request_ids, states, counts)

    drafter.draft_table = recording
    passes = 0
    first = [out.token_ids for out in llm.generate(TIER_PROMPTS, TIER_GREEDY)]
    llm.engine.scheduler.kv.reset_prefix_cache()  # the device forgets: the host tier serves
    passes = 1
    assert [out.token_ids for out in llm.generate(TIER_PROMPTS, TIER_GREEDY)] == first
    assert llm.stats().host_cache_hits > 0
    assert first_drafts[0].keys() == first_drafts[1].keys() and len(first_drafts[0]) == 8
    for prompt, features in first_drafts[0].items():
        torch.testing.assert_close(first_drafts[1][prompt], features, rtol=1e-5, atol=1e-5)
