"""A sampled structured choice under speculation is distributed as without it: prompt lookup
proposes the choices' tokens from the prompt, the grammar cuts them, exact rejection sampling
keeps the masked target's distribution (a tiny random model with the default tokenizer: its
distribution over the choices is far from uniform and far from certain)."""

from collections import Counter

from cluster import LLM, SamplingParams

CHOICES = ["the big apple pie", "the big apple tart", "a banana split"]
PROMPT = "the big apple pie, the big apple tart, a banana split. One:"
SAMPLES = 300
CRITICAL_2_DF = 13.82  # chi-square's 0.1% critical value, 2 degrees of freedom


def sample(llm: LLM) -> Counter:
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=32,
                             structured_outputs={"choice": CHOICES}) for seed in range(SAMPLES)]
    return Counter(out.outputs[0].text for out in llm.generate([PROMPT] * SAMPLES, params))


def test_a_sampled_choice_is_distributed_alike_with_and_without_prompt_lookup(tiny_chat_model):
    common = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=512)
    plain = sample(LLM(str(tiny_chat_model), **common))
    spec_llm = LLM(str(tiny_chat_model), **common, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    spec = sample(spec_llm)
    assert set(plain) <= set(CHOICES) and set(spec) <= set(CHOICES)
    stats = spec_llm.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    # two samples of one distribution: the chi-square test of homogeneity over the choices
    chi2 = 0.0
    for choice in CHOICES:
        pooled = (plain[choice] + spec[choice]) / 2
        if pooled:
            chi2 += ((plain[choice] - pooled) ** 2 + (spec[choice] - pooled) ** 2) / pooled
    assert chi2 < CRITICAL_2_DF, (plain, spec)
    # and the sample tells something: no choice is certain
    assert max(plain.values()) < SAMPLES
