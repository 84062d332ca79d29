"""How many drafts each decoding sequence verifies next step: adaptive speculation.

A verify step of T tokens costs about ``a + b * T`` seconds (``StepCost``, fitted online from
the engine's own steps). Adding a sequence's j-th draft costs ``b`` and gains the chance that
it and every draft before it are accepted, alpha^j (``alpha``: that sequence's measured
acceptance rate). A step of B plain decodes makes B tokens in ``a + b * B``; a draft pays when
its expected tokens per second beat that rate:

    alpha^j / b  >=  B / (a + b * B)      i.e.   alpha^j >= b * B / (a + b * B) = threshold

The threshold is the share of a plain step's time that grows with its tokens. A small batch
on a GPU is weight-bound (``a`` dominates): the threshold is near 0 and drafts pay while they
are likely to be accepted at all. A large batch, or the CPU, is compute-bound (``b * B``
dominates): the threshold nears 1 and speculation turns itself off. A sequence whose
acceptance falls stops drafting (k = 0), and drafts use only the budget left (the scheduler
trims them), so speculation fades under load by itself.
"""

from dataclasses import dataclass, field

PRIOR_ALPHA = 0.6  # before a sequence has verified anything: the brief's break-even guess
ALPHA_MEMORY = 0.8  # each verified draft moves the estimate by 1 - this
RETRY_EVERY = 16  # a sequence turned off still drafts every this many steps, to re-measure


@dataclass
class StepCost:
    """seconds ~ a + b * tokens, by least squares over recent steps (exponential forgetting)."""

    forget: float = 0.98
    n: float = 0.0
    sum_t: float = 0.0
    sum_s: float = 0.0
    sum_tt: float = 0.0
    sum_ts: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        f = self.forget
        self.n = self.n * f + 1
        self.sum_t = self.sum_t * f + tokens
        self.sum_s = self.sum_s * f + seconds
        self.sum_tt = self.sum_tt * f + tokens * tokens
        self.sum_ts = self.sum_ts * f + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None until steps of at least two sizes were seen."""
        spread = self.n * self.sum_tt - self.sum_t ** 2
        if self.n < 2 or spread <= 1e-9 * max(self.n * self.sum_tt, 1.0):
            return None
        b = (self.n * self.sum_ts - self.sum_t * self.sum_s) / spread
        a = (self.sum_s - b * self.sum_t) / self.n
        return max(a, 0.0), max(b, 0.0)


@dataclass
class Acceptance:
    alpha: float = PRIOR_ALPHA
    steps_off: int = 0


@dataclass
class DraftLength:
    max_drafts: int
    adaptive: bool = True
    cost: StepCost = field(default_factory=StepCost)
    seqs: dict[str, Acceptance] = field(default_factory=dict)

    def threshold(self, batch_size: int) -> float:
        fitted = self.cost.fit()
        if fitted is None:
            return 0.0  # nothing measured yet: try, and measure
        a, b = fitted
        step = a + b * batch_size
        return b * batch_size / step if step > 0 else 0.0

    def choose(self, request_id: str, batch_size: int) -> int:
        """Drafts for this sequence next step: 0 .. max_drafts."""
        if not self.adaptive:
            return self.max_drafts
        seq = self.seqs.setdefault(request_id, Acceptance())
        threshold = self.threshold(batch_size)
        k, chance = 0, 1.0
        while k < self.max_drafts and chance * seq.alpha >= threshold and seq.alpha > 0:
            chance *= seq.alpha
            k += 1
        if k == 0:
            seq.steps_off += 1
            if seq.steps_off >= RETRY_EVERY:  # the text may have turned repetitive since
                seq.steps_off = 0
                return 1
        return k

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verify of ``num_drafts`` drafts that kept ``num_accepted``: each draft up to
        the first rejected one is an observation of alpha (those after it were not tried)."""
        seq = self.seqs.setdefault(request_id, Acceptance())
        tried = min(num_accepted + 1, num_drafts)
        for index in range(tried):
            accepted = 1.0 if index < num_accepted else 0.0
            seq.alpha = ALPHA_MEMORY * seq.alpha + (1 - ALPHA_MEMORY) * accepted

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
