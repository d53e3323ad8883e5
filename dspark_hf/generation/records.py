"""What happened in each round: the public record the evaluation, the benchmarks and the demo are built on."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields

from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..errors import UnsupportedError


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

    The target's cache, which plain `generate()` returns in this dict, is absent: reading `out.cache` (or
    `out.past_key_values`) raises an AttributeError that says why; `scores`, `logits`, `attentions` and
    `hidden_states` are refused when asked for (`output_scores=True`, ...), as they are not computed per token.
    """

    rounds: list[list[DSparkRound]] | None = None
    timings: dict[str, float] | None = None
    ssd_stats: dict | None = None

    def __repr__(self) -> str:  # the dataclass's own would read the cache field, which refuses to be read
        shown = ", ".join(f"{k}={v!r}" for k, v in self.items())
        return f"{type(self).__name__}({shown})"

    def __eq__(self, other) -> bool:  # as the dataclass's, over the fields that are set
        return type(other) is type(self) and list(self.items()) == list(other.items())

    def __reduce__(self):  # for copy and pickle, as ModelOutput's, without reading the cache field
        rebuild, _, *rest = OrderedDict.__reduce__(self)
        return rebuild, tuple(self.__dict__.get(f.name) for f in fields(self)), *rest


# The field plain generate() returns its cache in ("cache" since transformers 5.24, "past_key_values" before).
_CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"


class _NoCache:
    """Plain generate() returns the target's cache; DSpark's output refuses the field when it is read, saying why,
    rather than holding a None that looks like an empty cache. `getattr(out, "cache", None)` (and transformers'
    own probing) still gets None, and the field stays out of `out.keys()`, as any unset field of a ModelOutput."""

    def __get__(self, output, owner=None):
        if output is None:
            return None  # the dataclass default
        raise _NoCacheError(
            "DSpark's generate() output has no cache: the target's cache it decodes with keeps each row at its own "
            "offset (and compiled, is reused by later calls), which plain generate()'s cache layout cannot express, "
            "and generate() with a DSpark draft takes no cache back. To go on from an output, call generate() again "
            "on out.sequences.")

    def __set__(self, output, value) -> None:
        if value is not None:
            raise ValueError("DSparkGenerateOutput holds no cache; leave the field unset.")
        output.__dict__[_CACHE_FIELD] = None


class _NoCacheError(UnsupportedError, AttributeError):
    """An AttributeError, so that getattr(out, name, None) and hasattr() treat the cache as absent."""


setattr(DSparkGenerateOutput, _CACHE_FIELD, _NoCache())
