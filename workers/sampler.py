"""The sampler: one batch of logits in, one token per row out, with no device sync.

Runs on rank 0 after the LM head. Order of work, as in vLLM:

    raw logits ──> logprobs (of the raw model distribution, before anything below)
        │
        └─> penalties ──> greedy rows: argmax here, exactly
                │
                └─> temperature ──> min_p ──> top_k ──> top_p ──> exponential race

Nothing here reads a tensor back to the host (.item(), .tolist(), branches on values): the
caller reads the returned tensors once. Python branches only on the *parameters*, so a batch
of greedy rows never softmaxes, sorts or draws noise (except to report logprobs).

Parameters are validated by the API layer and assumed sane here: temperature >= 0,
top_k >= -1, 0 < top_p <= 1, 0 <= min_p <= 1, repetition_penalty > 0, token ids < V.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

GREEDY_TEMPERATURE = 1e-5  # below this a row is greedy: dividing by it would overflow


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # divides positive logits, multiplies negative ones (HF/vLLM)
    presence_penalty: float = 0.0  # subtracted once for each token present in the output
    frequency_penalty: float = 0.0  # subtracted count-in-output times
    seed: int | None = None  # the caller turns it into a generator kept across steps
    logprobs: int | None = None  # top-n logprobs to return (0 = only the sampled token's)
    min_tokens: int = 0  # until a row has this many output tokens, stop_token_ids are masked
    stop_token_ids: tuple[int, ...] = ()  # the tokens that would end it (EOS unless ignored)
    # (token id, bias) added to the logits before anything else (workers/structured/masks.py)
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @cached_property  # asked of every row at every step: worked out once per request
    def is_plain_greedy(self) -> bool:
        """Greedy, and nothing else to compute: no penalty, no logprobs, no min_tokens."""
        return (self.is_greedy and not self.uses_history and self.logprobs is None
                and self.min_tokens == 0)

    @property
    def uses_history(self) -> bool:
        """Whether sampling reads the tokens before this one (the penalties do)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class SamplerOutput:
    """Rows that asked for fewer than n logprobs ignore the extra columns (n = the batch max)."""

    token_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor | None  # (B, 1 + n) float32: sampled token's logprob, then the top-n
    logprob_token_ids: torch.Tensor | None  # (B, 1 + n) int64: sampled token, then top-n ids
    ranks: torch.Tensor | None  # (B,) rank of the sampled token (1 = most likely)

    def rows(self, index: torch.Tensor) -> "SamplerOutput":
        """The rows ``index`` (on the same device), in its order."""
        def pick(values: torch.Tensor | None) -> torch.Tensor | None:
            return values[index] if values is not None else None

        return SamplerOutput(self.token_ids[index], pick(self.logprobs),
                             pick(self.logprob_token_ids), pick(self.ranks))


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-request generator a seeded request keeps across steps."""
    return torch.Generator(device=device).manual_seed(seed)


class Sampler:
    """Samples one token per row.

    A row whose entry in ``generators`` is set draws its noise from that generator alone, so a
    seeded request gives the same tokens whatever else is in the batch. Other rows share one
    draw from ``generator`` (the default RNG when None). Greedy rows never advance generators.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,  # (B, V) any float dtype
        specs: Sequence[SamplingSpec],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
    ) -> SamplerOutput:
        if all(spec.is_plain_greedy for spec in specs):
            # argmax in the logits' own dtype: widening to float32 changes no value or order,
            # and skips a pass that writes twice the LM head's output (a batch of 256 rows
            # over Qwen3's 151,936 tokens: ~0.1 ms a step on an H200)
            return SamplerOutput(greedy(logits), None, None, None)
        raw = logits.float()  # may alias the caller's tensor: nothing below works in place
        logits = apply_penalties(raw, specs, prompt_token_ids, output_token_ids)
        logits = apply_min_tokens(logits, specs, output_token_ids)
        token_ids = greedy(logits)  # (B,) the greedy answer for every row
        sampled_rows = [not spec.is_greedy for spec in specs]
        if any(sampled_rows):
            sampled = self.sample(logits, specs, generators)
            is_sampled = torch.tensor(sampled_rows, device=logits.device)
            token_ids = torch.where(is_sampled, sampled, token_ids)
        return with_logprobs(raw, token_ids, specs)

    def sample(
        self,
        logits: torch.Tensor,  # (B, V) float32, penalized
        specs: Sequence[SamplingSpec],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:  # (B,) int64
        # Greedy rows go through with neutral settings; the caller discards their result.
        probs = truncated_probs(logits, specs)
        own = [g if not s.is_greedy else None for g, s in zip(generators, specs, strict=True)]
        needs_shared = any(g is None and not s.is_greedy for g, s in zip(own, specs, strict=True))
        return exponential_race(probs, own, self.generator, needs_shared)


def truncated_probs(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """(B, V) the distribution each row samples from: temperature, min_p, top_k, top_p.
    Greedy rows get a neutral one (callers use the argmax for them)."""
    active = [spec if not spec.is_greedy else SamplingSpec() for spec in specs]
    logits = logits / row_values(logits, [s.temperature for s in active])
    if any(s.min_p > 0 for s in active):
        logits = apply_min_p(logits, row_values(logits, [s.min_p for s in active]))
    top_k = [s.top_k if s.top_k > 0 else logits.shape[-1] for s in active]
    top_p = [s.top_p for s in active]
    if any(k < logits.shape[-1] for k in top_k) or any(p < 1.0 for p in top_p):
        logits = apply_top_k_top_p(logits, row_values(logits, top_k), row_values(logits, top_p))
    return logits.softmax(dim=-1)


def target_probs(logits: torch.Tensor, specs: Sequence[SamplingSpec]) -> torch.Tensor:
    """(B, V) float32: what each row samples from, a greedy row's as the one-hot of its argmax
    (speculative verification treats both alike: workers/speculative/rejection.py)."""
    logits = logits.float()
    is_greedy = [spec.is_greedy for spec in specs]
    argmax = greedy(logits)
    one_hot = torch.zeros_like(logits).scatter_(1, argmax.unsqueeze(1), 1.0)
    if all(is_greedy):
        return one_hot
    probs = truncated_probs(logits, specs)
    return torch.where(torch.tensor(is_greedy, device=logits.device).unsqueeze(1), one_hot, probs)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; on a GPU in two passes (workers/greedy.py: torch's one block per row
    leaves a batch-1 step's 128k logits to one SM)."""
    if logits.is_cuda:
        from workers.greedy import greedy_tokens  # Triton only where there is a GPU

        return greedy_tokens(logits)
    return logits.argmax(dim=-1)


def row_values(like: torch.Tensor, values: Sequence[float]) -> torch.Tensor:
    """One parameter per row as a (B, 1) column on the logits' device, ready to broadcast."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def padded_ids(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """(B, L) int64 with ragged rows padded by `pad` (an extra column dropped after scatter)."""
    lists = [list(row) for row in rows]  # each row read once (rows may copy out on reading)
    width = max((len(row) for row in lists), default=0)
    padded = [row + [pad] * (width - len(row)) for row in lists]
    return torch.tensor(padded, dtype=torch.int64).to(device, non_blocking=True)


def token_counts(
    rows: Sequence[Sequence[int]], batch: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """(B, V) float32: how many times each token occurs in each row."""
    ids = padded_ids(rows, vocab, device)  # (B, L)
    counts = torch.zeros(batch, vocab + 1, device=device)  # the last column catches the padding
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,  # (B, V) float32
    specs: Sequence[SamplingSpec],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    batch, vocab = logits.shape
    use_repetition = any(s.repetition_penalty != 1.0 for s in specs)
    use_additive = any(s.presence_penalty != 0.0 or s.frequency_penalty != 0.0 for s in specs)
    if not (use_repetition or use_additive):
        return logits
    output_counts = token_counts(output_token_ids, batch, vocab, logits.device)
    if use_repetition:
        seen = token_counts(prompt_token_ids, batch, vocab, logits.device) + output_counts > 0
        penalty = row_values(logits, [s.repetition_penalty for s in specs])
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if use_additive:
        presence = row_values(logits, [s.presence_penalty for s in specs])
        frequency = row_values(logits, [s.frequency_penalty for s in specs])
        logits = logits - frequency * output_counts - presence * (output_counts > 0)
    return logits


def apply_min_tokens(
    logits: torch.Tensor,  # (B, V) float32
    specs: Sequence[SamplingSpec],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Rows short of their min_tokens cannot pick a token that would end them."""
    rows: list[int] = []
    columns: list[int] = []
    vocab = logits.shape[-1]
    for row, spec in enumerate(specs):
        if spec.min_tokens and len(output_token_ids[row]) < spec.min_tokens:
            stops = [t for t in spec.stop_token_ids if t < vocab]  # the model can't make others
            rows += [row] * len(stops)
            columns += stops
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token."""
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p  # (B, 1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,  # (B, V)
    top_k: torch.Tensor,  # (B, 1), V where off
    top_p: torch.Tensor,  # (B, 1), 1.0 where off
) -> torch.Tensor:
    """Per-row top-k then top-p, with one sort for the whole batch."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
    position = torch.arange(logits.shape[-1], device=logits.device)  # (V,)
    drop = position >= top_k  # (B, V)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of the more likely tokens
    # Keep the smallest prefix reaching top_p: drop a token once the mass before it suffices.
    # Rows at top_p == 1 skip this, as rounding can push the cumsum to 1 before the tail.
    drop |= (mass_before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def exponential_race(
    probs: torch.Tensor,  # (B, V)
    generators: Sequence[torch.Generator | None],
    shared_generator: torch.Generator | None,
    draw_shared: bool,  # False when every row without a generator is greedy (discarded)
) -> torch.Tensor:  # (B,) int64
    """argmax(probs / q) with q ~ Exp(1) picks token i with probability probs[i], no sync."""
    noise = torch.empty_like(probs)
    if draw_shared:
        noise.exponential_(generator=shared_generator)
    else:
        noise.fill_(1.0)
    for row, generator in enumerate(generators):
        if generator is not None:  # its own V draws, so the batch around it cannot matter
            noise[row].exponential_(generator=generator)
    # q == 0 would give 0/0 = nan, which argmax prefers: it could pick a masked token.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def with_logprobs(
    raw: torch.Tensor,  # (B, V) float32, before penalties and temperature
    token_ids: torch.Tensor,  # (B,)
    specs: Sequence[SamplingSpec],
) -> SamplerOutput:
    requested = [s.logprobs for s in specs if s.logprobs is not None]
    if not requested:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = raw.log_softmax(dim=-1)  # (B, V)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (B, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (B,) ties share the better rank
    top_values, top_ids = logprobs.topk(max(requested), dim=-1)  # (B, n) sorted descending
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=torch.cat([chosen, top_values], dim=1),
        logprob_token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
        ranks=ranks,
    )
