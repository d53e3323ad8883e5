"""The held-out report a run writes (heldout.json): teacher-forced acceptance and greedy agreement by position."""

from __future__ import annotations

import math

import torch

from .objective import train_step

@torch.no_grad()
def evaluate_heldout(draft, target, heldout, features, anchors_per_sequence, weights, batch_size=4,
                     lag: int = 0) -> dict:
    """Teacher-forced acceptance per position on held-out sequences (the target's own tokens), and the expected
    acceptance length each implies: 1 - TV for sampling, and whether the draft's argmax is the target's for greedy
    decoding. Where the examples name their domain, the same figures per domain under "domains", and the macro
    expected greedy tau over them. lag: every block sees its last `lag` context tokens without their features (as
    SSD's pre-speculated blocks do)."""
    if not heldout:
        return {}
    generator = torch.Generator().manual_seed(1234)
    by_domain: dict[str | None, list] = {}
    for ex in heldout:
        by_domain.setdefault(ex.domain, []).append(ex)
    sums = {}
    for domain, examples in sorted(by_domain.items(), key=lambda kv: str(kv[0])):
        acc = sums.setdefault(domain, {"acceptance": 0, "agreement": 0, "count": 0})
        for i in range(0, len(examples), batch_size):
            losses, valid = train_step(draft, target, examples[i: i + batch_size], features, anchors_per_sequence,
                                       weights, generator, feature_lag=lag, exact_lag=True)
            for k in ("acceptance", "agreement"):
                acc[k] = acc[k] + (losses[k] * valid).sum(0)
            acc["count"] = acc["count"] + valid.sum(0)

    def figures(acc, sequences) -> dict:
        acceptance, agreement = ((acc[k] / acc["count"].clamp_min(1)).tolist() for k in ("acceptance", "agreement"))
        return {"sequences": sequences, "acceptance_per_position": acceptance,
                "expected_tau_from_acceptance": _expected_tau(acceptance),
                "greedy_agreement_per_position": agreement, "expected_greedy_tau": _expected_tau(agreement)}

    total = {k: sum(acc[k] for acc in sums.values()) for k in ("acceptance", "agreement", "count")}
    report = figures(total, len(heldout))
    if any(domain is not None for domain in sums):
        report["domains"] = {str(d): figures(acc, len(by_domain[d])) for d, acc in sums.items()}
        report["macro_expected_greedy_tau"] = sum(r["expected_greedy_tau"] for r in report["domains"].values()) / len(
            report["domains"])
    return report


def _expected_tau(acceptance: list[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: the expected acceptance length (bonus token included) for per-position rates."""
    return 1 + sum(math.prod(acceptance[: k + 1]) for k in range(len(acceptance)))
