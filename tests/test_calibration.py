"""Sequential Temperature Scaling fixes an overconfident head without changing its ranking."""

import pytest
import torch

from dspark_hf.training.calibration import calibration_report, expected_calibration_error, roc_auc, \
    sequential_temperature_scaling


def overconfident_rounds(n=4000, gamma=4, seed=0):
    """True conditional survival s_k = sigmoid(z_k); the head reports logits 3 z_k (overconfident)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, gamma, generator=g, dtype=torch.double) * 1.2 + 0.8
    survive = torch.rand(n, gamma, generator=g, dtype=torch.double) < torch.sigmoid(z)
    accepted = survive.long().cumprod(1).sum(1)
    return 3 * z, torch.full((n,), gamma), accepted


def test_ece_and_auc_definitions():
    probs = torch.tensor([0.2, 0.2, 0.8, 0.8], dtype=torch.double)
    assert expected_calibration_error(probs, torch.tensor([0, 0, 1, 1])) == pytest.approx(0.2)
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == 0.75


def test_sts_recovers_the_temperature_and_cuts_ece():
    logits, verified, accepted = overconfident_rounds()
    temps = sequential_temperature_scaling(logits, verified, accepted)
    before = calibration_report(logits, verified, accepted, [1.0] * 4)
    after = calibration_report(logits, verified, accepted, temps)
    assert before["ece"] > 0.05 and after["ece"] < 0.02
    assert temps[0] == pytest.approx(3.0, abs=0.5)
    assert calibration_report(*overconfident_rounds(seed=1), temps)["ece"] < 0.03  # holds on fresh data


def test_sts_keeps_the_ranking_at_each_position():
    logits, verified, accepted = overconfident_rounds()
    temps = sequential_temperature_scaling(logits, verified, accepted)
    raw = torch.sigmoid(logits[:, 0])
    calibrated = torch.sigmoid(logits[:, 0] / temps[0])
    assert torch.equal(raw.argsort(), calibrated.argsort())
