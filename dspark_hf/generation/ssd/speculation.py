"""The speculation cache of speculative speculative decoding (SSD, sec. 4.1): while the target verifies a block,
the outcomes it may return are predicted (k drafted tokens accepted, then bonus token b) and a next block is
prepared for each; when the real outcome is among them its block is ready, else a fallback drafts one.

An outcome (k, b) is predictable from the block alone: after k acceptances the bonus comes from the residual at
position k + 1 (or from the target itself past the last verified token), so the candidates for b are the draft's
most likely tokens at position k + 1, without the drafted token there when it was verified and rejected (a
rejected token is never the bonus; greedy or sampled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class PredictedOutcomes:
    """S predicted outcomes per row: accepted (N, S) k, bonus (N, S) token id; valid (N, S) False for slots a row
    has no candidate for (past the end of its block)."""

    accepted: torch.Tensor
    bonus: torch.Tensor
    valid: torch.Tensor

    def lookup(self, accepted: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The real outcomes (N,) -> (hit (N,) bool, slot (N,) of the hit, 0 on a miss)."""
        match = self.valid & (self.accepted == accepted[:, None]) & (self.bonus == bonus[:, None])
        if match.shape[1] == 0:  # nothing prepared: every outcome misses
            return match.any(1), torch.zeros_like(accepted)
        return match.any(1), match.float().argmax(1)

    def worth_drafting(self) -> "PredictedOutcomes":
        """Only the slots some row can hit: a slot invalid in every row would cost a block to draft for nothing."""
        keep = self.valid.any(0)
        if bool(keep.all()):
            return self
        return PredictedOutcomes(self.accepted[:, keep], self.bonus[:, keep], self.valid[:, keep])


def top_candidates(p: torch.Tensor, F: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The F most likely tokens of each row of p (N, V), as (values, indices) (N, F) in no particular order, ties
    going to the lower token id: the order [`bonus_rank`] counts in. (`topk` alone picks among ties arbitrarily,
    and ties are common: a draft vocabulary's widened blocks, top-k / top-p sampling, bfloat16 logits.)"""
    if F == 0:
        return p[:, :0], torch.zeros(p.shape[0], 0, dtype=torch.long, device=p.device)
    top = p.topk(F, dim=-1)
    last = top.values[:, -1:]  # the F-th value: every token above it is in, and the first of its ties
    above = p > last
    tied = p == last
    if bool(((above | tied).sum(-1) == F).all()):  # no tie across the edge: topk's choice is the only one
        return top.values, top.indices
    taken = above | (tied & (tied.cumsum(-1) <= F - above.sum(-1, keepdim=True)))
    indices = taken.to(p.dtype).topk(F, dim=-1).indices  # exactly F tokens are taken
    return p.gather(-1, indices), indices


def predict_outcomes(probs: torch.Tensor, tokens: torch.Tensor, verify_len: torch.Tensor,
                     fan_out: Sequence[int]) -> PredictedOutcomes:
    """Outcomes of verifying tokens[:, :verify_len] worth a next block, F_k of them for each k accepted.

    probs (N, gamma, V) the draft distributions; tokens (N, gamma) the drafted block; verify_len (N,);
    fan_out F_0..F_gamma (e.g. from `dspark_hf.generation.ssd.fan_out`). Candidates for k are the top-F_k tokens of
    probs[:, k], without tokens[:, k] when k < verify_len (it was rejected if the outcome is k); a row with k past
    its verified length, or with k = gamma (the target's own next token, which the block has no distribution for),
    gets invalid slots.
    """
    N, gamma, V = probs.shape
    if len(fan_out) != gamma + 1:
        raise ValueError(f"fan_out has one count per number of accepted tokens 0..{gamma}: {gamma + 1} counts, got "
                         f"{len(fan_out)}.")
    accepted, bonus, valid = [], [], []
    for k, F in enumerate(fan_out):
        if F == 0:
            continue
        reachable = k <= verify_len
        if k == gamma:
            tokens_k = torch.zeros(N, F, dtype=torch.long, device=probs.device)
            accepted.append(torch.full((N, F), k, device=probs.device))
            bonus.append(tokens_k)
            valid.append(torch.zeros(N, F, dtype=torch.bool, device=probs.device))
            continue
        p = probs[:, k].clone()
        rejected = k < verify_len  # outcome k means tokens[:, k] was verified and rejected
        p[rejected, tokens[rejected, k]] = -1.0  # below every probability: never a candidate
        values, indices = top_candidates(p, min(F, V))
        accepted.append(torch.full((N, indices.shape[1]), k, device=probs.device))
        bonus.append(indices)
        valid.append(reachable[:, None] & (values >= 0))
    if not accepted:
        empty = torch.zeros(N, 0, dtype=torch.long, device=probs.device)
        return PredictedOutcomes(empty, empty, empty.bool())
    return PredictedOutcomes(torch.cat(accepted, 1), torch.cat(bonus, 1), torch.cat(valid, 1))


def bonus_rank(probs: torch.Tensor, tokens: torch.Tensor, verify_len: torch.Tensor, accepted: torch.Tensor,
               bonus: torch.Tensor) -> torch.Tensor:
    """Where the real outcome's bonus stood among the candidates [`predict_outcomes`] ranks for its k: (N,) rank j
    (0: the first candidate), so a cache with F_k > j blocks for k held it; -1 where k = gamma (no candidates).

    probs (N, gamma, V), tokens (N, gamma), verify_len (N,) as given to `predict_outcomes`; accepted (N,) and bonus
    (N,) the outcome. Among tokens of equal probability the lower id ranks first, as in [`top_candidates`].
    """
    N, gamma, _ = probs.shape
    rows = torch.arange(N, device=probs.device)
    k = accepted.clamp(max=gamma - 1)
    p = probs[rows, k]  # advanced indexing: a copy already
    rejected = accepted < verify_len
    p[rows[rejected], tokens[rows, k][rejected]] = -1.0
    p_bonus = p[rows, bonus][:, None]
    before = torch.arange(p.shape[1], device=p.device) < bonus[:, None]
    rank = ((p > p_bonus) | ((p == p_bonus) & before)).sum(1)
    return torch.where(accepted < gamma, rank, -1)


def saguaro(probs: torch.Tensor, fan_out: int, C: float) -> torch.Tensor:
    """Saguaro sampling (SSD, Definition 14): the draft distribution (.., V) with its top-`fan_out` tokens
    down-weighted by C in [0, 1] and renormalised. The residual max(p - q, 0) of a rejection then puts more mass on
    those tokens, the ones a speculation cache prepares bonus tokens for (Theorem 15); C = 1 leaves q as it is.
    Drafting from it is as exact as drafting from q: verification reads the distribution the tokens came from."""
    if not 0.0 <= C <= 1.0:
        raise ValueError(f"the Saguaro down-weighting constant C must be in [0, 1], got {C}.")
    if C == 1.0 or fan_out <= 0:
        return probs
    top = probs.topk(min(fan_out, probs.shape[-1] - 1), dim=-1).indices
    weighted = probs * torch.ones_like(probs).scatter_(-1, top, C)
    total = weighted.sum(-1, keepdim=True)
    # C = 0 leaves no mass where every possible token is cached (a top-k as small as the fan-out, say): such a row
    # keeps q, which is as exact to draft from as any other distribution
    return torch.where(total > 0, weighted / total, probs)
