"""DSparkRoundStreamer hands each round's record, with the tokens it committed, to another thread as it lands."""

import queue
import threading

import pytest
import torch

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import DSparkRoundStreamer, FixedLength, FullBlock
from dspark_hf.evaluation import OracleDraft


def plain(target, ids, mask, **kw):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)


def oracle_draft(target, ids, mask, corruption=0.3, max_new_tokens=30):
    """A draft that proposes the target's own continuation with `corruption` of its tokens wrong, so rounds accept
    different amounts (an untrained draft would accept almost nothing)."""
    reference = plain(target, ids, mask, max_new_tokens=max_new_tokens)
    return OracleDraft.from_draft(tiny_draft(target)).set_references(target, reference, mask, corruption=corruption)


def generate_in_thread(target, ids, mask, streamer, **kw):
    """Run generate() in a thread (as a server would) and return a callable that joins it and gives its output."""
    result = {}

    def work():
        result["out"] = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, streamer=streamer,
                                        return_dict_in_generate=True, **kw)

    thread = threading.Thread(target=work)
    thread.start()

    def join():
        thread.join()
        return result["out"]

    return join


def stream_oracle_decode():
    """(prompt ids, streamer, the steps it yielded, generate()'s output) for 24 tokens with a corrupted oracle."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    streamer = DSparkRoundStreamer(timeout=60)
    join = generate_in_thread(target, ids, mask, streamer, assistant_model=oracle_draft(target, ids, mask),
                              max_new_tokens=24, verification_policy=FullBlock())
    steps = list(streamer)
    return ids, streamer, steps, join()


def test_rounds_arrive_in_order_and_equal_the_returned_records():
    ids, streamer, steps, out = stream_oracle_decode()

    assert [s.round for s in steps[1:]] == out.rounds[0]
    accepted = [r.accepted for r in out.rounds[0]]
    assert min(accepted) < max(accepted), "rounds must accept different amounts for this test to mean anything"
    assert streamer.prompt == ids[0].tolist()


def test_steps_rebuild_the_output_token_by_token():
    ids, streamer, steps, out = stream_oracle_decode()

    first, *rounds = steps
    assert first.round is None and len(first.tokens) == 1, "the prefill's token comes before any round"
    for step in rounds:
        r = step.round
        assert step.tokens == (r.drafted[: r.accepted] + [r.next_token])[: r.committed]
    assert sum((s.tokens for s in steps), []) == out.sequences[0, ids.shape[1]:].tolist()


def test_trimmed_verification_is_visible_in_the_streamed_rounds():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    streamer = DSparkRoundStreamer(timeout=60)
    join = generate_in_thread(target, ids, mask, streamer, assistant_model=oracle_draft(target, ids, mask, 0.0),
                              max_new_tokens=16, verification_policy=FixedLength(2))
    rounds = [s.round for s in list(streamer)[1:]]
    join()
    assert rounds and all(len(r.drafted) == 4 and r.verified <= 2 for r in rounds)


def test_plain_generate_streams_steps_without_rounds():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    streamer = DSparkRoundStreamer(timeout=60)
    join = generate_in_thread(target, ids, mask, streamer, max_new_tokens=8)
    steps = list(streamer)
    out = join()
    assert all(s.round is None and len(s.tokens) == 1 for s in steps)
    assert sum((s.tokens for s in steps), []) == out.sequences[0, ids.shape[1]:].tolist()


def test_a_stream_that_never_ends_times_out():
    streamer = DSparkRoundStreamer(timeout=0.05)
    streamer.put(torch.tensor([[1, 2, 3]]))
    with pytest.raises(queue.Empty):
        next(streamer)


def test_batches_are_refused():
    with pytest.raises(ValueError, match="batch size 1"):
        DSparkRoundStreamer().put(torch.ones(2, 5, dtype=torch.long))


def test_a_round_streamer_serves_one_generate_call_after_another():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    draft = oracle_draft(target, ids, mask, corruption=0.0)  # corrupts afresh each call: none, to compare calls
    streamer = DSparkRoundStreamer(timeout=60)
    calls = []
    for _ in range(2):
        join = generate_in_thread(target, ids, mask, streamer, max_new_tokens=12, assistant_model=draft,
                                  verification_policy=FullBlock())
        calls.append([step.tokens for step in streamer])
        join()
    assert calls[0] == calls[1] and streamer.prompt == ids[0].tolist()


def test_a_streamed_round_counts_the_tokens_streamed_when_a_criterion_ends_the_output_inside_it():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AtLength(StoppingCriteria):
        def __init__(self, length):
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    draft = oracle_draft(target, ids, mask, corruption=0.0)
    streamer = DSparkRoundStreamer(timeout=60)
    for stop in range(3, 8):  # ends inside a block of 4 for some of them, with or without an EOS id
        join = generate_in_thread(target, ids, mask, streamer, max_new_tokens=20, assistant_model=draft,
                                  verification_policy=FullBlock(), eos_token_id=None,
                                  stopping_criteria=StoppingCriteriaList([AtLength(ids.shape[1] + stop)]))
        steps = [(len(step.tokens), step.round and step.round.committed) for step in streamer]
        join()
        assert all(committed in (None, n) for n, committed in steps), steps
        assert sum(n for n, _ in steps) == stop


def test_the_custom_generate_route_streams_to_the_usual_streamer_argument():
    import dspark_hf

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    streamer = DSparkRoundStreamer(timeout=60)
    join = generate_in_thread(target, ids, mask, streamer, max_new_tokens=6, custom_generate=dspark_hf.dspark_generate,
                              draft_model=tiny_draft(target))
    tokens = [t for step in streamer for t in step.tokens]
    assert tokens == join().sequences[0, ids.shape[1]:].tolist() and len(tokens) == 6
