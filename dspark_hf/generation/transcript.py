"""The output side of a decode: what plain generate() would show and return.

Logits processors and stopping criteria see, for every row, the ids plain `generate()` would pass them (the whole
batch, in order: some processors keep per-row state); the output grows with what is generated, never to the
length limit ahead of it; rows stop as plain generate()'s do; each round leaves a record ([`DSparkRound`]).

The output lives on the device (`gen`, `n_gen`) and every round's additions are written there without the host
looking; the host keeps its own copy of what it must decide on (`n_host`, `stopped_host`: each row's length and
where it stopped), updated from the round's one read ([`host.HostRead`]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .. import internals
from .block_sources import Outcome
from .host import HostRead, to_device
from .records import DSparkGenerateOutput, DSparkRound
from .streamers import RoundStreamer

# logits processors that read only the scores' values, not which token a column is: safe on a draft's own vocabulary
VOCAB_FREE_PROCESSORS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
                         lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
                         lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization)
# processors that read no ids, only the scores: safe to apply to any subset of rows, and to every position at once
IDS_FREE_PROCESSORS = VOCAB_FREE_PROCESSORS + (lp.SuppressTokensLogitsProcessor,)


def scores_of_block(processors: LogitsProcessorList, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Processors that read only the scores (`IDS_FREE_PROCESSORS`) over every position of a verification's logits
    (B, L + 1, V) over drafted tokens x (B, L) at once."""
    B, L = x.shape
    V = logits.shape[-1]
    return processors(x.new_zeros(B * (L + 1), 0), logits.reshape(-1, V)).view(B, L + 1, V)


def eos_index(chunk: torch.Tensor, counts: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """1-based position of the first of `eos_ids` among each row's first counts[b] tokens of chunk (B, K), 0 if
    none."""
    fired = torch.isin(chunk, eos_ids) & (torch.arange(chunk.shape[1], device=chunk.device) < counts[:, None])
    return torch.where(fired.any(1), fired.long().argmax(1) + 1, 0)


@dataclass
class _RoundRecord:
    """A round's record as the device left it, turned into `DSparkRound`s only when they are asked for."""

    rows: list[int]  # the rows that decoded in it
    outcome: Outcome
    verified: list[int]
    one_token_left: bool


@dataclass
class Transcript:
    """Every row's output so far, and the processors, criteria and streamer that see it.

    prompt (B, P) and prompt_mask (B, P): as generate() passed them. gen (B, W): each row's generated tokens,
    padded; n_gen (B,): how many; stopped_at (B,): output length at which a criterion first fired, 0 if none yet (all
    on the device; n_host and stopped_host: the host's copies, read with each round's read: `mirror`). longest: generated tokens of the longest row so far
    (plain generate()'s sequence length, less P). max_new: the request's length limit in new tokens; stop_limit:
    where the output ends once every row has stopped and no EOS criterion pads finished rows (plain generate() then
    ends with the last one). records: the rounds' records, kept when the call returns them or streams them.
    """

    prompt: torch.Tensor
    prompt_mask: torch.Tensor
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList  # the length criteria apart: the limit is kept here
    length_criteria: list[MaxLengthCriteria]
    max_new: int
    pads_finished: bool
    pad_id: int
    streamer: object | None
    return_records: bool
    gen: torch.Tensor
    n_gen: torch.Tensor
    stopped_at: torch.Tensor
    n_host: list[int]
    stopped_host: list[int]
    longest: int = 0
    stop_limit: int | None = None
    records: list[_RoundRecord] = field(default_factory=list)
    block_size: int = 0
    keeps_records: bool = False  # records are kept: the call returns them, or streams them to a RoundStreamer
    eos_ids: torch.Tensor | None = None  # every EOS id the criteria stop at, where they are EOS criteria only

    @classmethod
    def start(cls, prompt, prompt_mask, processors, criteria, cfg, streamer, block_size: int) -> "Transcript":
        """The transcript of a call about to decode `prompt` (B, P) with generate()'s processors, criteria and
        config `cfg`, with blocks of `block_size` drafted tokens."""
        B, P = prompt.shape
        # generate() turned max_new_tokens into max_length = P + max_new_tokens and a MaxLengthCriteria, which a
        # caller's own replaces; plain generate() decodes one token before it first asks the criteria, however low
        # the limit
        limits = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        max_new = max(min(limits) - P, 1) if limits else cfg.max_length - P
        pad = internals.pad_token_id(cfg)
        pad_id = pad if pad is not None else 0
        others = StoppingCriteriaList(c for c in criteria if not isinstance(c, MaxLengthCriteria))
        eos_only = len(others) > 0 and all(type(c) is EosTokenCriteria for c in others)
        return cls(prompt, prompt_mask if prompt_mask is not None else torch.ones_like(prompt), processors, others,
                   [c for c in criteria if isinstance(c, MaxLengthCriteria)], max_new,
                   # as in plain generate() (which asks the same question): rows stopped by a criterion are padded
                   # only when an EOS criterion is present; otherwise they go on until every row has stopped
                   any(hasattr(c, "eos_token_id") for c in criteria), pad_id, streamer, cfg.return_dict_in_generate,
                   prompt.new_full((B, 0), pad_id), prompt.new_zeros(B), prompt.new_zeros(B), [0] * B, [0] * B,
                   block_size=block_size,
                   keeps_records=cfg.return_dict_in_generate or isinstance(streamer, RoundStreamer),
                   eos_ids=torch.cat([c.eos_token_id.to(prompt.device).reshape(-1) for c in others])
                   if eos_only else None)

    # -- the length limit, and who is done (host) ------------------------------------------------------------------
    @property
    def limit(self) -> int:
        """The output's length limit in new tokens: max_new, or less once every row has stopped (`stop_limit`)."""
        return self.max_new if self.stop_limit is None else min(self.max_new, self.stop_limit)

    def done(self) -> list[bool]:
        """Per row, whether it has finished: its length limit, or a criterion with finished rows padded."""
        return [n >= self.limit or (self.pads_finished and s > 0) for n, s in zip(self.n_host, self.stopped_host)]

    def live_rows(self) -> list[int]:
        return [b for b, finished in enumerate(self.done()) if not finished]

    def remaining(self, rows: list[int]) -> list[int]:
        """Tokens each of `rows` may still add."""
        return [self.limit - self.n_host[b] for b in rows]

    # -- what plain generate() would see ---------------------------------------------------------------------------
    def history(self, row: int) -> list[int]:
        """A row's tokens so far: its prompt without padding, then what it generated."""
        return self.prompt[row, self.prompt_mask[row].bool()].tolist() + self.gen[row, : self.n_host[row]].tolist()

    def process(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Logits processors on (B, V) logits whose rows continue generated tokens + prefix (B, k)."""
        logits = logits.float()
        if len(self.processors) == 0:
            return logits
        if all(isinstance(p, IDS_FREE_PROCESSORS) for p in self.processors):
            return self.processors(prefix, logits)  # they read only the scores, row by row
        return self._process_by_rows(prefix, logits)

    @torch.compiler.disable  # inside a compiled draft step: its row groups change every round, so it runs as it is
    def _process_by_rows(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Processors that read the ids, called with the ids plain generate() would show each group of rows."""
        batches = list(self._plain_batches(prefix))
        if len(batches) == 1:  # every row as long as the others: one call serves them all
            return self.processors(batches[0][1], logits)
        out = torch.empty_like(logits)
        for rows, ids in batches:
            index = to_device(rows, torch.long, logits.device)
            out[index] = self.processors(ids, logits)[index]
        return out

    def process_block(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The processed scores (B, L + 1, V) of a verification's logits (B, >= L + 1, V) over drafted tokens x
        (B, L): position j continues x[:, :j]. Processors that read only the scores run once over all positions."""
        B, L = x.shape
        logits = logits[:, :L + 1].float()
        if len(self.processors) == 0:
            return logits
        if all(isinstance(p, IDS_FREE_PROCESSORS) for p in self.processors):
            return scores_of_block(self.processors, x, logits)
        return torch.stack([self.process(x[:, :j], logits[:, j]) for j in range(L + 1)], 1)

    def stop_index(self, chunk: torch.Tensor, counts: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """1-based position inside each row's chunk (B, K) where a stopping criterion fires, 0 if none does, among
        its first counts[b] tokens."""
        stop_at = torch.zeros_like(counts)
        if len(self.criteria) == 0:
            return stop_at
        K = chunk.shape[1]
        if self.eos_ids is not None:  # EOS criteria read the last token only: every position at once
            return eos_index(chunk, counts, self.eos_ids)
        for k in range(1, K + 1):
            for rows, ids in self._plain_batches(chunk[:, :k]):
                # criteria read the scores, never write them
                index = to_device(rows, torch.long, counts.device)
                fired = self.criteria(ids, scores[:, k - 1])[index].to(counts.device)
                stop_at[index] = torch.where(fired & (stop_at[index] == 0) & (counts[index] >= k), k, stop_at[index])
        return stop_at

    def _plain_batches(self, extra: torch.Tensor):
        """Yield (rows, input_ids (B, T)) so that every row in `rows` (a list) is called with exactly the ids plain
        generate() would pass its logits processors and stopping criteria: padded prompt + generated tokens +
        `extra`. Processors may keep per-row state (e.g. repetition_penalty's prompt lengths), so each call covers
        the whole batch in order; rows of other lengths show their own ids cut or padded to the length (ids plain
        generate() shows too: earlier steps, or a finished row) and their outputs are unused. The rows are grouped
        by the host's copy of their lengths: nothing is read from the device."""
        groups: dict[int, list[int]] = {}
        for b, n in enumerate(self.n_host):
            groups.setdefault(n, []).append(b)
        for n, rows in groups.items():  # past a row's length `gen` holds the pad id: a shorter row shows padding
            yield rows, torch.cat([self.prompt, self.gen[:, :n], extra], 1)

    # -- what a round adds (device, then host) ---------------------------------------------------------------------
    def commit(self, chunk: torch.Tensor, counts: torch.Tensor, stop_at: torch.Tensor) -> None:
        """Append chunk[:, :counts] (B, K) to the rows' outputs and note where a criterion first fired, on the
        device (rows that have finished commit 0)."""
        self._make_room(max(self.n_host) + chunk.shape[1])
        k = torch.arange(chunk.shape[1], device=chunk.device)
        slots = self.n_gen[:, None] + k
        take = k < counts[:, None]
        self.gen.scatter_(1, slots, torch.where(take, chunk, self.gen.gather(1, slots)))
        first = (stop_at > 0) & (self.stopped_at == 0)
        self.stopped_at = torch.where(first, self.n_gen + stop_at, self.stopped_at)
        self.n_gen += counts

    def _make_room(self, width: int) -> None:
        """Widen `gen` to at least `width` columns (a round writes whole chunks, masked), doubling up to the length
        limit, so that a limit far beyond the output costs nothing and the copies add up to O(output)."""
        if width > self.gen.shape[1]:
            wider = max(width, min(2 * self.gen.shape[1], self.limit + self.block_size + 1))
            self.gen = torch.cat([self.gen, self.gen.new_full((self.gen.shape[0], wider - self.gen.shape[1]),
                                                              self.pad_id)], 1)

    # -- the host's copy (`host.Mirrored`) --------------------------------------------------------------------------
    def ask(self, read: HostRead) -> HostRead:
        """Add what the host keeps a copy of to the round's read: each row's length and where it stopped."""
        return read.add("out.n_gen", self.n_gen).add("out.stopped_at", self.stopped_at)

    def mirror(self, values: dict) -> None:
        """The host's copy of the rows' lengths and stops, as the round's read found them (`ask`), and what follows
        from them on the host: where the output ends once every row has stopped, the length criteria's view."""
        self.n_host, self.stopped_host = values["out.n_gen"], values["out.stopped_at"]
        if not self.pads_finished and self.stop_limit is None and all(self.stopped_host):
            self.stop_limit = max(self.stopped_host)
        after = max(self.n_host)
        if after > self.longest:
            self._pass_lengths_to_the_length_criteria(self.longest, after)
            self.longest = after

    def stream(self, tokens: list[int]) -> None:
        """The tokens row 0 (batch size 1) committed in the round, to the streamer."""
        if self.streamer is not None and tokens:
            self.streamer.put(torch.tensor(tokens, dtype=self.prompt.dtype, device="cpu"))

    def record(self, rows: list[int], outcome: Outcome, verified: list[int], one_token_left: bool,
               stop_at: list[int]) -> None:
        """Keep a round's record (only when the call returns or streams records); a [`RoundStreamer`] gets it now,
        before the round's tokens, its `committed` cut where a criterion fired (stop_at: the round's, per row)."""
        if not self.keeps_records:
            return
        self.records.append(_RoundRecord(rows, outcome, verified, one_token_left))
        if isinstance(self.streamer, RoundStreamer):
            record = self._rounds_of(self.records[-1])[0]
            if stop_at[0]:  # the output ends where the criterion fired (with or without an EOS id)
                record.committed = min(record.committed, stop_at[0])
            self.streamer.put_round(record)

    def _pass_lengths_to_the_length_criteria(self, before: int, after: int) -> None:
        """Call the length criteria as plain generate() would have between `before` and `after` generated tokens: the
        limit is kept here, but transformers' criterion also warns (once) when a sequence grows past the target's
        max_position_embeddings short of the limit. The longest such length stands for all of them."""
        P = self.prompt.shape[1]
        for criterion in self.length_criteria:
            length = min(P + after, criterion.max_length - 1)
            if length > P + before:
                criterion(self.prompt.new_empty(1, length), None)

    # -- the call's beginning and end ------------------------------------------------------------------------------
    def open(self) -> None:
        """The prompt goes to the streamer first, as in plain generate()."""
        if self.streamer is not None:
            self.streamer.put(self.prompt.cpu())

    def close(self, timings: dict[str, float]):
        """What generate() returns: the sequences (B, P + new), or with return_dict_in_generate a
        [`DSparkGenerateOutput`] with the records and `timings`."""
        if self.streamer is not None:
            self.streamer.end()
        generated = min(max(self.n_host), self.limit)
        sequences = torch.cat([self.prompt, self.gen[:, :generated]], 1)
        if not self.return_records:
            return sequences
        rounds: list[list[DSparkRound]] = [[] for _ in range(self.prompt.shape[0])]
        for record in self.records:
            for row, r in zip(record.rows, self._rounds_of(record)):
                rounds[row].append(r)
        _clip(rounds, generated)
        return DSparkGenerateOutput(sequences=sequences, rounds=rounds, timings=timings)

    @staticmethod
    def _rounds_of(record: _RoundRecord) -> list[DSparkRound]:
        """A kept record as the `DSparkRound` of each of its rows (one read)."""
        outcome, rows = record.outcome, record.rows
        block = outcome.proposal.block
        index = torch.tensor(rows, device=outcome.accepted.device)
        hits = outcome.proposal.cache_hit if outcome.proposal.drafted else None
        read = (HostRead().add("drafted", block.tokens[index])
                .add("draft_probs", block.probs[index].gather(-1, block.tokens[index][..., None]).squeeze(-1))
                .add("confidences", None if block.confidences is None else block.confidences[index])
                .add("accepted", outcome.accepted[index]).add("next_token", outcome.next_token[index])
                .add("committed", outcome.committed[index]).add("cache_hit", None if hits is None else hits[index])
                .read())
        return [DSparkRound(drafted=read["drafted"][i], draft_probs=read["draft_probs"][i],
                            confidences=None if read["confidences"] is None else read["confidences"][i],
                            verified=record.verified[i], accepted=read["accepted"][i],
                            next_token=read["next_token"][i], committed=read["committed"][i],
                            cache_hit=None if hits is None else read["cache_hit"][i],
                            one_token_left=record.one_token_left) for i in range(len(rows))]


def _clip(rounds: list[list[DSparkRound]], generated: int) -> None:
    """Make each round's `committed` count what reached the output: without an EOS id, a stopping criterion that
    fires in every row ends the output inside the last rounds' chunks (the first token came from the prefill)."""
    for row in rounds:
        left = generated - 1
        for r in row:
            r.committed = max(0, min(r.committed, left))
            left -= r.committed
