"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's own
suffix are a cheap guess of what comes next (copying code, quoting the prompt, lists)."""

from collections.abc import Sequence


def ngram_drafts(token_ids: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_drafts`` tokens: for the longest n in [max_n .. min_n] whose last n tokens
    occurred earlier, what followed the latest such occurrence; [] when none did."""
    tokens = list(token_ids)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        # the latest start before the suffix itself, scanning back
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == first and tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + num_drafts]
                if follow:
                    return follow
    return []
