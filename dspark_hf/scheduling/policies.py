"""Verification policies: how much of each drafted block a row sends to the target.

A policy is anything that implements [`VerificationPolicy`] (subclass [`Policy`] for its defaults), or a plain
callable `(confidences, gamma, num_rows) -> lengths`, adapted by [`as_policy`]. confidences is None for a draft
without a confidence head; lengths are (R,) in [0, gamma], on any device (policies that decide on the host return
CPU tensors; the decoding loop moves them).

Drafting always uses the full trained block; only verification is trimmed, which never changes the output
distribution as long as a row's length is decided before its tokens are revealed to the decision (see the
scheduler's early stop). A policy keeps state across the rounds of one call and starts afresh in `prepare` (this
library's do), so one instance may serve consecutive generate() calls, never two at once.
"""

from __future__ import annotations

import numbers
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class VerificationPolicy(Protocol):
    """What generate() calls around the rounds of one call (a policy keeps state across them; prepare starts a
    call afresh)."""

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
        raise NotImplementedError(f"{type(self).__name__} must define __call__(confidences, gamma, num_rows) -> (R,) "
                                  "lengths.")

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
        self.length = whole("FixedLength", "length", length, 0)

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
    if isinstance(policy, type):  # a class passes the protocol check, but its hooks would miss `self`
        raise TypeError(f"verification_policy={policy.__name__} is a class: pass an instance, e.g. "
                        f"{policy.__name__}().")
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


def checked_lengths(lengths, gamma: int, num_rows: int, policy) -> torch.Tensor:
    """A policy's answer as (num_rows,) long lengths in [0, gamma] on its device, or one line saying what is wrong
    with it (a list, as `prefix_schedule` returns, is taken as it is)."""
    name = policy_name(policy)
    try:
        lengths = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths, device="cpu")
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"verification policy {name} returned {type(lengths).__name__}; it must return a ({num_rows},) "
                        "tensor or list of whole numbers of tokens to verify.") from None
    if tuple(lengths.shape) != (num_rows,):
        raise ValueError(f"verification policy {name} returned lengths of shape {tuple(lengths.shape)}; it must "
                         f"return one per row still decoding, shape ({num_rows},).")
    whole_numbers = not lengths.is_floating_point() or bool((lengths == lengths.round()).all())
    if lengths.dtype == torch.bool or lengths.is_complex() or not whole_numbers:
        raise ValueError(f"verification policy {name} returned {lengths.tolist()}: lengths are whole numbers of "
                         "tokens.")
    if num_rows and not (0 <= float(lengths.min()) and float(lengths.max()) <= gamma):
        raise ValueError(f"verification policy {name} returned {lengths.tolist()}: each row verifies between 0 and "
                         f"the block's {gamma} drafted tokens.")
    return lengths.long()


def policy_name(policy) -> str:
    """What error messages call a policy: its class, or the function a plain callable policy wraps."""
    fn = policy.fn if isinstance(policy, _Callable) else policy
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def whole(owner: str, name: str, value, low: int) -> int:
    """`value` if it is an int >= low, else one line saying what `owner`'s argument must be."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{owner}: {name} must be a whole number >= {low}, got {value!r}.")
    return int(value)


def real(owner: str, name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """`value` if it is a number in [low, high] ((low, high] with low_open), NaN refused, else one line saying so."""
    inside = isinstance(value, numbers.Real) and not isinstance(value, bool) and (
        (low < value if low_open else low <= value) and value <= high)
    if not inside:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{owner}: {name} must be a number in {span}, got {value!r}.")
    return float(value)
