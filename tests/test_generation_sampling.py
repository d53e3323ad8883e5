"""Sampled DSpark output follows the target's distribution exactly.

On a 6-token vocabulary the distribution of 4-token continuations is computed exactly by enumerating all 6^4 of
them through the target with the same logits processors. Generated continuations are compared with it by
Pearson's chi-square test at significance level 0.001 (bins with expected count < 5 pooled). The seeds are fixed,
so the verdicts are deterministic; a deliberately wrong implementation must fail the same test.
"""

import copy
import itertools

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from conftest import PAD, tiny_draft, tiny_target
from dspark_hf import FixedLength, FullBlock
from dspark_hf.generation import verify
from test_model import chi_square_p_value

V, NEW, SAMPLES, ALPHA = 6, 4, 20000, 1e-3
PROMPT = [3, 1, 4, 1, 5]


def exact_distribution(target, processors: LogitsProcessorList) -> torch.Tensor:
    """P(continuation) for all V^NEW continuations, in itertools.product order."""
    conts = torch.tensor(list(itertools.product(range(V), repeat=NEW)))
    seqs = torch.cat([torch.tensor(PROMPT).expand(len(conts), -1), conts], 1)
    with torch.no_grad():
        logits = target(seqs).logits[:, len(PROMPT) - 1: -1].float()
    logp = torch.zeros(len(conts))
    for k in range(NEW):
        scores = processors(seqs[:, : len(PROMPT) + k], logits[:, k])
        logp += torch.log_softmax(scores, -1).gather(1, conts[:, k: k + 1]).squeeze(1)
    return logp.exp()


def sample_continuations(target, draft, n, **kw) -> torch.Tensor:
    """n continuations of PROMPT, left-padded by 2, from one batched generate() call in which they are interleaved
    with n filler rows that have 7-token prompts of their own (not counted), so rows progress raggedly. The full
    block is verified unless kw names a policy (None: the default one)."""
    kw.setdefault("verification_policy", FullBlock())
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, V, (2 * n, len(PROMPT) + 2), generator=g)
    mask = torch.ones_like(ids)
    ids[::2] = torch.tensor([PAD, PAD] + PROMPT)
    mask[::2, :2] = 0
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW,
                          assistant_model=draft, **kw)
    return out[::2, ids.shape[1]:]


def p_value(samples: torch.Tensor, probs: torch.Tensor) -> float:
    index = (samples * (V ** torch.arange(NEW - 1, -1, -1))).sum(1)
    counts = torch.bincount(index, minlength=V ** NEW).float()
    return chi_square_p_value(counts, probs)


def sampling_setup():
    """(target, draft, generate() settings, exact distribution of continuations): a 6-token target and a flattened
    draft whose verified tokens are accepted about 40% of the time."""
    target = tiny_target("llama", vocab=V, initializer_range=0.2)
    draft = flattened_draft(target)
    settings = dict(temperature=0.7, top_k=4)
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)])
    return target, draft, settings, exact_distribution(target, processors)


def flattened_draft(target, **overrides):
    """A 2-token-block draft of `target` flattened so that about 40% of its verified drafts are accepted: both
    acceptance and the residual get exercised."""
    draft = tiny_draft(target, block_size=2, initializer_range=0.05, **overrides)
    with torch.no_grad():
        draft.norm.weight.fill_(0.05)
    return draft


@pytest.fixture(scope="module")
def setup():
    return sampling_setup()


@pytest.mark.lossless
def test_sampling_matches_the_target_distribution(setup):
    target, draft, settings, probs = setup
    torch.manual_seed(0)
    out = target.generate(input_ids=torch.tensor([PROMPT] * 64), do_sample=True, max_new_tokens=NEW,
                          assistant_model=draft, return_dict_in_generate=True, verification_policy=FullBlock(),
                          **settings)
    rounds = [r for rows in out.rounds for r in rows if r.verified > 0]
    accepted = sum(r.accepted for r in rounds) / sum(r.verified for r in rounds)
    assert 0.2 < accepted < 0.8, "both acceptance and rejection (the residual) must be exercised"
    assert any(r.accepted == r.verified == 2 for r in rounds), "and whole blocks with a bonus token"

    torch.manual_seed(1)
    samples = sample_continuations(target, draft, SAMPLES, **settings)
    assert p_value(samples, probs) > ALPHA


@pytest.mark.lossless
def test_trimmed_verification_stays_exact(setup):
    target, draft, settings, probs = setup
    torch.manual_seed(2)
    samples = sample_continuations(target, draft, SAMPLES, verification_policy=FixedLength(1), **settings)
    assert p_value(samples, probs) > ALPHA


@pytest.mark.lossless
def test_the_default_policy_stays_exact(setup):
    target, draft, settings, probs = setup
    torch.manual_seed(4)
    samples = sample_continuations(target, draft, SAMPLES, verification_policy=None, **settings)
    assert p_value(samples, probs) > ALPHA


def test_the_default_policy_gives_the_same_sampled_output_for_a_seed(setup):
    """Its decisions read the cached costs and the acceptance seen, never a clock."""
    target, draft, settings, _ = setup
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(target.generate(input_ids=torch.tensor([PROMPT] * 8), do_sample=True, max_new_tokens=24,
                                    assistant_model=draft, return_dict_in_generate=True, **settings))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert [[r.verified for r in rows] for rows in runs[0].rounds] == [[r.verified for r in rows] for rows in
                                                                        runs[1].rounds]


def test_a_bfloat16_draft_next_to_a_float32_target_stays_exact(setup):
    """q is the distribution the bf16 draft's tokens were drawn from (computed in float32 from its logits)."""
    target, draft, settings, probs = setup
    torch.manual_seed(3)
    samples = sample_continuations(target, copy.deepcopy(draft).to(torch.bfloat16), SAMPLES, **settings)
    assert p_value(samples, probs) > ALPHA


def test_a_draft_vocabulary_whose_every_token_the_processors_ban_stays_exact(setup):
    # bad_words_ids leaves the target tokens 1 and 4 only, none of which the draft can propose: it drafts from its
    # own distribution then, and verification rejects every drafted token
    from transformers import NoBadWordsLogitsProcessor

    target, _, settings, _ = setup
    draft = flattened_draft(target, draft_vocab=[0, 2, 3, 5])
    banned = [[0], [2], [3], [5]]
    processors = LogitsProcessorList([NoBadWordsLogitsProcessor(banned, eos_token_id=None),
                                      TemperatureLogitsWarper(0.7), TopKLogitsWarper(4)])
    torch.manual_seed(7)
    samples = sample_continuations(target, draft, SAMPLES, bad_words_ids=banned, **settings)
    assert p_value(samples, exact_distribution(target, processors)) > ALPHA


@pytest.mark.lossless
def test_skipping_the_residual_is_caught(setup, monkeypatch):
    """Sampling the correction from p instead of norm(max(p - q, 0)) biases the output; the test must see it."""
    target, draft, settings, probs = setup
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    torch.manual_seed(1)
    samples = sample_continuations(target, draft, SAMPLES, **settings)
    assert p_value(samples, probs) < ALPHA


@pytest.mark.lossless
def test_a_draft_sampled_without_the_processors_is_caught(setup, monkeypatch):
    """Accepting against the unprocessed draft distribution (a classic bug) is also caught."""
    target, draft, settings, probs = setup
    original = verify.verify_sampling

    def wrong(p, q, x, verify_len, generator=None):
        return original(p, torch.full_like(q, 1.0 / V), x, verify_len, generator)

    monkeypatch.setattr(verify, "verify_sampling", wrong)
    torch.manual_seed(1)
    samples = sample_continuations(target, draft, SAMPLES, **settings)
    assert p_value(samples, probs) < ALPHA


def test_num_return_sequences_samples_each_prompt_several_times():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids = torch.tensor([PROMPT, [2, 2, 2, 2, 2]])
    out = target.generate(input_ids=ids, do_sample=True, num_return_sequences=3, max_new_tokens=6,
                          assistant_model=draft)
    assert out.shape == (6, len(PROMPT) + 6)
    assert torch.equal(out[:, : len(PROMPT)], ids.repeat_interleave(3, 0))


def test_a_drafted_token_the_target_forbids_is_rejected_even_when_the_uniform_draw_is_zero(monkeypatch):
    """torch.rand draws from [0, 1): u = 0 happens (2^-24 per draw on the CPU), and u * q <= p would then accept a
    token of target probability 0 (one that top-k, top-p or a ban removed)."""
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # the target forbids token 0 at the drafted position
    q = torch.tensor([[[1.0, 0.0]]])
    monkeypatch.setattr(verify.torch, "rand", lambda *shape, **kw: torch.zeros(*shape))
    n, token = verify.verify_sampling(p, q, torch.tensor([[0]]), torch.tensor([1]))
    assert int(n) == 0 and int(token) == 1
