"""How many drafts each decoding sequence verifies next step: adaptive speculation.

Every cost is measured, from the engine's own calls (``StepCosts``, least squares with
exponential forgetting):

    seconds of a call  ~  a * steps + b * tokens + c * verifies + g * draft_steps
                          + h * draft_tokens + u * catch_up_tokens

``a`` and ``b``: the target's step, weight-bound and per token; ``c``: what a call that
verifies drafts costs for being one (a single step where plain decoding runs several a call,
the draft's catch-up forward as a launch); ``g`` and ``h``: a draft model's, per draft step (each of
a step's k draft forwards reads the draft's weights) and per draft token; ``u``: per token a
draft model catches up on before it drafts (the tokens it has not seen: one or a few a row
while a sequence drafts every step, all those since it last drafted when it resumes, so a
resume's price, or a new sequence's prompt, is not read as a price per draft); plus ``p``,
the proposer's own host time for each sequence it is asked about (prompt lookup's search; a
draft model's is in ``g``, ``h`` and ``u``).

A plain step of B decodes makes B tokens in ``a + b * B``. Drafts change that to
``B + sum_i sum_{j<=k_i} alpha_i^j`` expected tokens (``alpha_i``: sequence i's measured
acceptance; its j-th draft counts only when every one before it is accepted) in
``a + b * (B + D) + c + g * K + h * D + u * (asked + gain) + p * asked`` (D drafts in all,
K the longest row's; the catch-up at a drafting row's next drafting: its bonus token and the
drafts kept, at most).
``choose`` picks the k_i that maximise that rate, or none: each sequence's j-th draft must
beat the plain rate on its own (``alpha^j >= (b + h) * rate``), then the step's longest
length K is chosen by the rate of the whole step, so a verify call's own cost and a draft
model's per-step cost are paid only when the expected tokens cover them. A small batch on a
GPU is weight-bound (``a`` dominates) and drafts pay while they are likely to be accepted; a
large batch, or the CPU, is compute-bound and speculation turns itself off. A sequence that
drafts nothing for a while is tried again with one draft, after 16 steps, then 32, ...
(``RETRY_AFTER``): an unrelated draft model costs almost nothing once it has been found out
(a try of every draft would cost a batch its draft model's k steps, ~1 ms each on an H100 at
the 1B shape, where one costs one); tries fall on steps that are multiples of 16, so a batch's
share their verify calls. A try is made only when its price, the draft's catch-up over every
token it missed and a share of the verify call, is at most ``RETRY_SHARE`` of the plain time
the sequence spent since its last one: at batch 64 on an H100 a 1B draft's catch-up alone is
~3% of an 8B target's time per token, so a large batch never retries it. Verify calls alone
can't tell a plain step's cost from a verify's (the fit gives it all to the step, and drafts
look free): when the fit holds no recent plain
call (``PLAIN_PROBE_BELOW``), the next step is plain. tests/router/test_speculation_dynamics.py
runs these rules step after step against costs an H100 measured.
"""

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

PRIOR_ALPHA = 0.6  # before a sequence has verified anything: the brief's break-even guess
ALPHA_MEMORY = 0.9  # each verified draft moves the estimate by 1 - this (at 0.8, H100: a
# sequence of true alpha 0.8 read as below its break-even, 0.55, often enough to pause 3/4 of
# its steps)
POOL_MEMORY = 0.98  # the draft's acceptance over every sequence: each observation's weight
POOL_PRIOR_WEIGHT = 10.0  # decays by this a later one; the prior weighs as 10 observations
PLAIN_PROBE_BELOW = 0.1  # a plain call's weight in the fit below this: the next step is plain
RETRY_AFTER = 16  # steps off before a sequence is tried again; doubled after each failed try
MAX_RETRY_AFTER = 512
RETRY_SHARE = 0.02  # the most of a paused sequence's plain time its next try may cost
RCOND = 1e-12  # numerical noise of the solve, not a choice
RIDGE = 1e-9  # what the calls leave open goes to the step (``_least_squares``)


class Costs(NamedTuple):
    """Seconds: a target step, a target token, a verify call, a draft step, a draft token,
    a token the draft catches up on."""

    a: float
    b: float
    c: float
    g: float
    h: float
    u: float


FEATURES = len(Costs._fields)
RIDGES = RIDGE * np.diag([0.0] + [1.0] * (FEATURES - 1))  # on every coefficient but the step's


@dataclass
class StepCosts:
    """seconds ~ features . (a, b, c, g, h, u), by least squares over recent calls, none
    below 0. Features that move together (at batch 1 a plain call's tokens are its steps; a draft's
    steps are its tokens) are parted in favour of the step ``a``: what a decision reads of
    them, the time of the calls it compares, is still what was measured."""

    forget: float = 0.98
    xtx: np.ndarray = field(default_factory=lambda: np.zeros((FEATURES, FEATURES)))
    xty: np.ndarray = field(default_factory=lambda: np.zeros(FEATURES))
    calls: float = 0.0
    plain: float = 0.0  # the weight of the calls without drafts, forgotten alike
    # fit()'s answer until the next call is added (a step's decision and its measure read it)
    fitted: tuple[Costs | None] | None = field(default=None, repr=False, compare=False)

    def add(self, seconds: float, steps: int, tokens: int, verifies: int = 0,
            draft_steps: int = 0, draft_tokens: int = 0, catch_up_tokens: int = 0) -> None:
        x = np.array([steps, tokens, verifies, draft_steps, draft_tokens, catch_up_tokens],
                     dtype=np.float64)
        self.xtx = self.xtx * self.forget + np.outer(x, x)
        self.xty = self.xty * self.forget + x * seconds
        self.calls = self.calls * self.forget + 1
        self.plain = self.plain * self.forget + (0 if verifies else 1)
        self.fitted = None

    def fit(self) -> Costs | None:
        """(a, b, c, g, h, u), each at least 0, or None before two calls were seen."""
        if self.fitted is None:
            self.fitted = (self._fit(),)
        return self.fitted[0]

    def _fit(self) -> Costs | None:
        """The best fit with no negative cost (a negative one clamped afterwards would break
        the fit of the calls that set it)."""
        if self.calls < 2:
            return None
        scale = np.sqrt(np.maximum(np.diag(self.xtx), 1e-30))  # columns of like size
        gram = self.xtx / np.outer(scale, scale)
        target = self.xty / scale
        theta = _least_squares(gram, target, range(FEATURES))
        if np.any(theta < 0):
            theta = _nonnegative_least_squares(gram, target)
        return Costs(*(float(value) for value in theta / scale))


def _least_squares(gram: np.ndarray, target: np.ndarray, free) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Least squares over the ``free`` coefficients (the rest 0). What the calls leave open
    goes to ``a``, the step: a tiny ridge on the others (at batch 1 a plain call's tokens are
    its steps, so only their sum is known, and calling it all the step's keeps a draft's
    price, its extra tokens, at what the verify calls measured)."""
    free = list(free)
    at = np.ix_(free, free)  # built once: a verify step fits once, a few of these each
    theta = np.zeros(FEATURES)
    theta[free] = np.linalg.lstsq(gram[at] + RIDGES[at], target[free], rcond=RCOND)[0]
    return theta


def _nonnegative_least_squares(gram: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The fit of least ``_loss`` with no coefficient below 0 (Lawson and Hanson's active
    set: a few small solves, where trying every subset of the six took ~3 ms a call)."""
    ridged = gram + RIDGES
    tolerance = 1e-12 * max(float(np.abs(target).max()), 1e-30)
    theta, free = np.zeros(FEATURES), []
    for _ in range(3 * FEATURES):
        gradient = target - ridged @ theta  # where the loss falls as a coefficient grows
        candidates = [j for j in range(FEATURES) if j not in free and gradient[j] > tolerance]
        if not candidates:
            break
        free.append(max(candidates, key=lambda j: gradient[j]))
        while True:
            trial = _least_squares(gram, target, free)
            if all(trial[j] > 0 for j in free):
                theta = trial
                break
            # back along the way to the trial, to where the first coefficient reaches 0
            ratios = {j: theta[j] / (theta[j] - trial[j]) if theta[j] > trial[j] else 0.0
                      for j in free if trial[j] <= 0}
            step = min(ratios.values())
            theta = theta + step * (trial - theta)
            free = [j for j in free if theta[j] > 0 and ratios.get(j) != step]
            theta[[j for j in range(FEATURES) if j not in free]] = 0.0
            if not free:
                break
    return theta


def _loss(gram: np.ndarray, target: np.ndarray, theta: np.ndarray) -> float:
    """The squared error of a fit, up to a constant."""
    return float(theta @ gram @ theta - 2 * theta @ target + RIDGE * theta[1:] @ theta[1:])


@dataclass
class Acceptance:
    """A sequence's acceptance: a moving average of its observations that started from a
    prior, ``prior`` the share of ``alpha`` that still is that prior. The prior a decision
    reads is the draft's acceptance over every sequence (``DraftLength.pool_alpha``): at batch
    8 an unrelated draft is found out in one verify call (8 observations), where each
    sequence's own would take ~17."""

    alpha: float = PRIOR_ALPHA
    prior: float = 0.0
    steps_off: int = 0
    retry_after: int = RETRY_AFTER
    seen: int = 0  # the sequence's tokens when it last drafted: the draft has seen those


@dataclass
class DraftLength:
    max_drafts: int
    adaptive: bool = True
    costs: StepCosts = field(default_factory=StepCosts)
    seqs: dict[str, Acceptance] = field(default_factory=dict)
    proposer_seconds: float = 0.0  # p: host time per sequence asked (moving average)
    pool_alpha: float = PRIOR_ALPHA  # the draft's acceptance over every sequence's drafts
    pool_weight: float = POOL_PRIOR_WEIGHT
    steps: int = 0  # choose's calls: the clock the tries keep
    # the last choice drafted nothing and nothing was learnt since (no verify, no new
    # sequence): until the next try's step the choice is the same, made without a fit
    quiet: bool = False

    def quiet_next(self) -> bool:
        """The next ``choose`` drafts nothing and fits nothing, whatever it is asked about
        sequences it knows: quiet, and not a try's step."""
        return self.adaptive and self.quiet and (self.steps + 1) % RETRY_AFTER != 0

    def observe_proposer(self, seconds: float, asked: int) -> None:
        if asked:
            per = seconds / asked
            self.proposer_seconds = 0.9 * self.proposer_seconds + 0.1 * per if \
                self.proposer_seconds else per

    def choose(self, request_ids: list[str], batch_size: int,
               num_tokens: list[int] | None = None) -> dict[str, int]:
        """Drafts for each of ``request_ids`` (those that may draft) next step, in a batch of
        ``batch_size`` decodes: 0 .. max_drafts each. ``num_tokens``: each one's tokens (what
        a draft model that resumes catches up on is those since it last drafted; without
        them, one a step)."""
        if not self.adaptive:
            return dict.fromkeys(request_ids, self.max_drafts)
        seqs = [self._seq(request_id) for request_id in request_ids]
        self.steps += 1
        if self.quiet and self.steps % RETRY_AFTER:
            for seq in seqs:  # as _retry counts them
                seq.steps_off += 1
            return dict.fromkeys(request_ids, 0)
        fitted = self.costs.fit()
        lengths = [0] * len(seqs)
        if fitted is None:  # nothing measured yet: try, and measure
            lengths = [self.max_drafts] * len(seqs)
        elif self.costs.plain < PLAIN_PROBE_BELOW:
            # no recent plain call: a verify's time alone can't say what a plain step costs
            # (the fit gives it all to the step, and any draft looks free): measure one
            return dict.fromkeys(request_ids, 0)
        else:
            lengths = self._best_lengths(seqs, batch_size, fitted)
        chosen = {}
        for index, (request_id, seq, k) in enumerate(zip(request_ids, seqs, lengths,
                                                          strict=True)):
            tokens = num_tokens[index] if num_tokens is not None else seq.seen + seq.steps_off + 1
            if not k:
                pays = fitted is None or self._try_pays(tokens - seq.seen, batch_size, fitted)
                k = self._retry(seq, self.steps, pays)
            if k:
                seq.seen = tokens
            chosen[request_id] = k
        self.quiet = fitted is not None and not any(chosen.values())
        return chosen

    def _try_pays(self, missed: int, batch_size: int, fitted: Costs) -> bool:
        """A try of one draft for a sequence whose draft missed ``missed`` tokens costs at
        most RETRY_SHARE of the plain time those tokens took (tries share their verify call
        with the rest of the batch's)."""
        a, b, c, g, h, u = fitted
        plain_per_token = (a + b * batch_size) / batch_size
        price = u * missed + b + h + self.proposer_seconds + (c + g) / batch_size
        return price <= RETRY_SHARE * plain_per_token * missed

    def _best_lengths(self, seqs: list[Acceptance], batch_size: int,
                      fitted: Costs) -> list[int]:
        a, b, c, g, h, u = fitted
        p = self.proposer_seconds
        plain_time = a + b * batch_size
        if plain_time <= 0:
            return [self.max_drafts] * len(seqs)
        plain_rate = batch_size / plain_time
        per_draft = b + h
        # each sequence's own limit: its j-th draft beats the plain rate on its own
        alphas = [self.estimate(seq) for seq in seqs]
        limits = []
        for alpha in alphas:
            k, chance = 0, 1.0
            while k < self.max_drafts and alpha > 0 and chance * alpha >= per_draft * plain_rate:
                chance *= alpha
                k += 1
            limits.append(k)
        best_rate, best_cap = plain_rate, 0
        for cap in range(1, max(limits, default=0) + 1):
            lengths = [min(limit, cap) for limit in limits]
            gain = sum(sum(alpha ** j for j in range(1, k + 1))
                       for alpha, k in zip(alphas, lengths, strict=True))
            drafts = sum(lengths)
            asked = sum(1 for k in lengths if k)
            catch_up = u * (asked + gain)
            time = plain_time + c + per_draft * drafts + g * cap + catch_up + p * asked
            rate = (batch_size + gain) / time
            if rate > best_rate:
                best_rate, best_cap = rate, cap
        return [min(limit, best_cap) for limit in limits]

    @staticmethod
    def _retry(seq: Acceptance, step: int, pays: bool = True) -> int:
        """0, or 1 when a sequence off for long enough is tried again (the text may have
        turned repetitive since) and the try ``pays``. Tries fall on steps that are multiples
        of RETRY_AFTER, so a batch's sequences are tried in the same verify calls, not each
        in one of its own (every verify call costs the whole batch a single step)."""
        seq.steps_off += 1
        if seq.steps_off < seq.retry_after or step % RETRY_AFTER or not pays:
            return 0
        seq.steps_off = 0
        seq.retry_after = min(seq.retry_after * 2, MAX_RETRY_AFTER)
        return 1

    def record(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verify of ``num_drafts`` drafts that kept ``num_accepted``: each draft up to
        the first rejected one is an observation of alpha (those after it were not tried).
        Any accepted draft brings the retry wait back to its start."""
        seq = self._seq(request_id)
        self.quiet = False
        tried = min(num_accepted + 1, num_drafts)
        for index in range(tried):
            accepted = 1.0 if index < num_accepted else 0.0
            seq.alpha = ALPHA_MEMORY * seq.alpha + (1 - ALPHA_MEMORY) * accepted
            seq.prior *= ALPHA_MEMORY
            kept = POOL_MEMORY * self.pool_weight
            self.pool_weight = kept + 1
            self.pool_alpha = (kept * self.pool_alpha + accepted) / self.pool_weight
        if num_accepted:
            seq.retry_after = RETRY_AFTER

    def _seq(self, request_id: str) -> Acceptance:
        seq = self.seqs.get(request_id)
        if seq is None:
            seq = self.seqs[request_id] = Acceptance(prior=1.0)
            self.quiet = False
        return seq

    def estimate(self, seq: Acceptance) -> float:
        """The sequence's acceptance, its prior share read as the draft's over every
        sequence."""
        return min(1.0, max(0.0, seq.alpha + seq.prior * (self.pool_alpha - PRIOR_ALPHA)))

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
