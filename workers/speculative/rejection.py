"""Exact verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Row b proposed ``num_drafts[b]`` tokens d_1..d_k with draft probabilities q (a one-hot when
the proposer has none, as n-gram lookup). The target gave distributions p_0..p_k at the
positions before and after each draft. Draft j is accepted with probability
min(1, p_{j-1}(d_j) / q_j(d_j)); at the first rejection the row emits one token drawn from
normalize(max(0, p - q)) there, and if all are accepted a bonus token drawn from p_k. The
emitted tokens are then distributed exactly as tokens sampled from the target one at a time.
A greedy row's p is the one-hot of its argmax, which makes this "keep drafts while they equal
the argmax, then the argmax": the same code serves both.

Everything stays on the device: the caller reads the (B, k+1) tokens and counts once.
"""

from collections.abc import Sequence

import torch


def verify(
    target_probs: torch.Tensor,  # (B, k+1, V) float32, each row a distribution
    draft_ids: torch.Tensor,  # (B, k) int64, padded past each row's count
    num_drafts: torch.Tensor,  # (B,) int64
    draft_probs: torch.Tensor | None,  # (B, k, V), or None: one-hot drafts
    generators: Sequence[torch.Generator | None],  # per row: its own, or the shared one
    shared: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, k+1) int64 with -1 after each row's last, counts (B,) in 1..k+1)."""
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    device = target_probs.device
    uniforms, noise = draws(batch, k, vocab, device, generators, shared)
    positions = torch.arange(k, device=device)
    valid = positions < num_drafts.unsqueeze(1)  # (B, k)
    p_draft = target_probs[:, :k].gather(2, draft_ids.unsqueeze(2)).squeeze(2)  # (B, k)
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else draft_probs.gather(2, draft_ids.unsqueeze(2)).squeeze(2))
    accepted = (uniforms * q_draft < p_draft) & valid  # u < p / q without dividing by 0
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # (B,) the accepted prefix
    last = num_accepted.view(batch, 1, 1).expand(batch, 1, vocab)
    final_p = target_probs.gather(1, last).squeeze(1)  # (B, V) p at the first unaccepted slot
    rejected = num_accepted < num_drafts  # else all accepted: the bonus comes from p_k
    # computed for every row (rows that kept all take final_p below): asking whether any row
    # rejected would be a host sync in the middle of the step
    residual = final_p
    if k > 0:
        rejected_at = num_accepted.clamp(max=max(k - 1, 0))
        if draft_probs is None:
            q = torch.zeros_like(final_p).scatter_(
                1, draft_ids.gather(1, rejected_at.unsqueeze(1)), 1.0)
        else:
            q = draft_probs.gather(1, rejected_at.view(batch, 1, 1).expand(batch, 1, vocab))
            q = q.squeeze(1)
        leftover = (final_p - q).clamp_min(0.0)
        # rounding can leave nothing where p and q are (nearly) equal: then p itself
        empty = leftover.sum(dim=1, keepdim=True) <= 0
        leftover = torch.where(empty, final_p, leftover)
        residual = torch.where(rejected.unsqueeze(1), leftover, final_p)
    final = (residual / noise).argmax(dim=1)  # the exponential race: a draw from residual
    tokens = torch.full((batch, k_plus_1), -1, dtype=torch.int64, device=device)
    tokens[:, :k] = torch.where(positions < num_accepted.unsqueeze(1), draft_ids, -1)
    tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return tokens, num_accepted + 1


def verify_greedy(
    argmax: torch.Tensor,  # (B, k+1) int64: the target's argmax at each position
    draft_ids: torch.Tensor,  # (B, k) int64, padded past each row's count
    num_drafts: torch.Tensor,  # (B,) int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify`` for a batch of greedy rows, from the argmaxes alone: the drafts equal to
    the argmax, then the argmax. The same tokens as ``verify`` with one-hot targets (its
    accept test u < 1 holds for the argmax, fails elsewhere), without a (B, k+1, V) tensor."""
    batch, k_plus_1 = argmax.shape
    k = k_plus_1 - 1
    positions = torch.arange(k_plus_1, device=argmax.device)  # one launch serves both tests
    accepted = (draft_ids == argmax[:, :k]) & (positions[:k] < num_drafts.unsqueeze(1))
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)  # (B,)
    kept = positions <= num_accepted.unsqueeze(1)
    return torch.where(kept, argmax, -1), num_accepted + 1


def draws(batch: int, k: int, vocab: int, device: torch.device,
          generators: Sequence[torch.Generator | None],
          shared: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row k uniforms in [0, 1) and V exponential noises (for one race): from the row's
    own generator when it has one, so a seeded row repeats whatever else is in the batch."""
    uniforms = torch.empty(batch, k, device=device)
    noise = torch.empty(batch, vocab, device=device)
    if any(g is None for g in generators):
        uniforms.uniform_(generator=shared)
        noise.exponential_(generator=shared)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniforms[row].uniform_(generator=generator)
            noise[row].exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return uniforms, noise


def one_hot_rows(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """(..., V) float32 one-hot of each id: a greedy row's "distribution"."""
    out = torch.zeros(*token_ids.shape, vocab, device=token_ids.device)
    return out.scatter_(-1, token_ids.unsqueeze(-1), 1.0)
