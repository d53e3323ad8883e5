"""Verification policies: how much of each drafted block a row sends to the target.

A policy is anything that implements [`VerificationPolicy`] (subclass [`Policy`] for its defaults), or a plain
callable `(confidences, gamma, num_rows) -> lengths`, adapted by [`as_policy`]. confidences is None for a draft
without a confidence head; lengths are (R,) in [0, gamma], on any device (policies that decide on the host return
CPU tensors; the decoding loop moves them).

Drafting always uses the full trained block; only verification is trimmed, which never changes the output
distribution as long as a row's length is decided before its tokens are revealed to the decision (see the
scheduler's early stop). A policy keeps state across the rounds of one call: use one instance per generate() call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class VerificationPolicy(Protocol):
    """What generate() calls around the rounds of one call; one instance per call (a policy keeps state)."""

    def prepare(self, target, draft, batch_size: int, sampling: bool) -> None:
        """Once, before the first round; sampling: the call samples (its tokens depend on what is drafted), else it
        decodes greedily (no decision changes its output)."""

    def draft_this_round(self, num_rows: int) -> bool:
        """Before each round's draft; False decodes one plain token per row. Decided from past rounds only, so it
        cannot depend on the block."""

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        """(R,) lengths in [0, gamma]: how many of its drafted tokens each row verifies."""

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, drafted: bool) -> None:
        """After each round: how many tokens each row verified and accepted (zeros when nothing was drafted)."""


class Policy:
    """Base of the verification policies: drafts every round, learns nothing from the outcome."""

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, target, draft, batch_size: int, sampling: bool = False) -> None:
        """Called once per generate() call before the first round."""

    def draft_this_round(self, num_rows: int) -> bool:
        return True

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, drafted: bool) -> None:
        """Called after every round with the rows' verified and accepted counts (zeros when nothing was drafted)."""


class FullBlock(Policy):
    """Verify every drafted token (the paper's offline setting)."""

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows,), gamma, dtype=torch.long, device="cpu")


class FixedLength(Policy):
    """Verify the first `length` drafted tokens of every row."""

    def __init__(self, length: int):
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}.")
        self.length = length

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows,), min(self.length, gamma), dtype=torch.long, device="cpu")


class _Callable(Policy):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, confidences, gamma: int, num_rows: int) -> torch.Tensor:
        return self.fn(confidences, gamma, num_rows)


def as_policy(policy) -> VerificationPolicy:
    """`policy` itself if it implements [`VerificationPolicy`]; a plain callable becomes one that drafts every
    round."""
    if isinstance(policy, VerificationPolicy):
        return policy
    if not callable(policy):
        raise TypeError(f"verification_policy must be a dspark_hf policy or a callable (confidences, gamma, num_rows) "
                        f"-> lengths, got {type(policy).__name__}.")
    hooks = [name for name in ("prepare", "draft_this_round", "observe") if name in dir(policy)]
    if hooks:  # a plain callable would silently lose them
        raise TypeError(f"{type(policy).__name__} defines {', '.join(hooks)} but not all of prepare, "
                        "draft_this_round and observe: subclass dspark_hf.Policy so that generate() calls them.")
    return _Callable(policy)
