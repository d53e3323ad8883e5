"""What the paper measures, from per-round records ([`DSparkRound`]).

- acceptance length tau: mean over rounds of accepted + 1 (the bonus or corrected token included), as verified,
  over every round, the last too: a round whose chunk an EOS or the length limit cuts still counts accepted + 1
  (`committed` counts what reached the output; over a whole evaluation the two differ by about 0.1%), and a last
  round with one token left before max_new_tokens verifies nothing and counts 1. So tau depends a little on
  max_new_tokens, the more the shorter the outputs: a prompt has at most one such last round, which moves the mean
  of its n other rounds by about (tau - 1) / (n + 1): large for a good draft on short outputs, about 0.006 (0.4%) at
  128 tokens and tau near 1.5. The definition stays as published (every tau in docs/results.md uses it). A prompt with
  no round at all (EOS first, or max_new_tokens 1) has no tau (None), and averages leave it out;
- conditional acceptance at position k (paper Fig. 2): among rounds that verified position k and accepted
  positions 1..k-1, the share that also accepted position k;
- prefix survival at position k: among rounds that verified position k, the share that accepted 1..k.
"""

from __future__ import annotations

from ..generation.records import DSparkRound


def acceptance_length(rounds: list[DSparkRound]) -> float | None:
    """None without rounds: no draft was tried, and 0 would be a figure tau can never take (it is at least 1)."""
    return sum(r.tau for r in rounds) / len(rounds) if rounds else None


def format_tau(tau: float | None) -> str:
    return "-" if tau is None else f"{tau:.2f}"


def conditional_acceptance(rounds: list[DSparkRound], gamma: int) -> list[float | None]:
    out = []
    for k in range(1, gamma + 1):
        reached = [r for r in rounds if r.verified >= k and r.accepted >= k - 1]
        out.append(sum(r.accepted >= k for r in reached) / len(reached) if reached else None)
    return out


def prefix_survival(rounds: list[DSparkRound], gamma: int) -> list[float | None]:
    out = []
    for k in range(1, gamma + 1):
        verified = [r for r in rounds if r.verified >= k]
        out.append(sum(r.accepted >= k for r in verified) / len(verified) if verified else None)
    return out


def summarize(rounds: list[DSparkRound], gamma: int, new_tokens: int | None = None) -> dict:
    """The metrics of a set of rounds (one prompt, one domain, or everything)."""
    return {
        "acceptance_length": acceptance_length(rounds),
        "rounds": len(rounds),
        "new_tokens": new_tokens if new_tokens is not None else sum(r.committed for r in rounds),
        "conditional_acceptance": conditional_acceptance(rounds, gamma),
        "prefix_survival": prefix_survival(rounds, gamma),
    }
