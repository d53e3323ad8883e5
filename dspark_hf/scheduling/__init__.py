"""Verification policies: how many drafted tokens each row sends to the target in a round."""

from .policies import FixedLength, FullBlock
from .scheduler import AsyncScheduled, Scheduled, ThresholdPolicy, prefix_schedule, topk_schedule

__all__ = ["FullBlock", "FixedLength", "ThresholdPolicy", "Scheduled", "AsyncScheduled", "prefix_schedule",
           "topk_schedule"]
