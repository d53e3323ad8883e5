"""Verification policies. A policy maps the round's confidences to per-row verification lengths:

    policy(confidences: Tensor (R, gamma) | None, gamma: int, num_rows: int) -> LongTensor (R,) in [0, gamma]

on any device (policies that decide on the host return CPU tensors; the decoding loop moves them).

confidences is None for a draft without a confidence head. A policy may also define

    draft_this_round(num_rows: int) -> bool

asked before each round's draft: False skips drafting and decodes one plain token per row (the policy must decide
from past rounds only, so the choice cannot depend on the block it skips).

Drafting always uses the full trained block; only verification is trimmed, which never changes the output
distribution as long as a row's length is decided before its tokens are revealed to the decision (see the
scheduler's early stop).
"""

from __future__ import annotations

import torch


class FullBlock:
    """Verify every drafted token (the paper's offline setting)."""

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows,), gamma, dtype=torch.long, device="cpu")


class FixedLength:
    """Verify the first `length` drafted tokens of every row."""

    def __init__(self, length: int):
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}.")
        self.length = length

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows,), min(self.length, gamma), dtype=torch.long, device="cpu")
