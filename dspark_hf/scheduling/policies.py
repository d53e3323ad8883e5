"""Verification policies: how much of each drafted block a row sends to the target.

A policy is anything that implements [`VerificationPolicy`] (subclass [`Policy`] for its defaults), or a plain
callable `(confidences, gamma, num_rows) -> lengths`, adapted by [`as_policy`]. confidences is None for a draft
without a confidence head; lengths are (R,) in [0, gamma], a tensor or a list.

Policies decide on the host, from values the decoding loop has already read from the device with the rest of its
round (one transfer a round: `generation/host.py`): they get CPU tensors. A [`Policy`] may also take them as plain
Python numbers (`plan` and `learn`), which the loop calls: the built-in ones do all their work there, so that
deciding reads nothing more, not even from a CPU tensor. [`plan_lengths`] and [`learn_outcome`] are how the loop
asks any policy.

Drafting always uses the full trained block; only verification is trimmed, which never changes the output
distribution as long as a row's length is decided before its tokens are revealed to the decision (see the
scheduler's early stop). A policy keeps state across the rounds of one call and starts afresh in `prepare` (this
library's do), so one instance may serve consecutive generate() calls, never two at once.
"""

from __future__ import annotations

import numbers
from typing import Protocol, runtime_checkable

import torch

from ..errors import UnsupportedError, WrongTypeError


@runtime_checkable
class VerificationPolicy(Protocol):
    """What generate() calls around the rounds of one call (a policy keeps state across them; prepare starts a
    call afresh)."""

    def prepare(self, target, draft, batch_size: int, sampling: bool) -> None:
        """Once, before the first round; sampling: the call samples (its tokens depend on what is drafted), else it
        decodes greedily (no decision changes its output)."""

    def draft_this_round(self, num_rows: int) -> bool:
        """Before each round's draft; False decodes one plain token per row. Decided from past rounds only, so it
        cannot depend on the block. The loop drafts a round's block while the round before it is still on the
        device: this is asked before that round's outcome is observed (a `Policy` may drop the block once it is:
        `keep_drafted`)."""

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        """(R,) lengths in [0, gamma]: how many of its drafted tokens each row verifies."""

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, drafted: bool) -> None:
        """After each round: how many tokens each row verified and accepted (zeros when nothing was drafted)."""


class Policy:
    """Base of the verification policies: drafts every round, learns nothing from the outcome. Define `__call__`
    (and `observe` to learn); define `plan` and `learn` too where the policy can work on plain Python numbers."""

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        raise UnsupportedError(f"{type(self).__name__} must define __call__(confidences, gamma, num_rows) -> (R,) "
                                  "lengths.")

    def plan(self, confidences: list[list[float]] | None, gamma: int, num_rows: int) -> list[int]:
        """`__call__` on the confidences as Python numbers, its answer as a list (what the decoding loop calls)."""
        c = None if confidences is None else _host(confidences, torch.float32).view(num_rows, gamma)
        return checked_lengths(self(c, gamma, num_rows), gamma, num_rows, self)

    def learn(self, verified: list[int], accepted: list[int], drafted: bool) -> None:
        """`observe` on the counts as Python numbers (what the decoding loop calls)."""
        self.observe(_host(verified, torch.long), _host(accepted, torch.long), drafted)

    def prepare(self, target, draft, batch_size: int, sampling: bool = False) -> None:
        """Called once per generate() call before the first round."""

    def price(self, clock) -> None:
        """Called once per generate() call after `prepare`, before the first plan, with the call's own rounds ready
        to be timed on the path it runs (a `costs.RoundClock`): a policy that plans against what rounds cost
        measures them here (`costs.path_costs` keeps them for later calls)."""

    def draft_this_round(self, num_rows: int) -> bool:
        return True

    def keep_drafted(self, num_rows: int) -> bool:
        """Once the round before it is observed: whether the block drafted while that round was on the device is
        still verified; False makes its round a plain step (a pause the last outcome started goes on at once, not
        one round late). Decided from past rounds only, like `draft_this_round`."""
        return True

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, drafted: bool) -> None:
        """Called after every round with the rows' verified and accepted counts (zeros when nothing was drafted)."""


class FullBlock(Policy):
    """Verify every drafted token (the paper's offline setting)."""

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows,), gamma, dtype=torch.long, device="cpu")

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        return [gamma] * num_rows


class FixedLength(Policy):
    """Verify the first `length` drafted tokens of every row."""

    def __init__(self, length: int):
        self.length = whole("FixedLength", "length", length, 0)

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows,), min(self.length, gamma), dtype=torch.long, device="cpu")

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        return [min(self.length, gamma)] * num_rows


class _Callable(Policy):
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, confidences, gamma: int, num_rows: int) -> torch.Tensor:
        return self.fn(confidences, gamma, num_rows)


def as_policy(policy) -> VerificationPolicy:
    """`policy` itself if it implements [`VerificationPolicy`]; a plain callable becomes one that drafts every
    round."""
    if isinstance(policy, type):  # a class passes the protocol check, but its hooks would miss `self`
        raise WrongTypeError(f"verification_policy={policy.__name__} is a class: pass an instance, e.g. "
                             f"{policy.__name__}().")
    if isinstance(policy, VerificationPolicy):
        return policy
    if not callable(policy):
        raise WrongTypeError(f"verification_policy must be a dspark_hf policy or a callable (confidences, gamma, "
                             f"num_rows) -> lengths, got {type(policy).__name__}.")
    hooks = [name for name in ("prepare", "draft_this_round", "observe") if name in dir(policy)]
    if hooks:  # a plain callable would silently lose them
        raise WrongTypeError(f"{type(policy).__name__} defines {', '.join(hooks)} but not all of prepare, "
                             "draft_this_round and observe: subclass dspark_hf.Policy so that generate() calls them.")
    return _Callable(policy)


def plan_lengths(policy: VerificationPolicy, confidences: list[list[float]] | None, gamma: int,
                 num_rows: int) -> list[int]:
    """How many tokens each of `num_rows` rows verifies, by `policy`, from its block's confidences as read to the
    host (None without a confidence head): a list of whole numbers in [0, gamma], or one line saying what is wrong."""
    if isinstance(policy, Policy):
        return checked_lengths(policy.plan(confidences, gamma, num_rows), gamma, num_rows, policy)
    c = None if confidences is None else _host(confidences, torch.float32).view(num_rows, gamma)
    return checked_lengths(policy(c, gamma, num_rows), gamma, num_rows, policy)


def price_rounds(policy: VerificationPolicy, clock) -> None:
    """Hand `policy` the call's own rounds to time (a [`Policy`] may price them; other policies do not ask)."""
    if isinstance(policy, Policy):
        policy.price(clock)


def keeps_drafted(policy: VerificationPolicy, num_rows: int) -> bool:
    """Whether `policy` still verifies a block drafted before the last round was observed (a [`Policy`] may say no)."""
    return policy.keep_drafted(num_rows) if isinstance(policy, Policy) else True


def learn_outcome(policy: VerificationPolicy, verified: list[int], accepted: list[int], drafted: bool) -> None:
    """Tell `policy` how many tokens each row verified and accepted in a round."""
    if isinstance(policy, Policy):
        policy.learn(verified, accepted, drafted)
    else:
        policy.observe(_host(verified, torch.long), _host(accepted, torch.long), drafted)


def checked_lengths(lengths, gamma: int, num_rows: int, policy) -> list[int]:
    """A policy's answer (a tensor, or a list as `prefix_schedule` returns it) as a list of `num_rows` whole numbers
    in [0, gamma], or one line saying what is wrong with it."""
    name = policy_name(policy)
    numbers_only = isinstance(lengths, (list, tuple)) and all(
        isinstance(x, numbers.Real) and not isinstance(x, bool) for x in lengths)
    if numbers_only:  # the built-in policies' answer: checked without a tensor
        shape, values = (len(lengths),), list(lengths)
    else:
        try:
            tensor = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths, device="cpu")
        except (TypeError, ValueError, RuntimeError):
            raise WrongTypeError(f"verification policy {name} returned {type(lengths).__name__}; it must return a "
                                 f"({num_rows},) tensor or list of whole numbers of tokens to verify.") from None
        if tensor.dtype == torch.bool or tensor.is_complex():
            raise ValueError(f"verification policy {name} returned {tensor.tolist()}: lengths are whole numbers of "
                             "tokens.")
        shape, values = tuple(tensor.shape), tensor.tolist()
    if shape != (num_rows,):
        raise ValueError(f"verification policy {name} returned lengths of shape {shape}; it must return one per "
                         f"row still decoding, shape ({num_rows},).")
    if not all(float(x).is_integer() for x in values):
        raise ValueError(f"verification policy {name} returned {values}: lengths are whole numbers of tokens.")
    if not all(0 <= x <= gamma for x in values):
        raise ValueError(f"verification policy {name} returned {values}: each row verifies between 0 and the "
                         f"block's {gamma} drafted tokens.")
    return [int(x) for x in values]


def _host(values, dtype: torch.dtype) -> torch.Tensor:
    """Host values as the CPU tensor a policy's tensor methods take."""
    return torch.tensor(values, dtype=dtype, device="cpu")


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
