"""Speculative speculative decoding (SSD / Saguaro): the shape of the speculation cache (Theorem 12), the cache's
outcomes and lookup, Saguaro sampling (Theorem 15), the fallback (Theorem 17), and decoding with `ssd=`: greedy
output identical to plain generate(), sampled output exact, whatever the cache hits."""

import dataclasses

import pytest
import torch

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import SSDConfig
from dspark_hf.generation.ssd.source import SSDSource, ngram_proposal
from dspark_hf.generation.ssd.speculation import bonus_rank, predict_outcomes, saguaro
from dspark_hf.generation.ssd.fan_out import (critical_batch_size, expected_hit_rate, fit_power_law, geometric_fan_out,
                                      measured_fan_out, outcome_probabilities, ssd_speedup, uniform_fan_out)
from test_generation_greedy import eos_inside_a_block, oracle, plain
from test_generation_sampling import (ALPHA, SAMPLES, flattened_draft, p_value, sample_continuations,
                                      sampling_setup)


# -- the cache's shape: Theorem 12 ---------------------------------------------------------------------------------
def test_outcome_probabilities_are_geometric_with_the_all_accepted_tail():
    assert outcome_probabilities(0.5, 2) == [0.5, 0.25, 0.25]
    assert sum(outcome_probabilities(0.8, 7)) == pytest.approx(1.0)


def test_geometric_fan_out_on_hand_computed_cases():
    # alpha 0.5, r 1: weights sqrt(0.5, 0.25, 0.25) = (0.707, 0.5, 0.5); 10 blocks -> 4.14, 2.93, 2.93 -> 4, 3, 3
    assert geometric_fan_out(10, verified=2, alpha=0.5, r=1.0) == [4, 3, 3]
    # alpha 0.8, r 1: sqrt(0.2, 0.16, 0.128, 0.512) = (0.447, 0.4, 0.358, 0.716); 19 blocks -> 4.42, 3.96, 3.54,
    # 7.08 -> 4, 4, 4, 7
    assert geometric_fan_out(19, verified=3, alpha=0.8, r=1.0) == [4, 4, 4, 7]


def test_geometric_fan_out_falls_by_alpha_to_the_one_over_one_plus_r():
    alpha, r = 0.7, 0.5
    F = geometric_fan_out(10**6, verified=5, alpha=alpha, r=r)
    for a, b in zip(F[:4], F[1:5]):
        assert b / a == pytest.approx(alpha ** (1 / (1 + r)), rel=1e-4)
    assert F[5] / F[4] == pytest.approx((alpha / (1 - alpha)) ** (1 / (1 + r)), rel=1e-4), "the all-accepted tail"
    assert sum(F) == 10**6


def test_uniform_fan_out_spreads_the_budget_evenly():
    assert uniform_fan_out(10, verified=3) == [3, 3, 2, 2]
    assert uniform_fan_out(0, verified=3) == [0, 0, 0, 0]


def test_a_cache_that_cannot_hold_the_all_accepted_outcome_spends_nothing_on_it():
    # alpha 0.5, r 1, k < 3: weights 0.5^(k/2) = (1, 0.707, 0.5); 10 blocks -> 4.53, 3.20, 2.27 -> 5, 3, 2
    assert geometric_fan_out(10, verified=3, alpha=0.5, r=1.0, cache_last=False) == [5, 3, 2, 0]
    # Theorem 12 with the last term put 7 of 16 blocks on k = 4 at alpha 0.9, a draft's best case
    assert geometric_fan_out(16, verified=4, alpha=0.9, r=1.0)[-1] == 7
    assert geometric_fan_out(16, verified=4, alpha=0.9, r=1.0, cache_last=False) == [4, 4, 4, 4, 0]
    assert geometric_fan_out(9, verified=3, alpha=1.0, r=1.0, cache_last=False) == [3, 3, 3, 0], "the even limit"
    assert geometric_fan_out(9, verified=3, alpha=0.0, r=1.0, cache_last=False) == [9, 0, 0, 0]
    assert uniform_fan_out(10, verified=3, cache_last=False) == [4, 3, 3, 0]
    miss = lambda F: 1.0 if F == 0 else F ** -1.0  # noqa: E731
    hit_rate = lambda F: expected_hit_rate(F[:-1] + [0], 0.9, miss)  # noqa: E731  (k = 4 can never hit)
    assert hit_rate(geometric_fan_out(16, 4, 0.9, 1.0, cache_last=False)) > hit_rate(geometric_fan_out(16, 4, 0.9, 1.0))


def test_the_acceptance_rate_counts_only_tokens_that_were_tested():
    from dspark_hf.generation.ssd.source import acceptance_rate

    # rounds accepting 0 of 4, 2 of 4 and 4 of 4: 6 tokens accepted, 2 rejections; the 6 tokens after the two
    # rejections were never tested. Geometric maximum likelihood 6 / 8, with the prior (6 + 1) / (8 + 2)
    assert acceptance_rate(accepted=6, rejections=2) == pytest.approx(0.7)
    torch.manual_seed(0)
    alpha, L = 0.7, 7
    tested = torch.rand(20000, L) < alpha  # each drafted token accepted with probability alpha, until the first not
    accepted = tested.int().cumprod(1).sum(1)
    estimate = acceptance_rate(int(accepted.sum()), int((accepted < L).sum()))
    assert estimate == pytest.approx(alpha, abs=0.01), "accepted / verified would give about 0.44"


@pytest.mark.parametrize("alpha, r", [(0.3, 0.5), (0.6, 1.0), (0.9, 2.0)])
def test_geometric_fan_out_hits_at_least_as_often_as_uniform_at_the_same_budget(alpha, r):
    miss = lambda F: 1.0 if F == 0 else F ** -r  # noqa: E731
    for budget in (8, 16, 64):
        geometric, uniform = geometric_fan_out(budget, 7, alpha, r), uniform_fan_out(budget, 7)
        assert sum(geometric) == sum(uniform) == budget
        assert expected_hit_rate(geometric, alpha, miss) >= expected_hit_rate(uniform, alpha, miss) - 1e-12


def test_a_power_law_is_recovered_from_its_miss_rates():
    assert fit_power_law({F: F ** -0.7 for F in range(1, 33)}) == pytest.approx(0.7)
    assert fit_power_law({2.5: 2.5 ** -1.5, 8: 8 ** -1.5}) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        fit_power_law({1: 0.5, 2: 1.0, 3: 0.0})


def test_the_measured_fan_out_on_hand_computed_cases():
    # 6 rounds ended at k = 0 (5 with the first candidate, 1 with the second), 3 at k = 1 with the first
    ranks = {0: {0: 5, 1: 1}, 1: {0: 3}}
    assert measured_fan_out(1, 3, ranks) == [1, 0, 0, 0]
    assert measured_fan_out(2, 3, ranks) == [1, 1, 0, 0]
    assert measured_fan_out(3, 3, ranks) == [2, 1, 0, 0]
    assert measured_fan_out(5, 3, ranks) == [4, 1, 0, 0], "blocks no outcome needs go to the earliest"
    # a curve that is not concave: the first block at k = 1 holds nothing, the second holds 3 rounds. One block
    # at a time by marginal gain would stop at 2 rounds (k = 0); the exact plan holds 3
    assert measured_fan_out(2, 2, {0: {0: 2}, 1: {1: 3}}) == [0, 2, 0]
    assert measured_fan_out(2, 2, {0: {0: 2}, 1: {5: 9}, 2: {0: 9}}) == [2, 0, 0], \
        "ranks past the budget, and the outcome no cache can hold, buy nothing"
    assert measured_fan_out(0, 2, ranks) == [0, 0, 0]


def test_the_measured_fan_out_holds_the_most_outcomes_of_any_fan_out_at_its_budget():
    import itertools

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        counts = torch.randint(0, 4, (3, 8), generator=generator).tolist()  # rounds by (k, rank)
        ranks = {k: {j: n for j, n in enumerate(row)} for k, row in enumerate(counts)}
        held = lambda F: sum(counts[k][j] for k in range(3) for j in range(F[k]))  # noqa: E731
        for budget in (1, 4, 7):
            F = measured_fan_out(budget, 3, ranks)
            assert sum(F) == budget and F[-1] == 0
            best = max(held(c) for c in itertools.product(range(budget + 1), repeat=3) if sum(c) == budget)
            assert held(F[:3]) == best


def test_bad_fan_out_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="power-law"):
        geometric_fan_out(8, 3, 0.5, r=0.0)
    with pytest.raises(ValueError, match="acceptance rate"):
        geometric_fan_out(8, 3, 1.5, r=1.0)
    with pytest.raises(ValueError, match="needs the bonus ranks of some round"):
        measured_fan_out(8, 3, {3: {0: 5}})
    assert measured_fan_out(0, 3, {}) == [0, 0, 0, 0], "no blocks to plan: no data needed"
    assert measured_fan_out(2, 2, {"1": {"1": 3}, "0": {"0": 2}}) == [0, 2, 0], "keys as JSON gives them back"
    with pytest.raises(ValueError, match="budget must be >= 0"):
        measured_fan_out(-1, 3, {0: {0: 5}})


# -- the cache's outcomes and lookup -------------------------------------------------------------------------------
def block_probs():
    """One row, a block of 2 over 5 tokens: position 1 prefers 3 > 1 > 0 > ..., position 2 prefers 4 > 2 > ...."""
    probs = torch.tensor([[[0.2, 0.3, 0.05, 0.4, 0.05], [0.05, 0.1, 0.25, 0.1, 0.5]]])
    return probs, torch.tensor([[3, 4]])


def test_the_cache_prepares_the_top_candidates_without_the_rejected_drafted_token():
    probs, tokens = block_probs()
    outcomes = predict_outcomes(probs, tokens, torch.tensor([1]), fan_out=[2, 2, 0])
    # k = 0: the drafted 3 was rejected, so the bonus is among the rest: 1, then 0;
    # k = 1: position 2 was not verified, so its drafted 4 may be the target's next token: 4, then 2
    assert outcomes.accepted.tolist() == [[0, 0, 1, 1]] and outcomes.bonus.tolist() == [[1, 0, 4, 2]]
    assert outcomes.valid.all()
    hit, slot = outcomes.lookup(torch.tensor([1]), torch.tensor([2]))
    assert hit.tolist() == [True] and slot.tolist() == [3]
    for accepted, bonus in ((0, 3), (0, 2), (2, 0)):  # the rejected token itself, a token outside the top 2, k = 2
        hit, _ = outcomes.lookup(torch.tensor([accepted]), torch.tensor([bonus]))
        assert hit.tolist() == [False]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "tied"])
def test_a_bonus_at_rank_j_is_held_exactly_by_caches_of_more_than_j_candidates_for_its_k(ties):
    """Also where tokens tie (a draft vocabulary's widened zeros, top-k sampling, bfloat16 logits): the cache takes
    the lower ids among equals, and the rank counts in that order."""
    generator = torch.Generator().manual_seed(0)
    N, gamma, V = 6, 3, 9
    probs = torch.rand(N, gamma, V, generator=generator).softmax(-1)
    if ties:  # a few distinct values, and zeros
        probs = (probs * 30).round().clamp_min(2) - 2
    tokens = torch.randint(V, (N, gamma), generator=generator)
    verify_len = torch.tensor([0, 1, 2, 3, 3, 2])
    for _ in range(30):
        accepted = (torch.rand(N, generator=generator) * (verify_len + 1)).long()  # k <= verify_len
        bonus = torch.randint(V, (N,), generator=generator)
        rejected = (accepted < verify_len) & (bonus == tokens[torch.arange(N), accepted.clamp(max=gamma - 1)])
        bonus = torch.where(rejected, (bonus + 1) % V, bonus)  # a rejected drafted token is never the bonus
        rank = bonus_rank(probs, tokens, verify_len, accepted, bonus)
        for i in range(N):
            k, j = int(accepted[i]), int(rank[i])
            if k == gamma:
                assert j == -1
                continue
            for F, held in ((j, False), (j + 1, True)):
                if F == 0:  # no block for k at all
                    continue
                fan_out = [0] * (gamma + 1)
                fan_out[k] = F
                hit, _ = predict_outcomes(probs[i:i + 1], tokens[i:i + 1], verify_len[i:i + 1], fan_out).lookup(
                    accepted[i:i + 1], bonus[i:i + 1])
                assert bool(hit) == held


def test_outcomes_past_a_rows_verified_length_or_the_block_are_never_hits():
    probs, tokens = block_probs()
    probs, tokens = probs.expand(2, -1, -1), tokens.expand(2, -1)
    outcomes = predict_outcomes(probs, tokens, torch.tensor([0, 2]), fan_out=[1, 1, 1])
    # row 0 verified nothing: only k = 0 can happen; row 1 verified both: k = 2 is the target's own token
    assert outcomes.valid.tolist() == [[True, False, False], [True, True, False]]
    assert outcomes.bonus[0, 0] == 3, "row 0 verified nothing, so its drafted token may be the next one"
    with pytest.raises(ValueError, match="one count per number of accepted tokens"):
        predict_outcomes(probs, tokens, torch.tensor([0, 2]), fan_out=[1, 1])


# -- Saguaro sampling: Theorem 15 ----------------------------------------------------------------------------------
def test_saguaro_down_weights_the_top_tokens_and_stays_a_distribution():
    probs, _ = block_probs()
    q = saguaro(probs, fan_out=2, C=0.5)
    assert torch.allclose(q.sum(-1), torch.ones(1, 2))
    ratio = q / probs  # per position: C x s on the top two tokens, s (the renormalisation) on the rest
    top = probs.topk(2, -1).indices
    rest = torch.ones_like(probs, dtype=torch.bool).scatter_(-1, top, False)
    s_rest = ratio[rest].view(1, 2, 3)
    assert torch.allclose(s_rest, s_rest[..., :1].expand(-1, -1, 3))
    assert torch.allclose(ratio.gather(-1, top), 0.5 * s_rest[..., :2])
    assert torch.equal(saguaro(probs, 2, 1.0), probs)
    only_two = torch.tensor([[0.0, 0.7, 0.0, 0.3, 0.0]])  # a top-k of 2, say: C = 0 would leave no mass
    assert torch.equal(saguaro(only_two, 2, 0.0), only_two)
    assert torch.allclose(saguaro(only_two, 1, 0.0), torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        saguaro(probs, 2, 1.5)


def test_the_residual_puts_more_mass_on_the_cached_tokens_as_C_falls():
    """Theorem 15: with the cache the top-F draft tokens, the bonus after a rejection lands in the cache more often
    the smaller C is."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        target = torch.softmax(torch.randn(50, generator=g) * 2, -1)
        draft = torch.softmax(torch.log(target) + torch.randn(50, generator=g), -1)
        cached = draft.topk(4).indices
        hit = []
        for C in (1.0, 0.7, 0.4, 0.1, 0.0):
            residual = (target - saguaro(draft, 4, C)).clamp_min(0)
            hit.append(float(residual[cached].sum() / residual.sum()))
        assert all(b >= a - 1e-6 for a, b in zip(hit, hit[1:])) and hit[-1] > hit[0]


# -- the fallback and the speedup: Theorem 7, Corollary 16, Theorem 17 ------------------------------------------------
def test_the_speedup_equation_on_a_hand_computed_case():
    # half the rounds hit (3 tokens), half miss (1 token) and wait 0.5 for the fallback; plain: 1 token per 0.5
    assert ssd_speedup(0.5, 3.0, 1.0, t_verify=1.0, t_fallback=0.5, t_plain=0.5) == pytest.approx(2 * 0.5 / 1.25)
    # at batch size 2 some row misses with probability 1 - 0.5^2
    assert ssd_speedup(0.5, 3.0, 1.0, 1.0, 0.5, 0.5, batch_size=2) == pytest.approx(2 * 0.5 / (1 + 0.75 * 0.5))


def test_the_fast_fallback_takes_over_at_the_critical_batch_size():
    # slow: 3 tokens per round either way, a miss costs 0.6 -> 3 / (1 + 0.6 (1 - 0.5^b)) = 2.31, 2.07, 1.97 ...;
    # fast: 0.5 * 3 + 0.5 * 1 = 2 tokens per round, never waits
    assert critical_batch_size(0.5, 3.0, 3.0, 1.0, t_verify=1.0, t_slow=0.6, t_fast=0.0) == 3
    never = critical_batch_size(0.5, 3.0, 3.0, 1.0, 1.0, 0.5, 0.0, max_batch_size=64)
    assert never == 65, "at 0.5 the slow fallback's speedup only approaches the fast one's"


# -- decoding with a speculation cache ------------------------------------------------------------------------------

EVERY_OUTCOME = 96 * 5  # the tiny vocabulary times (block_size + 1): every outcome gets a block


def ssd_generate(target, draft, ids, mask, **kw):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, assistant_model=draft,
                           return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("config", [
    # every round hits (the first block drafted by the draft, so that every outcome's candidates are its own)
    SSDConfig(cache_size=EVERY_OUTCOME, fan_out="uniform", fallback="draft"),
    SSDConfig(cache_size=6, fallback="draft"),  # most rounds miss: the draft, just in time
    SSDConfig(cache_size=6, fallback="ngram", overlap=False),
    SSDConfig(cache_size=6, fallback="random"),
    SSDConfig(cache_size=12, fallback="auto"),
], ids=["all-hit", "draft", "ngram-no-overlap", "random", "auto"])
def test_greedy_ssd_is_token_identical_with_eos_inside_blocks_and_different_stopping_times(family, batch, config):
    target = tiny_target(family)
    ids, mask = left_padded_prompts(batch)
    free, eos = eos_inside_a_block(target, ids, mask)
    reference = plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    draft = oracle(target, tiny_draft(target), free, mask, 0.3)  # a good draft just in time, a random one cached
    out = ssd_generate(target, draft, ids, mask, max_new_tokens=30, eos_token_id=eos, ssd=config)
    assert torch.equal(out.sequences, reference)
    hits = [r.cache_hit for rows in out.rounds for r in rows]
    stats = out.ssd_stats
    assert stats["hits"] == sum(h is True for h in hits) and stats["rounds"] >= stats["hits"]
    drafted = [r for rows in out.rounds for r in rows if r.cache_hit is not None]
    assert stats["tokens_hit"] + stats["tokens_miss"] == sum(r.committed for r in drafted), \
        "tokens committed, where an EOS inside a block commits fewer than were accepted"
    if config.cache_size == EVERY_OUTCOME:
        for rows in out.rounds:
            for before, now in zip(rows, rows[1:]):
                last_without_a_draft = not now.drafted and now is rows[-1]  # one token left: nothing to verify
                assert now.cache_hit or last_without_a_draft or \
                    before.accepted == before.verified == draft.config.block_size, \
                    "with a block for every outcome, only a round whose whole block was accepted can miss"
        assert stats["hits"] > 0
    else:
        assert stats["rounds"] > stats["hits"]
    if batch == 3:
        lengths = (out.sequences[:, ids.shape[1]:] != 0).sum(1)
        assert len(set(lengths.tolist())) > 1, "rows stop at different times"


def cache_records(out):
    """What the speculation cache decided, round by round: it must not depend on when the speculator ran."""
    return [[(r.drafted, r.verified, r.accepted, r.next_token, r.cache_hit) for r in rows] for rows in out.rounds], \
        out.ssd_stats


def decode_with_overlaps(target, draft, ids, mask, config, overlaps):
    """Greedy SSD decodes with the speculator beside the verification or after it (one per entry of `overlaps`),
    each checked against plain generate(); returns their cache records and the last output."""
    free, eos = eos_inside_a_block(target, ids, mask)
    reference = plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    records = []
    for overlap in overlaps:
        out = ssd_generate(target, oracle(target, draft, free, mask, 0.3), ids, mask, max_new_tokens=30,
                           eos_token_id=eos, ssd=dataclasses.replace(config, overlap=overlap))
        assert torch.equal(out.sequences, reference)
        records.append(cache_records(out))
    return records, out


OVERLAP_CONFIGS = pytest.mark.parametrize("config", [
    SSDConfig(cache_size=EVERY_OUTCOME, fan_out="uniform", fallback="draft"),  # every round hits
    SSDConfig(cache_size=6, fallback="draft"),  # most rounds miss
], ids=["all-hit", "draft"])


@OVERLAP_CONFIGS
def test_the_speculator_beside_the_verification_builds_the_cache_it_builds_after_it(config):
    # greedy decoding fixes every block the speculator drafts, so running it in its own thread during the target's
    # verification (overlap) must leave the same records as running it afterwards: a difference is a stale read
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    records, _ = decode_with_overlaps(target, tiny_draft(target), ids, mask, config, (False, True))
    assert records[0][1]["hits"] > 0 and records[1] == records[0]


def test_the_speculator_thread_drafts_under_the_callers_autocast():
    # autocast is thread-local: unless the speculator's thread enters the caller's, it drafts the cache in float32
    # where the speculator run after the verification drafts in bfloat16, and the cached blocks part
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(3)
    free, eos = eos_inside_a_block(target, ids, mask)
    records = []
    for overlap in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ssd_generate(target, oracle(target, draft, free, mask, 0.3), ids, mask, max_new_tokens=30,
                               eos_token_id=eos, ssd=SSDConfig(cache_size=EVERY_OUTCOME, fan_out="uniform",
                                                               fallback="draft", overlap=overlap))
        records.append(cache_records(out))
    assert records[0][1]["hits"] > 0 and records[1] == records[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the campaign's ssd step runs it)")
@OVERLAP_CONFIGS
def test_greedy_ssd_with_the_speculator_on_its_own_cuda_stream_is_token_identical(config, monkeypatch):
    # the speculator's stream reads the verification's inputs (its anchors) while they may still be queued on the
    # verifier's stream: a delay queued right before them makes a missing wait read unfinished memory, and the
    # cache it builds then differs from the one built after the verification (greedy output alone would not show it)
    target = tiny_target("llama")
    draft = tiny_draft(target)
    target, draft = target.cuda(), draft.cuda()
    ids, mask = (t.cuda() for t in left_padded_prompts(3))
    verifying = SSDSource.verifying

    def late_inputs(self, proposal, verify_len, anchor, anchor_positions, context):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of the verifier stream's time
        return verifying(self, proposal, verify_len + 0, anchor + 0, anchor_positions + 0, context)

    monkeypatch.setattr(SSDSource, "verifying", late_inputs)
    records, out = decode_with_overlaps(target, draft, ids, mask, config, (False, True, True, True))
    assert records[0][1]["hits"] > 0 and all(r == records[0] for r in records[1:])
    assert out.timings["speculate"] > 0


def test_length_limits_and_a_cache_that_hits_every_round():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    for max_new_tokens in (1, 2, 5, 11):
        out = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=max_new_tokens,
                           ssd=SSDConfig(cache_size=EVERY_OUTCOME, fan_out="uniform"))
        assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=max_new_tokens))


def test_the_cache_keeps_blocks_over_the_draft_vocabulary_and_widens_them_exactly():
    """Greedy, so that both widths draft the same tokens (sampling draws from tensors of different widths; its
    exactness is the enumeration test's)."""
    from dspark_hf.model.sampling import sample_blocks

    target = tiny_target("llama")
    draft = tiny_draft(target, draft_vocab=list(range(1, 96, 3)))
    ids, mask = left_padded_prompts(2)
    context = draft.encode_context(draft.target_features(target(input_ids=ids, attention_mask=mask,
                                                                output_hidden_states=True).hidden_states),
                                   (mask.cumsum(1) - 1).clamp_min(0), mask.bool())
    anchors, positions = ids[:, -1:].repeat(1, 3), torch.full((2, 3), ids.shape[1])
    blocks = [sample_blocks(draft, anchors, positions, context, target_vocab=wide) for wide in (True, False)]
    full, compact = blocks
    assert compact.probs.shape[-1] == 32 and full.probs.shape[-1] == 96
    assert torch.equal(compact.tokens, full.tokens) and torch.equal(compact.vocab, draft.draft_vocab)
    assert torch.allclose(compact.in_target_vocab(96).probs, full.probs)


def test_greedy_ssd_with_a_draft_vocabulary_is_token_identical():
    target = tiny_target("qwen3")
    ids, mask = left_padded_prompts(3)
    out = ssd_generate(target, tiny_draft(target, draft_vocab=list(range(0, 96, 2))), ids, mask, max_new_tokens=16,
                       ssd=SSDConfig(cache_size=EVERY_OUTCOME // 2, fan_out="uniform"))
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=16))
    assert out.ssd_stats["hits"] > 0


def test_rounds_record_whether_their_block_came_from_the_cache():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    out = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=12,
                       ssd=SSDConfig(cache_size=EVERY_OUTCOME, fan_out="uniform"))
    hits = [r.cache_hit for r in out.rounds[0] if r.drafted]  # a last round with one token left drafts nothing
    assert hits[0] is False and all(hits[1:]), "the first block is drafted in time, every later one was ready"
    assert out.timings["speculate"] > 0 and out.timings["wait"] >= 0
    without = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4,
                              assistant_model=tiny_draft(target), return_dict_in_generate=True)
    assert all(r.cache_hit is None for r in without.rounds[0]) and without.ssd_stats is None


def test_the_auto_fallback_drafts_below_the_critical_batch_size_and_looks_up_n_grams_from_it(monkeypatch):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=12)
    for critical, used in ((4, "draft"), (3, "ngram")):  # three rows decode to the end
        monkeypatch.setattr(SSDSource, "critical_batch_size", lambda self, rows, c=critical: c)
        out = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=12,
                           ssd=SSDConfig(cache_size=2, fallback="auto"))
        assert torch.equal(out.sequences, reference)
        fallbacks = out.ssd_stats["fallbacks"]
        assert fallbacks[used] > 0 and sum(fallbacks.values()) == fallbacks[used]


def test_ssd_decodes_count_rejections_and_never_draft_for_an_outcome_the_cache_cannot_hold(monkeypatch):
    import dspark_hf.generation.ssd.source as ssd_module

    fan_outs, predict = [], ssd_module.predict_outcomes
    monkeypatch.setattr(ssd_module, "predict_outcomes", lambda *a: fan_outs.append(list(a[3])) or predict(*a))
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    out = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=16,
                       ssd=SSDConfig(cache_size=12, fallback="draft"))
    assert fan_outs and all(F[-1] == 0 and sum(F) == 12 for F in fan_outs)
    drafted = [r for rows in out.rounds for r in rows if r.verified]
    assert out.ssd_stats["rejections"] == sum(r.accepted < r.verified for r in drafted)
    assert sum(lag[2] for lag in out.ssd_stats["by_lag"].values()) == out.ssd_stats["rejections"]


def test_ssd_decodes_record_where_each_bonus_stood_and_a_fan_out_planned_from_them_is_lossless(monkeypatch):
    import dspark_hf.generation.ssd.source as ssd_module

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    _, eos = eos_inside_a_block(target, ids, mask)
    reference = plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    draft = tiny_draft(target, seed=5)  # a random draft whose blocks the speculation cache holds in a few rounds
    gamma = draft.config.block_size
    uniform = uniform_fan_out(2 * gamma, gamma, cache_last=False)
    out = ssd_generate(target, draft, ids, mask, max_new_tokens=30, eos_token_id=eos,
                       ssd=SSDConfig(cache_size=2 * gamma, fan_out="uniform", fallback="draft"))
    stats = out.ssd_stats
    assert sum(stats["outcomes"].values()) == stats["rounds"]
    assert sum(sum(ranks.values()) for ranks in stats["bonus_ranks"].values()) == \
        stats["rounds"] - stats["outcomes"].get(gamma, 0), "every outcome but a whole block accepted has a rank"
    held = sum(n for k, ranks in stats["bonus_ranks"].items() for j, n in ranks.items() if j < uniform[k])
    assert held == stats["hits"] > 0, "the ranks say which rounds the cache held"

    planned = measured_fan_out(2 * gamma, gamma, stats["bonus_ranks"])  # F_0..F_gamma, the last 0
    fan_outs, predict = [], ssd_module.predict_outcomes
    monkeypatch.setattr(ssd_module, "predict_outcomes", lambda *a: fan_outs.append(list(a[3])) or predict(*a))
    again = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=30, eos_token_id=eos,
                         ssd=SSDConfig(cache_size=2 * gamma, fan_out=planned, fallback="draft"))
    assert torch.equal(again.sequences, reference) and torch.equal(out.sequences, reference)
    assert fan_outs and all(F == planned for F in fan_outs)


@pytest.mark.parametrize("fan_out", [[0, 8, 0, 0], "geometric"], ids=["nothing-for-k-0", "geometric"])
def test_every_drafted_round_after_the_first_counts_as_a_hit_or_a_miss(fan_out):
    """Also a round after one whose rows could reach no outcome the fan-out holds (F_0 = 0, nothing verified):
    nothing was cached, so it misses."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    out = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=30,
                       ssd=SSDConfig(cache_size=8, fan_out=fan_out, fallback="ngram"))
    drafted = [r for r in out.rounds[0] if r.cache_hit is not None]
    assert out.ssd_stats["rounds"] == len(drafted) - 1 == sum(out.ssd_stats["outcomes"].values())
    assert out.ssd_stats["hits"] == sum(r.cache_hit for r in drafted)
    assert sum(out.ssd_stats["fallbacks"].values()) == out.ssd_stats["rounds"] - out.ssd_stats["hits"]


@pytest.mark.parametrize("fallback", ["ngram", "random"])
def test_after_a_lookup_block_the_bonus_candidates_are_the_drafts_own(fallback, monkeypatch):
    """A lookup block's one-hot distributions rank no other token: the speculator scores its tokens with the draft
    and takes the candidates from that, instead of from ties at probability 0."""
    import dspark_hf.generation.ssd.source as ssd_module

    seen, predict = [], ssd_module.predict_outcomes
    monkeypatch.setattr(ssd_module, "predict_outcomes", lambda *a: seen.append(a[0]) or predict(*a))
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    out = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=12,
                       ssd=SSDConfig(cache_size=8, fallback=fallback))
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=12))
    assert seen and all(bool((probs.amax(-1) < 1).all()) for probs in seen), "no one-hot rows left"


def test_ssd_settings_changed_after_the_config_was_made_are_checked_by_generate():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    for field, value, message in (("fallback", "ngrams", "fallback must be one of"),
                                  ("cache_size", 2.5, "cache_size must be an int"),
                                  ("acceptance", 2.0, r"acceptance must be in \[0, 1\]")):
        config = SSDConfig()
        setattr(config, field, value)
        with pytest.raises((TypeError, ValueError), match=message):
            ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=4, ssd=config)


def test_the_auto_fallback_measures_this_machines_costs_before_the_first_round_with_a_progress_bar(tmp_path,
                                                                                                    monkeypatch):
    import dspark_hf.generation.ssd.source as ssd_module

    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path))
    calls, measure = [], ssd_module.cached_costs
    monkeypatch.setattr(ssd_module, "cached_costs", lambda *a, **k: calls.append(k) or measure(*a, **k))
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=8, ssd=SSDConfig(fallback="auto"))
    assert len(calls) == 1 and calls[0].get("progress", True) is not False


def test_the_auto_fallback_s_progress_bar_can_be_turned_off_as_the_default_policy_s_can(tmp_path, monkeypatch,
                                                                                         capsys):
    monkeypatch.setenv("DSPARK_HF_PROFILE_CACHE", str(tmp_path))  # nothing measured yet
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=8, ssd=SSDConfig(fallback="auto",
                                                                                        progress=False))
    assert list(tmp_path.glob("*.json")) and "profiling this machine" not in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"^SSDConfig.progress must be True or False, got 'no'.$"):
        SSDConfig(progress="no")


@pytest.mark.parametrize("fallback", ["ngram", "random"])
def test_a_confidence_policy_verifies_lookup_blocks_as_far_as_they_reach(fallback):
    from dspark_hf import ThresholdPolicy

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    out = ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=16, verification_policy=ThresholdPolicy(
        0.3), ssd=SSDConfig(cache_size=4, fallback=fallback))
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=16))
    assert out.ssd_stats["fallbacks"][fallback] > 0


def test_processors_that_read_which_token_a_column_is_see_target_ids_in_the_cache():
    # suppress_tokens names target ids: a cache kept over the draft's own vocabulary would suppress other tokens
    target = tiny_target("llama")
    draft = tiny_draft(target, draft_vocab=list(range(0, 96, 2)))
    ids, mask = left_padded_prompts(3)
    suppressed = list(range(2, 96, 4))  # half the draft's vocabulary
    kw = dict(max_new_tokens=16, suppress_tokens=suppressed, renormalize_logits=True, remove_invalid_values=True)
    out = ssd_generate(target, draft, ids, mask, ssd=SSDConfig(cache_size=EVERY_OUTCOME, fan_out="uniform",
                                                               fallback="draft"), **kw)
    assert torch.equal(out.sequences, plain(target, ids, mask, **kw))
    drafted = {t for rows in out.rounds for r in rows if r.cache_hit for t in r.drafted}
    assert drafted and not drafted & set(suppressed)


def test_ngram_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    assert ngram_proposal([5, 6, 7, 1, 5, 6, 9, 5, 6], 3) == [9, 5, 6], "the latest occurrence of [5, 6]"
    assert ngram_proposal([1, 2, 3, 4, 2], 2) == [3, 4], "down to a 1-gram"
    assert ngram_proposal([1, 2, 3], 4) == [] and ngram_proposal([7], 4) == []


def test_bad_ssd_settings_and_processors_that_read_ids_are_refused():
    with pytest.raises(ValueError, match="fan_out must be one of geometric, uniform"):
        SSDConfig(fan_out="tree")
    with pytest.raises(ValueError, match="fan_out holds 3 blocks but cache_size is 16: set cache_size=3"):
        SSDConfig(fan_out=[2, 1, 0])
    for bad in ([2, -1], [True, 1], "21", 3):
        with pytest.raises((TypeError, ValueError), match="fan_out must be"):
            SSDConfig(cache_size=2, fan_out=bad)
    import json

    import numpy as np

    assert json.loads(json.dumps(SSDConfig(cache_size=3, fan_out=(np.int64(2), 1)).to_dict()))["fan_out"] == [2, 1]
    with pytest.raises(ValueError, match=r"saguaro_c must be in \[0, 1\]"):
        SSDConfig(saguaro_c=2.0)
    for bad, message in ((dict(cache_size=2.5), "cache_size must be an int"), (dict(saguaro_c=None), "a number"),
                         (dict(power_law_r=float("nan")), "got NaN"), (dict(overlap="no"), "True or False")):
        with pytest.raises((TypeError, ValueError), match=message):
            SSDConfig(**bad)
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    with pytest.raises(ValueError, match="RepetitionPenaltyLogitsProcessor"):
        ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=4, repetition_penalty=1.3,
                     ssd=SSDConfig())
    with pytest.raises(TypeError, match="dspark_hf.SSDConfig"):
        ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=4, ssd={"cache_size": 4})
    with pytest.raises(ValueError, match=r"fan_out has 2 counts, but this draft's block of 4 needs one per number "
                                         r"of accepted tokens 0..3 \(4 counts\)"):
        ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=4, ssd=SSDConfig(3, fan_out=[2, 1]))
    with pytest.raises(ValueError, match="gives 1 blocks to all 4 tokens accepted, an outcome no cache can hold"):
        ssd_generate(target, tiny_draft(target), ids, mask, max_new_tokens=4,
                     ssd=SSDConfig(3, fan_out=[1, 1, 0, 0, 1]))


# -- lagged context ---------------------------------------------------------------------------------------------
def test_known_tokens_enter_the_block_and_padding_ones_change_nothing():
    from test_model import context_for, encode

    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, features, positions = context_for(draft, target)
    context = encode(draft, features, positions)
    anchor, position = ids[:, -1:], positions[:, -1:]
    h = draft.backbone(anchor, position, context)
    torch.testing.assert_close(draft.backbone(anchor, position, context, torch.full((2, 1, 3), -1)), h)
    known = torch.tensor([[[-1, 5, 9]]]).expand(2, 1, 3)
    assert not torch.allclose(draft.backbone(anchor, position, context, known), h)


def test_a_lagged_block_sees_only_the_context_before_its_first_known_token():
    """Tokens 7 and 8 enter as known tokens ahead of anchor 9: their context entries, present or not, are unseen."""
    from test_model import context_for, encode

    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, features, positions = context_for(draft, target)
    known = ids[:, None, 7:9]
    full = draft.backbone(ids[:, None, 9], positions[:, None, 9], encode(draft, features, positions), known)
    lagged = draft.backbone(ids[:, None, 9], positions[:, None, 9],
                            encode(draft, features[:, :7], positions[:, :7]), known)
    torch.testing.assert_close(full, lagged)


# -- sampling: exact with a speculation cache, with and without Saguaro sampling ------------------------------------


@pytest.fixture(scope="module")
def setup():
    return sampling_setup()


@pytest.mark.parametrize("config", [SSDConfig(cache_size=3, saguaro_c=0.3, fallback="draft"),
                                    SSDConfig(cache_size=12, saguaro_c=0.0, fallback="draft"),
                                    SSDConfig(cache_size=2, fallback="ngram"),
                                    SSDConfig(cache_size=3, fan_out=[1, 2], saguaro_c=0.3, fallback="draft")],
                         ids=["saguaro-0.3", "saguaro-0", "ngram", "listed-fan-out"])
def test_sampled_ssd_follows_the_target_distribution(setup, config):
    target, draft, settings, probs = setup
    torch.manual_seed(7)
    samples = sample_continuations(target, draft, SAMPLES, ssd=config, **settings)
    assert p_value(samples, probs) > ALPHA


def test_sampled_ssd_with_a_draft_vocabulary_follows_the_target_distribution(setup):
    """The cache keeps its blocks over the draft's 4 of the 6 target ids and widens the one it uses."""
    target, _, settings, probs = setup
    draft = flattened_draft(target, draft_vocab=[0, 2, 3, 5])
    torch.manual_seed(7)
    samples = sample_continuations(target, draft, SAMPLES, ssd=SSDConfig(cache_size=3, saguaro_c=0.3,
                                                                         fallback="draft"), **settings)
    assert p_value(samples, probs) > ALPHA


def test_verifying_cached_tokens_against_the_unweighted_distribution_is_caught(setup, monkeypatch):
    """Guards the previous test: a cache that recorded the draft's own distribution instead of the reweighted one
    its tokens were drawn from fails it."""
    import dspark_hf.generation.ssd.source as ssd

    sample_blocks = ssd.sample_blocks

    def recording_the_wrong_distribution(*args, **kwargs):
        block = sample_blocks(*args, **kwargs)
        return type(block)(block.tokens, block.unweighted if block.unweighted is not None else block.probs,
                           block.confidences, vocab=block.vocab)

    monkeypatch.setattr(ssd, "sample_blocks", recording_the_wrong_distribution)
    target, draft, settings, probs = setup
    torch.manual_seed(7)
    samples = sample_continuations(target, draft, SAMPLES, ssd=SSDConfig(cache_size=3, saguaro_c=0.3,
                                                                         fallback="draft"), **settings)
    assert p_value(samples, probs) < ALPHA


def test_a_seed_gives_the_same_sampled_output_with_the_speculator_in_its_thread(setup):
    target, draft, settings, _ = setup
    outs = []
    for _ in range(2):
        torch.manual_seed(11)
        outs.append(sample_continuations(target, draft, 64, ssd=SSDConfig(cache_size=3, saguaro_c=0.5), **settings))
    assert torch.equal(*outs)
