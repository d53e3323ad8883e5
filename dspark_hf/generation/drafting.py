"""Drafting a block for a round: the draws themselves are `dspark_hf.model.sampling`'s ([`sample_block`], or a
[`BlockProposer`]'s own, as the oracle of `dspark bench oracle` drafts); here is what a round adds around them."""

from __future__ import annotations

import torch
from transformers.generation import logits_process as lp

from ..model.modeling_dspark import DSparkDraftModel
from ..model.sampling import BlockProposer, DraftBlock, drafter, sample_block, sample_blocks, score_block

__all__ = ["BlockProposer", "DraftBlock", "VOCAB_FREE_PROCESSORS", "drafter", "empty_block", "saguaro",
           "sample_block", "sample_blocks", "score_block"]


# logits processors that read only the scores' values, not which token a column is: safe on a draft's own vocabulary
VOCAB_FREE_PROCESSORS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
                         lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
                         lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization)


def empty_block(draft: DSparkDraftModel, anchor_ids: torch.Tensor) -> DraftBlock:
    """The block of a round without a draft: no tokens for each of the (N,) anchors."""
    N = anchor_ids.shape[0]
    return DraftBlock(anchor_ids.new_zeros(N, 0),
                      torch.zeros(N, 0, draft.config.target_vocab_size, device=anchor_ids.device), None)


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
