"""DSpark speculative decoding as a `generate()` decoding method, for any batch size.

Each round: the draft proposes a full block from every row's anchor; a verification policy decides how many of
those tokens each row sends to the target; one target forward scores them all; rejection sampling (or argmax
matching) keeps a prefix and adds the target's own next token. The target's hidden states of the kept tokens
become new draft context. Rows live flush right in every buffer (see `ragged`), finished rows leave the batch.

A round is a function of explicit state: the call's [`Decoding`] (models, policy, the output so far) and the rows
still decoding ([`Live`]) in, the rows after it out. Where its block comes from is a [`BlockSource`]'s.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from transformers import DynamicCache, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from .. import internals
from ..devices import clock
from ..model.modeling_dspark import DSparkContext, DSparkDraftModel
from ..scheduling.auto import AutoScheduled
from ..scheduling.policies import FullBlock, VerificationPolicy, as_policy, checked_lengths
from . import verify
from .drafting import BlockSource, Drafter, Outcome, Proposal, empty_block
from .ragged import Commit, leading_padding
from .records import DSparkGenerateOutput
from .request import check_request
from .ssd import SSDConfig, SSDSource
from .transcript import Transcript


def dspark_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    draft_model: DSparkDraftModel | None = None,
    token_streamer=None,
    verification_policy=None,
    ssd: SSDConfig | None = None,
    **model_kwargs,
):
    """Decoding method for ``target.generate(custom_generate=dspark_generate, draft_model=draft, ...)``.

    `target.generate(**inputs, assistant_model=draft)` routes here after ``import dspark_hf``. Extra arguments:
    draft_model (a [`DSparkDraftModel`] built for `model`, or a peft wrapper of one, unwrapped on the way in),
    token_streamer (a transformers streamer; batch size 1; one with a `put_round(DSparkRound)` method also gets each
    round's record, see `DSparkRoundStreamer`), verification_policy (a `dspark_hf.scheduling` policy, or a
    callable(confidences (R, gamma) or None, gamma, R) -> verify lengths (R,); default: `AutoScheduled()`, which
    plans against this machine's measured costs and drafts only while drafting pays; with `ssd`, `FullBlock()`), ssd
    (an [`SSDConfig`]: speculative speculative decoding, the next block prepared while the target verifies). Stop
    strings work on both routes (with `tokenizer=`, which generate() drops on this one, so `import dspark_hf` turns
    them into a `StopStringCriteria` first). Returns what `generate()` returns; with ``return_dict_in_generate=True``
    a [`DSparkGenerateOutput`].
    """
    input_ids = input_ids.long()  # plain generate() returns int64 ids for any integer prompt
    if model_kwargs.get("attention_mask") is not None:  # a float mask too: positions are sums of it
        model_kwargs["attention_mask"] = model_kwargs["attention_mask"].bool().long()
    check_request(model, draft_model, generation_config, input_ids, model_kwargs, logits_processor, synced_gpus,
                  token_streamer, ssd)
    if not draft_model.is_bound_to(model):
        draft_model.bind_target(model)
    out = Transcript.start(input_ids, model_kwargs.get("attention_mask"), logits_processor, stopping_criteria,
                           generation_config, token_streamer)
    do_sample = generation_config.get_generation_mode() == GenerationMode.SAMPLE
    if ssd is None:
        policy = AutoScheduled() if verification_policy is None else as_policy(verification_policy)
        call = Decoding(model, draft_model, policy, do_sample, functools.partial(clock, input_ids.device), out)
        return decode(call, Drafter(draft_model, do_sample))
    policy = FullBlock() if verification_policy is None else as_policy(verification_policy)
    source = SSDSource(ssd, model, draft_model, out, do_sample)
    try:
        result = decode(Decoding(model, draft_model, policy, do_sample, source.clock, out), source)
    finally:
        source.close()
    if isinstance(result, DSparkGenerateOutput):
        result.timings.update(source.timings)
        result.ssd_stats = source.stats
    return result


@dataclass
class Decoding:
    """One generate() call: the target and draft, the verification policy, whether it samples, the clock its timings
    read, its output so far (`out`, see [`Transcript`]) and its seconds by phase (`timings`: prefill, then over all
    rounds draft and target, and total)."""

    target: object
    draft: DSparkDraftModel
    policy: VerificationPolicy
    do_sample: bool
    clock: Callable[[], float]
    out: Transcript
    timings: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("prefill", "draft", "target", "total"),
                                                                            0.0))


@dataclass
class Live:
    """The rows still decoding, flush right in every buffer (see `ragged`). rows (R,): their index in the batch;
    mask (R, T): attention mask over every committed token, the anchor last; cache: the target's KV of every
    committed token but the anchor (changed in place, as transformers' caches are); context: the draft's context
    of the same tokens, followed by pending (R, T', F) target features of tokens committed in rounds without a
    draft at pending_positions (R, T'), encoded when drafting resumes; anchor (R,): the last committed token."""

    rows: torch.Tensor
    mask: torch.Tensor
    cache: DynamicCache
    context: DSparkContext
    anchor: torch.Tensor
    pending: torch.Tensor
    pending_positions: torch.Tensor

    def with_pending_encoded(self, draft: DSparkDraftModel) -> "Live":
        """The pending features turned into draft context, all in one pass (before a draft reads the context)."""
        if self.pending_positions.shape[1] == 0:
            return self
        valid = torch.ones_like(self.pending_positions, dtype=torch.bool)
        context = self.context.cat(draft.encode_context(self.pending, self.pending_positions, valid))
        return replace(self, context=context, pending=self.pending[:, :0],
                       pending_positions=self.pending_positions[:, :0])

    def committed(self, commit: Commit, mask, anchor, features, positions, draft, drafted: bool) -> "Live":
        """After a round appended [anchor, verified drafts] (their target `features` (R, L + 1, F) at `positions`;
        `mask` (R, T + L + 1) covers them and the next anchor): each row keeps its anchor and accepted drafts
        (`commit`), and `anchor` (R,) is its next one."""
        if not commit.keeps_all:
            for layer in self.cache.layers:
                layer.keys, layer.values = commit(layer.keys, 2), commit(layer.values, 2)
        if not drafted:  # every row keeps its one token; nothing reads the draft context before the next draft
            return replace(self, mask=commit(mask, 1), anchor=anchor, pending=torch.cat([self.pending, features], 1),
                           pending_positions=torch.cat([self.pending_positions, positions], 1))
        added = draft.encode_context(features, positions, torch.ones_like(positions, dtype=torch.bool))
        return replace(self, mask=commit(mask, 1), anchor=anchor, context=self.context.cat(added).map(commit))

    def select(self, alive: torch.Tensor) -> "Live":
        """The rows that decode on (alive (R,) bool), without the padding columns no row needs any more."""
        live = self
        if not bool(alive.all()):
            idx = alive.nonzero().squeeze(1)
            self.cache.batch_select_indices(idx)
            live = Live(self.rows[idx], self.mask[idx], self.cache, self.context.map(lambda t, dim: t[idx]),
                        self.anchor[idx], self.pending[idx], self.pending_positions[idx])
        drop = leading_padding(live.mask) if live.rows.numel() else 0
        if not drop:
            return live
        for layer in live.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, drop:], layer.values[:, :, drop:]
        return replace(live, mask=live.mask[:, drop:],
                       context=live.context.map(lambda t, dim: t.narrow(dim, drop, t.shape[dim] - drop)))


def decode(s: Decoding, source: BlockSource):
    """The call: the prompt once, then rounds until every row is done. Returns what generate() returns."""
    start = s.clock()
    s.out.open()
    if s.out.max_new > 0:
        s.policy.prepare(s.target, s.draft, s.out.prompt.shape[0], sampling=s.do_sample)
        live = _prefill(s)
        s.timings["prefill"] = s.clock() - start
        while live.rows.numel() > 0:
            live = _round(s, source, live)
    s.timings["total"] = s.clock() - start
    return s.out.close(s.timings)


def _prefill(s: Decoding) -> Live:
    """Run the prompt once, pick the first token (it becomes the first anchor), seed the draft context."""
    prompt, mask = s.out.prompt, s.out.prompt_mask
    B = prompt.shape[0]
    rows = torch.arange(B, device=prompt.device)
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    cache = DynamicCache()
    target_out = _forward(s, prompt, mask, positions, cache, logits_to_keep=1)  # timed as the prefill
    scores = s.out.process(rows, prompt.new_zeros(B, 0), target_out.logits[:, -1])
    token = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1) if s.do_sample else scores.argmax(-1)
    features = s.draft.target_features(target_out.hidden_states)
    context = s.draft.encode_context(features, positions, mask.bool())
    ones = torch.ones_like(token)
    stop_at = s.out.stop_index(rows, token[:, None], ones, scores[:, None])
    done = s.out.commit(rows, token[:, None], ones, stop_at)
    live = Live(rows, torch.cat([mask, ones[:, None].to(mask.dtype)], 1), cache, context, token, features[:, :0],
                positions[:, :0])
    return live.select(~done)


def _round(s: Decoding, source: BlockSource, live: Live) -> Live:
    """One round over the live rows, in the order of the math: propose a block, verify it in one target forward,
    accept a prefix and the target's own next token, commit them. Returns the rows that decode on."""
    out, rows = s.out, live.rows
    anchor_pos = live.mask.sum(1) - 1
    one_token_left = out.one_token_left(rows)
    live, proposal, verify_len = _propose(s, source, live, anchor_pos, one_token_left)
    block, L = proposal.block, int(verify_len.max())
    x = block.tokens[:, :L]

    # verify: one target forward over [anchor, x] after the cached tokens
    inputs = torch.cat([live.anchor[:, None], x], 1)
    positions = anchor_pos[:, None] + torch.arange(L + 1, device=x.device)
    mask = torch.cat([live.mask, live.mask.new_ones(rows.numel(), L + 1)], 1)  # [cache, anchor, x, next anchor]
    with source.verifying(proposal, verify_len, live.anchor, anchor_pos, live.context):
        start = s.clock()
        target_out = _forward(s, inputs, mask[:, :-1], positions, live.cache, logits_to_keep=0)  # a column per key
        s.timings["target"] += s.clock() - start
    scores = torch.stack([out.process(rows, x[:, :j], target_out.logits[:, j]) for j in range(L + 1)], 1)

    # accept: a prefix of x, then the target's own token (a correction, or a bonus after every verified draft)
    n, nxt = _accept(s.do_sample, scores, block, x, verify_len)
    chunk = torch.cat([x, x.new_zeros(rows.numel(), 1)], 1).scatter(1, n[:, None], nxt[:, None])
    stop_at = out.stop_index(rows, chunk, n + 1, scores)
    committed = torch.where(stop_at > 0, stop_at, n + 1) if out.pads_finished else n + 1

    # commit: to the policy, the records, the output and the source; every buffer keeps [anchor, accepted drafts]
    outcome = Outcome(proposal, verify_len, n, nxt, committed)
    s.policy.observe(verify_len, n, drafted=proposal.drafted)
    out.record(rows, outcome, stop_at, one_token_left)
    alive = ~out.commit(rows, chunk, committed, stop_at)
    source.learn(outcome, alive)
    features = s.draft.target_features(target_out.hidden_states)
    live = live.committed(Commit(L + 1, keep=n + 1), mask, nxt, features, positions, s.draft, proposal.drafted)
    return live.select(alive)


def _propose(s: Decoding, source: BlockSource, live: Live, anchor_pos: torch.Tensor,
             one_token_left: bool) -> tuple[Live, Proposal, torch.Tensor]:
    """This round's block and how much of it each row verifies: (the rows, their context up to date; the proposal;
    verify_len (R,)). A policy may switch drafting off for a round when, under the current load, plain decoding is
    faster; it decides before this round's block exists, so the choice cannot depend on it (lossless). A round
    where no row has more than one token left can verify nothing: it drafts nothing (nor does the policy count it)."""
    if one_token_left or not s.policy.draft_this_round(live.rows.numel()):
        return live, Proposal(empty_block(s.draft, live.anchor)), torch.zeros_like(live.rows)
    start = s.clock()
    live = live.with_pending_encoded(s.draft)
    proposal = source.propose(live.rows, live.anchor, anchor_pos, live.context,
                              functools.partial(s.out.process, live.rows))
    s.timings["draft"] += s.clock() - start
    return live, proposal, _verify_lengths(s, live.rows, proposal)


def _verify_lengths(s: Decoding, rows: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """The policy's choice of how much of the block each row verifies, never past the length limit or the block's
    reach."""
    gamma, R = s.draft.config.block_size, rows.numel()
    chosen = checked_lengths(s.policy(proposal.block.confidences, gamma, R), gamma, R, s.policy)
    lengths = torch.minimum(chosen.to(rows.device), s.out.remaining(rows) - 1)
    return lengths if proposal.reach is None else torch.minimum(lengths, proposal.reach)


def _forward(s: Decoding, input_ids, mask, positions, cache, logits_to_keep: int):
    """The target's forward, returning only the hidden states the draft reads."""
    return s.target(input_ids=input_ids, attention_mask=mask, position_ids=positions, **internals.with_cache(cache),
                    use_cache=True, output_hidden_states=s.draft.hidden_states_request, logits_to_keep=logits_to_keep)


def _accept(do_sample: bool, scores, block, x, verify_len) -> tuple[torch.Tensor, torch.Tensor]:
    """How many drafted tokens x (R, L) the target keeps and its own next token, from its processed scores
    (R, L + 1, V): (n (R,), next token (R,)), by `verify`."""
    if do_sample:
        return verify.verify_sampling(torch.softmax(scores, -1), block.probs[:, :x.shape[1]], x, verify_len)
    return verify.verify_greedy(scores, x, verify_len)
