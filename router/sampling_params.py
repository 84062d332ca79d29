"""What a request asks of generation. Validated once, when the request is made.

Everything here is checked before a request reaches an engine: a value the engine cannot
take (a seed past 64 bits, an infinite temperature) would otherwise fail inside a step,
where it takes down every request in the batch, not only its own.
"""

import math
from dataclasses import dataclass
from typing import Any

from router.structured_outputs import StructuredOutputs

# torch.Generator.manual_seed takes any 64-bit integer, signed or not (a negative seed is
# its two's complement); anything outside overflows in the sampler's per-request setup
MIN_SEED, SEED_END = -(2**63), 2**64
# samples of one prompt: each is a sequence of its own, with its own KV blocks
MAX_N = 128
# every stop string is searched for in the new text of each token, and the longest one
# sets how much text is held back while streaming: both stay small
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256
# OpenAI's bounds: a bias of +-100 bans or forces a token; at most 300 of them
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 300


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop tokens (and stop strings) cannot end it before this
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs for each generated token
    cache_salt: str | None = None
    # the output must match this (a JSON schema, regex, choice, grammar or structural tag);
    # a dict is taken as StructuredOutputs' fields
    structured_outputs: StructuredOutputs | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self._bias_items()}
        # callers pass lists or a single string; inside, stops are tuples
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        for problem in self._problems():
            raise ValueError(problem)

    def _problems(self) -> list[str]:
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")
        # NaN fails every comparison below and infinity passes some: both are refused first,
        # with a message that says what is wrong with them
        infinite = [name for name in floats if not math.isfinite(getattr(self, name))]
        if infinite:
            name = infinite[0]
            return [f"{name} must be a finite number, got {getattr(self, name)}"]
        checks = [
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.repetition_penalty > 0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be in [0, 20], got {self.logprobs}",
            ),
            (
                self.seed is None or MIN_SEED <= self.seed < SEED_END,
                f"seed must be a 64-bit integer, in [-2**63, 2**64), got {self.seed}",
            ),
            (
                len(self.stop) <= MAX_STOP_STRINGS,
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
            ),
            (
                all(len(stop) <= MAX_STOP_LENGTH for stop in self.stop),
                f"stop strings may be at most {MAX_STOP_LENGTH} characters long, got one of "
                f"{max((len(stop) for stop in self.stop), default=0)}",
            ),
            (all(self.stop), "stop strings must not be empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            *self._constraint_checks(),
        ]
        return [message for ok, message in checks if not ok]

    def _bias_items(self) -> list[tuple[Any, Any]]:
        items = list(dict(self.logit_bias or {}).items())
        for key, value in items:
            try:
                int(key), float(value)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias maps token ids to numbers, got {key!r}: "
                                 f"{value!r}") from None
        return items

    def _constraint_checks(self) -> list[tuple[bool, str]]:
        bias = self.logit_bias or {}
        structured = self.structured_outputs is not None
        return [
            (len(bias) <= MAX_LOGIT_BIAS_TOKENS,
             f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}"),
            (all(t >= 0 for t in bias), "logit_bias token ids must be >= 0"),
            (all(math.isfinite(v) and abs(v) <= MAX_LOGIT_BIAS for v in bias.values()),
             f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
            (not (structured and self.ignore_eos),
             "ignore_eos cannot be used with structured outputs: the grammar decides where "
             "the output ends"),
            (not (structured and self.min_tokens),
             "min_tokens cannot be used with structured outputs: the grammar decides where "
             "the output ends"),
        ]

    @property
    def uses_history(self) -> bool:
        """Whether sampling a token reads the tokens before it (the penalties do)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
