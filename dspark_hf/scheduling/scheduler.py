"""The hardware-aware prefix scheduler (paper sec. 3.2.2, Algorithm 1) and its asynchronous variant (sec. 5.2).

For R requests with conditional confidences c_{r,1..gamma}, the survival probability of draft position j is
a_{r,j} = prod_{i<=j} c_{r,i}. Verifying lengths l_r sends B = sum(1 + l_r) tokens to the target and is expected
to commit tau = sum(1 + sum_{j<=l_r} a_{r,j}) tokens, at SPS(B) steps per second: throughput Theta = tau * SPS(B).
(A padded engine, like batched `generate()` here, runs every request at the longest length: B = R * (1 + max l_r).)
Because a_{r,j} falls with j, admitting candidates in descending order of a respects every request's prefix.

Lossless scheduling needs admission to be non-anticipating: whether position k of a request is verified must not
depend on the drafted token x_{r,k} (Appendix A). c_{r,k+1} depends on x_{r,k} through the Markov feature, so:

- `prefix_schedule` (Algorithm 1) stops at the first admission that does not raise Theta. Position k is admitted
  only on evidence up to a_{r,k}; a later, higher Theta that would need a_{r,k+1} is never looked at. Optimal
  when Theta is unimodal along the admission path (smooth SPS curves).
- `topk_schedule` admits the K highest a_{r,j}, with K fixed beforehand. a_{r,k} outranks the request's own later
  candidates (ties broken by position), so whether it makes the cut never depends on x_{r,k}. `AsyncScheduled`
  takes K from a global search without early stop over the confidences of two steps earlier (sec. 5.2), which
  cannot depend on the current tokens either, and which sees past jagged SPS cliffs. Use it when SPS(B) is not
  smooth (real engines: steps at kernel tile sizes) and when the batch size of a step must be known early. On a
  padded engine the capacity is a length, and every request verifies up to it (a > 0): the rectangle is paid for.
- A global search over the *current* confidences without early stop is the retrospective scheduler of Appendix
  A: it leaks x_{r,k} into the admission of position k and biases the output. It exists here only as
  ``prefix_schedule(..., early_stop=False)`` for capacity estimates on past data and for the counterexample test.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Mapping
from typing import Callable, Sequence

import torch

from ..errors import WrongTypeError
from .policies import Pause, Policy, real, whole
from ..costs.cost_model import check_profile, load_draft_cost, load_profile, sps_curve

SPS = Sequence[float] | Mapping[int, float] | Callable[[int], float]


def _sps_fn(sps: SPS) -> Callable[[int], float]:
    if callable(sps):
        return sps
    if isinstance(sps, Mapping):  # {B: sps}, the shape `dspark profile` writes: measured points, not every B
        return sps_curve(sps)
    if isinstance(sps, (str, bytes)) or not (hasattr(sps, "__getitem__") and hasattr(sps, "__len__")):
        raise WrongTypeError(f"sps must be a list indexed by B, a {{B: sps}} dict or a callable B -> sps, got "
                             f"{type(sps).__name__}.")
    table = list(sps)

    def lookup(b: int) -> float:
        if b >= len(table):
            raise ValueError(f"SPS table covers batch sizes up to {len(table) - 1}, the schedule needs {b}: "
                             "profile larger batches or pass a callable.")
        return table[b]

    return lookup


def survival(confidences):
    """c (R, gamma) -> a (R, gamma), a_{r,j} = prod_{i<=j} c_{r,i}: nested lists from nested lists (as the decoding
    loop plans, without a tensor), a float64 tensor from a tensor."""
    if isinstance(confidences, torch.Tensor):
        if confidences.dim() != 2:
            raise ValueError(f"confidences must be (R, gamma), got shape {tuple(confidences.shape)}")
        return torch.cumprod(confidences.to(torch.float64), dim=1)
    if not all(isinstance(row, (list, tuple)) for row in confidences):
        raise ValueError("confidences must be (R, gamma): R lists of gamma numbers.")
    return [list(itertools.accumulate((float(c) for c in row), operator.mul)) for row in confidences]


def _survival_rows(confidences) -> list[list[float]]:
    """a (R, gamma) as Python lists (read once from a tensor)."""
    a = survival(confidences)
    return a.tolist() if isinstance(a, torch.Tensor) else a


def _candidates(a: list[list[float]]) -> list[tuple[float, int, int]]:
    """(a_{r,j}, r, j) for a > 0, by descending a; ties by request then position (prefix order)."""
    rows = [(a_rj, r, j + 1) for r, row in enumerate(a) for j, a_rj in enumerate(row) if a_rj > 0]
    return sorted(rows, key=lambda x: (-x[0], x[1], x[2]))


def prefix_schedule(confidences, sps: SPS, early_stop: bool = True, padded: bool = False) -> list[int]:
    """Algorithm 1: per-request verification lengths in [0, gamma] maximising tau * SPS(B).

    confidences: R rows of conditional confidences (nested lists or an (R, gamma) tensor); sps: steps per second
    by verification batch size in tokens: a list indexed by B, a {B: sps} dict of measured points (interpolated,
    as a `dspark profile` file's "sps") or a callable. Keep early_stop=True for lossless decoding.
    padded: the engine verifies a rectangle, every request padded to the longest length, B = R * (1 + max l_r)
    (this library's batched `generate()`); default: a packed engine, B = sum(1 + l_r) (the paper's setting).
    """
    a = _survival_rows(confidences)
    R = len(a)
    sps = _sps_fn(sps)
    lengths, best_lengths = [0] * R, [0] * R
    tau, admitted, longest = float(R), 0, 0
    best = tau * sps(R)
    for a_rj, r, j in _candidates(a):
        lengths[r], tau, admitted, longest = j, tau + a_rj, admitted + 1, max(longest, j)
        theta = tau * sps(R * (1 + longest) if padded else R + admitted)
        if theta > best:
            best, best_lengths = theta, list(lengths)
        elif early_stop:
            break
    return best_lengths


def verified_tokens(lengths: Sequence[int], padded: bool = False) -> int:
    """Tokens in the verification forward (anchors included): sum(1 + l_r), or R * (1 + max l_r) when padded."""
    return len(lengths) * (1 + max(lengths, default=0)) if padded else len(lengths) + sum(lengths)


def topk_schedule(confidences, capacity: int, padded: bool = False) -> list[int]:
    """Admit the `capacity` draft tokens with the highest survival probabilities (prefixes by construction).

    padded: capacity is the longest length instead, and every request verifies its candidates (a > 0) up to it:
    the padded engine verifies R x (1 + capacity) tokens whatever the rows are given below that, so they cost
    nothing more. Whether position k is admitted reads a_{r,k} only, never x_{r,k}."""
    a = _survival_rows(confidences)
    lengths = [0] * len(a)
    chosen = [c for c in _candidates(a) if c[2] <= capacity] if padded else _candidates(a)[: max(capacity, 0)]
    for _, r, j in chosen:
        lengths[r] = j
    return lengths


class ThresholdPolicy(Policy):
    """The reference baseline: verify up to the first position whose confidence is below `threshold`."""

    def __init__(self, threshold: float):
        self.threshold = real("ThresholdPolicy", "threshold", threshold, 0.0, 1.0)  # a confidence is a probability

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        rows = _require(confidences, "ThresholdPolicy")
        return [next((k for k, c in enumerate(row) if c < self.threshold), gamma) for row in rows]


class Scheduled(Policy):
    """Algorithm 1 every round, against a profiled engine (see `dspark profile` and [`Scheduled.from_profile`]).

    sps: SPS(B) of the verification forward (measured on rectangular R x T batches by `dspark profile`); padded:
    this library's verification forward pads every request to the longest verified length, so B = R * (1 + max
    l_r) (`prefix_schedule(padded=True)`). draft_seconds: optional R -> seconds of one draft pass for R requests;
    with it a round's rate counts the draft too, 1 / (t_draft(R) + 1 / SPS(B)), and when even the best schedule is
    slower than plain decoding at this load (R * SPS(R), no draft), drafting is switched off for `probe_every`
    rounds and then tried again; each probe that confirms it doubles the pause, up to `max_pause` rounds (a probe
    costs a draft pass and a longer verification). That decision uses past rounds only, so it stays lossless.
    Keeps state across the rounds of a call; prepare, at the start of each generate() call, resets it.
    """

    def __init__(self, sps: SPS, draft_seconds: Callable[[int], float] | None = None, probe_every: int = 8,
                 max_pause: int = 64, padded: bool = True):
        self.sps, self.draft_seconds, self.padded = sps, draft_seconds, padded
        self.probe_every = whole("Scheduled", "probe_every", probe_every, 1)
        self.max_pause = whole("Scheduled", "max_pause", max_pause, 1)
        self.pause = Pause(self.probe_every, self.max_pause)
        self.profile = None  # the `dspark profile` file the costs come from, checked against the models decoding

    @classmethod
    def from_profile(cls, path, **kwargs) -> "Scheduled":
        """The scheduler for the engine a `dspark profile` JSON describes (with its draft cost, if measured); a
        ProfileMismatchWarning says when it was measured for other models or another machine."""
        policy = cls(load_profile(path), load_draft_cost(path), **kwargs)
        policy.profile = path
        return policy

    def prepare(self, target, draft, batch_size: int, sampling: bool = False) -> None:
        if self.profile is not None:
            check_profile(self.profile, target, draft)
        self.pause = Pause(self.probe_every, self.max_pause)  # a pause learned in another call says nothing of this one

    def round_sps(self, num_rows: int) -> Callable[[int], float]:
        """Speculative steps per second at B verified tokens for `num_rows` requests, draft pass included."""
        sps = _sps_fn(self.sps)
        if self.draft_seconds is None:
            return sps
        t_draft = self.draft_seconds(num_rows)
        return lambda b: 1.0 / (t_draft + 1.0 / sps(b))

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        c = _require(confidences, "Scheduled")
        step = self.round_sps(num_rows)
        lengths = prefix_schedule(c, step, padded=self.padded)
        if self.draft_seconds is not None:
            a = survival(c)
            tau = num_rows + sum(sum(row[:n]) for row, n in zip(a, lengths))
            if tau * step(verified_tokens(lengths, self.padded)) < num_rows * _sps_fn(self.sps)(num_rows):
                self.pause.start()
            else:
                self.pause.pays()
        return lengths

    def draft_this_round(self, num_rows: int) -> bool:
        return self.pause.draft_this_round()


class AsyncScheduled(Policy):
    """Sec. 5.2: capacity K from a global search over the confidences of `lag` rounds earlier, then top-K
    admission over the current survival probabilities. Until `lag` rounds have passed, Algorithm 1 decides.

    padded (default, as batched `generate()` verifies): B = R * (1 + max l_r), and the capacity is the longest
    length the search chose, up to which every request verifies (`topk_schedule(padded=True)`); padded=False: the
    paper's packed engine, K draft tokens in all."""

    def __init__(self, sps: SPS, lag: int = 2, padded: bool = True):
        self.sps, self.lag, self.padded = sps, whole("AsyncScheduled", "lag", lag, 1), padded
        self.capacities: deque[int] = deque(maxlen=lag)  # capacities come from past rounds
        self.profile = None  # as Scheduled's

    @classmethod
    def from_profile(cls, path, **kwargs) -> "AsyncScheduled":
        """The scheduler for the engine a `dspark profile` JSON describes, checked as `Scheduled.from_profile`'s."""
        policy = cls(load_profile(path), **kwargs)
        policy.profile = path
        return policy

    def prepare(self, target, draft, batch_size: int, sampling: bool = False) -> None:
        if self.profile is not None:
            check_profile(self.profile, target, draft)
        self.capacities.clear()  # another call's rounds: not this call's rounds of `lag` rounds earlier

    def plan(self, confidences, gamma: int, num_rows: int) -> list[int]:
        c = _require(confidences, "AsyncScheduled")
        if len(self.capacities) == self.lag:
            lengths = topk_schedule(c, self.capacities[0], padded=self.padded)
        else:
            lengths = prefix_schedule(c, self.sps, padded=self.padded)
        searched = prefix_schedule(c, self.sps, early_stop=False, padded=self.padded)
        self.capacities.append(max(searched, default=0) if self.padded else sum(searched))
        return lengths


def _require(confidences, name) -> list[list[float]]:
    if confidences is None:
        raise ValueError(f"{name} needs a draft with a confidence head (config.confidence_head=True).")
    return confidences.tolist() if isinstance(confidences, torch.Tensor) else confidences
