"""The workloads of ../shared/BENCHMARKS.md as token-id prompts and output lengths.

W2 is nano-vllm's bench.py, draw for draw: under ``random.seed(0)``, for each of 256 requests
a length ``randint(100, 1024)`` and that many token ids ``randint(0, 10000)``; then each
request's output length ``randint(100, 1024)``. Seed 0 gives 142,827 prompt and 133,966
output tokens. A smaller run takes the first N requests of the same draw.
"""

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def total_prompt_tokens(requests: list[Request]) -> int:
    return sum(len(r.prompt_token_ids) for r in requests)


def total_output_tokens(requests: list[Request]) -> int:
    return sum(r.max_tokens for r in requests)


def throughput_requests(num_requests: int = 256, min_len: int = 100, max_len: int = 1024,
                        vocab_size: int = 10001, seed: int = 0,
                        num_drawn: int = 256) -> list[Request]:
    """W2: the first ``num_requests`` of nano-vllm's ``num_drawn`` requests."""
    rng = random.Random(seed)
    drawn = max(num_drawn, num_requests)
    prompts = [[rng.randint(0, 10000) % vocab_size for _ in range(rng.randint(min_len, max_len))]
               for _ in range(drawn)]
    outputs = [rng.randint(min_len, max_len) for _ in range(drawn)]
    return [Request(p, o) for p, o in zip(prompts[:num_requests], outputs[:num_requests],
                                          strict=True)]


def latency_prompt(num_tokens: int = 128, vocab_size: int = 10001, seed: int = 0) -> list[int]:
    """W1: one prompt of random token ids."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: Poisson at ``rate`` a second
    (seeded), all at 0 when rate is 0."""
    if rate <= 0:
        return [0.0] * count
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def prefix_requests(num_groups: int = 64, group_size: int = 16, prefix_len: int = 2048,
                    question_len: int = 128, max_tokens: int = 256, vocab_size: int = 10001,
                    seed: int = 0) -> list[Request]:
    """W4: groups sharing a system prompt, each request its own question; group-major order."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_groups):
        prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
        for _ in range(group_size):
            question = [rng.randrange(vocab_size) for _ in range(question_len)]
            requests.append(Request(prefix + question, max_tokens))
    return requests


def ideal_prefix_hit_rate(num_groups: int, group_size: int, prefix_len: int,
                          question_len: int, block_size: int) -> float:
    """Cached / all prompt tokens when every request after a group's first reuses the whole
    blocks of its prefix: 88.2% for 64 x 16, 2048 + 128, blocks of 16."""
    cached_per_request = prefix_len // block_size * block_size
    total = num_groups * group_size * (prefix_len + question_len)
    return num_groups * (group_size - 1) * cached_per_request / total


def skewed_prefix_requests(num_groups: int = 64, group_size: int = 16, prefix_len: int = 2048,
                           question_len: int = 128, max_tokens: int = 256,
                           vocab_size: int = 10001, seed: int = 0) -> list[Request]:
    """W4 skewed: as many requests as W4, half of them in group 0 (one hot prefix), the rest
    spread over the other groups; in a shuffled (seeded) order, as they would arrive."""
    rng = random.Random(seed)
    total = num_groups * group_size
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)]
                for _ in range(num_groups)]
    groups = [0] * (total // 2) + [1 + i % (num_groups - 1) for i in range(total - total // 2)]
    rng.shuffle(groups)
    return [Request(prefixes[g] + [rng.randrange(vocab_size) for _ in range(question_len)],
                    max_tokens) for g in groups]
