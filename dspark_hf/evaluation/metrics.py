"""What the paper measures, from per-round records ([`DSparkRound`]).

- acceptance length tau: mean over rounds of accepted + 1 (the bonus or corrected token included), as verified:
  a round whose chunk an EOS or the length limit cuts still counts accepted + 1 (`committed` counts what reached
  the output; over a whole evaluation the two differ by about 0.1%);
- conditional acceptance at position k (paper Fig. 2): among rounds that verified position k and accepted
  positions 1..k-1, the share that also accepted position k;
- prefix survival at position k: among rounds that verified position k, the share that accepted 1..k.
"""

from __future__ import annotations

from ..generation.records import DSparkRound


def acceptance_length(rounds: list[DSparkRound]) -> float:
    return sum(r.tau for r in rounds) / len(rounds) if rounds else 0.0


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
