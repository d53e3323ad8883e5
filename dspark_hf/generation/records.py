"""What happened in each round: the public record the evaluation, the benchmarks and the demo are built on."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class DSparkRound:
    """One draft-verify round of one row.

    Attributes:
        drafted: the block the draft proposed (block_size tokens, always the full trained block), or [] when the
            verification policy switched drafting off for the round (plain decoding was faster under the load), or
            when no row had more than one token left (`one_token_left`).
        draft_probs: q_k(x_k), the draft probability of each drafted token (after logits processors).
        confidences: calibrated c_k per drafted position, or None for a draft without a confidence head.
        verified: how many drafted tokens were sent to the target (the scheduler may trim the block).
        accepted: how many of the verified tokens the target kept (a prefix).
        next_token: the target's own token after the accepted prefix: a bonus token when every verified
            draft was accepted, otherwise the correction sampled from the residual distribution.
        committed: tokens this round added to the output (accepted + 1, or fewer when EOS, a stop string or
            the length limit ended the row inside the chunk).
        cache_hit: with `ssd=`, whether the block came ready from the speculation cache (False: a fallback
            drafted it); None without SSD or when nothing was drafted.
        one_token_left: the round started with at most one token left in every row: nothing could be verified, so
            nothing was drafted (the last round of a call that ends at its length limit).
    """

    drafted: list[int]
    draft_probs: list[float]
    confidences: list[float] | None
    verified: int
    accepted: int
    next_token: int
    committed: int
    cache_hit: bool | None = None
    one_token_left: bool = False

    @property
    def tau(self) -> int:
        """Acceptance length of the round, bonus token included (accepted + 1)."""
        return self.accepted + 1

    @property
    def bonus(self) -> bool:
        """True when every verified draft survived, so next_token is a bonus rather than a correction: drawn from
        the target's own distribution, not the residual one. That includes a round that verified nothing
        (verified == 0), whose token is plain decoding's; check `verified` to tell the two apart."""
        return self.accepted == self.verified


@dataclass
class DSparkGenerateOutput(GenerateDecoderOnlyOutput):
    """`generate(..., return_dict_in_generate=True)` with a DSpark draft.

    Attributes:
        sequences: (batch, prompt + new tokens), as plain `generate()` returns them.
        rounds: per row, its list of [`DSparkRound`]. The first new token comes from the prefill, not a round.
        timings: seconds: "prefill" (prompt forward, first token, draft context), then over all rounds "draft"
            (draft forwards and block sampling) and "target" (verification forwards); "total" covers everything;
            with `ssd=` also "speculate" (the speculator's passes, in its thread during verification unless
            overlap=False) and "wait" (how long a finished verification then waited for the speculator).
        ssd_stats: with `ssd=`, counts over the decode: "rounds" and "hits" (row-rounds that had a cache, and
            found their block in it), "fallbacks" by kind, and tokens committed after hits and misses.
    """

    rounds: list[list[DSparkRound]] | None = None
    timings: dict[str, float] | None = None
    ssd_stats: dict | None = None
