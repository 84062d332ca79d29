"""The worker's half of a verify step: the target's logits at each row's token and drafts in,
the kept tokens out, with one read of them to the host."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.input_batch import packed_to_device
from workers.pending import copied_event, to_host
from workers.request_state import RequestState
from workers.sampler import greedy, target_probs
from workers.speculative.rejection import verify, verify_greedy
from workers.step_input import StepOutput

if TYPE_CHECKING:
    from workers.structured.masks import LogitConstraints


@dataclass
class PendingTokens:
    """The kept tokens of the verified rows, on their way to the host: the tokens alone, one
    copy (each row's count is where its -1s start; a token is never -1)."""

    tokens: torch.Tensor  # (B, k+1), -1 after each row's last
    copied: "torch.cuda.Event | None"

    def result(self) -> list[list[int]]:
        if self.copied is not None:
            self.copied.synchronize()
        return [row[:row.index(-1)] if -1 in row else row for row in self.tokens.tolist()]


def verify_rows(logits: torch.Tensor, starts: Sequence[int], drafts: Sequence[list[int]],
                states: Sequence[RequestState], shared: torch.Generator | None,
                constraints: "LogitConstraints | None" = None,
                on_device: torch.Tensor | None = None) -> PendingTokens:
    """``logits`` (S, V): row r's 1 + k_r positions start at ``starts[r]`` (the token before
    its first draft, then each draft). Rows are padded to the longest k (the padding is never
    accepted: ``verify`` reads each row's own count).

    ``constraints``: each position's logit_bias and grammar mask (the grammar's state after
    the drafts before it), so verification is exact for the constrained distribution; a
    draft the grammar refuses ends its row's drafts there.

    ``on_device``: the drafts (B, k) on the device, where ``drafts`` holds placeholders of
    their lengths (workers/speculative/device_drafts.py; never with constraints)."""
    device = logits.device
    k = max(len(d) for d in drafts)
    batch, vocab = len(drafts), logits.shape[-1]
    index = [start + min(j, len(d)) for start, d in zip(starts, drafts, strict=True)
             for j in range(k + 1)]
    padded = [t for d in drafts for t in d + [0] * (k - len(d))]
    # one pinned, non-blocking copy: a pageable one would wait here for the forward to end,
    # and the verify kernels would only be launched after it
    index_t, draft_ids, num_drafts = packed_to_device(
        [np.array(index), np.array(padded), np.array([len(d) for d in drafts])], np.int64,
        device)
    # every row verifying k drafts (no plain rows among them): the logits are the rows
    # already, where a gather would copy B * (k+1) * V values
    rows = logits if index == list(range(logits.shape[0])) else logits[index_t]  # (B*(k+1), V)
    if constraints is not None:
        rows, valid = constraints.apply(rows, states, drafts, width=k + 1)
        if valid != [len(d) for d in drafts]:
            num_drafts = torch.tensor(valid, dtype=torch.int64).to(device, non_blocking=True)
    draft_ids = draft_ids.view(batch, k) if on_device is None else on_device
    if all(state.spec.is_greedy for state in states):
        tokens, _ = verify_greedy(greedy(rows).view(batch, k + 1), draft_ids, num_drafts)
    else:
        specs = [state.spec for state in states for _ in range(k + 1)]
        probs = target_probs(rows, specs).view(batch, k + 1, vocab)
        generators = [state.generator_for_next_token() for state in states]
        tokens, _ = verify(probs, draft_ids, num_drafts, None, generators, shared)
    return PendingTokens(to_host(tokens), copied_event(tokens))


@torch.inference_mode()
def warm_up_verify(max_drafts: int, vocab: int, device: torch.device,
                   dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)) -> None:
    """Runs verification's kernels once at start-up (greedy and sampled, 1..max_drafts drafts,
    one row and two): their first call compiles and loads them (~0.1 s on an H100), which a
    run that speculates rarely would otherwise pay in its first verify step."""
    generator = torch.Generator(device=device)
    for dtype in dtypes:
        for k in range(1, max_drafts + 1):
            for batch in (1, 2):
                logits = torch.zeros(batch * (k + 1), vocab, dtype=dtype, device=device)
                draft_ids = torch.zeros(batch, k, dtype=torch.int64, device=device)
                num_drafts = torch.full((batch,), k, dtype=torch.int64, device=device)
                verify_greedy(greedy(logits).view(batch, k + 1), draft_ids, num_drafts)
                probs = logits.float().softmax(dim=-1).view(batch, k + 1, vocab)
                verify(probs, draft_ids, num_drafts, None, [None] * batch, generator)
    torch.cuda.synchronize(device)


def merge_outputs(request_ids: list[str], plain: list[int], plain_out: StepOutput | None,
                  spec: list[int], spec_tokens: list[list[int]]) -> StepOutput:
    """One StepOutput in the batch's order. Verified rows never ask for logprobs (the engine
    proposes no drafts for them), so theirs are empty placeholders, one a token."""
    token_ids: list[list[int]] = [[] for _ in request_ids]
    logprobs = None
    if plain_out is not None and plain_out.logprobs is not None:
        logprobs = [[] for _ in request_ids]
    if plain_out is not None:
        for at, row in enumerate(plain):
            token_ids[row] = plain_out.token_ids[at]
            if logprobs is not None and plain_out.logprobs is not None:
                logprobs[row] = plain_out.logprobs[at]
    for at, row in enumerate(spec):
        token_ids[row] = spec_tokens[at]
        if logprobs is not None:
            logprobs[row] = [[] for _ in spec_tokens[at]]
    return StepOutput(request_ids, token_ids, logprobs)
