"""The serving loop (`DSparkServer`): requests that join and leave a running batch between rounds get what plain
generate() gives each of them alone, greedy token for token, sampled in distribution; bad and cancelled requests
leave the others' outputs as they are."""

import random

import pytest
import torch

from conftest import PAD, VOCAB, tiny_draft, tiny_target
from dspark_hf import FixedLength, FullBlock
from dspark_hf.evaluation.oracle import OracleDraft
from dspark_hf.generation.serving import DSparkServer

FAMILIES = ["llama", "qwen3", "gemma3"]  # gemma3: sliding windows, which the rows' masks keep per row


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(1, VOCAB) for _ in range(g.randrange(3, 12))] for _ in range(n)]


def alone(target, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Plain generate() on the request by itself: its new tokens, up to and with its EOS id."""
    ids = torch.tensor([prompt])
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def oracle_for(target, requests: list[tuple[list[int], int]], corruption: float):
    """A draft that proposes each request's plain continuation (corrupted at `corruption`), whatever row it is in:
    rounds accept whole blocks, part of a block, or nothing."""
    longest = max(len(p) for p, _ in requests)
    width = longest + max(m for _, m in requests)
    ids = torch.full((len(requests), width), PAD)
    mask = torch.zeros_like(ids)
    for i, (p, m) in enumerate(requests):
        row = p + alone(target, p, m)
        ids[i, longest - len(p): longest - len(p) + len(row)] = torch.tensor(row)
        mask[i, longest - len(p): longest] = 1
    return OracleDraft.from_draft(tiny_draft(target)).set_references(target, ids, mask[:, :longest], corruption)


def serve_with_arrivals(server, requests, seed: int, cancel: set[int] = frozenset()):
    """Submit `requests` ((prompt, max_new_tokens)) at random steps (seeded), cancelling those in `cancel` a few
    steps after they were submitted; every step in between runs. Returns the submitted requests in order."""
    g = random.Random(seed)
    pending, submitted, step = list(requests), [], 0
    while pending or server.busy:
        while pending and g.random() < 0.5:
            submitted.append(server.submit(*pending.pop(0)))
        for i in cancel:
            if i < len(submitted) and step == g.randrange(step, step + 3):
                server.cancel(submitted[i])
        server.step()
        step += 1
    return submitted


@pytest.mark.lossless
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["full block", "default", "fixed 1"])
def test_every_request_gets_what_plain_generate_gives_it_alone(family, policy):
    target = tiny_target(family)
    g = random.Random(1)
    requests = [(p, g.randrange(1, 20)) for p in prompts(14)]
    draft = oracle_for(target, requests, corruption=0.3)
    chosen = {"full block": FullBlock(), "default": None, "fixed 1": FixedLength(1)}[policy]
    server = DSparkServer(target, draft, max_batch_size=4, max_length=64, policy=chosen)
    served = serve_with_arrivals(server, requests, seed=2)
    for request, (prompt, max_new) in zip(served, requests):
        assert request.finish_reason == "length"
        assert request.tokens == alone(target, prompt, max_new), request.id
    if policy != "default":  # rounds accepted drafts, and rejected some (the default policy may pause)
        assert 0 < server.stats.accepted < server.stats.verified


@pytest.mark.lossless
def test_a_request_stops_at_its_eos_id_inside_a_block_and_its_row_goes_to_the_next():
    target = tiny_target("llama")
    requests = [(p, 24) for p in prompts(6, seed=3)]
    continuations = [alone(target, p, m) for p, m in requests]
    eos = continuations[0][5]  # a token the first request generates sixth: its row stops inside a block there
    draft = oracle_for(target, requests, corruption=0.0)  # whole blocks accepted: the EOS id lands inside one
    server = DSparkServer(target, draft, max_batch_size=2, max_length=64, policy=FullBlock(), eos_token_id=eos)
    served = serve_with_arrivals(server, requests, seed=4)
    assert served[0].finish_reason == "eos"
    for request, (prompt, max_new) in zip(served, requests):
        assert request.tokens == alone(target, prompt, max_new, eos=eos)


def test_a_cancelled_request_frees_its_row_and_leaves_the_others_unchanged():
    target = tiny_target("qwen3")
    requests = [(p, 16) for p in prompts(8, seed=5)]
    server = DSparkServer(target, tiny_draft(target), max_batch_size=3, max_length=64, policy=FullBlock())
    served = serve_with_arrivals(server, requests, seed=6, cancel={1, 4})
    assert {served[1].finish_reason, served[4].finish_reason} == {"cancelled"}
    for i, (request, (prompt, max_new)) in enumerate(zip(served, requests)):
        if i not in (1, 4):
            assert request.finish_reason == "length" and request.tokens == alone(target, prompt, max_new)
        else:  # what it had before it was cancelled is plain's beginning
            assert request.tokens == alone(target, prompt, max_new)[:len(request.tokens)]


@pytest.mark.parametrize("bad, match", [
    (([], 4), "non-empty list of token ids"),
    (([3, VOCAB], 4), r"token ids in \[0, 96\)"),
    (([3, 4], 0), "max_new_tokens must be a positive integer"),
    (([3] * 40, 30), "longer than this server's max_length=64"),
])
def test_a_bad_request_is_refused_in_one_line_and_the_others_go_on(bad, match):
    target = tiny_target("llama")
    server = DSparkServer(target, tiny_draft(target), max_batch_size=2, max_length=64, policy=FullBlock())
    good = server.submit([5, 6, 7], 8)
    with pytest.raises(ValueError, match=match) as error:
        server.submit(*bad)
    assert "\n" not in str(error.value)
    server.drain()
    assert good.tokens == alone(target, [5, 6, 7], 8)


@pytest.mark.lossless
def test_sampled_requests_follow_the_target_distribution():
    """Chi-square against the exact distribution of 4-token continuations (test_generation_sampling's setup), the
    requests joining a batch of 64 rows as rows free up."""
    from test_generation_sampling import ALPHA, NEW, PROMPT, SAMPLES, V, p_value, sampling_setup

    target, draft, settings, probs = sampling_setup()
    torch.manual_seed(0)
    server = DSparkServer(target, draft, max_batch_size=64, max_length=16, policy=FullBlock(), do_sample=True,
                          eos_token_id=[], **settings)
    g = random.Random(7)
    served = []
    for _ in range(SAMPLES):
        served.append(server.submit(PROMPT, NEW))
        if g.random() < 0.3:  # a request of another length now and then, not counted: rows go ragged
            server.submit([g.randrange(V) for _ in range(7)], g.randrange(1, 6))
        if len(served) % 64 == 0:
            server.step()
    server.drain()
    samples = torch.tensor([r.tokens for r in served])
    assert p_value(samples, probs) > ALPHA


@pytest.mark.slow  # inductor compiles every verification width and the draft's block: about a minute
def test_compiled_steps_serve_every_request_what_plain_generate_gives_it_alone():
    from conftest import cpu_compile_config

    target = tiny_target("llama")
    g = random.Random(8)
    requests = [(p, g.randrange(1, 20)) for p in prompts(10, seed=9)]
    draft = oracle_for(target, requests, corruption=0.3)
    server = DSparkServer(target, draft, max_batch_size=4, max_length=48, policy=FullBlock(),
                          compile_config=cpu_compile_config())
    served = serve_with_arrivals(server, requests, seed=10)
    for request, (prompt, max_new) in zip(served, requests):
        assert request.tokens == alone(target, prompt, max_new)


def test_a_round_keeps_no_autograd_graph():
    """generate() decodes under no_grad; a server's step must too, or every round's graph stays chained to the
    state's buffers (memory grows round after round)."""
    target = tiny_target("llama")
    server = DSparkServer(target, tiny_draft(target), max_batch_size=2, max_length=32, policy=FullBlock())
    server.submit([5, 6, 7], 8)
    server.step()
    state = server.state
    assert not any(t.requires_grad for t in [state.features, *state.context_keys, state.cache.layers[0].keys])
