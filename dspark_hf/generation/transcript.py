"""The output side of a decode: what plain generate() would show and return.

Logits processors and stopping criteria see, for every row, the ids plain `generate()` would pass them (the whole
original batch, in order: some processors keep per-row state); the output grows with what is generated, never to
the length limit ahead of it; rows stop as plain generate()'s do; each round leaves a record ([`DSparkRound`]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation import logits_process as lp
from transformers.generation.stopping_criteria import MaxLengthCriteria

from .. import internals
from .drafting import Outcome
from .records import DSparkGenerateOutput, DSparkRound
from .streamers import RoundStreamer

# logits processors that read only the scores' values, not which token a column is: safe on a draft's own vocabulary
VOCAB_FREE_PROCESSORS = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
                         lp.TypicalLogitsWarper, lp.EpsilonLogitsWarper, lp.EtaLogitsWarper,
                         lp.InfNanRemoveLogitsProcessor, lp.LogitNormalization)
# processors that read no ids, only the scores: safe to apply to any subset of rows in one call
IDS_FREE_PROCESSORS = VOCAB_FREE_PROCESSORS + (lp.SuppressTokensLogitsProcessor,)


@dataclass
class Transcript:
    """Every row's output so far, and the processors, criteria and streamer that see it.

    prompt (B, P) and prompt_mask (B, P): as generate() passed them. gen (B, W): each row's generated tokens,
    padded; n_gen (B,): how many; stopped_at (B,): output length at which a criterion first fired, 0 if none yet;
    longest: generated tokens of the longest row so far (plain generate()'s sequence length, less P); rounds: per
    row, its records. max_new: the request's length limit in new tokens; stop_limit: where the output ends once
    every row has stopped and no EOS criterion pads finished rows (plain generate() then ends with the last one).
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
    rounds: list[list[DSparkRound]]
    longest: int = 0
    stop_limit: int | None = None

    @classmethod
    def start(cls, prompt, prompt_mask, processors, criteria, cfg, streamer) -> "Transcript":
        """The transcript of a call about to decode `prompt` (B, P) with generate()'s processors, criteria and
        config `cfg`."""
        B, P = prompt.shape
        # generate() turned max_new_tokens into max_length = P + max_new_tokens and a MaxLengthCriteria, which a
        # caller's own replaces; plain generate() decodes one token before it first asks the criteria, however low
        # the limit
        limits = [c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)]
        pad = internals.pad_token_id(cfg)
        pad_id = pad if pad is not None else 0
        return cls(prompt, prompt_mask if prompt_mask is not None else torch.ones_like(prompt), processors,
                   StoppingCriteriaList(c for c in criteria if not isinstance(c, MaxLengthCriteria)),
                   [c for c in criteria if isinstance(c, MaxLengthCriteria)],
                   max(min(limits) - P, 1) if limits else cfg.max_length - P,
                   # as in plain generate() (which asks the same question): rows stopped by a criterion are padded
                   # only when an EOS criterion is present; otherwise they go on until every row has stopped
                   any(hasattr(c, "eos_token_id") for c in criteria), pad_id, streamer, cfg.return_dict_in_generate,
                   prompt.new_full((B, 0), pad_id), prompt.new_zeros(B), prompt.new_zeros(B), [[] for _ in range(B)])

    # -- the length limit -----------------------------------------------------------------------------------------
    @property
    def limit(self) -> int:
        """The output's length limit in new tokens: max_new, or less once every row has stopped (`stop_limit`)."""
        return self.max_new if self.stop_limit is None else min(self.max_new, self.stop_limit)

    def remaining(self, rows: torch.Tensor) -> torch.Tensor:
        """(R,) tokens each of `rows` may still add."""
        return self.limit - self.n_gen[rows]

    def one_token_left(self, rows: torch.Tensor) -> bool:
        """Whether every one of `rows` has a single token left (its next token only: nothing to verify)."""
        return bool((self.remaining(rows) <= 1).all())

    # -- what plain generate() would see ---------------------------------------------------------------------------
    def history(self, row: int) -> list[int]:
        """A row's tokens so far: its prompt without padding, then what it generated."""
        return self.prompt[row, self.prompt_mask[row].bool()].tolist() + self.gen[row, : int(self.n_gen[row])].tolist()

    def process(self, rows: torch.Tensor, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Logits processors on (R, V) logits whose rows continue generated tokens + prefix (R, k)."""
        logits = logits.float()
        if len(self.processors) == 0:
            return logits
        if all(isinstance(p, IDS_FREE_PROCESSORS) for p in self.processors):
            return self.processors(prefix, logits)  # they read only the scores, row by row
        out = torch.empty_like(logits)
        for sel, ids in self._plain_batches(rows, prefix):
            out[sel] = self.processors(ids, self._full(rows, sel, logits))[rows[sel]]
        return out

    def stop_index(self, rows, chunk, counts, scores) -> torch.Tensor:
        """1-based position inside each row's chunk (R, k) where a stopping criterion fires, 0 if none does."""
        stop_at = torch.zeros_like(counts)
        if len(self.criteria) == 0:
            return stop_at
        for k in range(1, int(counts.max()) + 1):
            for sel, ids in self._plain_batches(rows, chunk[:, :k]):
                # criteria read the scores, never write them: a whole batch in order gets them without a copy
                full = scores[:, k - 1] if sel.numel() == ids.shape[0] else self._full(rows, sel, scores[:, k - 1])
                fired = self.criteria(ids, full)[rows[sel]].to(counts.device)
                s = sel[fired & (stop_at[sel] == 0) & (counts[sel] >= k)]
                stop_at[s] = k
        return stop_at

    def _plain_batches(self, rows: torch.Tensor, extra: torch.Tensor):
        """Yield (selector into rows, input_ids (B, T)) so that every active row is called with exactly the ids plain
        generate() would pass its logits processors and stopping criteria: padded prompt + generated tokens +
        `extra`. Processors may keep per-row state (e.g. repetition_penalty's prompt lengths), so each call covers
        the whole original batch in order; rows of other lengths show their own ids cut or padded to the length
        (ids plain generate() shows too: earlier steps, or a finished row) and their outputs are unused."""
        lengths = self.n_gen[rows]
        B, P = self.prompt.shape
        if rows.numel() == B and bool((lengths == lengths[0]).all()):  # no row finished, none ahead: nothing to fill
            yield torch.arange(B, device=rows.device), torch.cat([self.prompt, self.gen[:, :int(lengths[0])], extra], 1)
            return
        groups = lengths.unique().tolist()
        history = torch.cat([self.prompt, self._generated(max(groups) + extra.shape[1])], 1)
        for g in groups:
            sel = (lengths == g).nonzero().squeeze(1)
            r = rows[sel]
            ids = history[:, :P + g + extra.shape[1]].clone()
            ids[r] = torch.cat([self.prompt[r], self.gen[r, :g], extra[sel]], dim=1)
            yield sel, ids

    def _generated(self, width: int) -> torch.Tensor:
        """(B, width): each row's first `width` generated tokens, padded where it has fewer."""
        part = self.gen[:, :width]
        missing = width - part.shape[1]
        return torch.cat([part, part.new_full((part.shape[0], missing), self.pad_id)], 1) if missing else part

    def _full(self, rows, sel, values):
        full = values.new_zeros(self.prompt.shape[0], *values.shape[1:])
        full[rows[sel]] = values[sel]
        return full

    # -- what a round adds -----------------------------------------------------------------------------------------
    def record(self, rows: torch.Tensor, outcome: Outcome, stop_at: torch.Tensor, one_token_left: bool) -> None:
        """Each row's record of a round; a [`RoundStreamer`] gets it before the round's tokens (batch size 1), its
        `committed` cut where a criterion fired."""
        block, R = outcome.proposal.block, rows.numel()
        hits = outcome.proposal.cache_hit if outcome.proposal.drafted else None
        fields = dict(drafted=block.tokens.tolist(),
                      draft_probs=block.probs.gather(-1, block.tokens[..., None]).squeeze(-1).tolist(),
                      confidences=[None] * R if block.confidences is None else block.confidences.tolist(),
                      verified=outcome.verified.tolist(), accepted=outcome.accepted.tolist(),
                      next_token=outcome.next_token.tolist(), committed=outcome.committed.tolist(),
                      cache_hit=[None] * R if hits is None else hits.tolist())
        for i, row in enumerate(rows.tolist()):
            self.rounds[row].append(DSparkRound(**{name: values[i] for name, values in fields.items()},
                                                one_token_left=one_token_left))
        if isinstance(self.streamer, RoundStreamer):
            record = self.rounds[0][-1]
            if int(stop_at[0]):  # the output ends where the criterion fired (with or without an EOS id)
                record.committed = min(record.committed, int(stop_at[0]))
            self.streamer.put_round(record)

    def commit(self, rows, chunk, counts, stop_at) -> torch.Tensor:
        """Append chunk[:, :counts] (R, k) to the rows' outputs; return which rows are done (length limit, or
        stopped)."""
        first = (stop_at > 0) & (self.stopped_at[rows] == 0)
        self.stopped_at[rows[first]] = self.n_gen[rows[first]] + stop_at[first]
        if not self.pads_finished and self.stop_limit is None and bool((self.stopped_at > 0).all()):
            self.stop_limit = int(self.stopped_at.max())
        self._append(rows, chunk, counts, stop_at)
        done = self.n_gen[rows] >= self.limit
        return done | (stop_at > 0) if self.pads_finished else done

    def _append(self, rows, chunk, counts, stop_at) -> None:
        k = torch.arange(chunk.shape[1], device=chunk.device)
        take = k < counts[:, None]
        slots = self.n_gen[rows][:, None] + k
        end = int((self.n_gen[rows] + counts).max())
        self._make_room(end)
        if end > self.longest:
            self._pass_lengths_to_the_length_criteria(self.longest, end)
            self.longest = end
        self.gen[rows[:, None].expand_as(chunk)[take], slots[take]] = chunk[take]
        self.n_gen[rows] += counts
        if self.streamer is not None:  # batch size 1: the output ends where a criterion fired, even without EOS
            self.streamer.put(chunk[0, : int(stop_at[0]) or int(counts[0])].cpu())

    def _make_room(self, width: int) -> None:
        """Widen `gen` to at least `width` columns, doubling (up to the length limit) so that a limit far beyond
        the output costs nothing and the copies add up to O(output)."""
        if width > self.gen.shape[1]:
            self.gen = self._generated(max(width, min(2 * self.gen.shape[1], self.limit)))

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
        generated = min(int(self.n_gen.max()), self.limit)
        sequences = torch.cat([self.prompt, self.gen[:, :generated]], 1)
        if not self.return_records:
            return sequences
        self._clip_records(generated)
        return DSparkGenerateOutput(sequences=sequences, rounds=self.rounds, timings=timings)

    def _clip_records(self, generated: int) -> None:
        """Make each round's `committed` count what reached the output: without an EOS id, a stopping criterion that
        fires in every row ends the output inside the last rounds' chunks (the first token came from the prefill)."""
        for row in self.rounds:
            left = generated - 1
            for r in row:
                r.committed = max(0, min(r.committed, left))
                left -= r.committed
