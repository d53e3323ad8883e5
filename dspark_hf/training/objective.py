"""The objective of one batch: random anchors, the frozen target's distribution at every drafted position of their
blocks (the teacher), and the draft's losses against it (paper sec. 3.3, eq. 9-12)."""

from __future__ import annotations

import torch

from .features import in_own_dtype, pad_batch, to_device
from .losses import losses_against, sample_anchors, target_distribution_on

def target_logits(target, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its last hidden state (final-logit soft cap included)."""
    logits = target.get_output_embeddings()(hidden)
    cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def block_positions(anchors: torch.Tensor, gamma: int, length: int) -> torch.Tensor:
    """anchors (B, A) -> positions anchor + k (B, A, gamma), clamped to length - 1 (mask the overflow)."""
    return (anchors[..., None] + torch.arange(gamma, device=anchors.device)).clamp_max(length - 1)


def gather_blocks(x: torch.Tensor, anchors: torch.Tensor, gamma: int) -> torch.Tensor:
    """x (B, L, ...) -> (B, A, gamma, ...) at positions anchor + k (clamped to L - 1; mask the overflow)."""
    B, L = x.shape[:2]
    idx = block_positions(anchors, gamma, L)
    flat = idx.reshape(B, -1)
    out = x.gather(1, flat.view(B, -1, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))
    return out.view(B, *idx.shape[1:], *x.shape[2:])


@torch.no_grad()
def target_distribution_at(target, last: torch.Tensor, anchors: torch.Tensor, gamma: int, draft_vocab=None,
                           spans: list[tuple[int, int]] | None = None):
    """The target's distribution at positions anchor + k over the draft vocabulary, p_t (B, A, gamma, K), its
    mass outside that vocabulary (B, A, gamma), and its argmax in draft ids, -1 outside (B, A, gamma). last (B, L, d):
    the target's last hidden state. Overlapping blocks share positions, so the LM head and the softmax run once per
    position of each row's span, spans[b] = (first, end) (a host list: where the row's blocks can fall, e.g. its
    answer; default the whole row), and a block position outside it takes the span's nearest end (mask those). The
    positions are known on the host: no device read, no shape that depends on the device's values."""
    B, L = last.shape[:2]
    idx = block_positions(anchors, gamma, L)
    spans = [(0, L)] * B if spans is None else [(min(f, e - 1), e) for f, e in spans]  # none empty
    first, end = (torch.tensor(v, device="cpu") for v in zip(*spans))
    offset = (end - first).cumsum(0) - (end - first)  # where each row's span starts among the positions computed
    rows = torch.cat([b * L + torch.arange(f, e, device="cpu") for b, (f, e) in enumerate(spans)])
    first, end, offset, rows = (to_device(t, last.device) for t in (first, end, offset, rows))
    with in_own_dtype(target):
        p_t, outside, top = target_distribution_on(draft_vocab, target_logits(target, last.flatten(0, 1)[rows].to(
            target.dtype)))
    first, end, offset = (t.view(-1, 1, 1) for t in (first, end, offset))
    where = offset + idx.clamp(first, end - 1) - first  # each block position among the positions computed
    return p_t[where], outside[where], top[where]


def lagged_tokens(ids: torch.Tensor, anchors: torch.Tensor, max_lag: int, generator, exact: bool = False,
                  lag_weights: list[float] | None = None) -> torch.Tensor:
    """For SSD's lagged contexts: each anchor's last L tokens before it (L in 0..max_lag, drawn on the CPU
    `generator`, uniformly or in proportion to `lag_weights` (max_lag + 1 of them); L = max_lag for every anchor if
    `exact`), right-aligned in (B, A, max_lag), -1 elsewhere. The draft sees them as tokens, without features."""
    if exact:
        lags = torch.full(anchors.shape, max_lag, device=anchors.device)
    elif lag_weights is not None:
        lags = torch.multinomial(torch.tensor(lag_weights, dtype=torch.float64), anchors.numel(), replacement=True,
                                 generator=generator).view(anchors.shape)
    else:
        lags = torch.randint(0, max_lag + 1, anchors.shape, generator=generator, device="cpu")
    lags = to_device(lags, anchors.device)  # drawn on the host (the generator's), copied without waiting
    j = torch.arange(max_lag, device=anchors.device)
    source = anchors[..., None] - max_lag + j  # positions anchor - max_lag .. anchor - 1
    taken = (j >= max_lag - lags[..., None]) & (source >= 0)
    B = ids.shape[0]
    tokens = ids.gather(1, source.clamp_min(0).view(B, -1)).view(source.shape)
    return tokens.masked_fill(~taken, -1)


def train_step(draft, target, examples, features, anchors_per_sequence, weights, generator, forward=None,
               feature_lag: int = 0, exact_lag: bool = False, lag_weights: list[float] | None = None):
    """Losses of one batch (no backward). `forward` is the (possibly data-parallel wrapped) draft to call.
    feature_lag > 0: each block sees its last 0..feature_lag context tokens (exactly feature_lag if `exact_lag`, in
    proportion to `lag_weights` if given) as tokens only ([`lagged_tokens`])."""
    forward = draft if forward is None else forward
    gamma = draft.config.block_size
    feats, last = features(examples)
    device = draft.device
    feats, last = feats.to(device, non_blocking=True), last.to(device, non_blocking=True)
    ids, context_valid, lengths = pad_batch([e.input_ids for e in examples])  # on the CPU, moved once below
    answer_start, length = [e.answer_start for e in examples], [len(e.input_ids) for e in examples]
    anchors, valid = sample_anchors(answer_start, length, anchors_per_sequence, generator)
    ids, anchors, valid, context_valid, lengths = (to_device(t, device) for t in (
        ids, anchors, valid, context_valid.bool(), lengths))
    positions = torch.arange(ids.shape[1], device=device).expand(len(examples), -1)

    labels = gather_blocks(ids, anchors + 1, gamma)  # position k predicts anchor + k + 1
    block_valid = valid[..., None] & ((anchors[..., None] + 1 + torch.arange(gamma, device=device))
                                      < lengths[:, None, None])
    known = (lagged_tokens(ids, anchors, feature_lag, generator, exact_lag, lag_weights) if feature_lag > 0
             else None)
    out = forward(ids.gather(1, anchors), anchors, block_tokens=labels, context_features=feats,
                  context_positions=positions, context_valid=context_valid, known=known)
    vocab = draft.draft_vocab if draft.config.draft_vocab_size is not None else None
    p_t, outside, top = target_distribution_at(target, last, anchors, gamma, vocab, list(zip(answer_start, length)))
    to_draft = draft.target_to_draft if vocab is not None else None
    return losses_against(out.logits.flatten(0, 1), p_t.flatten(0, 1), outside.flatten(0, 1), labels.flatten(0, 1),
                          block_valid.flatten(0, 1),
                          out.confidence_logits.flatten(0, 1) if out.confidence_logits is not None else None,
                          to_draft, weights, target_top=top.flatten(0, 1)), block_valid.flatten(0, 1)
