"""The hardware-aware prefix scheduler reproduces the paper's oracles, and scheduled decoding stays lossless."""

import statistics

import pytest
import torch

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import AutoScheduled, Policy
from dspark_hf.generation.block_sources import sample_block
from dspark_hf.scheduling.scheduler import AsyncScheduled, Scheduled, ThresholdPolicy, prefix_schedule, \
    topk_schedule, verified_tokens

APPENDIX_A_SPS = [None, 1.0, 0.5, 0.45]


def test_appendix_a_capacity_curve_schedules_nothing():
    assert prefix_schedule([[0.8, 0.9]], APPENDIX_A_SPS) == [0]


def test_sps_as_a_callable_or_a_table_agree():
    conf = [[0.9, 0.8, 0.5], [0.6, 0.6, 0.6]]
    table = [None] + [8000 / (96 + b) for b in range(1, 10)]
    assert prefix_schedule(conf, table) == prefix_schedule(conf, lambda b: 8000 / (96 + b))


def test_sps_as_a_dict_of_measured_points_is_interpolated_like_a_profile_not_read_as_its_keys():
    conf = torch.full((2, 4), 0.5)
    falling = {b: 100.0 / b for b in range(1, 41)}  # steeply falling: verifying anything loses
    assert prefix_schedule(conf, falling) == [0, 0]
    assert prefix_schedule(conf, {str(b): v for b, v in falling.items()}) == [0, 0]  # JSON's keys
    sparse = {1: 10.0, 16: 8.0}  # linear between the measured points, where verifying pays
    assert prefix_schedule(conf, sparse) == prefix_schedule(conf, lambda b: 10.0 - 2 * (b - 1) / 15) != [0, 0]


@pytest.mark.parametrize("sps", [{1, 2, 3}, "123", 5.0])
def test_sps_that_is_not_a_table_dict_or_callable_is_refused_in_one_line(sps):
    with pytest.raises(TypeError, match=r"^sps must be a list indexed by B, a \{B: sps\} dict or a callable"):
        prefix_schedule([[0.5]], sps)


@pytest.mark.parametrize("requests, mean_budget", [(4, 5.00), (32, 3.00), (256, 1.00)])
def test_budgets_shrink_with_load(requests, mean_budget):
    """SPS(B) = 8000 / (96 + B), every request with confidences [0.9, 0.85, 0.8, 0.7, 0.6, 0.5]."""
    conf = [[0.9, 0.85, 0.8, 0.7, 0.6, 0.5]] * requests
    lengths = prefix_schedule(conf, lambda b: 8000 / (96 + b))
    assert sum(lengths) / requests == pytest.approx(mean_budget, abs=1e-9)


def test_zero_confidences_give_zero_budgets():
    assert prefix_schedule(torch.zeros(3, 5), lambda b: 1.0) == [0, 0, 0]


def test_a_padded_engine_pays_for_the_longest_row_only():
    """Batched generate() verifies a rectangle: one row's extra token costs a column, the others' ride along."""
    sps = lambda b: 100 / (10 + b)  # noqa: E731
    assert prefix_schedule([[0.9], [0.1]], sps) == [1, 0]  # packed: B = 3 gains, B = 4 does not
    assert prefix_schedule([[0.9], [0.1]], sps, padded=True) == [1, 1]  # padded: B = 4 either way
    steep = [None, 1.0, 0.9, 0.8, 0.5]
    assert prefix_schedule([[0.9], [0.0]], steep) == [1, 0]  # 2.9 tokens at SPS(3) beat 2 at SPS(2)
    assert prefix_schedule([[0.9], [0.0]], steep, padded=True) == [0, 0]  # but not at SPS(4)
    assert verified_tokens([3, 0, 1]) == 7 and verified_tokens([3, 0, 1], padded=True) == 12


def test_admission_respects_prefixes_and_top_k():
    conf = [[0.9, 0.9, 0.1], [0.5, 1.0, 1.0]]
    assert topk_schedule(conf, 3) == [2, 1]  # a = [.9, .81, .081] and [.5, .5, .5]: .9, .81, then (.5, r1, j1)
    assert topk_schedule(conf, 0) == [0, 0]


def output_distribution(early_stop: bool) -> float:
    """Appendix A, computed exactly: P(Y = A) when the scheduler sees c_2 = 0.9 after x_1 = A and 0 after B."""
    p_t, p_d = {"A": 0.7, "B": 0.3}, {"A": 0.5, "B": 0.5}
    c2 = {"A": 0.9, "B": 0.0}
    prob_a = 0.0
    for x1, q in p_d.items():
        (length,) = prefix_schedule([[0.8, c2[x1]]], APPENDIX_A_SPS, early_stop=early_stop)
        if length >= 1:  # x1 verified: accepted with min(1, p/q), else the residual (all mass on the other token)
            accept = min(1.0, p_t[x1] / q)
            residual_a = max(p_t["A"] - p_d["A"], 0) / sum(max(p_t[v] - p_d[v], 0) for v in "AB")
            prob_a += q * (accept * (x1 == "A") + (1 - accept) * residual_a)
        else:  # not verified: the target samples the token itself
            prob_a += q * p_t["A"]
    return prob_a


def test_retrospective_admission_biases_the_output_and_the_early_stop_does_not():
    assert output_distribution(early_stop=False) == pytest.approx(0.85)
    assert output_distribution(early_stop=True) == pytest.approx(0.70)


def test_threshold_policy_cuts_at_the_first_low_confidence():
    assert ThresholdPolicy(0.5).plan([[0.9, 0.4, 0.9], [0.8, 0.7, 0.6], [0.2, 0.9, 0.9]], 3, 3) == [1, 3, 0]


@pytest.mark.parametrize("padded", [True, False])
def test_async_scheduler_uses_the_capacity_of_two_rounds_earlier(padded):
    policy = AsyncScheduled(lambda b: 8000 / (96 + b), padded=padded)
    high, low = [[0.95] * 6] * 4, [[0.3] * 6] * 4
    first = policy.plan(high, 6, 4)
    policy.plan(low, 6, 4)
    third = policy.plan(low, 6, 4)  # capacity from round 1 (high confidence): many tokens admitted
    searched = prefix_schedule(high, lambda b: 8000 / (96 + b), early_stop=False, padded=padded)
    assert sum(first) == sum(third) == sum(searched) > sum(prefix_schedule(low, lambda b: 8000 / (96 + b)))


def test_async_scheduler_prices_the_padded_batch_generate_verifies_by_default():
    """One confident row among 8: verifying its 4 tokens pads all 8 rows to 5, which this cost curve punishes."""
    sps = lambda b: 1.0 / (10 + b)  # noqa: E731
    c = [[0.99] * 4] + [[0.05] * 4] * 7
    policy, packed = AsyncScheduled(sps), AsyncScheduled(sps, padded=False)
    rounds = [(policy.plan(c, 4, 8), packed.plan(c, 4, 8)) for _ in range(3)]  # round 3: top-K admission
    assert all(lengths == Scheduled(sps).plan(c, 4, 8) == [0] * 8 for lengths, _ in rounds)
    assert all(lengths == [4] + [0] * 7 for _, lengths in rounds)  # what a packed engine would verify


def test_padded_top_k_admission_verifies_every_row_up_to_the_capacity_length():
    conf = [[0.9, 0.9, 0.1], [0.5, 1.0, 1.0], [0.0, 1.0, 1.0]]
    assert topk_schedule(conf, 2, padded=True) == [2, 2, 0]  # the rectangle is paid for: fill it (a > 0 only)
    assert topk_schedule(conf, 0, padded=True) == [0, 0, 0]


# -- lossless decoding with scheduling on ---------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [ThresholdPolicy(0.5), Scheduled(lambda b: 100 / (10 + b)),
                                    AsyncScheduled(lambda b: 100 / (10 + b))])
def test_scheduled_greedy_decoding_is_token_identical(family, policy):
    from test_generation_greedy import dspark, oracle, plain

    target = tiny_target(family)
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=20)
    out = dspark(target, oracle(target, tiny_draft(target), reference, mask, 0.2), ids, mask, max_new_tokens=20,
                 verification_policy=policy)
    assert torch.equal(out.sequences, reference)
    verified = [r.verified for rows in out.rounds for r in rows]
    assert min(verified) < 4, "the policy must actually trim some blocks"


def test_scheduled_sampling_is_exact():
    from test_generation_sampling import ALPHA, SAMPLES, exact_distribution, p_value, sample_continuations
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    from test_generation_sampling import V, flattened_draft

    target = tiny_target("llama", vocab=V, initializer_range=0.2)
    draft = flattened_draft(target)
    probs = exact_distribution(target, LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)]))
    torch.manual_seed(3)
    samples = sample_continuations(target, draft, SAMPLES, temperature=0.7, top_k=4,
                                   verification_policy=Scheduled(lambda b: 3000 / (2000 + b)))
    assert p_value(samples, probs) > ALPHA


class Alternating(Policy):
    """Drafts every other round and verifies one token: rounds with and without a draft interleave."""

    def __init__(self):
        self.calls = 0

    def draft_this_round(self, num_rows):
        self.calls += 1
        return self.calls % 2 == 0

    def plan(self, confidences, gamma, num_rows):
        return [1] * num_rows


def test_a_policy_with_hooks_must_be_a_policy_so_that_they_are_called():
    from dspark_hf.scheduling import as_policy

    class DuckTyped:
        def draft_this_round(self, num_rows):
            return False

        def __call__(self, confidences, gamma, num_rows):
            return torch.zeros(num_rows, dtype=torch.long)

    expected = "DuckTyped defines draft_this_round but not all of .*: subclass dspark_hf.Policy"
    with pytest.raises(TypeError, match=expected):
        as_policy(DuckTyped())
    assert as_policy(lambda c, gamma, rows: torch.ones(rows, dtype=torch.long)).draft_this_round(3)


def test_rounds_without_a_draft_stay_token_identical(family):
    from test_generation_greedy import dspark, oracle, plain

    target = tiny_target(family)
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=15)
    out = dspark(target, oracle(target, tiny_draft(target), reference, mask, 0.2), ids, mask, max_new_tokens=15,
                 verification_policy=Alternating())
    assert torch.equal(out.sequences, reference)
    skipped = [r for rows in out.rounds for r in rows if not r.drafted]
    assert skipped and all(r.verified == r.accepted == 0 and r.committed <= 1 for r in skipped)


class DraftingEveryRound(Alternating):
    """Drafts every round but verifies only where `Alternating` drafts: the same tokens land in the same rounds."""

    def draft_this_round(self, num_rows):
        self.drafting = super().draft_this_round(num_rows)
        return True

    def plan(self, confidences, gamma, num_rows):
        return [int(self.drafting)] * num_rows


def contexts_seen_by_the_draft(target, policy):
    draft = tiny_draft(target)
    seen = []

    def recording(anchor, anchor_positions, context, *args, **kwargs):
        # as it is now: the context is a view of the decode's buffers, which later rounds write on
        seen.append((anchor_positions.clone(), context.map(lambda t, dim: t.clone())))
        return sample_block(draft, anchor, anchor_positions, context, *args, **kwargs)

    draft.propose_block = recording  # now a BlockProposer: generate() asks it for every block
    ids, mask = left_padded_prompts(3)
    target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12, assistant_model=draft,
                    verification_policy=policy)
    return seen


def test_rounds_without_a_draft_leave_the_draft_the_context_it_would_have_had(family):
    """Tokens committed without a draft reach the draft's context (encoded lazily, when drafting resumes)."""
    target = tiny_target(family)
    lazy = contexts_seen_by_the_draft(target, Alternating())
    eager = contexts_seen_by_the_draft(target, DraftingEveryRound())[1::2]
    assert len(lazy) == len(eager) > 2
    for (pos, ctx), (pos_ref, ref) in zip(lazy, eager):
        assert torch.equal(pos, pos_ref) and torch.equal(ctx.positions, ref.positions)
        assert torch.equal(ctx.valid, ref.valid)
        for k, k_ref in zip(ctx.keys + ctx.values, ref.keys + ref.values):
            torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-4)


def test_rounds_without_a_draft_sample_exactly():
    from test_generation_sampling import ALPHA, SAMPLES, exact_distribution, p_value, sample_continuations
    from transformers import LogitsProcessorList, TemperatureLogitsWarper

    from test_generation_sampling import V, flattened_draft

    target = tiny_target("llama", vocab=V, initializer_range=0.2)
    draft = flattened_draft(target)
    probs = exact_distribution(target, LogitsProcessorList([TemperatureLogitsWarper(0.7)]))
    torch.manual_seed(5)
    samples = sample_continuations(target, draft, SAMPLES // 2, temperature=0.7, verification_policy=Alternating())
    assert p_value(samples, probs) > ALPHA


def test_scheduler_switches_drafting_off_when_plain_decoding_is_faster():
    sps = lambda b: 100 / (10 + b)  # noqa: E731
    cheap, costly = Scheduled(sps, draft_seconds=lambda r: 0.001), Scheduled(sps, draft_seconds=lambda r: 1.0,
                                                                             probe_every=3)
    conf = [[0.9] * 4] * 2
    assert sum(cheap.plan(conf, 4, 2)) > 0 and cheap.draft_this_round(2)
    costly.plan(conf, 4, 2)  # 1 s of drafting per round: one plain step (0.12 s for 2 tokens) is far ahead
    assert [costly.draft_this_round(2) for _ in range(4)] == [False, False, False, True]
    costly.plan(conf, 4, 2)  # the probe confirms it: the next pause is twice as long
    assert [costly.draft_this_round(2) for _ in range(7)] == [False] * 6 + [True]


def test_a_reused_scheduled_policy_starts_each_call_drafting_and_a_reused_async_one_with_algorithm_1():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    sps = lambda b: 100 / (10 + b)  # noqa: E731
    costly = Scheduled(sps, draft_seconds=lambda r: 1.0)
    costly.plan([[0.9] * 4] * 2, 4, 2)  # drafting does not pay: paused for the next rounds of this call
    assert not Scheduled(sps, draft_seconds=lambda r: 1.0).pause.skip and costly.pause.skip
    costly.prepare(target, draft, 2)
    assert costly.draft_this_round(2)
    policy = AsyncScheduled(sps, lag=1)
    high, low = [[0.95] * 6] * 4, [[0.3] * 6] * 4
    policy.plan(high, 6, 4)  # this call's next round would admit high's capacity
    policy.prepare(target, draft, 4)
    assert policy.plan(low, 6, 4) == prefix_schedule(low, sps, padded=True)


def test_the_draft_pass_counts_in_the_scheduled_rate():
    sps = lambda b: 100 / (10 + b)  # noqa: E731
    step = Scheduled(sps, draft_seconds=lambda r: 0.05).round_sps(2)
    assert step(4) == pytest.approx(1 / (0.05 + 1 / sps(4)))


def test_profile_measures_every_batch_size_and_loads_as_a_callable(tmp_path):
    from dspark_hf.costs.cost_model import load_draft_cost, load_profile, save_profile
    from dspark_hf.costs.profile import profile_sps

    target = tiny_target("llama")
    profile = profile_sps(target, rows=[1, 2], max_tokens_per_row=3, context=16, repeats=2, warmup=1,
                          draft=tiny_draft(target))
    # 1 x 1..3 and 2 x 1..3 tokens; B = 2 is measured twice (1 x 2, 2 x 1) and takes the median
    assert sorted(profile["sps"]) == [1, 2, 3, 4, 6] and all(v > 0 for v in profile["sps"].values())
    assert sorted(profile["draft_seconds"]) == [1, 2]
    save_profile(profile, tmp_path / "p.json")
    sps, draft_cost = load_profile(tmp_path / "p.json"), load_draft_cost(tmp_path / "p.json")
    assert sps(4) == pytest.approx(profile["sps"][4])
    assert min(profile["sps"][4], profile["sps"][6]) <= sps(5) <= max(profile["sps"][4], profile["sps"][6])
    assert sps(12) == pytest.approx(profile["sps"][6] * 6 / 12)
    assert draft_cost(4) == pytest.approx(profile["draft_seconds"][2] * 2)
    policy = Scheduled.from_profile(tmp_path / "p.json")
    assert policy.draft_seconds is not None and len(policy.plan([[0.5] * 4] * 2, 4, 2)) == 2


def test_a_draft_with_a_very_long_block_is_profiled_at_a_bounded_set_of_widths_interpolated_between():
    """A block_size edited to 100 once meant 101 verification widths to measure per row count (over ten minutes of
    "profiling this machine (once)" on a CPU): beyond 16 tokens a row the widths grow by about 1.5x, and the costs
    between them are interpolated."""
    from dspark_hf.costs.cost_model import EngineCosts
    from dspark_hf.costs.profile import measured_widths, profile_sps

    assert measured_widths(8) == list(range(1, 9))
    assert len(measured_widths(101)) == 21 and measured_widths(101)[-1] == 101
    target = tiny_target("llama")
    profile = profile_sps(target, rows=[1], max_tokens_per_row=20, context=8, repeats=1, warmup=0)
    assert sorted(profile["grid"][1]) == [*range(1, 17), 20]
    costs = EngineCosts({1: {1: 1.0, 16: 16.0, 24: 40.0}}, {1: 1.0})
    assert costs.verify(1, 20) == pytest.approx(28.0) and costs.verify(1, 48) == pytest.approx(80.0)


def test_a_profile_measures_every_shape_in_every_repeat_so_a_slowdown_midway_skews_no_ratio(monkeypatch):
    from dspark_hf.costs import profile

    now, calls = [0.0], []

    def run(key, seconds):
        def fn():
            calls.append(key)
            # the machine halves its speed after the first two repeats: every shape is hit alike
            now[0] += seconds * (2 if len(calls) > 2 * 3 else 1)
        return fn, None

    runs = {key: run(key, s) for key, s in (("1 token", 1.0), ("6 tokens", 2.0), ("draft", 0.5))}
    monkeypatch.setattr(profile, "clock", lambda device: now[0])
    seconds = profile.interleaved_seconds(runs, "cpu", warmup=0, repeats=4, statistic=statistics.median)
    assert [calls[i:i + 3] for i in range(0, 12, 3)] == [
        ["1 token", "6 tokens", "draft"], ["6 tokens", "draft", "1 token"],
        ["draft", "1 token", "6 tokens"], ["1 token", "6 tokens", "draft"]]
    assert seconds["6 tokens"] / seconds["1 token"] == pytest.approx(2.0)
    assert seconds["draft"] / seconds["1 token"] == pytest.approx(0.5)


# -- the default policy ------------------------------------------------------------------------------------------
def costs(draft=0.01, verify=lambda n: 0.05 + 0.005 * n, rows=(1, 2, 4), catch_up=None):
    """Synthetic engine costs: a draft pass of `draft` s, a verification of n tokens per row of verify(n) s x R, a
    pause's catch-up of `catch_up` s x R (None: not measured, as in a profile)."""
    from dspark_hf.costs.cost_model import EngineCosts

    return EngineCosts({R: {n: R * verify(n) for n in range(1, 9)} for R in rows}, {R: R * draft for R in rows},
                       catch_up_seconds=None if catch_up is None else {R: R * catch_up for R in rows})


def auto(engine, gamma=7, **kw):
    """AutoScheduled over `engine`; at break-even (margin=1) unless told, as the tests of its mechanics read."""
    from dspark_hf import AutoScheduled

    policy = AutoScheduled(**{"margin": 1.0, **kw})
    policy.costs = engine
    policy.learned = policy.fresh(gamma)
    return policy


def play(policy, confidences, accepted_of, rounds):
    """Run `rounds` rounds: accepted_of(lengths) -> accepted counts; returns whether each round drafted."""
    drafted = []
    for _ in range(rounds):
        R = confidences.shape[0]
        if not policy.draft_this_round(R):
            policy.learn([0] * R, [0] * R, drafted=False)
            drafted.append(False)
            continue
        lengths = policy.plan(confidences.tolist(), confidences.shape[1], R)
        policy.learn(lengths, accepted_of(torch.tensor(lengths)).tolist(), drafted=True)
        drafted.append(True)
    return drafted


def test_the_default_policy_stops_drafting_a_draft_that_never_pays_and_probes_less_and_less():
    # a draft pass almost as dear as a verification, nothing accepted; a budget whose floor (41 rounds) lets the
    # pauses double
    policy = auto(costs(draft=0.04), probe_budget=0.02)
    drafted = play(policy, torch.full((1, 7), 0.6), lambda lengths: torch.zeros_like(lengths), 200)
    probes = [i for i, d in enumerate(drafted) if d]
    assert policy.gain < 1 and len(probes) <= 6
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0], "each probe that loses doubles the pause"


@pytest.mark.parametrize("max_pause", [64, 16])  # at 16 the budget needs longer pauses than max_pause allows
@pytest.mark.parametrize("catch_up", [None, 0.02])  # a probe first projects its pause's slots into the context
def test_the_probes_of_a_draft_that_never_pays_cost_at_most_the_probe_budget(max_pause, catch_up):
    engine = costs(draft=0.04, catch_up=catch_up)
    policy = auto(engine, probe_budget=0.02, max_pause=max_pause)
    rounds = 200
    drafted = play(policy, torch.full((1, 7), 0.6), lambda lengths: torch.zeros_like(lengths), rounds)
    extra = (engine.catch_up(1) + engine.draft(1) + engine.verify(1, 2) - engine.verify(1, 1)) / engine.verify(1, 1)
    probes_after_the_first = sum(drafted[1:])
    assert probes_after_the_first >= 2 and probes_after_the_first * extra <= 0.02 * rounds


def test_a_short_request_with_a_draft_that_never_pays_pays_for_one_probe():
    policy = auto(costs(draft=0.04))  # a probe costs 0.82 of a plain step: the default budget pauses 164+ rounds
    drafted = play(policy, torch.full((1, 7), 0.6), lambda lengths: torch.zeros_like(lengths), 32)
    assert drafted[0] and sum(drafted) == 1


def test_in_generate_a_pause_starts_at_once_not_one_round_late():
    """The loop drafts a round's block while the round before it is on the device, so the policy decides to draft it
    before that round's outcome is known; once known, a pause it started drops that block: a short request with a
    draft that never pays verifies one drafted round (its first probe), as the policy alone would."""
    from test_generation_greedy import dspark, oracle, plain

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    reference = plain(target, ids, mask, max_new_tokens=32)
    never_right = oracle(target, tiny_draft(target), reference, mask, corruption=1.0)
    policy = auto(costs(draft=0.04))
    out = dspark(target, never_right, ids, mask, max_new_tokens=32, verification_policy=policy)
    assert torch.equal(out.sequences, reference)
    assert [i for i, r in enumerate(out.rounds[0]) if r.drafted] == [0]


def test_in_generate_the_round_that_verifies_a_probe_after_a_pause_drafts_nothing(monkeypatch):
    """A probe after a pause decides whether drafting resumes: the round that verifies it drafts no block of its own,
    which a losing probe's pause would drop (a second draft pass per probe); the first block of a call is not such a
    probe (nothing has paused yet), so the round after it drafts as drafting rounds do."""
    from test_generation_greedy import dspark, oracle, plain

    from dspark_hf.generation.candidate_generator import DSparkCandidateGenerator

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    reference = plain(target, ids, mask, max_new_tokens=96)
    never_right = oracle(target, tiny_draft(target), reference, mask, corruption=1.0)
    policy = auto(costs(draft=0.04), probe_budget=0.05)  # a pause of 17+ rounds: a few probes in 96 tokens
    drafted, propose = [], DSparkCandidateGenerator.propose  # per proposal (the prefill's, then each round's)

    def counted(self, anchor, positions, context, process, drafting):
        drafted.append(drafting)
        return propose(self, anchor, positions, context, process, drafting)

    monkeypatch.setattr(DSparkCandidateGenerator, "propose", counted)
    out = dspark(target, never_right, ids, mask, max_new_tokens=96, verification_policy=policy)
    assert torch.equal(out.sequences, reference)
    probes = [i for i, r in enumerate(out.rounds[0]) if r.drafted]
    assert probes[0] == 0 and len(probes) >= 3, probes
    # drafted[k] is the block round k verifies (drafted in the prefill or the round before), drafted[k + 1] the one
    # round k drafts
    assert drafted[1], "the first block's round drafts the next (the pause drops it)"
    for k in probes[1:]:
        assert drafted[k] and not drafted[k + 1], (k, drafted)
    assert sum(drafted) == len(probes) + 1


def request(engine, target, draft, batch_size=1, sampling=False, **settings):
    """A fresh default policy, prepared as generate() prepares it for one call."""
    from dspark_hf import AutoScheduled

    policy = AutoScheduled(**settings)
    policy.costs = engine
    policy.prepare(target, draft, batch_size, sampling=sampling)
    return policy


NEVER_ACCEPTED = (lambda lengths: torch.zeros_like(lengths))


def test_greedy_requests_go_on_where_the_last_one_stopped_so_short_ones_pay_one_probe_per_pause_not_per_request():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    engine, confidences = costs(draft=0.04), torch.full((1, 4), 0.6)
    one_long = play(request(engine, target, tiny_draft(target)), confidences, NEVER_ACCEPTED, 8 * 32)
    many_short = sum((play(request(engine, target, draft), confidences, NEVER_ACCEPTED, 32) for _ in range(8)), [])
    assert many_short == one_long and sum(many_short) < 8


def test_sampled_requests_start_afresh_and_hand_nothing_on_so_a_seed_gives_the_same_sample_every_call():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    engine, confidences = costs(draft=0.04), torch.full((1, 4), 0.6)
    greedy = play(request(engine, target, draft), confidences, NEVER_ACCEPTED, 32)
    sampled = [play(request(engine, target, draft, sampling=True), confidences, NEVER_ACCEPTED, 32) for _ in range(3)]
    greedy += play(request(engine, target, draft), confidences, NEVER_ACCEPTED, 32)
    assert sampled[0] == sampled[1] == sampled[2] and sampled[0][0], "each sampled call probes in its first round"
    assert greedy == play(request(engine, target, tiny_draft(target)), confidences, NEVER_ACCEPTED, 64)


def test_greedy_requests_that_run_at_once_each_learn_in_their_own_copy_and_the_one_started_last_hands_on():
    """Two calls at once (threads of a server) must not step on each other's pause or estimates: each learns in a
    copy of what was handed on, and the call started last is the one the next call goes on from."""
    target = tiny_target("llama")
    draft = tiny_draft(target)
    engine = costs(draft=0.04)
    first, second = request(engine, target, draft), request(engine, target, draft)
    assert first.learned is not second.learned and first.learned == second.learned
    play(first, torch.full((1, 4), 0.6), NEVER_ACCEPTED, 32)  # first pauses; second saw none of it
    assert first.learned.pause.skip > 0 and second.learned == request(engine, target, tiny_draft(target)).learned
    play(second, torch.full((1, 4), 0.6), NEVER_ACCEPTED, 16)
    after = request(engine, target, draft)
    assert after.learned == second.learned and after.learned is not second.learned


def test_what_a_greedy_request_hands_on_belongs_to_its_draft_target_batch_size_and_settings():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    engine = costs(draft=0.04)
    play(request(engine, target, draft), torch.full((1, 4), 0.6), NEVER_ACCEPTED, 32)
    assert not request(engine, target, draft).draft_this_round(1), \
        "the same draft, target, batch size and settings: still in the pause"
    other_target = tiny_target("llama", seed=3)
    for policy in (request(engine, target, draft, batch_size=2), request(engine, target, tiny_draft(target)),
                   request(engine, other_target, draft), request(engine, target, draft, probe_every=2)):
        assert policy.draft_this_round(1) and policy.gain == 1.0


def test_a_probe_that_verifies_more_tokens_pauses_longer():
    """The probe budget prices a probe by what the last drafted round really verified, not by one token."""
    engine = costs(draft=0.01, verify=lambda n: 0.05 + 0.01 * n)
    pause = {}
    for verified in (1, 7):
        policy = auto(engine)
        policy.plan([[0.05] * 7], 7, 1)  # a head that promises nothing: the estimate falls below 1
        policy.learn([verified], [0], drafted=True)
        pause[verified] = policy.learned.pause.skip
    assert pause[7] > pause[1] > 0, pause


def test_a_lucky_first_block_does_not_keep_a_draft_that_does_not_pay_drafting():
    """Two tokens accepted in the first block, then nothing, from a head that promises 0.6 everywhere: the estimate
    starts at break-even and reads the confidences recalibrated by what was accepted, so the misses pull the head's
    promise down and drafting pauses within four of them, not carried on by the one lucky round."""
    policy = auto(costs(draft=0.04))
    luck = iter([2] + [0] * 40)
    drafted = play(policy, torch.full((1, 7), 0.6), lambda lengths: torch.minimum(lengths, torch.tensor(next(luck))),
                   30)
    assert drafted[:2] == [True, True] and sum(drafted) <= 5 and not any(drafted[5:])


def test_the_gain_estimate_reads_what_a_round_was_expected_to_commit_not_the_noisy_count():
    """A calibrated draft that pays on average, 1.2x by its confidences, accepts nothing in half its rounds: the
    estimate of what drafting gains follows the expectation given each block, so the misses do not pause it (an
    estimate of the counts would have, in the draft of 2026-11-26's first rounds)."""
    engine = costs(draft=0.01, verify=lambda n: 0.05 if n <= 3 else 0.08)
    luck = iter([0, 0, 2, 0, 0, 1, 0, 0, 3, 0, 2, 0] * 10)
    policy = auto(engine)
    drafted = play(policy, torch.full((1, 7), 0.5), lambda ls: torch.minimum(ls, torch.tensor(next(luck))), 100)
    assert all(drafted) and policy.gain > 1


def test_drafting_is_judged_against_what_a_round_that_drafts_nothing_costs_on_the_call_s_path():
    """A round that drafts nothing runs one token per row and no draft work, cheaper than a drafting round's
    verification of one token (which projects the target's features for the draft): a draft that beats the latter,
    but not the former, pauses."""
    from dspark_hf.costs.cost_model import EngineCosts

    def drafts(plain):
        policy = auto(EngineCosts({1: {n: 0.05 + 0.004 * n for n in range(1, 9)}}, {1: 0.01}, plain))
        luck = iter([1, 0, 1, 0, 0] * 20)  # the first drafted token accepted in 2 rounds of 5, never the second
        confidences = torch.tensor([[0.4] + [0.05] * 6])
        return play(policy, confidences, lambda ls: torch.minimum(ls, torch.tensor(next(luck))), 60)

    assert all(drafts(None))  # against verifying one token: 1.4 tokens in 0.068 s, 1.11x one in 0.054 s
    assert sum(drafts({1: 0.045})) <= 3  # against the plain round it costs: 0.93x one in 0.045 s


def test_drafting_must_beat_one_token_rounds_by_the_margin():
    """A draft that the costs say gains 1.06x drafts at break-even (margin=1) and pauses under the default margin
    (1.1x): its rounds, timed apart, do not show what a decode that mixes drafted and plain rounds pays for them."""
    from dspark_hf import AutoScheduled

    def drafts(margin):
        policy = auto(costs(draft=0.004, verify=lambda n: 0.054 if n == 1 else 0.068), margin=margin)
        luck = iter([1, 0, 1, 0, 0] * 20)  # the first drafted token accepted in 2 rounds of 5, never the second
        return play(policy, torch.tensor([[0.4] + [0.05] * 6]), lambda ls: torch.minimum(ls, torch.tensor(next(luck))),
                    60)

    assert AutoScheduled().margin == 1.1
    assert all(drafts(1.0))  # 1.4 tokens in 0.072 s against one in 0.054 s, 1.06x by the estimate
    drafted = drafts(1.1)  # under the default margin, 1.06 / 1.1: the estimate sinks below 1 from its start at 1
    assert all(drafted[:5]) and not any(drafted[20:])


def test_one_unlucky_round_does_not_stop_a_draft_that_pays():
    policy = auto(costs())
    luck = iter([7] * 10 + [0] + [7] * 10)
    drafted = play(policy, torch.full((1, 7), 0.9), lambda lengths: torch.minimum(lengths, torch.tensor(next(luck))),
                   21)
    assert all(drafted), "the running gain stays above 1 through one bad round"


def test_a_draft_better_than_its_confidences_gets_its_full_block_verified():
    """An oracle-like draft whose confidence head says 0.3 everywhere: the acceptance seen recalibrates it."""
    policy = auto(costs())
    lengths = []
    play(policy, torch.full((2, 7), 0.3), lambda ls: lengths.append(ls.tolist()) or ls.clone(), 12)
    assert max(lengths[0]) < 7 and all(row == [7, 7] for row in lengths[3:])


def test_a_draft_algorithm_1_would_never_verify_at_batch_8_is_verified_and_found_out():
    """At batch 8, Algorithm 1 on the raw confidences verifies nothing (one row's first token would pay every row's
    padding), which would teach it nothing: every row verifies the common length, which grows with the acceptance
    seen until the whole block is verified."""
    engine = costs(verify=lambda n: 0.05 + 0.03 * n, rows=(1, 8))
    confidences = torch.full((8, 7), 0.3)
    cost = lambda b: 1 / (engine.draft(8) + engine.verify(8, b // 8))  # noqa: E731
    assert prefix_schedule(confidences, cost, padded=True) == [0] * 8
    policy, lengths = auto(engine), []
    drafted = play(policy, confidences, lambda ls: lengths.append(ls.tolist()) or ls.clone(), 10)
    assert min(lengths[0]) >= 1 and all(row == [7] * 8 for row in lengths[2:])
    assert all(drafted) and policy.gain > 1


def test_probes_verify_at_least_one_token_and_are_judged_by_what_the_plan_would_have_gained():
    policy = auto(costs(draft=0.04), probe_budget=0.02)  # probes every 41+ rounds
    lengths = []
    drafted = play(policy, torch.full((1, 7), 0.05),
                   lambda ls: lengths.append(int(ls)) or torch.zeros_like(ls), 200)
    probes = [i for i, d in enumerate(drafted) if d]
    assert all(n >= 1 for n in lengths), "a plan of zero tokens would never learn otherwise"
    assert len(probes) >= 3 and policy.gain < 1


def test_without_a_confidence_head_the_default_policy_plans_with_the_acceptance_seen():
    always, never = auto(costs()), auto(costs(draft=0.001))
    for policy, accept in ((always, lambda ls: ls.clone()), (never, lambda ls: torch.zeros_like(ls))):
        for _ in range(10):
            lengths = policy.plan(None, 7, 1)
            policy.learn(lengths, accept(torch.tensor(lengths)).tolist(), drafted=True)
    assert always._plan(None, 1) == [7] and never._plan(None, 1) == [0]


def test_the_default_policy_measures_costs_once_and_later_processes_reuse_them(tmp_path):
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, "tests")
        from conftest import left_padded_prompts, tiny_draft, tiny_target
        target = tiny_target("llama")
        ids, mask = left_padded_prompts(2)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              assistant_model=tiny_draft(target))
        print(out[0].tolist())
    """)
    env = {**os.environ, "DSPARK_HF_PROFILE_CACHE": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    (cached,) = tmp_path.glob("*.json")
    written = cached.stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout == first.stdout
    assert "profiling this machine" in first.stderr and "profiling this machine" not in second.stderr
    assert cached.stat().st_mtime_ns == written


@pytest.mark.slow  # its compiled call compiles the tiny target's steps
def test_a_reused_default_policy_prices_each_call_on_that_call_s_path_target_and_batch_size(tmp_path, monkeypatch):
    """Costs are those of the call's own rounds: measured once per path (eager, or compiled), target, draft and batch
    size, read again only for a call on another, and never in place of costs set by hand."""
    from conftest import cpu_compile_config
    from dspark_hf.scheduling import auto

    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path))
    measured, path_costs = [], auto.path_costs
    monkeypatch.setattr(auto, "path_costs", lambda clock, **kw: measured.append(clock) or path_costs(clock, **kw))
    llama, qwen = tiny_target("llama"), tiny_target("qwen3")
    llama_draft, qwen_draft = tiny_draft(llama), tiny_draft(qwen)
    policy = AutoScheduled(progress=False)

    def decode(target, draft, batch, **options):
        ids, mask = left_padded_prompts(batch)
        target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, assistant_model=draft,
                        verification_policy=policy, **options)
        return policy.costs

    first = decode(llama, llama_draft, 1)
    assert decode(llama, llama_draft, 1) is first and len(measured) == 1  # nothing to read again
    assert set(decode(qwen, qwen_draft, 1).verify_seconds) == {1}
    assert set(decode(qwen, qwen_draft, 3).verify_seconds) == {3} and len(measured) == 3
    compiled = decode(llama, llama_draft, 1, cache_implementation="static", compile_config=cpu_compile_config())
    eager_clock, compiled_clock = measured[0], measured[-1]
    assert compiled_clock.key["path"].startswith("compiled") and eager_clock.key["path"] == "eager"
    # eagerly every width is timed; compiled, the widths the forward is compiled for, each pricing the tokens it runs
    block = llama_draft.config.block_size
    assert widths_timed(eager_clock) == list(range(1, block + 2))
    buckets = widths_timed(compiled_clock)
    assert buckets == [1, 2, 4, block + 1]
    assert compiled_clock.verify_table({w: float(w) for w in buckets}) == {1: 1.0, 2: 2.0, 3: 4.0, 4: 4.0, 5: 5.0}
    assert set(compiled.verify_seconds[1]) == set(first.verify_seconds[1]) == set(range(1, block + 2))
    by_hand = costs()
    policy.costs = by_hand
    assert decode(llama, llama_draft, 2) is by_hand and len(measured) == 4  # costs set by hand are the caller's


def widths_timed(clock) -> list[int]:
    return sorted(name[1] for name in clock.runs() if isinstance(name, tuple))


def test_a_call_plans_with_the_row_counts_it_asked_for_only_whatever_else_earlier_calls_cached(tmp_path, monkeypatch):
    from dspark_hf.costs.cost_model import cached_costs

    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path))
    target = tiny_target("llama")
    draft = tiny_draft(target)
    cached_costs(target, draft, [1, 2, 4], progress=False)  # an earlier call at batch 2 measured R = 2 too
    costs = cached_costs(target, draft, [1, 4], progress=False)
    assert set(costs.verify_seconds) == set(costs.draft_seconds) == {1, 4}  # R = 2 is interpolated, as without it
    one, four = costs.verify(1, 3), costs.verify(4, 3)
    assert costs.verify(2, 3) == pytest.approx(one + (four - one) / 3)


def test_the_default_policy_can_plan_against_a_dspark_profile_file(tmp_path):
    from dspark_hf import AutoScheduled
    from dspark_hf.costs.cost_model import save_profile
    from dspark_hf.costs.profile import profile_sps

    target = tiny_target("llama")
    draft = tiny_draft(target)
    save_profile(profile_sps(target, rows=[1, 3], max_tokens_per_row=5, context=16, repeats=2, warmup=1,
                             draft=draft, progress=False), tmp_path / "p.json")
    ids, mask = left_padded_prompts(3)
    from test_generation_greedy import plain

    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                          assistant_model=draft, verification_policy=AutoScheduled(profile=tmp_path / "p.json"))
    assert torch.equal(out, plain(target, ids, mask, max_new_tokens=12))
    with pytest.raises(ValueError, match="without --no-draft"):
        save_profile(profile_sps(target, rows=[1], max_tokens_per_row=2, context=8, repeats=1, warmup=0,
                                 progress=False), tmp_path / "no_draft.json")
        AutoScheduled(profile=tmp_path / "no_draft.json").prepare(target, draft, 1)


def saved_profile(path, target, draft, max_tokens=5):
    from dspark_hf.costs.cost_model import save_profile
    from dspark_hf.costs.profile import profile_sps

    save_profile(profile_sps(target, rows=[1], max_tokens_per_row=max_tokens, context=8, repeats=1, warmup=0,
                             draft=draft, progress=False), path)
    return path


def profile_warnings(path, target, draft) -> list[str]:
    import warnings

    from dspark_hf.costs.cost_model import ProfileMismatchWarning, check_profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_profile(path, target, draft)
    assert all(w.category is ProfileMismatchWarning for w in caught)
    return [str(w.message) for w in caught]


def test_a_profile_used_for_other_models_or_another_machine_is_warned_about_once_saying_what_differs(tmp_path,
                                                                                                    monkeypatch):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    path = saved_profile(tmp_path / "p.json", target, draft)
    assert profile_warnings(path, target, draft) == []
    qwen = tiny_target("qwen3")
    [other_target] = profile_warnings(path, qwen, tiny_draft(qwen))
    assert other_target.startswith(f"{path} was measured for another target or machine (differing in config, model)")
    assert other_target.endswith("re-run `dspark profile --max-tokens 5` with these models on this machine.")
    assert "\n" not in other_target and profile_warnings(path, qwen, tiny_draft(qwen)) == []  # said once
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert "(differing in threads)" in profile_warnings(path, target, draft)[0]
    monkeypatch.undo()
    assert "another draft (differing in class, shape or dtype)" in profile_warnings(path, target, tiny_draft(
        target, markov_rank=4))[0]


def test_a_profile_that_measured_fewer_tokens_per_row_than_the_draft_verifies_is_warned_about(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    path = saved_profile(tmp_path / "short.json", target, draft, max_tokens=2)
    assert profile_warnings(path, target, draft) == [
        f"{path} was measured for up to 2 tokens per row, this draft verifies up to 5: plans against it may be wrong; "
        "re-run `dspark profile --max-tokens 5` with these models on this machine."]


def test_a_profile_from_before_models_were_recorded_loads_and_is_checked_for_its_grid_only(tmp_path):
    import json

    target = tiny_target("llama")
    path = saved_profile(tmp_path / "old.json", target, tiny_draft(target))
    old = json.loads(path.read_text())
    del old["target_key"], old["draft_key"]
    path.write_text(json.dumps(old))
    qwen = tiny_target("qwen3")
    assert profile_warnings(path, qwen, tiny_draft(qwen)) == []
    assert len(Scheduled.from_profile(path).plan([[0.5] * 4], 4, 1)) == 1


@pytest.mark.parametrize("make", [lambda p: Scheduled.from_profile(p), lambda p: AsyncScheduled.from_profile(p),
                                  lambda p: AutoScheduled(profile=p)], ids=["scheduled", "async", "auto"])
def test_generate_warns_when_its_policy_s_profile_was_measured_for_other_models(tmp_path, make):
    from dspark_hf.costs.cost_model import ProfileMismatchWarning

    target = tiny_target("llama")
    draft = tiny_draft(target)
    path = saved_profile(tmp_path / "p.json", tiny_target("qwen3"), draft)
    ids, mask = left_padded_prompts(2)
    with pytest.warns(ProfileMismatchWarning, match="was measured for another target or machine"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=draft,
                        verification_policy=make(path))


def test_a_probe_is_counted_in_the_gain_as_the_plan_would_have_done_not_at_what_exploring_cost():
    engine = costs(draft=0.04, verify=lambda n: 0.05 + 0.03 * n)
    policy = auto(engine)
    policy.learned.seen[0][0] = 20  # position 1 verified 20 times, never accepted: the plan verifies nothing
    lengths = policy.plan([[0.05] * 7], 7, 1)
    assert lengths == [1], "the probe verifies one token all the same"
    policy.learn(lengths, [1], drafted=True)  # and it is accepted
    plan_would = engine.verify(1, 1) / (engine.draft(1) + engine.verify(1, 1))  # one token, nothing verified
    smoothing = policy.smoothing  # the estimate starts at break-even
    assert policy._plan(None, 1) == [0] and policy.gain == pytest.approx(1 - smoothing + smoothing * plan_would)


def test_any_object_with_the_six_policy_methods_is_a_policy_without_subclassing():
    from dspark_hf import VerificationPolicy
    from dspark_hf.scheduling import as_policy

    class Mine:  # drafts every other round, verifies two tokens
        def __init__(self):
            self.rounds, self.learnt = 0, []

        def prepare(self, target, draft, batch_size, sampling):
            pass

        def price(self, clock):
            pass

        def draft_this_round(self, num_rows):
            self.rounds += 1
            return self.rounds % 2 == 0

        def keep_drafted(self, num_rows):
            return True

        def plan(self, confidences, gamma, num_rows):
            return [2] * num_rows

        def learn(self, verified, accepted, drafted):
            self.learnt.append((verified, accepted, drafted))

    mine = Mine()
    assert isinstance(mine, VerificationPolicy) and as_policy(mine) is mine
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                          assistant_model=tiny_draft(target), verification_policy=mine, return_dict_in_generate=True)
    assert mine.rounds > 1 and [len(r.drafted) for r in out.rounds[0][:2]] == [0, 4]
    assert all(isinstance(n, int) for verified, accepted, _ in mine.learnt for n in verified + accepted)


class EarlierReleases(Policy):
    """A policy written to the tensor interface docs/api.md described before design step 4: `__call__` on a
    (num_rows, gamma) confidence tensor, `observe` on (num_rows,) tensors."""

    def __init__(self):
        self.observed = []

    def __call__(self, confidences, gamma, num_rows):
        assert confidences.shape == (num_rows, gamma) and confidences.dtype == torch.float32
        return torch.full((num_rows,), 2)

    def observe(self, verified, accepted, drafted):
        self.observed.append((verified.dtype, tuple(verified.shape), accepted.dtype, drafted))


class EarlierDuckTyped:
    """The same, without subclassing: the four methods of the earlier protocol."""

    def __init__(self):
        self.rounds, self.observed = 0, []

    def prepare(self, target, draft, batch_size, sampling):
        self.rounds = 0

    def draft_this_round(self, num_rows):
        self.rounds += 1
        return self.rounds % 2 == 0

    def __call__(self, confidences, gamma, num_rows):
        return torch.full((num_rows,), 2)

    def observe(self, verified, accepted, drafted):
        self.observed.append((verified.dtype, tuple(verified.shape), accepted.dtype, drafted))


@pytest.mark.parametrize("make", [EarlierReleases, EarlierDuckTyped,
                                  lambda: lambda confidences, gamma, num_rows: [2] * num_rows])
def test_policies_of_the_earlier_tensor_interface_decode_through_the_adapter_as_before(make):
    from test_generation_greedy import dspark, plain
    from dspark_hf.scheduling import TensorPolicy, as_policy

    policy = make()
    adapted = as_policy(policy)
    assert isinstance(adapted, TensorPolicy) and adapted.wrapped is policy
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    out = dspark(target, tiny_draft(target), ids, mask, max_new_tokens=10, verification_policy=policy)
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=10))
    drafted = [r for r in out.rounds[0] if r.drafted]
    assert drafted and {r.verified for r in drafted} <= {1, 2}  # two, or one where one token was left
    if isinstance(policy, EarlierDuckTyped):  # its own draft_this_round decides: every other round drafts
        assert not out.rounds[0][0].drafted and out.rounds[0][1].drafted
    if hasattr(policy, "observed"):  # it learns from tensors, as before
        assert policy.observed and all(v == a == torch.long and shape == (2,) for v, shape, a, _ in policy.observed)


def test_a_tensor_interface_subclass_of_the_adapter_is_a_policy_as_it_stands():
    from dspark_hf.scheduling import TensorPolicy, as_policy

    class Mine(TensorPolicy):
        def __call__(self, confidences, gamma, num_rows):
            return (confidences > 0.5).long().cumprod(1).sum(1)

    mine = Mine()
    assert as_policy(mine) is mine and mine.plan([[0.9, 0.6, 0.1], [0.2, 0.9, 0.9]], 3, 2).tolist() == [2, 0]


def test_generate_hands_the_default_policy_s_learning_on_between_greedy_calls_only():
    from dspark_hf import AutoScheduled

    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(2)
    policies = [AutoScheduled(progress=False) for _ in range(3)]
    for policy, sampling in zip(policies, (False, False, True)):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=sampling,
                        assistant_model=draft, verification_policy=policy)
    first, second, sampled = (p.learned for p in policies)
    # the second greedy call went on in the pause the first one ended in, in a copy of its own
    assert second is not first and second.pause.next == first.pause.next and second.pause.skip < first.pause.skip
    assert sampled is not first and sampled is not second


# -- what a policy may answer, and what may be asked of it -----------------------------------------------------------
class Answers(Policy):
    """Answers every round with `lengths(num_rows)`."""

    def __init__(self, lengths):
        self.lengths = lengths

    def plan(self, confidences, gamma, num_rows):
        return self.lengths(num_rows)


def test_a_policy_may_answer_with_a_list_as_prefix_schedule_returns_it():
    from test_generation_greedy import dspark, plain

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    out = dspark(target, tiny_draft(target), ids, mask, max_new_tokens=10,
                 verification_policy=Answers(lambda R: [2] * R))
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=10))
    assert {r.verified for rows in out.rounds for r in rows if r.drafted} <= {0, 1, 2}


@pytest.mark.parametrize("answer, error", [
    (lambda R: 3, r"shape \(\); it must return one per row still decoding, shape \(2,\)"),
    (lambda R: torch.ones(R, 1), r"shape \(2, 1\)"),
    (lambda R: [-1] * R, r"between 0 and the block's 4 drafted tokens"),
    (lambda R: [5] * R, r"between 0 and the block's 4 drafted tokens"),
    (lambda R: torch.full((R,), 1.5), "whole numbers of tokens"),
    (lambda R: torch.full((R,), float("nan")), "whole numbers of tokens"),
    (lambda R: "two", "str; it must return a"),
])
def test_a_policy_answer_that_is_not_one_length_per_row_in_the_block_is_refused_naming_the_policy(answer, error):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    with pytest.raises((ValueError, TypeError), match="verification policy Answers returned .*" + error):
        target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
                        assistant_model=tiny_draft(target), verification_policy=Answers(answer))


def test_a_policy_class_instead_of_an_instance_is_refused():
    from dspark_hf import AutoScheduled, FullBlock
    from dspark_hf.scheduling import as_policy

    for cls in (FullBlock, AutoScheduled):
        with pytest.raises(TypeError, match=f"verification_policy={cls.__name__} is a class: pass an instance"):
            as_policy(cls)


@pytest.mark.parametrize("make, error", [
    (lambda: __import__("dspark_hf").FixedLength(2.5), "FixedLength: length must be a whole number >= 0"),
    (lambda: __import__("dspark_hf").FixedLength("2"), "FixedLength: length must be a whole number >= 0"),
    (lambda: ThresholdPolicy("0.5"), r"ThresholdPolicy: threshold must be a number in \[0, 1\]"),
    (lambda: ThresholdPolicy(float("nan")), r"ThresholdPolicy: threshold must be a number in \[0, 1\]"),
    (lambda: AsyncScheduled(lambda b: 1.0, lag=0), "AsyncScheduled: lag must be a whole number >= 1"),
    (lambda: Scheduled(lambda b: 1.0, probe_every=0), "Scheduled: probe_every must be a whole number >= 1"),
    (lambda: __import__("dspark_hf").AutoScheduled(probe_budget=0), r"probe_budget must be a number in \(0, inf\]"),
    (lambda: __import__("dspark_hf").AutoScheduled(margin=0.9), r"margin must be a number in \[1, inf\]"),
    (lambda: __import__("dspark_hf").AutoScheduled(smoothing=5), r"smoothing must be a number in \(0, 1\]"),
    (lambda: __import__("dspark_hf").AutoScheduled(max_pause=-3), "max_pause must be a whole number >= 1"),
])
def test_policy_settings_are_checked_when_the_policy_is_made(make, error):
    with pytest.raises(ValueError, match=error):
        make()


@pytest.mark.parametrize("name, error", [
    ("fixed -1", "--policy 'fixed -1': FixedLength: length must be a whole number >= 0, got -1."),
    ("threshold 1.5", "--policy 'threshold 1.5': ThresholdPolicy: threshold must be a number in [0, 1], got 1.5."),
])
def test_a_named_policy_with_a_value_out_of_range_is_refused_when_the_name_is_read_naming_it(name, error):
    from dspark_hf.scheduling.named import named_policy

    with pytest.raises(ValueError) as refused:
        named_policy(name)
    assert str(refused.value) == error
    assert named_policy("fixed 2")().length == 2


def test_a_last_round_in_which_no_row_can_verify_a_token_drafts_nothing():
    from test_generation_greedy import dspark, plain

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    policy = Answers(lambda R: torch.full((R,), 4))
    seen = []
    policy.learn = lambda verified, accepted, drafted: seen.append(drafted)
    out = dspark(target, tiny_draft(target), ids, mask, max_new_tokens=7, verification_policy=policy)
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=7))
    (rounds,) = out.rounds
    assert rounds[-1].drafted == [] and rounds[-1].committed == 1 and seen[-1] is False
    assert rounds[-1].one_token_left and not any(r.one_token_left for r in rounds[:-1])
    assert all(r.drafted for r in rounds[:-1])


# -- the default policy's cost cache ----------------------------------------------------------------------------
def measure_counting(monkeypatch):
    """Count the measurements cached_costs makes."""
    from dspark_hf.costs import cost_model as costs

    calls, measure = [], costs.profile_sps
    monkeypatch.setattr(costs, "profile_sps", lambda *a, **kw: calls.append(a[1]) or measure(*a, **kw))
    return calls


@pytest.mark.parametrize("content", ['{"key": {}, "verify": {"1": {"1": 0.', "", '{"key": {}}', "[]",
                                     '{"key": {}, "verify": {"1": {}}, "drafts": {}}',
                                     '{"key": {}, "verify": {"1": {"1": -2}}, "drafts": {}}',
                                     '{"key": {}, "verify": {}, "drafts": {}, "rounds": {"a": {"verify": {"1": 1}}}}'])
def test_an_unreadable_cost_cache_is_named_measured_again_and_written_anew(tmp_path, monkeypatch, content):
    from dspark_hf.costs.cost_model import cached_costs

    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path))
    target = tiny_target("llama")
    draft = tiny_draft(target)
    cached_costs(target, draft, [1], progress=False)
    (path,) = tmp_path.glob("*.json")
    path.write_text(content)
    calls = measure_counting(monkeypatch)
    with pytest.warns(UserWarning, match=f"{path}: the default policy's cost cache cannot be read"):
        cached_costs(target, draft, [1], progress=False)
    assert calls == [[1]]
    cached_costs(target, draft, [1], progress=False)  # the file written anew is read back
    assert calls == [[1]]


def test_a_cost_cache_that_cannot_be_written_is_said_once_and_kept_for_the_process(tmp_path, monkeypatch):
    from dspark_hf.costs.cost_model import cached_costs

    (tmp_path / "a file").write_text("")
    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path / "a file" / "profiles"))  # cannot become a folder
    target = tiny_target("llama")
    draft = tiny_draft(target)
    calls = measure_counting(monkeypatch)
    with pytest.warns(UserWarning, match="cannot save the default policy's measured costs to .*kept for this process"):
        first = cached_costs(target, draft, [1], progress=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = cached_costs(target, draft, [1], progress=False)
    assert calls == [[1]] and again.verify_seconds == first.verify_seconds


def test_threads_adding_to_the_cost_cache_at_once_lose_nothing(tmp_path):
    import os
    import threading

    from dspark_hf.costs.cost_model import _merge_into, _read_cache

    path = tmp_path / "costs.json"

    def add(first):
        for R in range(first, first + 40):
            _merge_into(path, {}, {R: {1: 0.1}}, "draft", {R: 0.01})

    threads = [threading.Thread(target=add, args=(40 * i + 1,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stored = _read_cache(path, {})
    assert sorted(map(int, stored["verify"])) == list(range(1, 121)) and len(stored["drafts"]["draft"]) == 120
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".partial"] == []
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask, "readable by others as any file the user writes"


def test_costs_are_kept_apart_by_attention_implementation_and_device_kind():
    from dspark_hf.costs.profile import target_key

    target = tiny_target("llama")
    key = target_key(target)
    target.config._attn_implementation = "eager" if key["attention"] != "eager" else "sdpa"
    assert target_key(target) != key
    assert {"attention", "transformers"} <= set(key) and key["device"].startswith("cpu: ")


def test_a_draft_subclass_that_proposes_its_own_blocks_does_not_share_the_draft_s_cached_cost():
    from dspark_hf.evaluation.oracle import OracleDraft
    from dspark_hf.costs.profile import draft_key

    draft = tiny_draft(tiny_target("llama"))
    same_shape = tiny_draft(tiny_target("llama"))
    assert draft_key(OracleDraft.from_draft(draft)) != draft_key(draft) == draft_key(same_shape)


def test_costs_measured_under_a_caller_s_autocast_are_kept_apart_from_those_without():
    from dspark_hf.costs.profile import target_key

    target = tiny_target("llama")
    plain = target_key(target)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = target_key(target)
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = target_key(target)
    assert len({str(plain), str(bf16), str(fp16)}) == 3 and target_key(target) == plain


@pytest.mark.parametrize("profile, error", [
    ({"sps": {"1": "fast"}}, "sps holds '1': 'fast', not a count and a number"),
    ({"sps": [1, 2]}, "sps must be a non-empty table"),
    ({"sps": {"one": 2.0}}, "sps holds 'one'"),
    ({"sps": {"1": 2.0}, "grid": {"1": {}}}, r"grid\[1\] must be a non-empty table"),
    ({"sps": {"1": 2.0}, "grid": [1]}, "grid must be a table of row counts"),
    ({"sps": {"1": 2.0}, "draft_seconds": {"1": 0}}, "draft_seconds holds '1': 0; counts are >= 1, measurements"),
])
def test_a_profile_file_with_bad_tables_is_refused_naming_the_file(tmp_path, profile, error):
    import json

    from dspark_hf.costs.cost_model import read_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ValueError, match=f"{path}: {error}.*make it again with `dspark profile`"):
        read_profile(path)


def test_a_target_whose_learned_positions_end_before_the_profiling_context_is_profiled_within_them():
    import transformers as tr
    from test_generation_greedy import plain

    torch.manual_seed(0)
    target = tr.BioGptForCausalLM(tr.BioGptConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=None, eos_token_id=None)).eval()
    target.generation_config.eos_token_id = None
    ids, mask = left_padded_prompts(2)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                          assistant_model=tiny_draft(target))  # the default policy profiles at 256 tokens elsewhere
    assert torch.equal(out, plain(target, ids, mask, max_new_tokens=12))


def test_the_default_policy_measures_at_most_auto_max_rows_and_prices_larger_batches_in_proportion(tmp_path,
                                                                                                   monkeypatch):
    from dspark_hf.costs import cost_model as cost_cache

    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path))  # nothing measured yet
    target = tiny_target("llama")
    draft = tiny_draft(target)
    calls = measure_counting(monkeypatch)
    costs = cost_cache.cached_costs(target, draft, [1, 5000], progress=False)  # 5,000 rows x 256 tokens not held
    assert calls and all(max(rows) <= cost_cache.AUTO_MAX_ROWS for rows in calls)
    big = cost_cache.AUTO_MAX_ROWS
    assert costs.verify(5000, 2) == pytest.approx(costs.verify(big, 2) * 5000 / big)
