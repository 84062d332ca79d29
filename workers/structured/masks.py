"""The constraints applied to a batch's logits before the sampler sees them: each row's
``logit_bias`` added, then each constrained row's grammar mask (tokens it disallows to
-inf). Greedy, temperature, top-k/p, min-p, penalties and the logprobs all see the result, so
logprobs are the constrained distribution's (as vLLM's).

The masks are filled on the host after the step's forward is queued, so on a GPU they are
filled while the device runs it; one copy from a persistent pinned buffer takes them over, and
one kernel applies them in place (workers/structured/mask_kernel.py).
"""

from collections.abc import Sequence

import numpy as np
import torch

from workers.pending import copied_event
from workers.request_state import RequestState

BITS = 32


def bitmask_words(vocab: int) -> int:
    return -(-vocab // BITS)


class LogitConstraints:
    """The worker's persistent mask buffers, grown when a step needs more rows."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.host = torch.empty(0, bitmask_words(vocab), dtype=torch.int32)
        self.shifts = torch.arange(BITS, dtype=torch.int32, device=device)
        self.broken: list[tuple[str, str]] = []  # rows whose output broke their grammar
        # on a GPU: the host buffer's copy to the device (async scheduling fills the next
        # step's mask while a step runs; the buffer is written again only once it has left)
        self.copied: torch.cuda.Event | None = None

    def rows(self, count: int) -> torch.Tensor:
        """The first ``count`` rows of the host buffer (all tokens allowed)."""
        if self.host.shape[0] < count:
            size = max(count, 2 * self.host.shape[0], 64)
            pin = self.device.type == "cuda"
            self.host = torch.empty(size, bitmask_words(self.vocab), dtype=torch.int32,
                                    pin_memory=pin)
        if self.copied is not None:  # the last step's words may still be on their way over
            self.copied.synchronize()
            self.copied = None
        rows = self.host[:count]
        rows.fill_(-1)
        return rows

    def apply(self, logits: torch.Tensor, row_states: Sequence[RequestState | None],
              drafts: Sequence[Sequence[int]] | None = None,
              width: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """``logits`` (rows, V) with the constraints of each row's state (None: a padding row)
        applied; with ``drafts`` (verify steps), each state owns 1 + len(drafts) consecutive
        rows (``width`` rows when given: the rows past its drafts are padding). Returns the
        logits (a new tensor when anything applies) and, with drafts, how many of each row's
        drafts its grammar takes (all, for rows without one)."""
        valid = [len(d) for d in drafts] if drafts is not None else []
        spans = self._spans(row_states, drafts, width)
        biased = [span for span in spans if span[1] is not None and span[1].spec.logit_bias]
        constrained = any(s is not None and s.grammar is not None for _, s, _ in spans)
        if not biased and not constrained:
            return logits, valid
        logits = logits.clone()
        if biased:
            add_logit_bias(logits, biased)
        if constrained:
            bitmask = self.rows(logits.shape[0])
            masked: list[int] = []  # the rows a grammar masks; the others are left alone
            anded: dict[int, tuple[torch.Tensor, list[int]]] = {}  # and_row's id -> its rows
            for index, (start, state, row_drafts) in enumerate(spans):
                grammar = state.grammar if state is not None else None
                if grammar is None or state is None:
                    continue
                broken = grammar.catch_up(state.output_token_ids)
                if broken is not None:
                    self.broken.append((state.request_id, broken))
                if row_drafts is None:
                    if grammar.fill(bitmask, start, and_row=False) and (
                            grammar.and_row is not None):
                        anded.setdefault(id(grammar.and_row), (grammar.and_row, []))[1].append(
                            start)
                    masked.append(start)
                else:
                    valid[index] = grammar.fill_drafts(bitmask, start, row_drafts)
                    masked += range(start, start + valid[index] + 1)
            and_rows(bitmask, list(anded.values()), len(masked))
            self._mask(logits, bitmask, masked)
        return logits, valid

    def _spans(self, row_states: Sequence[RequestState | None],
               drafts: Sequence[Sequence[int]] | None, width: int | None,
               ) -> list[tuple[int, RequestState | None, Sequence[int] | None]]:
        if drafts is None:
            return [(row, state, None) for row, state in enumerate(row_states)]
        spans, start = [], 0
        for state, row_drafts in zip(row_states, drafts, strict=True):
            spans.append((start, state, row_drafts))
            start += width if width is not None else 1 + len(row_drafts)
        return spans

    def take_failures(self) -> list[tuple[str, str]]:
        """(request id, why) of the rows found broken since the last call, each once."""
        broken, self.broken = self.broken, []
        return broken

    def _mask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of ``rows`` to -inf: on a GPU one copy of the pinned words and
        one kernel (workers/structured/mask_kernel.py); else the bits unpacked by torch."""
        if self.device.type == "cuda":
            from workers.structured.mask_kernel import apply_token_bitmask

            words, index = packed_words(bitmask, rows, self.device)
            self.copied = copied_event(words)
            apply_token_bitmask(logits, words, index)
            return
        if len(rows) == logits.shape[0]:
            words = bitmask.to(self.device, non_blocking=True)  # (R, W) int32
            index = None
        else:
            words = bitmask[rows].to(self.device)  # a gathered copy: small, rows only
            index = torch.tensor(rows, device=self.device)
        allowed = ((words.unsqueeze(-1) >> self.shifts) & 1).view(words.shape[0], -1)
        refused = allowed[:, : logits.shape[-1]] == 0
        if index is None:
            logits.masked_fill_(refused, float("-inf"))
        else:
            logits[index] = logits[index].masked_fill(refused, float("-inf"))


def and_rows(bitmask: torch.Tensor, groups: list[tuple[torch.Tensor, list[int]]],
             num_masked: int) -> None:
    """Each group's rows ANDed with its row of words. One group holding every masked row
    (every row under JSON schemas, the usual batch) is ANDed over the whole buffer in place:
    ~40 us for 64 rows of a 128k vocabulary, where a row at a time takes 5-25 us each and an
    indexed gather and scatter ~1.5 ms (the other rows are not masked: their words are unread)."""
    for and_row, rows in groups:
        if len(rows) == num_masked:
            bitmask &= and_row
        else:
            for row in rows:
                bitmask[row] &= and_row


def packed_words(bitmask: torch.Tensor, rows: list[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The words of every row and the indices of ``rows`` on the device, each a
    non-blocking copy from pinned memory (the forward runs on meanwhile)."""
    from workers.input_batch import to_device

    words = bitmask.to(device, non_blocking=True)
    return words, to_device(np.asarray(rows, dtype=np.int64), device)


def add_logit_bias(logits: torch.Tensor,
                   biased: Sequence[tuple[int, RequestState | None, Sequence[int] | None]],
                   ) -> None:
    """Each biased state's bias on every one of its rows (its verify rows too)."""
    rows, columns, values = [], [], []
    for start, state, drafts in biased:
        assert state is not None
        for row in range(start, start + 1 + len(drafts or ())):
            for token_id, bias in state.spec.logit_bias:
                rows.append(row)
                columns.append(token_id)
                values.append(bias)
    device = logits.device
    logits.index_put_((torch.tensor(rows, device=device), torch.tensor(columns, device=device)),
                      torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
