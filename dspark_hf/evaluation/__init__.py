"""Measuring drafts and decoding: oracles, metrics, benchmarks."""

from .oracle import OracleDraft

__all__ = ["OracleDraft"]
