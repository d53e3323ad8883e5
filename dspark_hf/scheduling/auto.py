"""The default verification policy: plan every round against this machine's measured costs, and draft only while
drafting pays, so that adding a draft to generate() does not make it slower than plain decoding."""

from __future__ import annotations

import copy
import json
import math
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

from .policies import Pause, Policy, real, whole
from ..costs.cost_model import EngineCosts, RoundClock, check_profile, path_costs
from ..costs.profile import cache_key
from .scheduler import prefix_schedule, survival


@dataclass
class Learned:
    """What the default policy has learned about a draft beside a target at one batch size."""

    seen: list[list[float]]  # per position: rounds examined, tokens accepted, confidence spent (3 lists of gamma)
    pause: Pause  # while the estimate stays below 1
    gain: float = 1.0  # running estimate of drafting's speed over plain decoding's; starts at break-even
    probing: bool = True  # is the next drafted round a probe: the first one, or the first after a pause


# draft -> target -> (batch size, profile, settings) -> Learned: what greedy calls hand on to the next in this process.
# Each call learns in its own copy, which becomes the one handed on: calls that run at once (threads) share nothing.
_CARRIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CARRIED_LOCK = threading.Lock()


class AutoScheduled(Policy):
    """What ``generate(assistant_model=draft)`` uses when no `verification_policy` is given.

    - Costs: seconds of the call's own rounds on the path it runs (eager, or compiled as its CompileConfig says), at
      its batch size: a drafting round's verification by tokens per row (the forward as the round runs it, the
      draft's context projected, the scores processed and checked), a round that drafts nothing (plain generate()'s
      step), and the draft's block. Timed with the call's own steps the first time a generate() call on a path
      needs them (a few seconds, a progress bar) and cached on disk for later calls and processes
      (``dspark_hf.costs.cost_model.path_costs``), or read from a `dspark profile` file (`profile=`). Every round is
      priced at the call's batch size: rows that have finished keep their place in the batch.
    - Each round: Algorithm 1 with its lossless early stop over the draft's confidences against the cost of this
      round, t_draft + t_verify(1 + longest), the verification padded to its longest row. The confidences are
      recalibrated online: at each position, by the ratio of tokens accepted to confidence spent in the rounds so
      far (a draft better or worse than its confidence head says is planned for as it is); a draft without a
      confidence head is planned with the acceptance rates seen so far.
    - Between rounds: a running estimate of what drafting gains, each drafted round's expected committed tokens (given
      its block: 1 + the recalibrated prefix survival over the positions verified) per second of its measured cost over
      `margin` times plain decoding's R / t_plain, smoothed over rounds (`smoothing`: the weight of the newest round).
      The expectation, not the count, and a slow average: a draft that pays accepts nothing in many of its rounds and is
      expected to in many more (the confidences of one block vary far more than a draft's worth does), and a quicker,
      noisier estimate paused it where it paid. The margin (1.1 by default) covers what the costs, timed apart, do not
      see: on a 2-core CPU at batch 8, compiled, a draft they put at 1.10x lost 5-10% in `dspark bench speed` (which
      runs eager calls between the compiled ones), though it gained 10% with the compiled calls alone
      (experiments/the-floor-cpu, section 4; margin=1.0 drafts at break-even). It starts at 1 (break even: no evidence
      either way), so a lucky first block alone does not keep a weak draft drafting. While it is below 1, drafting
      pauses and probes again after `probe_every` rounds, and each probe that leaves the estimate below 1 doubles the
      pause (up to `max_pause`): one unlucky round does not stop drafting, one lucky probe does not restart it. No pause
      is shorter than what keeps the probes' extra cost (the pause's slots projected into the draft's context, a draft
      pass, and as many verified tokens as the last drafted round verified, from the costs) within `probe_budget` of the
      time spent decoding plainly, `max_pause` notwithstanding: with a weak draft the probes cost about that much at
      most (0.5% by default: a round that drafts nothing costs what plain generate()'s step costs, so the probes are all
      a paused policy adds), and a short request (tens of tokens) pays for its first probe only. The round that verifies
      a probe ending a pause drafts nothing after it: were the probe to lose, the pause it starts would drop that block,
      a second draft pass per probe (compiled at batch 1 on a 2-core CPU a probe cost about a plain step, where its
      costs put it at 0.6; experiments/the-floor-cpu, section 3d); one that pays resumes drafting a round later.
    - Rows verify at least a common length, the one that maximises tokens per second by the acceptance rates
      of past rounds (Algorithm 1's early stop cannot find it on a padded batch); probes (the first drafted round,
      and the first after a pause) verify at least one token, so that a draft better than its confidence head says
      gets found out. The gain estimate counts a probe as the plan would have done in it.
    - Across calls: greedy decoding carries all of the above (`Learned`) over to the next greedy call in this
      process with the same draft, target, batch size, settings and path (eager or compiled), which goes on where
      the last one stopped: with a weak draft a stream of short requests pays one probe per pause, not one per
      request. Each call learns in its own copy, so calls that run at once (threads) share nothing; the one started
      last hands on. No decision can change greedy output. Sampled calls start afresh and hand nothing on, because
      the tokens drawn depend on how many were drafted: a seed gives the same sample on every call.

    Decisions read the costs and the acceptance seen so far, never a clock: greedy output is plain generate()'s,
    and a seed gives the same sampled output every run with the same cached costs. An instance may serve several
    generate() calls: each call's prepare starts it afresh, and `price` gives it the costs of that call's rounds.
    """

    def __init__(self, profile: str | Path | None = None, smoothing: float = 0.1, probe_every: int = 4,
                 max_pause: int = 64, probe_budget: float = 0.005, margin: float = 1.1, progress: bool = True):
        self.profile = profile
        self.smoothing = real("AutoScheduled", "smoothing", smoothing, 0.0, 1.0, low_open=True)
        self.probe_every = whole("AutoScheduled", "probe_every", probe_every, 1)
        self.max_pause = whole("AutoScheduled", "max_pause", max_pause, 1)
        self.probe_budget = real("AutoScheduled", "probe_budget", probe_budget, 0.0, math.inf, low_open=True)
        self.margin = real("AutoScheduled", "margin", margin, 1.0, math.inf)
        self.progress = progress
        self.costs: EngineCosts | None = None
        self._fetched = (None, None)  # (the path and models `price` measured the costs for, those costs)
        self.batch_size: int | None = None  # of the call: every round runs all its rows
        self._sampling = False
        self.learned: Learned | None = None
        self._planned = None  # this round's raw confidences (R lists of gamma), or None
        self._verifying_resumption = False  # is the planned round a probe that ends a pause

    @property
    def gain(self) -> float:
        """The running estimate of drafting's speed over plain decoding's (1: break-even)."""
        return self.learned.gain

    def fresh(self, block_size: int) -> Learned:
        """What a policy knows before its first round: nothing."""
        return Learned(seen=[[0.0] * block_size for _ in range(3)], pause=Pause(self.probe_every, self.max_pause))

    def prepare(self, target, draft, batch_size: int, sampling: bool = False) -> None:
        self.batch_size = batch_size
        if self.profile is not None:
            if self.costs is None:
                self.costs = EngineCosts.from_profile(self.profile)
            check_profile(self.profile, target, draft)
        self._sampling = sampling
        self._verifying_resumption = False
        self.learned = self.fresh(draft.config.block_size) if sampling else self._carried(target, draft, path=None)

    def _carried(self, target, draft, path: str | None) -> Learned:
        """What the last greedy call with this draft, target, batch size, settings and path handed on (a copy: this
        call's, which it hands on in turn), or a fresh start."""
        # set up otherwise, it learned otherwise
        key = (self.batch_size, None if self.profile is None else str(self.profile), self.smoothing,
               self.probe_every, self.max_pause, self.probe_budget, self.margin, path)
        with _CARRIED_LOCK:
            carried = _CARRIED.setdefault(draft, weakref.WeakKeyDictionary()).setdefault(target, {})
            learned = copy.deepcopy(carried[key]) if key in carried else self.fresh(draft.config.block_size)
            carried[key] = learned
        return learned

    def price(self, clock: RoundClock) -> None:
        """The costs of this call's rounds on its path (see the class): a reused instance may decode on another
        path, target or batch size, so costs are read again (cheap once cached) for what they were not measured
        for; a profile's costs, and costs set by hand, are kept. A greedy call goes on from what the last one on
        the same path learned: whether drafting pays depends on the path."""
        if not self._sampling:
            self.learned = self._carried(clock.target, clock.draft, path=clock.key["path"])
        if self.profile is not None or (self.costs is not None and self.costs is not self._fetched[1]):
            return
        measured_for = (cache_key(clock.target, clock.draft), json.dumps(clock.key, sort_keys=True, default=str))
        if self.costs is None or measured_for != self._fetched[0]:
            self.costs = path_costs(clock, progress=self.progress)
            self._fetched = (measured_for, self.costs)

    def draft_this_round(self, num_rows: int) -> bool:
        # the block after a probe that ends a pause is not drafted: the probe decides whether drafting resumes, and a
        # probe of a draft that does not pay would start a pause that drops the block (a draft pass for nothing, as
        # dear as the probe's own on a CPU); one that pays resumes a round later
        if self._verifying_resumption:
            self._verifying_resumption = False
            return False
        return self.learned.pause.draft_this_round()

    def keep_drafted(self, num_rows: int) -> bool:
        return self.learned.pause.skip == 0  # a pause the last round started drops the block drafted during it

    def plan(self, confidences: list[list[float]] | None, gamma: int, num_rows: int) -> list[int]:
        if self.costs is None:
            raise RuntimeError("AutoScheduled plans against the costs of the call's own rounds, which generate() "
                               "measures (AutoScheduled.price): decode through generate(), or give it profile= or "
                               "costs.")
        self._planned = confidences
        # a probe after a pause, not the first block: a pause starts only below break-even, where the estimate stays
        # until the probe (rounds without a draft leave it alone); a fresh estimate is 1
        self._verifying_resumption = self.learned.probing and self.learned.gain < 1
        lengths = self._plan(self._planned, num_rows)
        # A plan learns only at the positions it verifies: a probe (the first drafted round, and the first after each
        # pause) verifies at least one token, so that a draft planned at zero can still be found out. The gain
        # estimate counts a probe as the plan would have done in it, not at what exploring cost.
        return [max(n, 1) for n in lengths] if self.learned.probing else lengths

    def _plan(self, planned: list[list[float]] | None, num_rows: int) -> list[int]:
        """This round's lengths: every row verifies at least `_common_length`, and further where Algorithm 1 (with
        its lossless early stop) over the recalibrated confidences finds it pays."""
        common = self._common_length(num_rows)
        if planned is None:  # no confidence head: the acceptance seen is all there is to plan with
            return [common] * num_rows
        R = self._rows(num_rows)
        t_draft = self.costs.draft(R)
        lengths = prefix_schedule(self._recalibrated(planned),
                                  lambda b: 1.0 / (t_draft + self.costs.verify(R, b // num_rows)), padded=True)
        return [max(n, common) for n in lengths]

    def _rows(self, num_rows: int) -> int:
        """The rows a round runs, priced: the call's batch (finished rows keep their place), or `num_rows` outside a
        call."""
        return self.batch_size or num_rows

    def _common_length(self, num_rows: int) -> int:
        """The length that maximises expected tokens per second when every row verifies it, by the acceptance rates
        seen in past rounds. Algorithm 1 alone cannot find it on a padded batch: its first admission pays the
        padding of every row for one row's token, so its early stop ends the search there. Reading only past
        rounds, never this block, it is lossless as it is."""
        survival, R = self._survival(), self._rows(num_rows)
        t_draft, best, best_rate = self.costs.draft(R), 0, 0.0
        for length in range(len(survival) + 1):
            rate = (1 + sum(survival[:length])) / (t_draft + self.costs.verify(R, 1 + length))
            if rate > best_rate:
                best, best_rate = length, rate
        return best

    def _recalibrated(self, planned: list[list[float]]) -> list[list[float]]:
        """The head's confidences (R, gamma) scaled by the acceptance seen per unit of confidence spent: `_plan` and
        the gain estimate must read the same numbers, or a plan would be judged by odds it was not made with."""
        rates = self._rates(prior=1.0, weight=1.0, against=self.learned.seen[2])
        return [[min(max(c * rate, 0.0), 1.0) for c, rate in zip(row, rates)] for row in planned]

    def _survival(self) -> list[float]:
        """(gamma,) chance that every position up to each one is accepted, by the acceptance rates seen, for a draft
        without a confidence head: `_common_length` plans by it and the gain estimate prices the round by it."""
        return survival([self._rates(prior=0.5, weight=2.0, against=self.learned.seen[0])])[0]

    def _rates(self, prior: float, weight: float, against: list[float]) -> list[float]:
        """Per position, tokens accepted over `against` (rounds examined, or confidence spent), shrunk towards the
        previous position's rate (the first towards `prior`) with `weight`: positions verified rarely or never so
        far inherit what was seen before them."""
        rates, previous = [], prior
        for took, seen in zip(self.learned.seen[1], against):
            previous = (took + weight * previous) / (seen + weight)
            rates.append(previous)
        return rates

    def learn(self, verified: list[int], accepted: list[int], drafted: bool) -> None:
        if not drafted:
            return
        learned = self.learned
        R, gamma = len(verified), len(learned.seen[0])
        for r, (v, a) in enumerate(zip(verified, accepted)):
            for k in range(min(v, a + 1, gamma)):  # positions verified, all before them accepted
                learned.seen[0][k] += 1
                if self._planned is not None:
                    learned.seen[2][k] += self._planned[r][k]
            for k in range(min(a, gamma)):
                learned.seen[1][k] += 1

        longest = max(verified)  # what this round really verified: the next probe's cost is priced by it
        if learned.probing:
            verified = [min(p, v) for p, v in zip(self._plan(self._planned, R), verified)]  # as the plan would have
            learned.probing = False
        rows = self._rows(R)
        plain_rate = self.margin * R / self.costs.plain(rows)  # the rate drafting must beat
        round_seconds = self.costs.draft(rows) + self.costs.verify(rows, 1 + max(verified))
        this_round = self._expected_tokens(verified) / round_seconds / plain_rate
        learned.gain = (1 - self.smoothing) * learned.gain + self.smoothing * this_round
        if learned.gain >= 1:
            learned.pause.pays()
        else:  # no shorter than the probe budget allows
            learned.pause.start(at_least=math.ceil(self._probe_overhead(R, longest) / self.probe_budget))
            learned.probing = True  # the next drafted round ends a pause

    def _probe_overhead(self, num_rows: int, verified: int) -> float:
        """What a probe costs beyond a plain step, in plain steps: the pause's slots projected into the draft's
        context, a draft pass and `verified` (at least one) more tokens per row, as many as the last drafted round
        verified (at batch 4 here the plan verifies 5-6 tokens per row, which costs more than the draft pass)."""
        R = self._rows(num_rows)
        plain = self.costs.plain(R)
        extra = self.costs.catch_up(R) + self.costs.draft(R) + self.costs.verify(R, 1 + max(verified, 1)) - plain
        return extra / plain

    def _expected_tokens(self, verified: list[int]) -> float:
        """Tokens this round commits in expectation over its rows, given what each row verified: 1 + the sum of
        the recalibrated prefix survival c_1 ... c_k over the verified positions (the acceptance rates seen so far
        for a draft without a confidence head). An expectation given the block, not the tokens accepted: a round of
        a draft that pays accepts nothing half the time, and a running estimate of counts that noisy paused drafting
        where it paid (the draft of 2026-11-26 drafted in about 1% of rounds, where verifying 2 tokens a round
        gained about 15% by the costs). The counts still recalibrate the confidences (`_rates`)."""
        if self._planned is None:
            rows = [self._survival()] * len(verified)
        else:
            rows = survival(self._recalibrated(self._planned))
        return float(len(verified) + sum(sum(a[:v]) for a, v in zip(rows, verified)))
