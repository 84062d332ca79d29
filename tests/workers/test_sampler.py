"""The sampler on CPU: exact picks for greedy and truncation, reproducible seeded rows."""

import torch

from workers.request_state import RequestState, TokenHistory
from workers.sampler import Sampler, SamplerOutput, SamplingSpec, make_generator

GREEDY = SamplingSpec(temperature=0.0)


def sample(logits, specs, prompts=None, outputs=None, generators=None, sampler=None):
    batch = logits.shape[0]
    return (sampler or Sampler())(
        logits,
        specs,
        prompts if prompts is not None else [[] for _ in range(batch)],
        outputs if outputs is not None else [[] for _ in range(batch)],
        generators if generators is not None else [None] * batch,
    )


def test_greedy_equals_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits.half(), [GREEDY] * 5)
    assert torch.equal(out.token_ids, logits.half().float().argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None and out.ranks is None


def test_plain_greedy_takes_the_argmax_in_the_logits_dtype_first_index_on_ties():
    # bfloat16 rows with ties (3.0 twice, and a row of equal values): the widened float32 path
    # (logprobs asked) and the plain one pick the same, lowest, index
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.5, 0.5, 0.5, 0.5], [-2.0, -1.0, -3.0, -1.0]],
                          dtype=torch.bfloat16)
    plain = sample(logits, [GREEDY] * 3)
    widened = sample(logits, [SamplingSpec(temperature=0.0, logprobs=0)] * 3)
    assert plain.token_ids.tolist() == widened.token_ids.tolist() == [1, 0, 1]
    assert GREEDY.is_plain_greedy
    assert not SamplingSpec(temperature=0.0, repetition_penalty=1.2).is_plain_greedy
    assert not SamplingSpec(temperature=0.0, logprobs=0).is_plain_greedy
    assert not SamplingSpec(temperature=0.7).is_plain_greedy


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, 1.5, -0.5, -1.0, 0.1]])
    spec = SamplingSpec(temperature=0.0, repetition_penalty=2.0)
    # Token 0 seen in the prompt: 2.0 -> 1.0; token 1 unseen stays 1.5 and wins.
    assert sample(logits, [spec], prompts=[[0]]).token_ids.tolist() == [1]
    # Tokens 0 and 1 seen (prompt and output): 1.0 beats 0.75, so token 0 is back.
    assert sample(logits, [spec], prompts=[[0]], outputs=[[1]]).token_ids.tolist() == [0]
    # Without penalty the plain argmax.
    assert sample(logits, [GREEDY], prompts=[[0]]).token_ids.tolist() == [0]


def test_penalties_read_the_token_history_of_request_states_only_when_used():
    """The worker hands the sampler views of its request states: a prompt or output is copied
    out only for a penalty; a batch without penalties reads none."""
    logits = torch.tensor([[2.0, 1.5, -0.5, -1.0, 0.1]])
    reads = []
    states = [RequestState([0, 3, 1], 2, [], SamplingSpec(), None)]  # prompt [0, 3], output [1]

    def prompt(state):
        reads.append("prompt")
        return state.prompt_token_ids

    def output(state):
        reads.append("output")
        return state.output_token_ids

    prompts, outputs = TokenHistory(states, prompt), TokenHistory(states, output)
    assert sample(logits, [GREEDY], prompts, outputs).token_ids.tolist() == [0]
    assert reads == []
    spec = SamplingSpec(temperature=0.0, repetition_penalty=2.0)  # tokens 0 and 1 seen
    assert sample(logits, [spec], prompts, outputs).token_ids.tolist() == [0]  # 1.0 vs 0.75
    assert sorted(reads) == ["output", "prompt"]
    assert len(prompts) == 1 and list(prompts) == [[0, 3]] and outputs[0:1] == [[1]]


def test_repetition_penalty_makes_a_seen_negative_token_lose():
    logits = torch.tensor([[-1.0, -1.2]])
    spec = SamplingSpec(temperature=0.0, repetition_penalty=1.5)
    # Token 0: -1.0 * 1.5 = -1.5 < -1.2.
    assert sample(logits, [spec], outputs=[[0]]).token_ids.tolist() == [1]


def test_presence_and_frequency_penalties_as_computed_by_hand():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0]])
    outputs = [[0, 0, 0, 1]]  # token 0 three times, token 1 once; prompt tokens don't count
    prompts = [[2, 2, 2]]
    # presence 0.6: 2.4, 1.9, 2.0 -> token 0.
    spec = SamplingSpec(temperature=0.0, presence_penalty=0.6)
    assert sample(logits, [spec], prompts, outputs).token_ids.tolist() == [0]
    # frequency 0.3: 3 - 0.9 = 2.1, 2.5 - 0.3 = 2.2, 2.0 -> token 1.
    spec = SamplingSpec(temperature=0.0, frequency_penalty=0.3)
    assert sample(logits, [spec], prompts, outputs).token_ids.tolist() == [1]
    # both: 3 - 0.5 - 1.2 = 1.3, 2.5 - 0.5 - 0.4 = 1.6, 2.0 -> token 2.
    spec = SamplingSpec(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.4)
    assert sample(logits, [spec], prompts, outputs).token_ids.tolist() == [2]


def test_top_k_one_always_yields_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    spec = SamplingSpec(temperature=1.0, top_k=1)
    for _ in range(20):
        assert torch.equal(sample(logits, [spec] * 8).token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_yields_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    spec = SamplingSpec(temperature=1.0, top_p=1e-6)
    for _ in range(20):
        assert torch.equal(sample(logits, [spec] * 8).token_ids, logits.argmax(dim=-1))


def test_top_p_keeps_smallest_set_reaching_the_mass():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps exactly tokens 0 and 1.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(200, 1)
    sampler = Sampler(torch.Generator().manual_seed(3))
    out = sample(logits, [SamplingSpec(top_p=0.75)] * 200, sampler=sampler)
    assert set(out.token_ids.tolist()) == {0, 1}


def test_min_p_filters_to_tokens_above_the_threshold():
    # Probabilities 0.4, 0.3, 0.1, 0.1, 0.1; min_p 0.5 keeps p >= 0.2: tokens 0 and 1.
    logits = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1]).log().repeat(200, 1)
    sampler = Sampler(torch.Generator().manual_seed(4))
    out = sample(logits, [SamplingSpec(min_p=0.5)] * 200, sampler=sampler)
    assert set(out.token_ids.tolist()) == {0, 1}


def test_per_row_top_k_and_top_p_in_one_batch():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().repeat(4, 1)
    specs = [SamplingSpec(top_k=2), SamplingSpec(top_p=0.65), SamplingSpec(top_k=1), GREEDY]
    seen = [set() for _ in specs]
    sampler = Sampler(torch.Generator().manual_seed(5))
    for _ in range(200):
        for row, token in enumerate(sample(logits, specs, sampler=sampler).token_ids.tolist()):
            seen[row].add(token)
    assert seen == [{0, 1}, {0, 1}, {0}, {0}]


def run_steps(logits_per_step, specs, seeds, row):
    """Tokens of one row over the steps, generators made fresh from `seeds` (None: unseeded)."""
    generators = [None if seed is None else make_generator(seed, "cpu") for seed in seeds]
    outputs = [[] for _ in specs]
    for logits in logits_per_step:
        tokens = sample(logits, specs, outputs=outputs, generators=generators).token_ids
        for out, token in zip(outputs, tokens.tolist(), strict=True):
            out.append(token)
    return outputs[row]


def test_seeded_rows_reproduce_and_ignore_batch_composition():
    steps = [torch.randn(4, 64, generator=torch.Generator().manual_seed(10 + i)) for i in range(20)]
    seeded = SamplingSpec(temperature=1.3, top_k=40, seed=7)
    alone = run_steps([s[:1] for s in steps], [seeded], [7], row=0)
    assert alone == run_steps([s[:1] for s in steps], [seeded], [7], row=0)
    assert len(set(alone)) > 1  # really sampled
    # The same row (same logits) as row 2 of 4, among a seeded, an unseeded and a greedy row.
    mixed = [torch.cat([s[1:3], s[:1], s[3:]]) for s in steps]
    specs = [SamplingSpec(seed=99), SamplingSpec(top_p=0.9), seeded, GREEDY]
    assert run_steps(mixed, specs, [99, None, 7, None], row=2) == alone


def test_frequencies_match_softmax_over_temperature():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    temperature, draws = 0.7, 4000
    sampler = Sampler(torch.Generator().manual_seed(11))
    out = sample(
        logits.repeat(draws, 1), [SamplingSpec(temperature=temperature)] * draws, sampler=sampler
    )
    observed = torch.bincount(out.token_ids, minlength=4).float()
    expected = (logits / temperature).softmax(dim=-1) * draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001


def test_logprobs_come_from_raw_logits_with_sorted_top_n_and_ranks():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(12))
    specs = [
        SamplingSpec(temperature=0.0, logprobs=3, repetition_penalty=5.0),
        SamplingSpec(logprobs=0, temperature=2.0),
        SamplingSpec(temperature=0.5),  # asked for none: ignores the columns
    ]
    out = sample(
        logits,
        specs,
        prompts=[list(range(30))] * 3,
        sampler=Sampler(torch.Generator().manual_seed(13)),
    )
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.shape == (3, 4) and out.logprob_token_ids.shape == (3, 4)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, out.token_ids[:, None]).squeeze(1))
    top_values, top_ids = raw.sort(dim=-1, descending=True)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids[:, :3])
    assert torch.allclose(out.logprobs[:, 1:], top_values[:, :3])
    expected_ranks = [
        (top_ids[row] == token).nonzero().item() + 1
        for row, token in enumerate(out.token_ids.tolist())
    ]
    assert out.ranks.tolist() == expected_ranks


def test_rows_of_an_output_keep_every_field_in_the_order_asked():
    """What a call takes up of a lookahead step when some of its sequences have finished."""
    out = SamplerOutput(torch.tensor([7, 8, 9]), torch.tensor([[-1.0], [-2.0], [-3.0]]),
                        torch.tensor([[7], [8], [9]]), torch.tensor([1, 2, 3]))
    rows = out.rows(torch.tensor([2, 0]))
    assert rows.token_ids.tolist() == [9, 7]
    assert rows.logprobs.tolist() == [[-3.0], [-1.0]]
    assert rows.logprob_token_ids.tolist() == [[9], [7]]
    assert rows.ranks.tolist() == [3, 1]
    plain = SamplerOutput(torch.tensor([7, 8]), None, None, None).rows(torch.tensor([1]))
    assert plain.token_ids.tolist() == [8] and plain.logprobs is plain.ranks is None


def test_mixed_batch_of_greedy_and_sampled_rows():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(14))
    specs = [
        GREEDY,
        SamplingSpec(top_k=1),
        GREEDY,
        SamplingSpec(temperature=1e-6),
        SamplingSpec(temperature=5.0),
        GREEDY,
    ]
    sampler = Sampler(torch.Generator().manual_seed(15))
    sampled_tokens = set()
    for _ in range(30):
        tokens = sample(logits, specs, sampler=sampler).token_ids
        argmax = logits.argmax(dim=-1)
        assert torch.equal(tokens[[0, 1, 2, 3, 5]], argmax[[0, 1, 2, 3, 5]])
        sampled_tokens.add(tokens[4].item())
    assert len(sampled_tokens) > 1  # the hot row really samples


def test_greedy_rows_draw_no_noise():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(16))
    shared, own = torch.Generator().manual_seed(17), make_generator(18, "cpu")
    shared_state, own_state = shared.get_state(), own.get_state()
    sample(logits, [GREEDY, GREEDY], generators=[own, None], sampler=Sampler(shared))
    # A seeded greedy row beside a seeded sampled row: only the sampled row's generator moves.
    other = make_generator(19, "cpu")
    sample(logits, [GREEDY, SamplingSpec()], generators=[own, other], sampler=Sampler(shared))
    assert torch.equal(shared.get_state(), shared_state)
    assert torch.equal(own.get_state(), own_state)
    assert not torch.equal(other.get_state(), make_generator(19, "cpu").get_state())


def test_min_tokens_masks_the_stop_tokens_of_short_rows_only():
    # token 3 (EOS) is every row's argmax; token 1 the runner-up, token 4 a stop token out of
    # this vocabulary (ignored, not an index error)
    logits = torch.tensor([[0.0, 2.0, 1.0, 5.0]] * 3)
    spec = SamplingSpec(temperature=0.0, min_tokens=2, stop_token_ids=(3, 4))
    outputs = [[], [7], [7, 8]]  # rows below, below, at min_tokens
    assert sample(logits, [spec] * 3, outputs=outputs).token_ids.tolist() == [1, 1, 3]
    assert not spec.is_plain_greedy
    # sampled rows never draw a masked token either
    hot = SamplingSpec(temperature=5.0, min_tokens=1, stop_token_ids=(1, 3))
    picks = sample(logits.repeat(50, 1), [hot] * 150, sampler=Sampler(
        torch.Generator().manual_seed(0))).token_ids
    assert set(picks.tolist()) <= {0, 2}


def test_min_tokens_keeps_the_logprobs_of_the_raw_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0, 5.0]])
    spec = SamplingSpec(temperature=0.0, logprobs=1, min_tokens=1, stop_token_ids=(3,))
    out = sample(logits, [spec])
    raw = logits.log_softmax(dim=-1)[0]
    assert out.token_ids.tolist() == [1]
    assert out.logprob_token_ids.tolist() == [[1, 3]]  # the top token is still reported
    assert torch.allclose(out.logprobs[0], raw[[1, 3]])
