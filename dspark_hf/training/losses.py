"""The DSpark training objective (paper sec. 3.3, eq. 9-12, with the reference code's conventions).

Shapes: N blocks of gamma positions. Position k (0-based) of a block predicts the token at anchor + k + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossWeights:
    """alpha_ce, alpha_tv, alpha_conf of eq. 12, the position decay gamma_w of w_k = exp(-k / gamma_w), and the
    weight of a forward KL(p_t || p_d) term (0: off, as in the paper)."""

    ce: float = 0.1
    l1: float = 0.9
    confidence: float = 1.0
    decay: float = 4.0
    kl: float = 0.0


def position_weights(gamma: int, decay: float, device=None) -> torch.Tensor:
    """w_k = exp(-k / decay) for k = 0..gamma-1 (the reference code's exp(-k/4); the paper writes exp(-(k-1)/gamma)
    with 1-based k)."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float) / decay)


def sample_anchors(answer_start, lengths, num: int, generator=None):
    """Up to `num` distinct anchors per row, uniformly among positions a where a and a + 1 are answer tokens
    (answer_start <= a <= length - 2; both (B,), host lists or CPU tensors). Returns anchors (B, num) and valid
    (B, num) on the CPU (`generator` is a CPU generator); invalid slots hold 0."""
    B = len(lengths)
    anchors = torch.zeros(B, num, dtype=torch.long, device="cpu")
    valid = torch.zeros(B, num, dtype=torch.bool, device="cpu")
    for b in range(B):
        lo, hi = int(answer_start[b]), int(lengths[b]) - 2
        count = hi - lo + 1
        if count <= 0:
            continue
        take = min(num, count)
        picks = torch.randperm(count, generator=generator, device="cpu")[:take] + lo
        anchors[b, :take] = picks.sort().values
        valid[b, :take] = True
    return anchors, valid


def target_distribution_on(draft_vocab: torch.Tensor | None, target_logits: torch.Tensor):
    """Target probabilities restricted to the draft vocabulary (.., K), the mass outside it (..,), and the target's
    argmax as an index into those K probabilities, or -1 where it lies outside the draft vocabulary (..,)."""
    if draft_vocab is None:
        probs = torch.softmax(target_logits.float(), -1)
        return probs, torch.zeros(probs.shape[:-1], device=probs.device), target_logits.argmax(-1)
    logp = target_logits.float() - torch.logsumexp(target_logits.float(), -1, keepdim=True)
    probs = logp[..., draft_vocab].exp()
    best_inside, top = target_logits[..., draft_vocab].max(-1)
    top = torch.where(best_inside >= target_logits.max(-1).values, top, -1)
    return probs, (1 - probs.sum(-1)).clamp_min(0), top


def dspark_losses(draft_logits, target_logits, labels, valid, confidence_logits=None, draft_vocab=None,
                  target_to_draft=None, weights: LossWeights | None = None) -> dict:
    """CE + L1 + confidence BCE, each position-weighted and normalised by the summed weights of valid positions.

    draft_logits (N, gamma, K): U + B over the draft vocabulary (K = V without a draft vocabulary);
    target_logits (N, gamma, V): the frozen target's logits at the same positions (its LM head on its last hidden
    state); labels (N, gamma) ground-truth target ids; valid (N, gamma) bool; confidence_logits (N, gamma) or None.
    The L1 term is the full |p_d - p_t|_1 (target mass the draft cannot propose counts fully); the confidence label
    is c* = 1 - L1 / 2, detached; with ``weights.kl`` a forward KL(p_t || p_d) over the draft vocabulary is added.
    Returns the weighted total and every term, plus for monitoring c* ("acceptance")
    and whether the draft's argmax is the target's ("agreement"), both (N, gamma).
    """
    p_t, outside, top = target_distribution_on(draft_vocab, target_logits)
    return losses_against(draft_logits, p_t, outside, labels, valid, confidence_logits, target_to_draft, weights,
                          target_top=top)


def losses_against(draft_logits, p_t, outside, labels, valid, confidence_logits=None, target_to_draft=None,
                   weights: LossWeights | None = None, target_top=None) -> dict:
    """[`dspark_losses`] given the target distribution already restricted to the draft vocabulary, p_t (N, gamma,
    K), the target mass outside it (N, gamma) and, optionally, the target's argmax in draft ids (N, gamma) (see
    [`target_distribution_on`]); the trainer computes them once per sequence position, since overlapping blocks
    share positions. "agreement" is only reported when target_top is given."""
    weights = weights or LossWeights()
    gamma = draft_logits.shape[1]
    w = position_weights(gamma, weights.decay, draft_logits.device) * valid.float()
    norm = w.sum().clamp_min(1e-8)

    logp_d = torch.log_softmax(draft_logits.float(), -1)
    l1 = (logp_d.exp() - p_t).abs().sum(-1) + outside
    accept = (1 - 0.5 * l1).detach().clamp(0, 1)

    draft_labels = labels.clamp_min(0) if target_to_draft is None else target_to_draft[labels.clamp_min(0)]
    in_vocab = valid & (draft_labels < draft_logits.shape[-1])
    nll = -logp_d.gather(-1, draft_labels.clamp_max(draft_logits.shape[-1] - 1)[..., None]).squeeze(-1)
    w_ce = w * in_vocab.float()

    out = {
        "ce": (w_ce * nll).sum() / w_ce.sum().clamp_min(1e-8),
        "l1": (w * l1).sum() / norm,
        "acceptance": accept,
    }
    if weights.kl:  # sum_v p_t(v) (log p_t(v) - log p_d(v)) over the draft vocabulary
        kl = (torch.xlogy(p_t, p_t) - p_t * logp_d).sum(-1)
        out["kl"] = (w * kl).sum() / norm
    if target_top is not None:  # teacher-forced greedy acceptance, as 1 - TV is the sampled one
        out["agreement"] = (draft_logits.argmax(-1) == target_top).float()
    total = weights.ce * out["ce"] + weights.l1 * out["l1"] + (weights.kl * out["kl"] if weights.kl else 0)
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
        out["confidence"] = (w * bce).sum() / norm
        total = total + weights.confidence * out["confidence"]
    out["total"] = total
    return out
