"""Drawing a block from the draft: its heads run left to right, each token drawn from p_k = softmax(U_k + B_k(x_{k-1}))
(eq. 4-6) after the same logits processors the target's scores will get, so that verification can be exact.

The model computes the pieces (backbone, base logits, transition, confidence); this module draws the tokens, as
`generation/verify.py` judges them. It sits beside the model, below the layers that draft (`generation`) and that
price a draft pass (`scheduling`). Each caller says only what it means:

- [`sample_block`]: one block per row, as a round drafts it (what [`BlockProposer`] drafts otherwise);
- [`sample_blocks`]: several blocks per row, after tokens the context has no features of yet and from reweighted
  distributions, as a speculation cache drafts them (SSD);
- [`score_block`]: the draft's distributions at each position of a block proposed some other way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from ..errors import NotFiniteError
from .modeling_dspark import DSparkContext, DSparkDraftModel

# process_logits(tokens_so_far (M, k), logits (M, V)) -> logits: generation's logits processors
ProcessLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# reweight(k, probs (M, V)) -> probs: the distribution actually drawn from at position k (0-based)
Reweight = Callable[[int, torch.Tensor], torch.Tensor]
# choose(k, logits (M, V), probs (M, V) as drawn, finite (M,)) -> (M,) column of the token at position k
_Choose = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DraftBlock:
    """A drafted block. tokens (N, gamma) target ids; probs (N, gamma, V) the exact distributions the tokens were
    drawn from (after logits processors); confidences (N, gamma) calibrated c_k in (0, 1), or None; unweighted
    (N, gamma, V) the draft's own distributions when the tokens were drawn from reweighted ones (Saguaro
    sampling), else None; vocab (V',) the target ids of the distributions' columns when they cover only the
    draft's vocabulary (probs (N, gamma, V'): a speculation cache keeps many blocks), else None; finite
    (gamma + 1,) bool: whether the probabilities at each position, and the confidences, were all finite, for a
    block drawn without its check ([`raise_if_not_finite`] reads it with a round's other values), else None."""

    tokens: torch.Tensor
    probs: torch.Tensor
    confidences: torch.Tensor | None
    unweighted: torch.Tensor | None = None
    vocab: torch.Tensor | None = None
    finite: torch.Tensor | None = None

    def index(self, *index) -> "DraftBlock":
        """The same rows (and blocks) of every tensor, e.g. block.index(rows) or block.index(rows, slots)."""
        pick = (lambda t: None if t is None else t[index])
        return DraftBlock(self.tokens[index], self.probs[index], pick(self.confidences), pick(self.unweighted),
                          self.vocab, self.finite)

    def in_target_vocab(self, vocab_size: int) -> "DraftBlock":
        """The block with its distributions over all `vocab_size` target ids (zero where the draft proposes
        nothing), as verification reads them."""
        if self.vocab is None:
            return self
        spread = (lambda t: None if t is None else
                  t.new_zeros(*t.shape[:-1], vocab_size).index_copy_(-1, self.vocab, t))
        return DraftBlock(self.tokens, spread(self.probs), self.confidences, spread(self.unweighted),
                          finite=self.finite)


@runtime_checkable
class BlockProposer(Protocol):
    """A draft that drafts its own blocks instead of being sampled by [`sample_block`]; same arguments."""

    def propose_block(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor, context: DSparkContext,
                      do_sample: bool = False, process_logits: ProcessLogits | None = None,
                      generator: torch.Generator | None = None, check: bool = True) -> DraftBlock:
        ...


def drafter(draft: DSparkDraftModel) -> Callable[..., DraftBlock]:
    """The function that drafts `draft`'s blocks: its own `propose_block` if it is a [`BlockProposer`], else
    [`sample_block`] bound to it."""
    if isinstance(draft, BlockProposer):
        return draft.propose_block
    return lambda *args, **kwargs: sample_block(draft, *args, **kwargs)


@torch.no_grad()
def sample_block(draft: DSparkDraftModel, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                 context: DSparkContext, do_sample: bool = False, process_logits: ProcessLogits | None = None,
                 generator: torch.Generator | None = None, check: bool = True) -> DraftBlock:
    """Draft one block per row, left to right (eq. 4): anchor_ids, anchor_positions (N,) -> a block of (N, gamma).

    `process_logits(tokens_so_far (N, k), logits (N, V)) -> logits` applies generation's logits processors
    (temperature, top-k, ...) exactly as they will be applied to the target. Greedy (do_sample=False) takes the
    argmax of the processed logits; sampling draws with `generator`. check=False leaves the finiteness check to the
    caller (`DraftBlock.finite`, read with other values: the check reads the device).
    """
    blocks = _draw(draft, anchor_ids[:, None], anchor_positions[:, None], context, _drawn(do_sample, generator),
                   process_logits, check=check)
    return blocks.index(slice(None), 0)


@torch.no_grad()
def sample_blocks(draft: DSparkDraftModel, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
                  context: DSparkContext, do_sample: bool = False, process_logits: ProcessLogits | None = None,
                  generator: torch.Generator | None = None, *, known: torch.Tensor | None = None,
                  reweight: Reweight | None = None, target_vocab: bool = True) -> DraftBlock:
    """A blocks per row, all in one pass: anchor_ids, anchor_positions (N, A) -> blocks of (N, A, gamma).

    known (N, A, lag): tokens before each anchor that the context has no features of yet
    ([`DSparkDraftModel.backbone`]). reweight(k, probs (M, V)) -> probs: the distribution actually sampled at
    position k (0-based; Saguaro sampling); the block records it, so verification stays exact, and keeps the draft's
    own in `unweighted`. Greedy drafting proposes the draft's own argmax however it is reweighted. target_vocab=False
    keeps the distributions over the draft's own vocabulary, if it has one (`DraftBlock.vocab`; for SmolLM2's
    shipped draft a sixth of the memory), for logits processors that read only the scores: the target ids outside
    it have probability 0 either way. The rest as in [`sample_block`].
    """
    return _draw(draft, anchor_ids, anchor_positions, context, _drawn(do_sample, generator), process_logits, known,
                 reweight, target_vocab)


@torch.no_grad()
def score_block(draft: DSparkDraftModel, tokens: torch.Tensor, anchor_ids: torch.Tensor,
                anchor_positions: torch.Tensor, context: DSparkContext,
                process_logits: ProcessLogits | None = None) -> DraftBlock:
    """The draft's distributions at each position of `tokens` (N, gamma) target ids, given the tokens before it: a
    block proposed some other way (an n-gram lookup), scored as if the draft had drawn it. anchor_ids,
    anchor_positions (N,)."""
    forced = tokens[:, None]
    blocks = _draw(draft, anchor_ids[:, None], anchor_positions[:, None], context,
                   lambda k, logits, p, finite: forced[:, :, k].reshape(-1), process_logits)
    return blocks.index(slice(None), 0)


def _drawn(do_sample: bool, generator: torch.Generator | None) -> _Choose:
    """Sampling from the distribution drawn from, or the argmax of the processed logits (greedy proposes the draft's
    own best token, however it is reweighted)."""
    if not do_sample:
        return lambda k, logits, p, finite: logits.argmax(-1)
    # a non-finite row samples from a stand-in, so that multinomial cannot fail (or assert on a GPU) before the error
    # that names it is raised, once per block
    return lambda k, logits, p, finite: torch.multinomial(torch.where(finite[:, None], p, 1.0), 1,
                                                          generator=generator).squeeze(1)


def _draw(draft: DSparkDraftModel, anchors: torch.Tensor, positions: torch.Tensor, context: DSparkContext,
          choose: _Choose, process_logits: ProcessLogits | None, known: torch.Tensor | None = None,
          reweight: Reweight | None = None, target_vocab: bool = True, check: bool = True) -> DraftBlock:
    """Blocks at anchors, positions (N, A), left to right through the sequential head: (N, A, gamma) tensors."""
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
        # checked once per block, not per position (a device sync each)
        finite.append(torch.isfinite(p).all(-1))
        x = choose(k, logits, p, finite[-1])
        if vocab is not None:  # a column of the draft's vocabulary -> its target id
            x = vocab[x]
        tokens.append(x)
        probs.append(p)
        prev = x
    finite = torch.stack(finite, 1)
    shape = (N, A, gamma)
    confidences = draft.calibrated(torch.stack(conf_logits, 1).float()).view(shape) if conf_logits else None
    # the policies plan on the confidences: NaN ones would make every plan arbitrary
    usable = torch.cat([finite.all(0), torch.isfinite(confidences).all()[None] if confidences is not None else
                        finite.new_ones(1)])
    if check:
        raise_if_not_finite(usable.tolist())  # one read for both checks
    return DraftBlock(torch.stack(tokens, 1).view(shape), torch.stack(probs, 1).view(*shape, -1), confidences,
                      torch.stack(unweighted, 1).view(*shape, -1) if unweighted else None, vocab, usable)


def raise_if_not_finite(finite: list[bool]) -> None:
    """One line for a draft whose block was not finite: `finite` read from `DraftBlock.finite`."""
    if all(finite):
        return
    if not all(finite[:-1]):
        position = finite.index(False) + 1
        raise NotFiniteError(f"The draft produced non-finite probabilities (NaN or inf) at block position "
                                 f"{position}: its weights or the logits processors' output are not finite. "
                                 "Reload the draft (or check training for divergence).")
    raise NotFiniteError("The draft produced non-finite confidences (NaN): its confidence head's weights are "
                             "not finite. Reload the draft (or check training for divergence).")
