"""Planning speculative speculative decoding (SSD / Saguaro): the cache's shape, the fallback, the speedup.

**The cache's shape** (sec. 4.1): how many bonus-token candidates F_k to prepare a next block for,
for each number k of drafted tokens the target may accept, under a budget of sum_k F_k blocks.

The outcome "k of L verified tokens accepted" has probability P(k) = alpha^k (1 - alpha) for k < L and alpha^L for
k = L under a constant acceptance rate alpha. A speculator has a *power-law* cache hit rate when the bonus token
misses the top-F candidates with probability F^-r. Maximising the hit rate sum_k P(k) (1 - F_k^-r) under the
budget (Lagrange: P(k) r F_k^(-r-1) equal for every k) gives F_k proportional to P(k)^(1 / (1 + r)): a geometric
series in k with ratio alpha^(1 / (1 + r)), its last term raised by (1 - alpha)^(-1 / (1 + r)) (Theorem 12).
A block-parallel draft has no distribution for the bonus token after its whole block (the paper's autoregressive
speculator drafts one more token for it), so its cache leaves that last outcome out (`cache_last=False`): the
series over k < L alone, where alpha -> 1 spreads the budget evenly instead of onto the outcome it cannot cache.
A measured cache shape drops the model: [`measured_fan_out`] spends the budget where the outcomes of earlier
rounds were (each k with its own miss curve, from where each bonus stood among its candidates).

**The fallback** (sec. 4.3): on a miss the whole batch waits for the backup speculator, and at batch size b some
row misses with probability 1 - h^b. The slow, accurate backup (the draft itself, just in time) pays below a
critical batch size, a fast one (n-gram lookup) above it (Theorem 17).

**The speedup** (Theorem 7, Corollary 16): tokens per round over the round's time relative to one plain step,
[h E_p + (1 - h) E_b] / [t_v + (1 - h^b) t_b] * t_1, with h the hit rate, E_p and E_b the tokens a round commits
after a cached and a fallback block, t_v the verification, t_b the fallback's drafting and t_1 one plain step.
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence


def outcome_probabilities(alpha: float, verified: int) -> list[float]:
    """P(k accepted) for k = 0..verified under a constant acceptance rate `alpha` (they sum to 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha is an acceptance rate in [0, 1], got {alpha}.")
    return [alpha ** k * (1 - alpha) for k in range(verified)] + [alpha ** verified]


def geometric_fan_out(budget: int, verified: int, alpha: float, r: float, cache_last: bool = True) -> list[int]:
    """Theorem 12: F_0..F_verified, integers summing to `budget`, proportional to P(k)^(1 / (1 + r)).

    alpha: the draft's acceptance rate; r > 0: the exponent of its power-law miss rate F^-r (see
    [`fit_power_law`]). The real-valued optimum is rounded by largest remainders, so the total is exact.
    cache_last=False: F_verified = 0 (the outcome "all accepted" cannot be cached) and the budget goes to k < verified,
    in the same ratios (the common factor (1 - alpha)^(1 / (1 + r)) dropped, so alpha = 1 is the even spread it tends
    to).
    """
    if r <= 0:
        raise ValueError(f"r is the exponent of a power-law miss rate F^-r and must be > 0, got {r}.")
    if not cache_last:
        outcome_probabilities(alpha, verified)  # checks alpha
        return _apportion(budget, [alpha ** (k / (1 + r)) for k in range(verified)]) + [0]
    weights = [p ** (1 / (1 + r)) for p in outcome_probabilities(alpha, verified)]
    return _apportion(budget, weights)


def uniform_fan_out(budget: int, verified: int, cache_last: bool = True) -> list[int]:
    """The comparison: the budget spread evenly over k = 0..verified (the first ones get the remainder); over
    k < verified with cache_last=False (F_verified = 0)."""
    if not cache_last:
        return _apportion(budget, [1.0] * verified) + [0]
    return _apportion(budget, [1.0] * (verified + 1))


def measured_fan_out(budget: int, verified: int, bonus_ranks: Mapping[int, Mapping[int, int]]) -> list[int]:
    """F_0..F_verified (F_verified = 0, as `cache_last=False`) summing to `budget` that would have held the most of
    the outcomes seen: bonus_ranks {k: {rank j: rounds}} counts rounds that ended with k accepted and a bonus at
    candidate rank j (`ssd_stats["bonus_ranks"]` of a decode, or its JSON), and F_k blocks hold those with j < F_k.

    Theorem 12 without its model: each outcome gets its own measured miss curve instead of a shared power law and
    a geometric P(k). Solved exactly (a knapsack over k, as a measured curve need not be concave); among equal
    totals the earlier outcomes get the blocks.
    """
    if budget < 0:
        raise ValueError(f"the cache budget must be >= 0 blocks, got {budget}.")
    # keys may be ints or, after a trip through JSON, their strings
    bonus_ranks = {int(k): {int(j): n for j, n in ranks.items()} for k, ranks in bonus_ranks.items()}
    if budget == 0:
        return [0] * (verified + 1)
    if not any(n for k, ranks in bonus_ranks.items() if 0 <= k < verified for n in ranks.values()):
        raise ValueError("measured_fan_out needs the bonus ranks of some round that accepted fewer than all "
                         f"{verified} tokens (`ssd_stats['bonus_ranks']` of a decode with ssd=).")
    # held[k][F]: rounds with outcome k whose bonus the top F candidates hold
    held = []
    for k in range(verified):
        counts = [0] * (budget + 1)
        for j, n in bonus_ranks.get(k, {}).items():
            if 0 <= j < budget:
                counts[j + 1] += n
        held.append(list(itertools.accumulate(counts)))
    # best[k][b]: the most rounds outcomes k.. hold with b blocks; take[k][b]: the F_k that gets it
    best = [[0] * (budget + 1) for _ in range(verified + 1)]
    take = [[0] * (budget + 1) for _ in range(verified)]
    for k in reversed(range(verified)):
        for b in range(budget + 1):
            best[k][b], take[k][b] = max((held[k][F] + best[k + 1][b - F], F) for F in range(b + 1))
    fan_out, left = [], budget
    for k in range(verified):  # the last outcome takes what is left (max prefers the larger F among equals)
        fan_out.append(take[k][left])
        left -= fan_out[-1]
    return fan_out + [0]


def fit_power_law(miss_rates: dict[float, float]) -> float:
    """r of the power law miss(F) = F^-r closest (least squares in log-log, through F = 1) to measured miss rates
    {fan-out F: miss rate}; points at F <= 1 or with a rate of 0 or 1 carry no slope information and are skipped."""
    points = [(math.log(F), math.log(m)) for F, m in miss_rates.items() if 0 < m < 1 and F > 1]
    if not points:
        raise ValueError("fit_power_law needs a miss rate strictly between 0 and 1 at some fan-out F > 1.")
    return -sum(x * y for x, y in points) / sum(x * x for x, _ in points)


def expected_hit_rate(fan_out: Sequence[int], alpha: float, miss_rate) -> float:
    """sum_k P(k) (1 - miss_rate(F_k)): the chance that the outcome of a round is in the cache, for a miss rate
    function of F (miss_rate(0) should be 1)."""
    return sum(p * (1 - miss_rate(F)) for p, F in zip(outcome_probabilities(alpha, len(fan_out) - 1), fan_out))


def _apportion(total: int, weights: Sequence[float]) -> list[int]:
    if total < 0:
        raise ValueError(f"the cache budget must be >= 0 blocks, got {total}.")
    if not weights:  # no outcome to spend on (a block of no verified tokens)
        return []
    scale = total / sum(weights)
    exact = [w * scale for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def ssd_speedup(hit_rate: float, tokens_hit: float, tokens_miss: float, t_verify: float, t_fallback: float,
                t_plain: float, batch_size: int = 1) -> float:
    """Expected speedup of SSD over plain decoding (Theorem 7 at batch size 1, Corollary 16 above it): a round
    commits hit_rate * tokens_hit + (1 - hit_rate) * tokens_miss tokens per row and lasts t_verify, plus t_fallback
    when some row of the batch missed; plain decoding commits one token per t_plain. Speculating is assumed to
    finish within the verification (on other hardware, or hidden behind it)."""
    tokens = hit_rate * tokens_hit + (1 - hit_rate) * tokens_miss
    return tokens * t_plain / (t_verify + (1 - hit_rate ** batch_size) * t_fallback)


def critical_batch_size(hit_rate: float, tokens_hit: float, tokens_slow: float, tokens_fast: float,
                        t_verify: float, t_slow: float, t_fast: float, max_batch_size: int = 4096) -> int:
    """The smallest batch size from which the fast fallback (tokens_fast per miss, t_fast to draft) beats the slow
    one (tokens_slow, t_slow) in [`ssd_speedup`]; max_batch_size + 1 if it never does (Theorem 17)."""
    for b in range(1, max_batch_size + 1):
        slow = ssd_speedup(hit_rate, tokens_hit, tokens_slow, t_verify, t_slow, 1.0, b)
        fast = ssd_speedup(hit_rate, tokens_hit, tokens_fast, t_verify, t_fast, 1.0, b)
        if fast > slow:
            return b
    return max_batch_size + 1
