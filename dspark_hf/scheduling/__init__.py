"""Verification policies: how many drafted tokens each row sends to the target in a round."""

from .policies import FixedLength, FullBlock

__all__ = ["FullBlock", "FixedLength"]
