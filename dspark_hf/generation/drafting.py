"""Drafting a block: the draft's heads run left to right, each token drawn from p_k = softmax(U_k + B_k(x_{k-1}))
(eq. 4-6) after the same logits processors the target's scores will get, so that verification can be exact.

The model computes the pieces (backbone, base logits, transition, confidence); this module draws the tokens, as
`verify.py` judges them. A draft that proposes its blocks some other way (the oracle of `dspark bench oracle`)
implements [`BlockProposer`]; every other draft is sampled by [`sample_block`].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from transformers.generation import logits_process as lp

from ..model.modeling_dspark import DSparkContext, DSparkDraftModel

ProcessLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DraftBlock:
    """A drafted block. tokens (N, gamma) target ids; probs (N, gamma, V) the exact distributions the tokens were
    drawn from (after logits processors); confidences (N, gamma) calibrated c_k in (0, 1), or None; unweighted
    (N, gamma, V) the draft's own distributions when the tokens were drawn from reweighted ones (Saguaro
    sampling), else None; vocab (V',) the target ids of the distributions' columns when they cover only the
    draft's vocabulary (probs (N, gamma, V'): a speculation cache keeps many blocks), else None."""

    tokens: torch.Tensor
    probs: torch.Tensor
    confidences: torch.Tensor | None
    unweighted: torch.Tensor | None = None
    vocab: torch.Tensor | None = None

    def index(self, *index) -> "DraftBlock":
        """The same rows (and blocks) of every tensor, e.g. block.index(rows) or block.index(rows, slots)."""
        pick = (lambda t: None if t is None else t[index])
        return DraftBlock(self.tokens[index], self.probs[index], pick(self.confidences), pick(self.unweighted),
                          self.vocab)

    def in_target_vocab(self, vocab_size: int) -> "DraftBlock":
        """The block with its distributions over all `vocab_size` target ids (zero where the draft proposes
        nothing), as verification reads them."""
        if self.vocab is None:
            return self
        spread = (lambda t: None if t is None else
                  t.new_zeros(*t.shape[:-1], vocab_size).index_copy_(-1, self.vocab, t))
        return DraftBlock(self.tokens, spread(self.probs), self.confidences, spread(self.unweighted))


@runtime_checkable
class BlockProposer(Protocol):
    """A draft that drafts its own blocks instead of being sampled by [`sample_block`]; same arguments."""

    def propose_block(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, context: DSparkContext,
                      do_sample: bool = False, process_logits: ProcessLogits | None = None,
                      generator: torch.Generator | None = None) -> DraftBlock:
        ...


def drafter(draft: DSparkDraftModel) -> Callable[..., DraftBlock]:
    """The function that drafts `draft`'s blocks: its own `propose_block` if it is a [`BlockProposer`], else
    [`sample_block`] bound to it."""
    if isinstance(draft, BlockProposer):
        return draft.propose_block
    return lambda *args, **kwargs: sample_block(draft, *args, **kwargs)


# logits processors that read only the scores' values, not which token a column is: safe on a draft's own vocabulary
VOCAB_FREE_PROCESSORS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
                         lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
                         lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization)


@torch.no_grad()
def sample_block(
    draft: DSparkDraftModel,
    anchor_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    context: DSparkContext,
    do_sample: bool = False,
    process_logits: ProcessLogits | None = None,
    generator: torch.Generator | None = None,
    known: torch.Tensor | None = None,
    reweight: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    target_vocab: bool = True,
    forced: torch.Tensor | None = None,
) -> DraftBlock:
    """Draft one block per row, left to right (eq. 4).

    anchor_ids, anchor_positions (N,), or (N, A) for A blocks per row (the block's tensors then have an A dim
    after N). `process_logits(tokens_so_far (M, k), logits (M, V)) -> logits` applies generation's logits
    processors (temperature, top-k, ...) exactly as they will be applied to the target. Greedy (do_sample=False)
    takes the argmax of the processed logits. known (N, A, lag): tokens before each anchor that the context has no
    features of yet ([`DSparkDraftModel.backbone`]). reweight(k, probs (M, V)) -> probs: the distribution actually
    sampled at position k (0-based; Saguaro sampling, [`saguaro`]); the block records it, so verification stays
    exact. Greedy drafting proposes the draft's own argmax however it is reweighted. target_vocab=False keeps the
    distributions over the draft's own vocabulary, if it has one (`DraftBlock.vocab`; for SmolLM2's shipped draft
    a sixth of the memory), for logits processors that read only the scores (`VOCAB_FREE_PROCESSORS`): the target
    ids outside it have probability 0 either way. forced (N, gamma) target ids: take these tokens instead of drawing
    them, for the draft's distributions at each position given them (scoring a block proposed some other way).
    """
    one_per_row = anchor_ids.dim() == 1
    anchors = anchor_ids[:, None] if one_per_row else anchor_ids
    positions = anchor_positions[:, None] if one_per_row else anchor_positions
    h = draft.backbone(anchors, positions, context, known)  # (N, A, gamma, d)
    N, A, gamma = h.shape[:3]
    h = h.reshape(N * A, gamma, -1)
    U = draft.base_logits(h)
    state = h.new_zeros(N * A, draft.config.markov_rank) if draft.config.head_type == "rnn" else None
    prev = anchors.reshape(N * A)
    vocab = None if target_vocab or draft.config.draft_vocab_size is None else draft.draft_vocab
    tokens, probs, unweighted, conf_logits, finite = [], [], [], [], []
    for k in range(gamma):
        prev_emb = draft.prev_embedding(prev) if draft.w1 is not None else None
        logits = U[:, k]
        if prev_emb is not None:
            bias, state = draft.transition(prev_emb, h[:, k], state)
            logits = logits + bias
        if draft.confidence is not None:
            conf_logits.append(draft.confidence_logit(h[:, k], prev_emb))
        logits = logits.float() if vocab is not None else draft.to_target_vocab(logits.float())
        if process_logits is not None:
            prefix = torch.stack(tokens, 1) if tokens else prev.new_zeros(N * A, 0)
            own, logits = logits, process_logits(prefix, logits)
            # the processors may ban every token a draft vocabulary holds (bad_words_ids, no_repeat_ngram_size), or
            # push the -inf of a token outside it to +inf (remove_invalid_values makes it finfo.min, which an
            # exponential decay penalty overflows): such a row drafts from its own distribution, exact to verify
            # like any other (banned tokens, having target probability 0, are rejected)
            usable = ~(torch.isnan(logits) | torch.isposinf(logits)).any(-1, keepdim=True) & \
                ~torch.isneginf(logits).all(-1, keepdim=True)
            logits = torch.where(usable, logits, own)
        p = torch.softmax(logits, dim=-1)
        if reweight is not None:
            unweighted.append(p)
            p = reweight(k, p)
        # checked once per block, not per position (a device sync each); meanwhile a non-finite row samples from
        # a stand-in so that multinomial cannot fail (or assert on a GPU) before the error below is raised
        finite.append(torch.isfinite(p).all(-1))
        if forced is not None:
            x = forced[:, k]
        elif do_sample:
            x = torch.multinomial(torch.where(finite[-1][:, None], p, 1.0), 1, generator=generator).squeeze(1)
        else:
            x = logits.argmax(-1)  # greedy proposes the draft's own best token, however it is reweighted
        if vocab is not None and forced is None:  # a column of the draft's vocabulary -> its target id
            x = vocab[x]
        tokens.append(x)
        probs.append(p)
        prev = x
    finite = torch.stack(finite, 1)
    shape = (N, gamma) if one_per_row else (N, A, gamma)
    confidences = draft.calibrated(torch.stack(conf_logits, 1).float()).view(shape) if conf_logits else None
    # the policies plan on the confidences: NaN ones would make every plan arbitrary (one sync for both checks)
    usable = finite.all() if confidences is None else finite.all() & torch.isfinite(confidences).all()
    if not bool(usable):
        if not bool(finite.all()):
            position = int((~finite).any(0).float().argmax()) + 1
            raise FloatingPointError(f"The draft produced non-finite probabilities (NaN or inf) at block position "
                                     f"{position}: its weights or the logits processors' output are not finite. "
                                     "Reload the draft (or check training for divergence).")
        raise FloatingPointError("The draft produced non-finite confidences (NaN): its confidence head's weights are "
                                 "not finite. Reload the draft (or check training for divergence).")
    return DraftBlock(torch.stack(tokens, 1).view(shape), torch.stack(probs, 1).view(*shape, -1), confidences,
                      torch.stack(unweighted, 1).view(*shape, -1) if unweighted else None, vocab)


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
