"""A step's token budget from its measured cost, for a TPOT target (``tpot_target_ms``).

Every running decode waits for its whole step, so a step that carries prompt chunks sets the
time between the decodes' tokens. With a target, the budget is the most tokens a step can
carry and still take at most the target: from steps of one call each, seconds ~ a + b × tokens
(least squares over recent steps, router/speculation.py's ``StepCosts``, no cost below 0), the
budget is (target − a) / b, between ``max_num_batched_tokens / 8`` (a prefill always moves; at
least every decode fits) and ``max_num_batched_tokens``. Until two steps are measured, and
with no target, the budget is ``max_num_batched_tokens``: with a target, set that high and let
the target choose (fewer, larger steps pay the host's work a step once for more tokens, up to
where the decodes' pace allows).
"""

from router.speculation import StepCosts

FLOOR_SHARE = 8  # the budget never falls below max_num_batched_tokens / this


class TokenBudget:
    def __init__(self, target_ms: float, ceiling: int) -> None:
        if target_ms < 0:
            raise ValueError(f"tpot_target_ms must be >= 0 (0: off), got {target_ms}")
        self.target_s = target_ms / 1e3
        self.ceiling = ceiling
        self.costs = StepCosts()

    def observe(self, num_steps: int, num_tokens: int, seconds: float) -> None:
        """A call's time: one-step calls only (several decode steps a call are the decodes'
        own pace, not a mixed step's)."""
        if self.target_s and num_steps == 1 and num_tokens:
            self.costs.add(seconds, 1, num_tokens)

    def budget(self, num_decodes: int) -> int:
        """Tokens the next step may carry, ``num_decodes`` of them the running decodes'."""
        floor = max(num_decodes + 1, self.ceiling // FLOOR_SHARE, 1)
        fitted = self.costs.fit() if self.target_s else None
        if fitted is None or fitted.b <= 0:
            return self.ceiling
        tokens = int(round((self.target_s - fitted.a) / fitted.b, 6))  # not 399.999...
        return max(floor, min(self.ceiling, tokens))
