"""One constrained row's matcher in the sampling worker.

The matcher's state is a function of the compiled grammar and the row's output tokens, so it
is never shipped anywhere: a row that is new to this worker (admitted, recomputed after a
preemption, reloaded from a tier, resumed on another replica after a failover) replays the
output tokens it already has (~1.5 us a token) before its first mask.
"""

from collections.abc import Sequence
from typing import Any

import torch


class RowGrammar:
    def __init__(self, compiled: Any, and_row: torch.Tensor | None = None) -> None:
        """``and_row``: a bitmask row every mask is ANDed with (JSON's control characters)."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.and_row = and_row
        self.num_accepted = 0  # output tokens the matcher has taken
        self.failed: str | None = None

    def catch_up(self, output_ids: Sequence[int]) -> str | None:
        """Accepts the output tokens the matcher has not seen. A token it refuses marks the
        row failed (its mask then allows only the stop tokens, so the row ends); the reason
        is returned by the call that found it, None otherwise."""
        if self.failed is not None:
            return None
        for token_id in output_ids[self.num_accepted:]:
            if self.matcher.is_terminated():
                break  # the stop token ended the grammar: nothing after it is masked
            if not self.matcher.accept_token(token_id):
                self.failed = (f"token {token_id} at output position {self.num_accepted} is "
                               "not allowed by the request's grammar")
                return self.failed
            self.num_accepted += 1
        return None

    def fill(self, bitmask: torch.Tensor, row: int, and_row: bool = True) -> bool:
        """Row ``row`` of ``bitmask`` (int32, one bit a token) to the tokens allowed next.
        Returns whether the grammar filled it (not only the stop tokens); then, with
        ``and_row`` False, the caller ANDs ``self.and_row`` in (one op for many rows)."""
        if self.failed is not None or self.matcher.is_terminated():
            self._stops_only(bitmask, row)
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if and_row and self.and_row is not None:
            bitmask[row] &= self.and_row
        return True

    def fill_drafts(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> int:
        """Fills rows first_row .. first_row + len(drafts): row j allows what may follow the
        first j drafts. Returns how many drafts the grammar takes; the rows after the first
        refused draft are left unfilled (verification never samples there). The matcher ends
        where it began."""
        valid = 0
        for j, token_id in enumerate(drafts):
            self.fill(bitmask, first_row + j)
            if self.failed is not None or self.matcher.is_terminated() or \
                    not self.matcher.accept_token(token_id):
                break
            valid += 1
        else:
            self.fill(bitmask, first_row + len(drafts))
        if valid:
            self.matcher.rollback(valid)
        return valid

    def _stops_only(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token_id in self.matcher.stop_token_ids:
            bitmask[row, token_id // 32] |= 1 << (token_id % 32)
