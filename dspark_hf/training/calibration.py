"""Sequential Temperature Scaling (paper sec. 3.2.1).

c_k estimates P(position k survives | positions 1..k-1 did), so the chance that a whole prefix survives is the
cumulative product prod_{i<=k} c_i. STS calibrates that product left to right: at position k a 1-D grid search
picks the temperature T_k (c_k = sigmoid(logit_k / T_k)) minimising the expected calibration error of the
product against "positions 1..k were all accepted", with T_1..T_{k-1} already fixed. Temperature scaling preserves
order, so the ranking the confidence head learned is untouched.

Data: full-block rounds on held-out prompts, each with raw (uncalibrated) confidence logits and the number of
accepted drafts. Position k of a round counts when the round verified it.
"""

from __future__ import annotations

import torch

from ..scheduling.scheduler import survival

GRID = torch.cat([torch.linspace(0.25, 1.0, 16), torch.linspace(1.1, 6.0, 50)])


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """Equal-width-bin ECE: sum over bins of (bin share) * |mean prediction - mean label|."""
    probs, labels = probs.double().flatten(), labels.double().flatten()
    if probs.numel() == 0:
        return 0.0
    index = (probs * bins).long().clamp(max=bins - 1)
    ece = 0.0
    for b in range(bins):
        sel = index == b
        if sel.any():
            ece += float(sel.double().mean() * (probs[sel].mean() - labels[sel].mean()).abs())
    return ece


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Probability that a random positive outranks a random negative (ties count half)."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    pos, neg = scores[labels], scores[~labels]
    if pos.numel() == 0 or neg.numel() == 0:
        return None
    ranks = torch.empty_like(scores)
    order = scores.argsort()
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.double)
    for value in scores.unique():  # average ranks over ties
        tie = scores == value
        ranks[tie] = ranks[tie].mean()
    return float((ranks[labels].sum() - pos.numel() * (pos.numel() + 1) / 2) / (pos.numel() * neg.numel()))


def survival_targets(logits: torch.Tensor, verified: torch.Tensor, accepted: torch.Tensor):
    """(R, gamma) raw confidence logits, (R,) verified and accepted counts -> labels y (R, gamma) with
    y_k = [accepted >= k], and mask (R, gamma) of verified positions."""
    k = torch.arange(1, logits.shape[1] + 1)
    return (accepted[:, None] >= k).double(), verified[:, None] >= k


def cumulative(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The calibrated prefix survival (N, gamma) of confidence logits (N, gamma) at these temperatures (gamma,)."""
    return survival(torch.sigmoid(logits.double() / temperatures.double()))


def sequential_temperature_scaling(logits, verified, accepted, grid: torch.Tensor = GRID) -> list[float]:
    """Per-position temperatures, fitted left to right by grid search on the ECE of the cumulative product."""
    logits = torch.as_tensor(logits, dtype=torch.double)
    y, mask = survival_targets(logits, torch.as_tensor(verified), torch.as_tensor(accepted))
    temps = torch.ones(logits.shape[1], dtype=torch.double)
    for k in range(logits.shape[1]):
        if not mask[:, k].any():
            continue
        best = None
        for t in grid.tolist():
            temps[k] = t
            ece = expected_calibration_error(cumulative(logits, temps)[mask[:, k], k], y[mask[:, k], k])
            if best is None or ece < best[0] - 1e-12:
                best = (ece, t)
        temps[k] = best[1]
    return temps.tolist()


def calibration_report(logits, verified, accepted, temperatures) -> dict:
    """ECE and ROC-AUC of the cumulative product, pooled over verified positions and per position."""
    logits = torch.as_tensor(logits, dtype=torch.double)
    y, mask = survival_targets(logits, torch.as_tensor(verified), torch.as_tensor(accepted))
    pred = cumulative(logits, torch.as_tensor(temperatures, dtype=torch.double))
    return {
        "ece": expected_calibration_error(pred[mask], y[mask]),
        "roc_auc": roc_auc(pred[mask], y[mask]),
        "ece_per_position": [expected_calibration_error(pred[mask[:, k], k], y[mask[:, k], k])
                             for k in range(logits.shape[1])],
        "points": int(mask.sum()),
    }
