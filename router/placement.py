"""Which replica a new request goes to. Policies are small objects, replaceable by design."""

from collections.abc import Sequence
from typing import Protocol


class PlacementPolicy(Protocol):
    def choose(self, loads: Sequence[int], token_ids: Sequence[int]) -> int:
        """Index of the replica for a request, given each replica's in-flight count."""
        ...


class LeastLoaded:
    """The replica with the fewest requests in flight; ties go round-robin."""

    def __init__(self) -> None:
        self._next_tie = 0

    def choose(self, loads: Sequence[int], token_ids: Sequence[int]) -> int:
        if not loads:
            raise ValueError("no replicas to place a request on")
        lowest = min(loads)
        tied = [index for index, load in enumerate(loads) if load == lowest]
        choice = tied[self._next_tie % len(tied)]
        self._next_tie += 1
        return choice
