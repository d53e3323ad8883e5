"""Verification policies: how much of each drafted block a row sends to the target.

A policy is anything that implements [`VerificationPolicy`] (subclass [`Policy`] for its defaults). The loop asks
it on the host, with plain Python numbers it has already read from the device with the rest of its round (one
transfer a round: `generation/host.py`): `plan` a round's lengths from the block's confidences, `learn` from what
the round verified and accepted. A plain callable `(confidences, gamma, num_rows) -> lengths` on CPU tensors, and
a policy written to the tensor interface of earlier releases (`__call__` and `observe` on CPU tensors), work
through [`TensorPolicy`], which [`as_policy`] wraps them in.

Drafting always uses the full trained block; only verification is trimmed, which never changes the output
distribution as long as a row's length is decided before its tokens are revealed to the decision (see the
scheduler's early stop). A policy keeps state across the rounds of one call and starts afresh in `prepare` (this
library's do), so one instance may serve consecutive generate() calls, never two at once.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..errors import UnsupportedError, WrongTypeError


@runtime_checkable
class VerificationPolicy(Protocol):
    """What generate() asks a policy around the rounds of one call, in this order (a policy keeps state across
    them; prepare starts a call afresh). Every argument is a Python number, or lists of them."""

    def prepare(self, target, draft, batch_size: int, sampling: bool) -> None:
        """Once, before the first round; sampling: the call samples (its tokens depend on what is drafted), else it
        decodes greedily (no decision changes its output)."""

    def price(self, clock) -> None:
        """Once, after `prepare`, with the call's own rounds ready to be timed on the path it runs (a
        `costs.RoundClock`): a policy that plans against what rounds cost measures them here (`costs.path_costs`
        keeps them for later calls); others ignore it."""

    def draft_this_round(self, num_rows: int) -> bool:
        """Before each round's draft; False decodes one plain token per row. Decided from past rounds only, so it
        cannot depend on the block. The loop drafts a round's block while the round before it is still on the
        device: this is asked before that round is learnt from (`keep_drafted` may drop the block once it is)."""

    def keep_drafted(self, num_rows: int) -> bool:
        """Once the round before it is learnt from: whether the block drafted while that round was on the device is
        still verified; False makes its round a plain step (a pause the last round started goes on at once, not
        one round late). Decided from past rounds only, like `draft_this_round`."""

    def plan(self, confidences: list[list[float]] | None, gamma: int, num_rows: int) -> list[int]:
        """How many of its drafted tokens each of `num_rows` rows verifies: whole numbers in [0, gamma], from each
        row's block confidences (`num_rows` lists of gamma; None for a draft without a confidence head)."""

    def learn(self, verified: list[int], accepted: list[int], drafted: bool) -> None:
        """After each round: how many tokens each row verified and accepted (zeros when nothing was drafted)."""


class Policy:
    """Base of the verification policies: drafts every round, learns nothing, ignores the costs. Define `plan` (and
    `learn` to learn, `prepare` to start each call afresh); see [`VerificationPolicy`]."""

    def prepare(self, target, draft, batch_size: int, sampling: bool = False) -> None:
        """Called once per generate() call before the first round."""

    def price(self, clock) -> None:
        """Called once per generate() call after `prepare` (see [`VerificationPolicy.price`])."""

    def draft_this_round(self, num_rows: int) -> bool:
        return True

    def keep_drafted(self, num_rows: int) -> bool:
        return True

    def plan(self, confidences: list[list[float]] | None, gamma: int, num_rows: int) -> list[int]:
        raise UnsupportedError(f"{type(self).__name__} must define plan(confidences, gamma, num_rows) -> lengths, "
                               "one whole number per row.")

    def learn(self, verified: list[int], accepted: list[int], drafted: bool) -> None:
        """Called after every round (see [`VerificationPolicy.learn`])."""


@runtime_checkable
class EarlierPolicy(Protocol):
    """The tensor interface of earlier releases, which [`TensorPolicy`] adapts: `__call__` returns the lengths from
    a (num_rows, gamma) float32 CPU tensor of confidences (or None), `observe` learns from (num_rows,) long CPU
    tensors."""

    def prepare(self, target, draft, batch_size: int, sampling: bool) -> None: ...

    def draft_this_round(self, num_rows: int) -> bool: ...

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int): ...

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, drafted: bool) -> None: ...


class TensorPolicy(Policy):
    """A policy on CPU tensors, as in earlier releases: subclass it and define `__call__(confidences, gamma,
    num_rows)` ((num_rows, gamma) float32 confidences or None -> (num_rows,) lengths, a tensor or a list) and
    `observe(verified, accepted, drafted)` ((num_rows,) long tensors); `plan` and `learn` build the tensors from
    the loop's numbers. [`as_policy`] wraps a plain callable of that signature, an [`EarlierPolicy`], or a `Policy`
    subclass of earlier releases (one that defines `__call__` and not `plan`) in one, whose hooks (`prepare`,
    `draft_this_round`, and a Policy's `price` and `keep_drafted`) are then the wrapped object's."""

    def __init__(self, wrapped=None):
        self.wrapped = wrapped  # None for a subclass, which defines the methods itself
        self._hooks = wrapped if isinstance(wrapped, (Policy, EarlierPolicy)) else Policy()  # a callable has none

    def __call__(self, confidences: torch.Tensor | None, gamma: int, num_rows: int):
        if self.wrapped is None:
            raise UnsupportedError(f"{type(self).__name__} must define __call__(confidences, gamma, num_rows) -> "
                                   "(R,) lengths.")
        return self.wrapped(confidences, gamma, num_rows)

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, drafted: bool) -> None:
        observe = getattr(self.wrapped, "observe", None)  # earlier releases' Policy made it optional
        if observe is not None:
            observe(verified, accepted, drafted)

    def plan(self, confidences, gamma: int, num_rows: int):
        c = None if confidences is None else torch.tensor(confidences, dtype=torch.float32, device="cpu")
        return self(None if c is None else c.view(num_rows, gamma), gamma, num_rows)

    def learn(self, verified: list[int], accepted: list[int], drafted: bool) -> None:
        self.observe(torch.tensor(verified, dtype=torch.long, device="cpu"),
                     torch.tensor(accepted, dtype=torch.long, device="cpu"), drafted)

    def prepare(self, target, draft, batch_size: int, sampling: bool = False) -> None:
        self._hooks.prepare(target, draft, batch_size, sampling)

    def price(self, clock) -> None:
        if isinstance(self._hooks, Policy):
            self._hooks.price(clock)

    def draft_this_round(self, num_rows: int) -> bool:
        return self._hooks.draft_this_round(num_rows)

    def keep_drafted(self, num_rows: int) -> bool:
        return self._hooks.keep_drafted(num_rows) if isinstance(self._hooks, Policy) else True


@dataclass
class Pause:
    """Drafting switched off for a while where it does not pay, then tried again (a probe): each pause that a
    probe does not end is twice the last, up to `max_pause` rounds; a round that pays starts them at `probe_every`
    again. It reads past rounds only, so it is lossless."""

    probe_every: int
    max_pause: int
    skip: int = 0  # rounds left in the current pause
    next: int = 0  # rounds the next pause lasts (probe_every at first)

    def __post_init__(self):
        self.next = self.next or self.probe_every

    def draft_this_round(self) -> bool:
        """False, and one round less to wait, while a pause lasts."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def pays(self) -> None:
        """Drafting paid: should it stop paying, the next pause is a short one."""
        self.next = self.probe_every

    def start(self, at_least: int = 0) -> None:
        """Drafting does not pay: pause for the next pause's rounds (`at_least`, which outranks max_pause), and
        make the one after it twice as long."""
        self.skip = max(min(self.next, self.max_pause), at_least)
        self.next = min(2 * self.skip, self.max_pause)


class FullBlock(Policy):
    """Verify every drafted token (the paper's offline setting)."""

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        return [gamma] * num_rows


class FixedLength(Policy):
    """Verify the first `length` drafted tokens of every row; `FixedLength(0)` never drafts (every round is plain
    generate()'s step: the one-token round a paused policy runs, without the policy)."""

    def __init__(self, length: int):
        self.length = whole("FixedLength", "length", length, 0)

    def draft_this_round(self, num_rows: int) -> bool:
        return self.length > 0  # a block none of which is verified is not worth drafting

    def keep_drafted(self, num_rows: int) -> bool:
        return self.length > 0

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        return [min(self.length, gamma)] * num_rows


def as_policy(policy) -> VerificationPolicy:
    """`policy` itself if it implements [`VerificationPolicy`]; a plain callable, or a policy written to the tensor
    interface of earlier releases, in a [`TensorPolicy`] (see there)."""
    if isinstance(policy, type):  # a class passes the protocol check, but its hooks would miss `self`
        raise WrongTypeError(f"verification_policy={policy.__name__} is a class: pass an instance, e.g. "
                             f"{policy.__name__}().")
    if isinstance(policy, Policy):
        earlier = _defines(policy, "__call__") and not _defines(policy, "plan")
        return TensorPolicy(policy) if earlier else policy
    if isinstance(policy, VerificationPolicy):
        return policy
    if isinstance(policy, EarlierPolicy):
        return TensorPolicy(policy)
    if not callable(policy):
        raise WrongTypeError(f"verification_policy must be a dspark_hf policy or a callable (confidences, gamma, "
                             f"num_rows) -> lengths, got {type(policy).__name__}.")
    hooks = [name for name in ("prepare", "draft_this_round", "observe") if name in dir(policy)]
    if hooks:  # a plain callable would silently lose them
        raise WrongTypeError(f"{type(policy).__name__} defines {', '.join(hooks)} but not all of prepare, "
                             "draft_this_round and observe: subclass dspark_hf.Policy so that generate() calls them.")
    return TensorPolicy(policy)


def _defines(policy: Policy, name: str) -> bool:
    """Whether `policy`'s class defines `name` itself, below Policy."""
    return any(name in vars(cls) for cls in type(policy).__mro__ if cls not in (Policy, object))


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


def policy_name(policy) -> str:
    """What error messages call a policy: its class, or the function a plain callable policy wraps."""
    fn = policy.wrapped if isinstance(policy, TensorPolicy) and policy.wrapped is not None else policy
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
