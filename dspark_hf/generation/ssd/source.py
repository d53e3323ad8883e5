"""Speculative speculative decoding (SSD, the Saguaro algorithm) with a DSpark draft as the speculator.

While the target verifies round t's block, the speculator predicts the outcomes that verification may return
(k drafted tokens accepted, then bonus token b: [`predict_outcomes`]) and drafts round t + 1's block for each of
them, all in one batched pass of the block-parallel draft (one block per (row, outcome)). When the real outcome is
in this *speculation cache*, the next block is ready at once; when it is not, a fallback drafts one: the draft
itself just in time, or a fast n-gram lookup from the batch size on where waiting for the draft costs the whole
batch more than it gains (sec. 4.3).

A pre-speculated block starts after tokens whose target features do not exist yet (the anchor and the accepted
tokens are still being verified): they enter the draft as known tokens ahead of the new anchor (a lagged context,
[`DSparkDraftModel.backbone`]). Lossless like every DSpark round: the cache only decides which block is verified
next; verification and acceptance are the same, against the distribution each token was drawn from.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from ...devices import clock
from ...errors import WrongTypeError
from ...model.sampling import BlockProposer, DraftBlock, sample_blocks, score_block
from ...costs.cost_model import cached_costs
from .fan_out import critical_batch_size, geometric_fan_out, uniform_fan_out
from ..block_sources import Outcome, Proposal
from .speculation import PredictedOutcomes, bonus_rank, predict_outcomes, saguaro
from ..transcript import VOCAB_FREE_PROCESSORS

FAN_OUTS = ("geometric", "uniform")
FALLBACKS = ("auto", "draft", "ngram", "random")


@dataclass
class SSDConfig:
    """`target.generate(..., assistant_model=draft, ssd=SSDConfig(...))`: decode with a speculation cache."""

    cache_size: int = field(default=16, metadata={"help": "Blocks prepared per row while the target verifies "
                            "(sum over k of the fan-out F_k)."})
    fan_out: str | Sequence[int] = field(default="geometric", metadata={"help": "How the cache is spread over the "
                                         "number k of accepted tokens: geometric (Theorem 12), uniform, or the "
                                         "blocks F_0..F_(block_size - 1) for each k, summing to cache_size (a "
                                         "trailing F_block_size = 0 is allowed, as `fan_out.measured_fan_out` "
                                         "returns it)."})
    power_law_r: float = field(default=1.0, metadata={"help": "Exponent r of the draft's power-law miss rate F^-r "
                               "that shapes the geometric fan-out (`dspark bench ssd` fits it)."})
    acceptance: float | None = field(default=None, metadata={"help": "Acceptance rate alpha for the geometric "
                                     "fan-out; None: estimated from the rounds so far."})
    saguaro_c: float = field(default=1.0, metadata={"help": "Saguaro sampling: the draft's probability of each "
                             "cached token is multiplied by C in [0, 1] while sampling (1: off; greedy ignores it)."})
    fallback: str = field(default="auto", metadata={"help": "What drafts a block on a cache miss: the draft just in "
                          "time, an n-gram lookup of the text so far, random tokens (the paper's baseline), or auto "
                          "(the draft below the critical batch size, n-gram lookup from it on).", "choices": FALLBACKS})
    overlap: bool = field(default=True, metadata={"help": "Speculate in a thread (on a GPU, its own CUDA stream) "
                          "while the target verifies; False runs the two one after the other."})
    progress: bool = field(default=True, metadata={"help": "Show a bar while fallback auto measures this machine's "
                           "costs the first time, as AutoScheduled(progress=) does."})

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise a TypeError or ValueError naming the first field that cannot work (run when made, and again by
        generate(), as a field may have been set since)."""
        if isinstance(self.cache_size, bool) or not isinstance(self.cache_size, numbers.Integral):
            raise WrongTypeError(f"SSDConfig.cache_size must be an int (blocks per row), got {self.cache_size!r}.")
        for name in ("power_law_r", "saguaro_c") + (("acceptance",) if self.acceptance is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise WrongTypeError(f"SSDConfig.{name} must be a number, got {value!r}.")
            if math.isnan(value):
                raise ValueError(f"SSDConfig.{name} must be a number, got NaN.")
        for name in ("overlap", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise WrongTypeError(f"SSDConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if isinstance(self.fan_out, str):
            if self.fan_out not in FAN_OUTS:
                raise ValueError(f"SSDConfig.fan_out must be one of {', '.join(FAN_OUTS)} or a list of blocks per "
                                 f"number of accepted tokens, got {self.fan_out!r}.")
        elif not isinstance(self.fan_out, Sequence) or not all(
                isinstance(F, numbers.Integral) and not isinstance(F, bool) and F >= 0 for F in self.fan_out):
            raise WrongTypeError("SSDConfig.fan_out must be geometric, uniform or a list of blocks (ints >= 0) per "
                                 f"number of accepted tokens, got {self.fan_out!r}.")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"SSDConfig.fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}.")
        if self.cache_size < 0:
            raise ValueError(f"SSDConfig.cache_size must be >= 0 blocks, got {self.cache_size}.")
        if not isinstance(self.fan_out, str) and sum(self.fan_out) != self.cache_size:
            raise ValueError(f"SSDConfig.fan_out holds {sum(self.fan_out)} blocks but cache_size is "
                             f"{self.cache_size}: set cache_size={sum(self.fan_out)}.")
        if not 0.0 <= self.saguaro_c <= 1.0:
            raise ValueError(f"SSDConfig.saguaro_c must be in [0, 1], got {self.saguaro_c}.")
        if self.power_law_r <= 0:
            raise ValueError(f"SSDConfig.power_law_r must be > 0, got {self.power_law_r}.")
        if self.acceptance is not None and not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"SSDConfig.acceptance must be in [0, 1] or None, got {self.acceptance}.")

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if not isinstance(self.fan_out, str):  # JSON-ready, whatever ints the list held
            out["fan_out"] = [int(F) for F in self.fan_out]
        return out


@dataclass
class _Speculation:
    """The cache of one round: the outcomes prepared for (N, S) and a block for each (tensors (N, S, ...)); None
    when no row can reach an outcome the fan-out holds (S = 0: the round after it misses)."""

    outcomes: PredictedOutcomes
    blocks: DraftBlock | None
    ranked: tuple  # (probs, tokens, verify_len): what the outcomes' candidates were ranked by, for `bonus_rank`


@dataclass
class _Ready:
    """Blocks ready for the next round: per row, whether it came from the cache, the block where it did, its lag
    (how many tokens before its anchor it saw without their target features), and the outcome that decided it
    (k accepted, and the bonus's rank among the candidates for k: `bonus_rank`)."""

    hit: torch.Tensor
    block: DraftBlock | None  # None when nothing was cached
    lag: torch.Tensor
    accepted: torch.Tensor
    rank: torch.Tensor

    def select(self, idx: torch.Tensor) -> "_Ready":
        block = None if self.block is None else self.block.index(idx)
        return _Ready(self.hit[idx], block, self.lag[idx], self.accepted[idx], self.rank[idx])


def ngram_proposal(history: list[int], length: int, max_n: int = 3) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the history's last n tokens
    (n = max_n down to 1), at most `length` of them; [] when the tail occurs nowhere before."""
    for n in range(min(max_n, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == tail:
                return history[start + n:start + n + length]
    return []


class SSDSource:
    """A [`BlockSource`]: each round's block comes from the speculation cache built while the target verified the
    last one, or from a fallback where the real outcome is not in it. The decoding loop verifies and commits it as
    any other block; this source sees the outcome and keeps the blocks prepared for it.

    Made for one generate() call, before its first round: the auto fallback measures this machine's costs here
    (once, cached on disk, with a progress bar) rather than inside the first round's drafting time. `stats` counts
    what the cache did (`DSparkGenerateOutput.ssd_stats`); `timings` the speculator's seconds and verification's
    wait for it. Close it (`close`) when the call ends: its thread is shut down.
    """

    def __init__(self, config: SSDConfig, target, draft, transcript, do_sample: bool):
        self.config, self.draft, self.transcript, self.do_sample = config, draft, transcript, do_sample
        device = transcript.prompt.device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dspark-ssd") if config.overlap else None
        self._stream = torch.cuda.Stream(device) if config.overlap and device.type == "cuda" else None
        # the stream the decode (and its verification) runs on, which the speculator's stream is ordered against
        self._verifier_stream = torch.cuda.current_stream(device) if self._stream is not None else None
        # the speculator samples with its own generator, seeded from the caller's: a seed gives the same output
        self._generator = torch.Generator(device=device).manual_seed(int(torch.randint(2 ** 62, (1,))))
        self._costs = None if config.fallback != "auto" else cached_costs(
            target, draft, sorted({1, transcript.prompt.shape[0]}), progress=config.progress)
        # N x S blocks: kept over the draft's own vocabulary, unless a processor reads which token a column is
        self._needs_target_vocab = not all(isinstance(p, VOCAB_FREE_PROCESSORS) for p in transcript.processors)
        self._next: _Ready | None = None  # blocks ready for the next round's rows
        self._speculation: _Speculation | None = None  # made during this round's verification
        self._looked_up: torch.Tensor | None = None  # (B,) rows whose block this round an n-gram / random lookup made
        self._lag: torch.Tensor | None = None  # (B,) tokens before each anchor its block saw without their features
        # how this round's block was found, counted once the round's rows are known: (the cache looked in or None,
        # its hits (B,), the fallback's kind or None, the rows it served (B,))
        self._found: tuple | None = None
        # running counts for the fan-out and the fallback: rounds, hits, tokens committed after hits / misses
        self.stats = {"rounds": 0, "hits": 0, "accepted": 0, "verified": 0, "rejections": 0, "tokens_hit": 0,
                      "rounds_hit": 0, "tokens_miss": 0, "rounds_miss": 0,
                      "fallbacks": {name: 0 for name in FALLBACKS[1:]},
                      "by_lag": {},  # lag -> [accepted, verified, rejections] (lag 0: drafted in time)
                      "outcomes": {}, "bonus_ranks": {}}  # k -> rounds; k -> {bonus rank -> rounds}
        # measured overlap: seconds the speculator ran, and seconds verification then waited for it
        self.timings = {"speculate": 0.0, "wait": 0.0}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def clock(self) -> float:
        """The verifier's clock: with the speculator on a CUDA stream, the current stream's work only (a device-wide
        sync would wait for the speculator it overlaps, and serialize the two)."""
        return clock(self.transcript.prompt.device, self._verifier_stream)

    def _speculator_clock(self) -> float:
        """The speculator's clock: its own CUDA stream's work only, for the same reason."""
        return clock(self.transcript.prompt.device, self._stream)

    # -- this round's block --------------------------------------------------------------------------------------
    def propose(self, rows, anchor, anchor_positions, context, process_logits) -> Proposal:
        R, ready = rows.numel(), self._next
        hit = ready.hit if ready is not None else torch.zeros(R, dtype=torch.bool, device=rows.device)
        reach = torch.full((R,), self.draft.config.block_size, device=rows.device)
        self._looked_up = torch.zeros(R, dtype=torch.bool, device=rows.device)
        kind = None
        if bool(hit.all()):
            block = ready.block
        else:
            block, kind = self._fallback(rows, anchor, anchor_positions, context, process_logits, ~hit, reach)
            if ready is not None and bool(hit.any()):
                block = _merge(block, ready.block, hit)
        self._lag = torch.where(hit, ready.lag, 0) if ready is not None else torch.zeros_like(rows)
        self._found = (ready, hit, kind, ~hit)
        return Proposal(block, reach, hit)

    def _fallback(self, rows, anchor, anchor_positions, context, process_logits, missed,
                  reach) -> tuple[DraftBlock, str]:
        """A block for every row (only the `missed` rows' are used): the draft's, or an n-gram / random one (whose
        rows' `reach` it cuts to what the lookup proposed); and which fallback made it."""
        kind = self.config.fallback
        if kind == "auto":
            kind = "ngram" if rows.numel() >= self.critical_batch_size(rows.numel()) else "draft"
        if kind == "draft":
            if isinstance(self.draft, BlockProposer):
                return self.draft.propose_block(anchor, anchor_positions, context, self.do_sample,
                                                process_logits=process_logits), kind
            return sample_blocks(self.draft, anchor[:, None], anchor_positions[:, None], context, self.do_sample,
                                 process_logits, reweight=self._reweight(self._fan_out())).index(slice(None), 0), kind
        self._looked_up = missed
        return self._lookup_block(rows, missed, reach, random=kind == "random"), kind

    def _lookup_block(self, rows, missed, reach, random: bool) -> DraftBlock:
        """One-hot blocks of tokens proposed without the draft: exact to verify like any other, as the proposal
        does not depend on the target's randomness."""
        R, gamma, V = rows.numel(), self.draft.config.block_size, self.draft.config.target_vocab_size
        tokens = torch.zeros(R, gamma, dtype=torch.long, device=rows.device)
        for i, r in enumerate(rows.tolist()):
            if not bool(missed[i]):
                continue
            if random:
                proposal = torch.randint(V, (gamma,), generator=self._generator, device=tokens.device).tolist()
            else:
                proposal = ngram_proposal(self.transcript.history(r), gamma)
            tokens[i, : len(proposal)] = torch.tensor(proposal, dtype=torch.long, device=tokens.device)
            reach[i] = len(proposal)
        probs = torch.nn.functional.one_hot(tokens, V).float()
        # no confidence head scores a lookup: confidence 1 lets a confidence policy verify it as far as it reaches
        # (`reach` cuts it there), and keeps rounds whose rows mix cache hits and lookups scored for the policy
        confidences = torch.ones(R, gamma, device=tokens.device) if self.draft.config.confidence_head else None
        return DraftBlock(tokens, probs, confidences)

    # -- the cache, built while the target verifies ----------------------------------------------------------------
    @contextlib.contextmanager
    def verifying(self, proposal, verify_len, anchor, anchor_positions, context):
        """Speculate on the outcomes of this verification while it runs: in the thread (and on a GPU the stream)
        of the speculator, or before it without overlap."""
        if not proposal.drafted or self.config.cache_size == 0:
            self._speculation = None
            yield
            return
        job = functools.partial(self._speculate, proposal.block, verify_len, anchor, anchor_positions, context,
                                self._looked_up)
        if self._pool is None:
            self._speculation = job()
            yield
            return
        if self._stream is not None:  # the block and its verified lengths may still be queued on this stream
            self._stream.wait_stream(self._verifier_stream)
        future = self._pool.submit(self._on_stream, job, _callers_autocast(anchor.device.type))
        yield
        start = self.clock()
        self._speculation = future.result()
        self.timings["wait"] += self.clock() - start
        if self._stream is not None:  # what the speculator made is read on this stream from here on
            # Its tensors belong to the speculator stream's memory pool and may be freed while reads of them are
            # still queued here; no record_stream is needed because the next job's stream first waits for this
            # one (above), so that memory cannot be reused before those reads are done.
            self._verifier_stream.wait_stream(self._stream)

    def _on_stream(self, job, autocast):
        with torch.no_grad(), autocast:
            if self._stream is None:
                return job()
            with torch.cuda.stream(self._stream):
                return job()

    def _speculate(self, block, verify_len, anchor, anchor_positions, context, looked_up) -> _Speculation:
        """Predict the outcomes of verifying `block` and draft the next block for each, in one draft pass."""
        start = self._speculator_clock()
        fan_out = self._fan_out()
        processors = self.transcript.processors
        process = (lambda prefix, logits: processors(prefix, logits.float())) if len(processors) else None
        probs = _own(block)
        if bool(looked_up.any()):
            # a lookup block's one-hot distributions name no bonus candidates (every other token ties at 0): the
            # draft's own distributions given its tokens do (the paper's primary speculator after a backup round)
            scored = score_block(self.draft, block.tokens, anchor, anchor_positions, context, process)
            probs = torch.where(looked_up[:, None, None], scored.probs, probs)
        outcomes = predict_outcomes(probs, block.tokens, verify_len, fan_out).worth_drafting()
        N, S = outcomes.bonus.shape
        if S == 0:  # still a round with a cache, all of whose outcomes miss
            speculation = _Speculation(outcomes, None, (probs, block.tokens, verify_len))
        else:
            # the tokens a block for outcome k starts after, without target features yet: the anchor and k accepted
            lag = int(outcomes.accepted.max()) + 1
            seq = torch.cat([anchor[:, None], block.tokens], 1)  # (N, gamma + 1)
            j = torch.arange(lag, device=seq.device)
            source = j - (lag - 1 - outcomes.accepted[..., None])  # right-aligned: the last known token at lag - 1
            known = seq.gather(1, source.clamp_min(0).view(N, -1)).view(N, S, lag).masked_fill(source < 0, -1)
            blocks = sample_blocks(self.draft, outcomes.bonus, anchor_positions[:, None] + outcomes.accepted + 1,
                                   context, self.do_sample, process, self._generator, known=known,
                                   reweight=self._reweight(fan_out), target_vocab=self._needs_target_vocab)
            speculation = _Speculation(outcomes, blocks, (probs, block.tokens, verify_len))
        self.timings["speculate"] += self._speculator_clock() - start
        return speculation

    # -- what the round's outcome tells ----------------------------------------------------------------------------
    def learn(self, outcome: Outcome, rows: list[int]) -> None:
        """Count the round (its `rows`, those that decoded in it), and keep the blocks the cache holds for its real
        outcome."""
        if outcome.proposal.drafted:
            index = torch.tensor(rows, device=outcome.accepted.device)
            ready, hit, kind, missed = self._found
            if ready is not None:  # the rounds that had a cache to look in
                self.stats["rounds"] += len(rows)
                self.stats["hits"] += int(hit[index].sum())
                self._record_outcomes(ready.accepted[index], ready.rank[index])
                if kind is not None:  # a real miss (the first round has no cache to miss)
                    self.stats["fallbacks"][kind] += int(missed[index].sum())
            self._count(outcome, index)
        self._found = None
        self._next = self._ready(outcome.accepted, outcome.next_token)

    def _ready(self, accepted, next_token) -> _Ready | None:
        """The next round's blocks: where this round's speculation holds the real outcome, (R,) accepted and next
        token; None where nothing was speculated."""
        spec, self._speculation = self._speculation, None
        if spec is None:
            return None
        hit, slot = spec.outcomes.lookup(accepted, next_token)
        rank = bonus_rank(*spec.ranked, accepted, next_token)
        if spec.blocks is None:
            return _Ready(hit, None, torch.zeros_like(accepted), accepted, rank)
        rows = torch.arange(hit.shape[0], device=hit.device)
        block = spec.blocks.index(rows, slot).in_target_vocab(self.draft.config.target_vocab_size)
        return _Ready(hit, block, spec.outcomes.accepted[rows, slot] + 1, accepted, rank)

    def _count(self, outcome: Outcome, rows: torch.Tensor) -> None:
        hits, n, verified = outcome.proposal.cache_hit[rows], outcome.accepted[rows], outcome.verified[rows]
        for h, c in zip(hits.tolist(), outcome.committed[rows].tolist()):  # a stop may cut the chunk short
            key = "hit" if h else "miss"
            self.stats[f"tokens_{key}"] += c
            self.stats[f"rounds_{key}"] += 1
        self.stats["accepted"] += int(n.sum())
        self.stats["rejections"] += int((n < verified).sum())
        for lag, a, v in zip(self._lag[rows].tolist(), n.tolist(), verified.tolist()):
            seen = self.stats["by_lag"].setdefault(lag, [0, 0, 0])
            seen[0] += a
            seen[1] += v
            seen[2] += a < v
        self.stats["verified"] += int(verified.sum())

    def _record_outcomes(self, accepted, rank):
        """Count the outcomes a cache was looked up for: k accepted, and where the bonus stood among the candidates
        for k (what `fan_out.measured_fan_out` plans a cache from)."""
        for k, j in zip(accepted.tolist(), rank.tolist()):
            self.stats["outcomes"][k] = self.stats["outcomes"].get(k, 0) + 1
            if j >= 0:
                ranks = self.stats["bonus_ranks"].setdefault(k, {})
                ranks[j] = ranks.get(j, 0) + 1

    # -- planning ------------------------------------------------------------------------------------------------
    def _alpha(self) -> float:
        """The acceptance rate for the fan-out: the configured one, else [`acceptance_rate`] of the rounds so far."""
        if self.config.acceptance is not None:
            return self.config.acceptance
        return acceptance_rate(self.stats["accepted"], self.stats["rejections"])

    def _fan_out(self) -> list[int]:
        gamma, budget = self.draft.config.block_size, self.config.cache_size
        if not isinstance(self.config.fan_out, str):  # F_0..F_(gamma - 1), or with F_gamma = 0 as planners give it
            return [int(F) for F in self.config.fan_out[:gamma]] + [0]
        if self.config.fan_out == "uniform":
            return uniform_fan_out(budget, gamma, cache_last=False)
        return geometric_fan_out(budget, gamma, self._alpha(), self.config.power_law_r, cache_last=False)

    def _reweight(self, fan_out):
        if not self.do_sample or self.config.saguaro_c == 1.0:
            return None
        C = self.config.saguaro_c
        return lambda k, p: saguaro(p, fan_out[k], C)

    def critical_batch_size(self, rows: int) -> int:
        """From which batch size the n-gram fallback beats drafting just in time (Theorem 17), by this machine's
        measured costs and the hit rate and tokens per round seen so far (priors: half the outcomes hit, a block
        from the draft commits 1 + alpha tokens, an n-gram block 1); `rows`: the batch size now."""
        s, gamma, R = self.stats, self.draft.config.block_size, max(rows, 1)
        hit_rate = (s["hits"] + 1.0) / (s["rounds"] + 2.0)
        tokens_draft = (s["tokens_hit"] + 1.0 + self._alpha()) / (s["rounds_hit"] + 1.0)
        # the times of a round of R rows (an n-gram lookup costs next to nothing beside it)
        return critical_batch_size(hit_rate, tokens_draft, tokens_draft, 1.0, self._costs.verify(R, gamma + 1),
                                   self._costs.draft(R), 0.0)


def acceptance_rate(accepted: int, rejections: int) -> float:
    """The per-token acceptance rate alpha of the fan-out's model P(k) = alpha^k (1 - alpha): accepted tokens over
    accepted tokens plus rejections (its maximum likelihood; the tokens after a rejection were never tested, so they
    do not count), with one of each as a prior (0.5 before any round)."""
    return (accepted + 1.0) / (accepted + rejections + 2.0)


def _callers_autocast(device_type: str) -> torch.autocast:
    """The caller's `torch.autocast` state, to re-enter in the speculator's thread: autocast is thread-local, and
    without it the speculator would draft in float32 beside a bfloat16 fallback (and overlap would change which
    blocks are cached)."""
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                          enabled=torch.is_autocast_enabled(device_type),
                          cache_enabled=torch.is_autocast_cache_enabled())


def _merge(block: DraftBlock, cached: DraftBlock, use_cached: torch.Tensor) -> DraftBlock:
    """Rows of `cached` where use_cached (R,), of `block` elsewhere (confidences only if both have them)."""
    pick = (lambda a, b: None if a is None or b is None else torch.where(
        use_cached.view(-1, *([1] * (a.dim() - 1))), b, a))
    unweighted = None
    if block.unweighted is not None or cached.unweighted is not None:
        unweighted = pick(_own(block), _own(cached))
    return DraftBlock(pick(block.tokens, cached.tokens), pick(block.probs, cached.probs),
                      pick(block.confidences, cached.confidences), unweighted)


def _own(block: DraftBlock) -> torch.Tensor:
    """The draft's own distributions of a block (before any reweighting)."""
    return block.unweighted if block.unweighted is not None else block.probs
