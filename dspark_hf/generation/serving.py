"""DSpark under live traffic: requests join and leave a running batch between rounds ([`DSparkServer`]).

The server keeps one decoding state of `max_batch_size` rows (`state.DecodingState`, each row at its own offset).
Requests come at any time (`submit`, from any thread) and wait; between rounds the server admits waiting requests
into free rows (prompts of one length prefilled together, each then taken into its row: `DecodingState.admit`),
runs one DSpark round over every row (a row without a request verifies nothing), hands each request what it
committed, and frees the rows of requests that finished (an EOS id, their `max_new_tokens`) or were cancelled. A
request's greedy output is plain generate()'s on it alone; sampled, it follows the target's distribution exactly
(the same rejection sampling as `generate()`'s rounds).

What this first step does not do yet (issue 61): packed verification (a round verifies every row at its longest
row's width, padded); sampling settings per request (one set per server; each request has its own prompt and
`max_new_tokens`); one host read a round (a round reads the block's confidences before it plans, then its outcome:
joins take rows between rounds, so the next block is drafted after them).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .. import internals
from ..model.modeling_dspark import DSparkDraftModel
from ..model.sampling import raise_if_not_finite
from ..scheduling.auto import AutoScheduled
from ..scheduling.policies import as_policy
from . import verify
from .block_sources import Drafter, Outcome
from .candidate_generator import DSparkCandidateGenerator
from .host import HostRead, to_device
from .pricing import StepClock
from .state import DecodingState
from .steps import Steps
from .transcript import eos_index, scores_of_block


@dataclass(eq=False)
class ServedRequest:
    """A request to a [`DSparkServer`]: its prompt ids, its length limit, and what it has generated so far
    (`tokens`, growing round by round). finish_reason: None while it waits or decodes, then "eos", "length" or
    "cancelled"."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    row: int | None = None  # its row in the batch while it decodes

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def left(self) -> int:
        """Tokens it may still add."""
        return self.max_new_tokens - len(self.tokens)


@dataclass
class Scores:
    """The server's logits processors, which read only the scores (temperature, top-k, top-p): every row and every
    position of a block at once, as `generate()` applies them to each row (`StepClock` prices rounds with it)."""

    processors: LogitsProcessorList

    def process(self, prefix: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return self.processors(prefix, logits.float())

    def process_block(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Scores (B, L + 1, V) of a verification's logits (B, >= L + 1, V) over drafted tokens x (B, L)."""
        return scores_of_block(self.processors, x, logits[:, :x.shape[1] + 1].float())


@dataclass
class ServerStats:
    """What a server's rounds did: rounds run, rows decoding summed over them, drafted tokens verified and accepted
    summed over those rows, and rounds that drafted."""

    rounds: int = 0
    row_rounds: int = 0
    verified: int = 0
    accepted: int = 0
    drafted_rounds: int = 0

    @property
    def verified_per_request_round(self) -> float:
        """Drafted tokens verified per request per round (the paper's verification budget under load)."""
        return self.verified / self.row_rounds if self.row_rounds else 0.0


def sampling_processors(temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None) -> LogitsProcessorList:
    """The warpers plain generate(do_sample=True, ...) applies for these settings, in its order."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return processors


class DSparkServer:
    """Continuous batching with DSpark rounds (see the module).

    target, draft: as for `generate(assistant_model=draft)`. max_batch_size: rows decoding at once; max_length: the
    longest prompt + max_new_tokens a request may ask for (the state holds that many slots per row). policy: a
    verification policy (default `AutoScheduled()`, priced at max_batch_size rows: every round runs them all).
    do_sample, temperature, top_k, top_p: as generate()'s, for every request (top_k None: no top-k, where
    generate()'s default config has 50). eos_token_id: where a request stops (default: the target's generation
    config's). compile_config: a transformers `CompileConfig` to compile the round's two forwards with, as
    generate() with a static cache does (`steps.Steps`; a CPU needs its `_compile_all_devices`); None: eager.

    >>> server = DSparkServer(target, draft, max_batch_size=8)
    >>> request = server.submit(tokenizer("Hello").input_ids, max_new_tokens=32)
    >>> while not request.done:
    ...     server.step()  # {request: tokens it committed in this round}
    """

    def __init__(self, target, draft: DSparkDraftModel, max_batch_size: int = 8, max_length: int = 1024,
                 policy=None, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | list[int] | None = None, compile_config=None):
        if not isinstance(draft, DSparkDraftModel):
            raise TypeError(f"DSparkServer needs a DSparkDraftModel as its draft, got {type(draft).__name__}: load "
                            "one with DSparkDraftModel.from_pretrained(...).")
        for name, value in (("max_batch_size", max_batch_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DSparkServer: {name} must be a positive integer, got {value!r}.")
        refused = internals.row_masks_refused(target)
        if refused is not None:
            raise ValueError(f"DSparkServer keeps every request at its own offset, which {type(target).__name__} "
                             f"cannot ({refused}): serve it with generate() on static batches.")
        if not draft.is_bound_to(target):
            draft.bind_target(target)
        self.target, self.draft, self.do_sample = target, draft, do_sample
        self.max_batch_size, self.max_length = max_batch_size, max_length
        self.scores = Scores(sampling_processors(temperature, top_k, top_p) if do_sample else LogitsProcessorList())
        eos = target.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self._eos, self._eos_ids = torch.tensor(eos, dtype=torch.long, device=target.device), set(eos)
        self.steps = Steps(target, draft, compile_config)
        gamma = draft.config.block_size
        self.state = DecodingState.allocate(target, draft, max_batch_size, max_length + gamma + 1, shared=False,
                                            compiled=self.steps.compiled)
        self.state.host_ends = [0] * max_batch_size
        self.policy = AutoScheduled() if policy is None else as_policy(policy)
        self.policy.prepare(target, draft, max_batch_size, sampling=do_sample)
        self.candidates = DSparkCandidateGenerator(draft, Drafter(draft, do_sample, self.steps.draft_block),
                                                   self.policy)
        self.rows: list[ServedRequest | None] = [None] * max_batch_size
        self._waiting: deque[ServedRequest] = deque()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._priced = False
        self.stats = ServerStats()

    # -- requests ----------------------------------------------------------------------------------------------------
    def submit(self, input_ids, max_new_tokens: int) -> ServedRequest:
        """Queue a request (prompt ids: a list of ints or a 1-D tensor); it joins the batch at a later round. A bad
        request is refused here with one line, leaving the others as they are."""
        prompt = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
        vocab = self.target.get_output_embeddings().weight.shape[0]
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"a request's prompt must be a non-empty list of token ids in [0, {vocab}), got "
                             f"{str(prompt)[:60]}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_length:
            raise ValueError(f"a request of {len(prompt)} prompt tokens and max_new_tokens={max_new_tokens} is longer "
                             f"than this server's max_length={self.max_length}: shorten it, or start the server "
                             "with a larger max_length.")
        with self._lock:
            request = ServedRequest(next(self._ids), prompt, max_new_tokens)
            self._waiting.append(request)
        return request

    def cancel(self, request: ServedRequest) -> None:
        """Stop `request`: it leaves before the next round (its row goes to a waiting request)."""
        with self._lock:
            self._cancelled.add(request.id)

    @property
    def busy(self) -> bool:
        """Whether a request waits or decodes."""
        with self._lock:
            return bool(self._waiting) or any(r is not None for r in self.rows)

    def drain(self) -> None:
        """Run rounds until every request submitted so far has finished."""
        while self.busy:
            self.step()

    # -- one step: leave, join, one round ----------------------------------------------------------------------------
    @torch.no_grad()  # as generate(): the state's buffers must not chain every round's autograd graph
    def step(self) -> dict[ServedRequest, list[int]]:
        """Between rounds, cancelled requests leave and waiting ones join free rows; then one round. Returns the
        tokens each request committed in this step (a joining request's first token included)."""
        committed: dict[ServedRequest, list[int]] = {}
        joining = self._leave_and_take()
        if joining:
            self._join(joining, committed)
        if any(r is not None for r in self.rows):
            self._round(committed)
        return committed

    def _leave_and_take(self) -> list[ServedRequest]:
        """Free the rows of cancelled requests; take as many waiting requests as rows are free."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            for request in self.rows:
                if request is not None and request.id in cancelled:
                    self._finish(request, "cancelled")
            waiting = [r for r in self._waiting if r.id not in cancelled]
            for request in self._waiting:
                if request.id in cancelled:
                    request.finish_reason = "cancelled"
            free = sum(r is None for r in self.rows)
            taken, rest = waiting[:free], waiting[free:]
            self._waiting = deque(rest)
            return taken

    def _join(self, joining: list[ServedRequest], committed: dict) -> None:
        """Prefill the joining requests (those of one prompt length together), pick each one's first token, and
        give each that goes on a free row."""
        by_length: dict[int, list[ServedRequest]] = {}
        for request in joining:
            by_length.setdefault(len(request.prompt), []).append(request)
        device = self.target.device
        for P, group in by_length.items():
            prompt = torch.tensor([r.prompt for r in group], dtype=torch.long, device=device)
            prefill = DecodingState.allocate(self.target, self.draft, len(group), P, shared=False, compiled=False)
            logits = prefill.prefill(self.target, self.draft, prompt, torch.ones_like(prompt))
            token = verify.next_token(self.scores.process(prompt.new_zeros(len(group), 0), logits[:, -1]),
                                      self.do_sample)
            for i, (request, first) in enumerate(zip(group, token.tolist())):
                self._add(request, [first], committed)
                if request.done:
                    continue
                row = self.rows.index(None)
                self.state.admit(row, prefill, i, first)
                self.rows[row], request.row = request, row

    def _round(self, committed: dict) -> None:
        """One DSpark round over every row: draft (where the policy drafts), plan per row, verify in one target
        forward, accept, commit."""
        state, candidates = self.state, self.candidates
        if not self._priced:  # compiled, every width once; the default policy times the rounds (cached on disk)
            self.steps.prepared(state)
            self.steps.warm(state, self.do_sample, self.scores.process)
            self.policy.price(StepClock(self.steps, state, self.scores, self.do_sample))
            self._priced = True
        rows = [b for b, r in enumerate(self.rows) if r is not None]
        remaining = [self.rows[b].left for b in rows]
        drafting = candidates.drafts(rows, remaining)
        context = None
        if drafting:
            state.catch_up(self.draft, state.host_end)
            context = state.context(self.steps.context_width(state, state.host_end))
        proposal = candidates.propose(state.anchor, state.count, context, self.scores.process, drafting)
        block = proposal.block
        read = (HostRead().add("confidences", block.confidences if proposal.drafted else None)
                .add("reach", proposal.reach if proposal.drafted else None)
                .add("finite", block.finite if proposal.drafted else None).read())
        if read["finite"] is not None:
            raise_if_not_finite(read["finite"])
        proposal, lengths = candidates.plan(proposal, read["confidences"], read["reach"], rows, remaining)
        block, L, B, device = proposal.block, max(lengths, default=0), self.max_batch_size, state.anchor.device
        verify_len, live = [0] * B, [False] * B
        for b, n in zip(rows, lengths):
            verify_len[b], live[b] = n, True
        verify_len, live = to_device(verify_len, torch.long, device), to_device(live, torch.bool, device)

        # verify: one target forward over [anchor, x] after each row's committed tokens (compiled: padded to a
        # width its graphs know)
        x, Q = block.tokens[:, :L], self.steps.width(L + 1)
        encode = proposal.drafted  # a round that drafted leaves the draft's context whole; one that did not, stale
        inputs = torch.cat([state.anchor[:, None], x, x.new_zeros(B, Q - L - 1)], 1)
        logits = self.steps.verify(state, inputs, encode=encode)
        if not encode:
            state.unencoded(rows)
        scores = self.scores.process_block(x, logits)

        # accept a prefix of x, then the target's own token; a row stops at its first EOS id
        n, nxt = verify.verify_block(scores, block.probs, x, verify_len, self.do_sample)
        chunk = torch.cat([x, x.new_zeros(B, 1)], 1).scatter(1, n[:, None], nxt[:, None])
        kept = torch.where(live, n + 1, 0)
        stop_at = eos_index(chunk, kept, self._eos)
        cut = torch.where(stop_at > 0, stop_at, kept)
        state.keep(kept, nxt, Q)
        candidates.observe(Outcome(proposal, verify_len, n, nxt, cut), rows)
        read = state.ask(HostRead().add("accepted", n).add("cut", cut).add("chunk", chunk)).read()
        state.mirror(read)
        accepted = [read["accepted"][b] for b in rows]
        candidates.learn(lengths, accepted, drafted=proposal.drafted)
        self._count(rows, lengths, accepted, proposal.drafted)
        for b in rows:
            self._add(self.rows[b], read["chunk"][b][:read["cut"][b]], committed)

    def _count(self, rows: list[int], lengths: list[int], accepted: list[int], drafted: bool) -> None:
        st = self.stats
        st.rounds += 1
        st.row_rounds += len(rows)
        st.verified += sum(lengths)
        st.accepted += sum(accepted)  # within what each row verified
        st.drafted_rounds += drafted

    def _add(self, request: ServedRequest, tokens: list[int], committed: dict) -> None:
        """Hand `request` the tokens it committed; it finishes at an EOS id or its length limit."""
        request.tokens += tokens
        committed.setdefault(request, []).extend(tokens)
        if tokens and tokens[-1] in self._eos_ids:
            self._finish(request, "eos")
        elif request.left <= 0:
            self._finish(request, "length")

    def _finish(self, request: ServedRequest, reason: str) -> None:
        request.finish_reason = reason
        if request.row is not None:
            self.state.vacate(request.row)
            self.rows[request.row], request.row = None, None
