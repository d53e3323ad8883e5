"""The default verification policy: plan every round against this machine's measured costs, and draft only while
drafting pays, so that adding a draft to generate() does not make it slower than plain decoding."""

from __future__ import annotations

from pathlib import Path

import torch

from .policies import Policy
from .profile import EngineCosts, cached_costs
from .scheduler import prefix_schedule


class AutoScheduled(Policy):
    """What ``generate(assistant_model=draft)`` uses when no `verification_policy` is given.

    - Costs: seconds of the target's verification forward by rows R and verified tokens, and of the draft pass,
      for this target, device, dtype and thread count: measured the first time a generate() call needs them (a few
      seconds, a progress bar, only the batch sizes in use) and cached on disk for later calls and processes
      (``dspark_hf.scheduling.profile.cached_costs``), or read from a `dspark profile` file (`profile=`).
    - Each round: Algorithm 1 with its lossless early stop over the draft's confidences against the cost of this
      round, t_draft(R) + t_verify(R, 1 + longest), the verification padded to its longest row. The confidences are
      recalibrated online: at each position, by the ratio of tokens accepted to confidence spent in the rounds so
      far (a draft better or worse than its confidence head says is planned for as it is); a draft without a
      confidence head is planned with the acceptance rates seen so far.
    - Between rounds: a running estimate of what drafting gains, each drafted round's committed tokens per second
      of its measured cost over plain decoding's R / t_verify(R, 1), smoothed over rounds. While it is below 1,
      drafting pauses and probes again after `probe_every` rounds; a probe that itself lost doubles the pause (up to
      `max_pause`), so one unlucky round neither stops drafting nor keeps it stopped.

    Decisions read the costs and the acceptance seen so far, never a clock: greedy output is plain generate()'s,
    and a seed gives the same sampled output every run with the same cached costs. One instance per generate() call.
    """

    def __init__(self, profile: str | Path | None = None, smoothing: float = 0.3, probe_every: int = 4,
                 max_pause: int = 64, progress: bool = True):
        self.profile, self.smoothing, self.probe_every, self.max_pause = profile, smoothing, probe_every, max_pause
        self.progress = progress
        self.costs: EngineCosts | None = None
        self.gain: float | None = None  # running estimate; None until the first drafted round
        self._skip, self._pause = 0, probe_every
        self._seen = None  # per position: (rounds examined, tokens accepted, confidence spent), (3, gamma)
        self._planned = None  # this round's raw confidences (R, gamma), or None

    def prepare(self, target, draft, batch_size: int) -> None:
        if self.costs is None:
            self.costs = (EngineCosts.from_profile(self.profile) if self.profile is not None else
                          cached_costs(target, draft, sorted({1, batch_size}), progress=self.progress))
        self._seen = torch.zeros(3, draft.config.block_size, dtype=torch.float64, device="cpu")

    def draft_this_round(self, num_rows: int) -> bool:
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def __call__(self, confidences, gamma: int, num_rows: int) -> torch.Tensor:
        if self.costs is None:
            raise RuntimeError("AutoScheduled.prepare(target, draft, batch_size) must run before the first round "
                               "(generate() does it).")
        if confidences is None:  # no confidence head: the acceptance rates seen so far, the same for every row
            planned = None
            c = self._rates(prior=0.5, weight=2.0, against=self._seen[0]).expand(num_rows, -1)
        else:
            planned = confidences.detach().to("cpu", torch.float64)
            c = (planned * self._rates(prior=1.0, weight=1.0, against=self._seen[2])).clamp(0, 1)
        self._planned = planned
        t_draft = self.costs.draft(num_rows)
        lengths = prefix_schedule(c, lambda b: 1.0 / (t_draft + self.costs.verify(num_rows, b // num_rows)),
                                  padded=True)
        return torch.tensor(lengths, dtype=torch.long, device="cpu")

    def _rates(self, prior: float, weight: float, against: torch.Tensor) -> torch.Tensor:
        """Per position, tokens accepted over `against` (rounds examined, or confidence spent), shrunk towards the
        previous position's rate (the first towards `prior`) with `weight`: positions verified rarely or never so
        far inherit what was seen before them."""
        rates, previous = [], prior
        for took, seen in zip(self._seen[1].tolist(), against.tolist()):
            previous = (took + weight * previous) / (seen + weight)
            rates.append(previous)
        return torch.tensor(rates, dtype=torch.float64, device="cpu")

    def observe(self, verified: torch.Tensor, accepted: torch.Tensor, drafted: bool) -> None:
        if not drafted:
            return
        verified, accepted = verified.cpu(), accepted.cpu()
        R, gamma = verified.shape[0], self._seen.shape[1]
        k = torch.arange(1, gamma + 1, device="cpu")
        examined = (k <= verified[:, None]) & (k <= accepted[:, None] + 1)  # verified, all before it accepted
        took = k <= accepted[:, None]
        self._seen[0] += examined.sum(0)
        self._seen[1] += took.sum(0)
        if self._planned is not None:
            self._seen[2] += (self._planned * examined).sum(0)

        plain_rate = R / self.costs.verify(R, 1)
        round_seconds = self.costs.draft(R) + self.costs.verify(R, 1 + int(verified.max()))
        probe = float((accepted + 1).sum()) / round_seconds / plain_rate
        self.gain = probe if self.gain is None else (1 - self.smoothing) * self.gain + self.smoothing * probe
        if self.gain >= 1:
            self._pause = self.probe_every
        else:
            self._skip = self._pause
            self._pause = min(2 * self._pause, self.max_pause) if probe < 1 else self.probe_every
