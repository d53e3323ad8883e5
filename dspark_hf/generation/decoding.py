"""DSpark speculative decoding as a `generate()` decoding method, for any batch size.

Each round: the draft's block, proposed from every row's anchor, is verified as far as the verification policy
chose for each row, in one target forward; rejection sampling (or argmax matching) keeps a prefix and adds the
target's own next token; the target's features of the kept tokens become new draft context; and the next block is
drafted from the new anchors. Every buffer is preallocated (`state.DecodingState`): rows write at their own offsets
and the batch keeps its shape to the end, rows that have finished committing nothing.

The device is never waited for within a round but once: everything the host must know to go on (what each row
accepted and committed, where it stopped, the next block's confidences and whether it is finite) comes back in one
transfer at the round's end (`host.HostRead`), and the policy plans the next round from it. The next block is
drafted before that read, so the policy's choice whether to draft a round is made before the previous round's
outcome reaches it; once it has, the policy may still drop that block (`VerificationPolicy.keep_drafted`). That
choice is made before the round's forward, so a round after which nothing is drafted runs plain generate()'s step:
the target over one token per row, its features kept for later, no draft work. With ``cache_implementation="static"`` the two
forwards are compiled (`steps.Steps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode

from ..devices import Stopwatch
from ..model.modeling_dspark import DSparkDraftModel
from ..model.sampling import raise_if_not_finite
from ..scheduling.auto import AutoScheduled
from ..scheduling.policies import FullBlock, VerificationPolicy, as_policy
from . import verify
from .candidate_generator import DSparkCandidateGenerator
from .block_sources import Drafter, Outcome, Proposal
from .host import HostRead, to_device
from .pricing import StepClock
from .records import DSparkGenerateOutput
from .request import check_request
from .ssd import SSDConfig, SSDSource
from .state import DecodingState
from .steps import Steps
from .transcript import Transcript

PHASES = ("prefill", "draft", "target", "total")


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
    them into a `StopStringCriteria` first). ``cache_implementation="static"`` compiles the round's forwards where
    plain generate() would compile its step (`steps.Steps`). Returns what `generate()` returns; with
    ``return_dict_in_generate=True`` a [`DSparkGenerateOutput`].
    """
    if model_kwargs.get("attention_mask") is not None:  # a float mask too: positions are sums of it
        model_kwargs["attention_mask"] = model_kwargs["attention_mask"].bool().long()
    check_request(model, draft_model, generation_config, input_ids, model_kwargs, logits_processor, synced_gpus,
                  token_streamer, ssd)
    input_ids = input_ids.long()  # plain generate() returns int64 ids for any integer prompt
    if not draft_model.is_bound_to(model):
        draft_model.bind_target(model)
    steps = Steps.for_call(model, draft_model, generation_config, ssd)
    out = Transcript.start(input_ids, model_kwargs.get("attention_mask"), logits_processor, stopping_criteria,
                           generation_config, token_streamer, draft_model.config.block_size)
    do_sample = generation_config.get_generation_mode() == GenerationMode.SAMPLE
    # timings are read only where they are returned: on a GPU, CUDA events (no wait until the call's end)
    watch = Stopwatch(input_ids.device, enabled=generation_config.return_dict_in_generate)
    if ssd is None:
        policy = AutoScheduled() if verification_policy is None else as_policy(verification_policy)
        call = Decoding(model, draft_model, policy, do_sample, steps, out, watch)
        return decode(call, DSparkCandidateGenerator(draft_model, Drafter(draft_model, do_sample, steps.draft_block),
                                                     policy))
    policy = FullBlock() if verification_policy is None else as_policy(verification_policy)
    source = SSDSource(ssd, model, draft_model, out, do_sample)
    try:
        result = decode(Decoding(model, draft_model, policy, do_sample, steps, out, watch),
                        DSparkCandidateGenerator(draft_model, source, policy))
    finally:
        source.close()
    if isinstance(result, DSparkGenerateOutput):
        result.timings.update(source.timings)
        result.ssd_stats = source.stats
    return result


@dataclass
class Decoding:
    """One generate() call: the target and draft, the verification policy, whether it samples, how its forwards run
    (`steps`), its output so far (`out`, see [`Transcript`]) and its seconds by phase (`watch`: the prefill, then
    over all rounds the draft and the target, and the total)."""

    target: object
    draft: DSparkDraftModel
    policy: VerificationPolicy
    do_sample: bool
    steps: Steps
    out: Transcript
    watch: Stopwatch


@dataclass
class Plan:
    """What a round verifies: the proposal (its block), and per row how many of its tokens (verify_len (B,) on the
    device, 0 for rows that have finished; `lengths` on the host, for `rows`, the rows still decoding, which `live`
    (B,) marks on the device)."""

    proposal: Proposal
    verify_len: torch.Tensor
    live: torch.Tensor
    lengths: list[int]
    rows: list[int]
    one_token_left: bool

    @property
    def longest(self) -> int:
        return max(self.lengths, default=0)


def decode(s: Decoding, candidates: DSparkCandidateGenerator):
    """The call: the prompt once, then rounds until every row is done, each block from `candidates` (a transformers
    candidate generator over the call's block source and policy). Returns what generate() returns."""
    with s.watch.phase("total"):
        s.out.open()
        if s.out.max_new > 0:
            B, P = s.out.prompt.shape
            s.policy.prepare(s.target, s.draft, B, sampling=s.do_sample)
            state = s.steps.state(B, P, s.out.max_new)
            try:
                plan = _prefill(s, candidates, state)
                while plan is not None:
                    plan = _round(s, candidates, state, plan)
            finally:
                s.steps.release(state)
    return s.out.close(s.watch.totals(PHASES))


def _prefill(s: Decoding, candidates: DSparkCandidateGenerator, state: DecodingState) -> Plan | None:
    """Run the prompt once, pick the first token (it becomes the first anchor), seed the draft context, draft the
    first block."""
    prompt, mask = s.out.prompt, s.out.prompt_mask
    B = prompt.shape[0]
    with s.watch.phase("prefill"):
        logits = state.prefill(s.target, s.draft, prompt, mask)
        s.steps.prepared(state)
        s.steps.warm(state, s.do_sample, s.out.process)
        s.policy.price(StepClock(s.steps, state, s.out, s.do_sample))
        scores = s.out.process(prompt.new_zeros(B, 0), logits[:, -1])
        token = verify.next_token(scores, s.do_sample)
        ones = torch.ones_like(token)
        stop_at = s.out.stop_index(token[:, None], ones, scores[:, None])
        s.out.commit(token[:, None], ones, stop_at)
        state.anchor = token
    rows = list(range(B))
    proposal = _propose(s, candidates, state, candidates.drafts(rows, [s.out.limit - 1] * B), bound=state.host_end)
    read = _read(s, proposal, s.out.ask(HostRead().add("token", token[:1])))
    s.out.mirror(read)
    s.out.stream(read["token"])
    return _plan(s, candidates, proposal, read)


def _round(s: Decoding, candidates: DSparkCandidateGenerator, state: DecodingState, plan: Plan) -> Plan | None:
    """One round, in the order of the math: verify the planned prefix of the block in one target forward, accept a
    prefix and the target's own next token, commit them; then draft the next block and read what the host needs."""
    out, proposal, L = s.out, plan.proposal, plan.longest
    block = proposal.block
    x = block.tokens[:, :L]

    # whether the next block is drafted, decided from past rounds (the policy's pause) and the rows' length limits;
    # when it is not, a one-token round's forward leaves the draft's context alone (plain generate()'s step). A wider
    # round, the last drafted one before a pause, encodes as a drafting round does: compiled, its forward is then a
    # graph the default policy's pricing already built, where a pause starting after a block of each width would
    # compile one more graph per width in the middle of a call (seconds on a CPU; experiments/the-floor-cpu, 3b)
    drafting = candidates.drafts(plan.rows, [r - 1 for r in out.remaining(plan.rows)])

    # verify: one target forward over [anchor, x] after each row's committed tokens
    Q = s.steps.width(L + 1)
    encode = drafting or Q > 1
    inputs = torch.cat([state.anchor[:, None], x, x.new_zeros(x.shape[0], Q - L - 1)], 1)  # padded to a bucket
    context = _context(s, state, 0) if proposal.drafted else None  # for a source that works while verifying
    with candidates.verifying(proposal, plan.verify_len, state.anchor, state.count, context), \
            s.watch.phase("target"):
        logits = s.steps.verify(state, inputs, encode=encode)
    if not encode:
        state.unencoded(plan.rows)
    scores = out.process_block(x, logits)

    # accept: a prefix of x, then the target's own token (a correction, or a bonus after every verified draft)
    n, nxt = verify.verify_block(scores, block.probs, x, plan.verify_len, s.do_sample)
    chunk = torch.cat([x, x.new_zeros(x.shape[0], 1)], 1).scatter(1, n[:, None], nxt[:, None])
    kept = torch.where(plan.live, n + 1, 0)
    stop_at = out.stop_index(chunk, kept, scores)
    committed = torch.where(stop_at > 0, stop_at, kept) if out.pads_finished else kept

    # commit: to the output, the state and the block source; then the next block, drafted while this round is on the
    # device
    outcome = Outcome(proposal, plan.verify_len, n, nxt, committed)
    out.commit(chunk, committed, stop_at)
    # in a one-token round where every row ends at one slot, finished rows move on with the others (as plain
    # generate()'s cache goes on taking their padding): the rows keep ending at one slot, and the next forward's
    # writes stay slice copies
    along = L == 0 and state.one_end() is not None
    state.keep(n + 1 if along else kept, nxt, Q)
    candidates.observe(outcome, plan.rows)
    upcoming = _propose(s, candidates, state, drafting, bound=state.host_end + Q)

    # what the host learns of the round, in one read: with the state's and the output's own copies (`mirror`)
    read = _read(s, upcoming, state.ask(out.ask(HostRead().add("accepted", n).add("committed", committed)
                                                .add("stop_at", stop_at)
                                                .add("chunk", chunk[0] if out.streamer is not None else None))))
    rows = plan.rows
    state.mirror(read)
    out.mirror(read)
    candidates.learn(plan.lengths, [read["accepted"][b] for b in rows], drafted=proposal.drafted)
    out.record(rows, outcome, plan.lengths, plan.one_token_left, read["stop_at"])
    if read["chunk"] is not None and 0 in rows:
        stop = read["stop_at"][0]
        out.stream(read["chunk"][: stop or read["committed"][0]])
    return _plan(s, candidates, upcoming, read)


def _propose(s: Decoding, candidates: DSparkCandidateGenerator, state: DecodingState, drafting: bool,
             bound: int) -> Proposal:
    """The next round's block, drafted before the host knows how this round ended, where `drafting`
    (`candidates.drafts`); `bound`: past the last slot a row may have filled."""
    with s.watch.phase("draft"):
        context = _context(s, state, bound) if drafting else None
        return candidates.propose(state.anchor, state.count, context, s.out.process, drafting)


def _context(s: Decoding, state: DecodingState, bound: int):
    """The draft's context: every slot a row may have filled (up to `bound`; compiled: all), the slots that
    rounds without a draft left unprojected projected first."""
    bound = max(bound, state.host_end)
    state.catch_up(s.draft, min(bound, state.slots))
    return state.context(s.steps.context_width(state, bound))


def _read(s: Decoding, proposal: Proposal, read: HostRead) -> dict:
    """The round's one read, with what the next plan needs of its block; a non-finite block is refused here."""
    block = proposal.block
    read.add("confidences", block.confidences if proposal.drafted else None)
    read.add("reach", proposal.reach if proposal.drafted else None)
    values = read.add("finite", block.finite if proposal.drafted else None).read()
    if values["finite"] is not None:
        raise_if_not_finite(values["finite"])
    return values


def _plan(s: Decoding, candidates: DSparkCandidateGenerator, proposal: Proposal, read: dict) -> Plan | None:
    """The next round's verify lengths for the rows still decoding (`candidates.plan`: by the policy, never past a
    row's length limit or its block's reach); None when every row is done."""
    rows = s.out.live_rows()
    if not rows:
        return None
    remaining = s.out.remaining(rows)
    B = s.out.prompt.shape[0]
    proposal, lengths = candidates.plan(proposal, read["confidences"], read["reach"], rows, remaining)
    per_row, live = [0] * B, [False] * B
    for b, n in zip(rows, lengths):
        per_row[b], live[b] = n, True
    device = proposal.block.tokens.device
    return Plan(proposal, to_device(per_row, torch.long, device), to_device(live, torch.bool, device), lengths, rows,
                all(r <= 1 for r in remaining))
