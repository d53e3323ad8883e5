import math, os, sys, json, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay_sim import replay, table
from dspark_hf.scheduling import FixedLength, FullBlock
from dspark_hf.scheduling.auto import AutoScheduled


class LossFloor(AutoScheduled):
    """pause floor from the probe's expected loss, not its gross overhead"""
    def _probe_overhead(self, R, verified):
        plain = self.costs.verify(R, 1)
        steps = (self.costs.draft(R) + self.costs.verify(R, 1 + max(verified, 1))) / plain
        return steps * (1 - min(self._last, 1.0))

    def _expected_tokens(self, verified):
        e = super()._expected_tokens(verified)
        R = verified.shape[0]
        self._last = e / (self.costs.draft(R) + self.costs.verify(R, 1 + int(verified.max())))
        self._last *= self.costs.verify(R, 1) / R
        return e


class NoPause(AutoScheduled):
    def draft_this_round(self, R):
        return True


def run(path):
    costs = table()
    rows = json.load(open(path))
    pols = {"auto": lambda: AutoScheduled(progress=False), "lossfloor": lambda: LossFloor(progress=False),
            "nopause": lambda: NoPause(progress=False),
            "auto sm.1": lambda: AutoScheduled(progress=False, smoothing=0.1),
            "fixed 1": lambda: FixedLength(1), "fixed 2": lambda: FixedLength(2), "full": FullBlock}
    for name, make in pols.items():
        r, rounds, drafted = replay(rows, make, costs)
        print(f"  {name:10s} {r:.3f}x rounds {rounds} drafted {drafted} ({drafted / rounds:.0%})")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p); run(p)


class Spy(NoPause):
    log = []

    def _expected_tokens(self, verified):
        e = super()._expected_tokens(verified)
        R = verified.shape[0]
        g = e / (self.costs.draft(R) + self.costs.verify(R, 1 + int(verified.max())))
        self._last *= self.costs.verify(R, 1) / R
        Spy.log.append((g, int(verified.max()), e))
        return e


def spy(path):
    costs = table(); rows = json.load(open(path)); Spy.log = []
    replay(rows, lambda: Spy(progress=False), costs)
    gs = torch.tensor([g for g, _, _ in Spy.log]); Ls = torch.tensor([l for _, l, _ in Spy.log])
    print("rounds", len(gs), "mean gain", gs.mean().item(), "share<1", (gs < 1).float().mean().item())
    print("L hist", torch.bincount(Ls, minlength=8).tolist())
    ema = 1.0; below = 0
    for g in gs.tolist():
        ema = 0.7 * ema + 0.3 * g; below += ema < 1
    print("ema<1 share", below / len(gs))
