"""Verification policies: how many drafted tokens each row sends to the target in a round."""

from .auto import AutoScheduled
from .policies import FixedLength, FullBlock, Pause, Policy, TensorPolicy, VerificationPolicy, as_policy
from .scheduler import AsyncScheduled, Scheduled, ThresholdPolicy, prefix_schedule, topk_schedule

__all__ = ["AutoScheduled", "Policy", "VerificationPolicy", "TensorPolicy", "Pause", "as_policy", "FullBlock", "FixedLength", "ThresholdPolicy", "Scheduled",
           "AsyncScheduled", "prefix_schedule", "topk_schedule"]
