"""Greedy DSpark decoding returns exactly what plain `generate()` returns, whatever the batch looks like."""

import copy
import dataclasses
import logging
import string
import threading
import warnings

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, MaxLengthCriteria, PreTrainedTokenizerFast, \
    StoppingCriteria, StoppingCriteriaList, SynthIDTextWatermarkingConfig
from transformers.generation.streamers import BaseStreamer

from conftest import PAD, left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import FixedLength, FullBlock, HalfPrecisionGreedyWarning, dspark_generate, fast_draft_dtype
from dspark_hf.internals import CACHE_ARG
from dspark_hf.evaluation import OracleDraft


def plain(target, ids, mask, **kw):
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)


def dspark(target, draft, ids, mask, policy="full block", **kw):
    """DSpark decoding verifying the full block (round structure is then predictable) unless kw names a policy, or
    with policy="default" the policy generate() picks when none is given."""
    if policy == "full block":
        kw.setdefault("verification_policy", FullBlock())
    return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, assistant_model=draft,
                           return_dict_in_generate=True, **kw)


POLICY = pytest.mark.parametrize("policy", ["full block", "default"])
LOSSLESS = pytest.mark.lossless  # CI runs these once more on the compiled fast path


def oracle(target, draft, reference, mask, corruption):
    return OracleDraft.from_draft(draft).set_references(target, reference, mask, corruption=corruption)


@LOSSLESS
@POLICY
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("corruption", [0.0, 0.3])
def test_greedy_is_token_identical_with_left_padding(family, batch, corruption, policy):
    target = tiny_target(family)
    ids, mask = left_padded_prompts(batch)
    reference = plain(target, ids, mask, max_new_tokens=24)
    draft = oracle(target, tiny_draft(target), reference, mask, corruption)
    out = dspark(target, draft, ids, mask, max_new_tokens=24, policy=policy)
    assert torch.equal(out.sequences, reference)
    if policy == "default":
        return  # what it verifies depends on this machine's costs
    accepted = [r.accepted for rows in out.rounds for r in rows]
    assert max(accepted) == draft.config.block_size, "some block must be accepted whole"
    if corruption:
        assert any(0 < a < draft.config.block_size for a in accepted), "corrupted blocks are accepted partly"
        assert len(set(accepted)) > 2


@LOSSLESS
@POLICY
def test_greedy_is_token_identical_with_an_untrained_draft(family, policy):
    target = tiny_target(family)
    ids, mask = left_padded_prompts(3)
    out = dspark(target, tiny_draft(target), ids, mask, max_new_tokens=16, policy=policy)
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=16))


def test_sliding_windows_matter_in_the_gemma_target():
    """Guards the previous tests: with 4-token windows the output differs from a full-attention twin."""
    ids, mask = left_padded_prompts(3)
    windowed = plain(tiny_target("gemma3"), ids, mask, max_new_tokens=16)
    wide = tiny_target("gemma3")
    wide.config.sliding_window = 64
    assert not torch.equal(plain(wide, ids, mask, max_new_tokens=16), windowed)


@LOSSLESS
@POLICY
@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 11])
def test_length_limits_that_end_mid_block(family, max_new_tokens, policy):
    target = tiny_target(family)
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=max_new_tokens)
    draft = oracle(target, tiny_draft(target), plain(target, ids, mask, max_new_tokens=30), mask, 0.0)
    out = dspark(target, draft, ids, mask, max_new_tokens=max_new_tokens, policy=policy)
    assert torch.equal(out.sequences, reference)
    assert all(sum(r.committed for r in rows) == max_new_tokens - 1 for rows in out.rounds)  # + prefill token


def test_max_length_counts_the_padded_prompt_like_plain_generate():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    out = dspark(target, tiny_draft(target), ids, mask, max_length=ids.shape[1] + 7)
    assert torch.equal(out.sequences, plain(target, ids, mask, max_length=ids.shape[1] + 7))


@pytest.mark.parametrize("limit", [5, 9])
def test_a_callers_max_length_criterion_replaces_max_new_tokens_like_plain_generate(limit):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    kw = dict(max_new_tokens=7, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + limit)]))
    assert torch.equal(dspark(target, tiny_draft(target), ids, mask, **kw).sequences, plain(target, ids, mask, **kw))


@pytest.mark.parametrize("kw", [dict(cache_implementation="dynamic"), dict(dtype=torch.int32)], ids=str)
def test_a_dynamic_cache_and_int32_ids_decode_like_plain_generate(kw):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    ids = ids.to(kw.pop("dtype", ids.dtype))
    reference = plain(target, ids, mask, max_new_tokens=12, **kw)
    out = dspark(target, tiny_draft(target), ids, mask, max_new_tokens=12, **kw).sequences
    assert out.dtype == reference.dtype == torch.long and torch.equal(out, reference)


def eos_inside_a_block(target, ids, mask, row=0, index=6, block=4):
    """(free continuation, a token that row `row` first emits at or after `index`, strictly inside a chunk of
    block + 1 tokens, so an oracle draft accepts it in the middle of a block)."""
    free = plain(target, ids, mask, max_new_tokens=30)
    tokens = free[row, ids.shape[1]:].tolist()
    for i in range(index, len(tokens)):
        if tokens[i] not in tokens[:i] and i % (block + 1) != 0:
            return free, tokens[i]
    raise AssertionError("no suitable token")


@LOSSLESS
@POLICY
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_eos_inside_a_block_ends_the_row_there(family, batch, policy):
    target = tiny_target(family)
    ids, mask = left_padded_prompts(batch)
    free, eos = eos_inside_a_block(target, ids, mask)
    reference = plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.0), ids, mask, max_new_tokens=30,
                 eos_token_id=eos, policy=policy)
    assert torch.equal(out.sequences, reference)
    if policy == "default":
        return
    cut = [r for r in out.rounds[0] if r.committed < r.accepted + 1]
    assert cut, "EOS must have ended row 0 inside an accepted chunk"
    assert out.sequences.shape[1] < ids.shape[1] + 30 or batch > 1


@LOSSLESS
@POLICY
def test_several_eos_ids(policy):
    target = tiny_target("qwen3")
    ids, mask = left_padded_prompts(3)
    free = plain(target, ids, mask, max_new_tokens=30)
    eos = [int(free[1, ids.shape[1] + 4]), int(free[2, ids.shape[1] + 9])]
    reference = plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos)
    out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.2), ids, mask, max_new_tokens=30,
                 eos_token_id=eos, policy=policy)
    assert torch.equal(out.sequences, reference)


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@POLICY
def test_custom_stopping_criteria_are_checked_inside_chunks(policy):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    for row, eos in ((1, None), (1, 95)):  # without EOS, stopped rows keep generating; with EOS they are padded
        free, stop = eos_inside_a_block(target, ids, mask, row=row, index=5)
        criteria = StoppingCriteriaList([StopOnToken(stop)])
        kw = dict(max_new_tokens=30, stopping_criteria=criteria, eos_token_id=eos)
        reference = plain(target, ids, mask, **kw)
        out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.0), ids, mask, policy=policy, **kw)
        assert torch.equal(out.sequences, reference)
        if eos is None:  # the output ends where the last row stopped, inside a chunk: the records say so
            generated = reference.shape[1] - ids.shape[1]
            assert all(1 + sum(r.committed for r in rows) == generated for rows in out.rounds)
    one = ids[1:2], mask[1:2]  # alone, the row that stops ends the output inside the chunk where it stopped
    free, stop = eos_inside_a_block(target, *one, row=0, index=5)
    kw = dict(max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopOnToken(stop)]), eos_token_id=None)
    out = dspark(target, oracle(target, tiny_draft(target), free, one[1], 0.0), *one, policy=policy, **kw)
    assert torch.equal(out.sequences, plain(target, *one, **kw))
    assert 1 + sum(r.committed for r in out.rounds[0]) == out.sequences.shape[1] - ids.shape[1]


@POLICY
def test_input_dependent_logits_processors_see_what_plain_generate_sees(policy):
    """repetition_penalty reads the whole sequence; min_new_tokens reads its length."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    free, eos = eos_inside_a_block(target, ids, mask, row=0, index=2)
    kw = dict(max_new_tokens=20, repetition_penalty=1.5, eos_token_id=eos, min_new_tokens=6)
    reference = plain(target, ids, mask, **kw)
    draft = oracle(target, tiny_draft(target), plain(target, ids, mask, **kw), mask, 0.2)
    out = dspark(target, draft, ids, mask, policy=policy, **kw)
    assert torch.equal(out.sequences, reference)


class RecordIds(LogitsProcessor):
    """Reads the ids (so DSpark calls it row group by row group) and records what every call showed."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append(input_ids.clone())
        return scores


def test_a_processor_called_for_some_rows_sees_every_row_with_its_own_prompt():
    # rows that accepted different amounts are processed in groups of one length; the other rows of each call must
    # still look like rows plain generate() shows (their own ids), not like padding where the prompt was
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=20)
    recorder = RecordIds()
    out = dspark(target, oracle(target, tiny_draft(target), reference, mask, 0.3), ids, mask, max_new_tokens=20,
                 logits_processor=[recorder])
    assert torch.equal(out.sequences, reference)
    lengths = {call.shape[1] for call in recorder.calls}
    assert len(recorder.calls) > len(lengths)  # some round was processed in more than one group
    assert all(torch.equal(call[:, :ids.shape[1]], ids) for call in recorder.calls)


def test_round_records_add_up():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    free = plain(target, ids, mask, max_new_tokens=20)
    out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.3), ids, mask, max_new_tokens=20)
    gamma = 4
    for row, rows in enumerate(out.rounds):
        assert sum(r.committed for r in rows) == 20 - 1  # the first token comes from the prefill
        rebuilt = []
        for r in rows:
            drafted = 0 if r.one_token_left else gamma  # a row's last token alone: nothing to verify, nothing drafted
            assert len(r.drafted) == drafted and len(r.draft_probs) == drafted and len(r.confidences or []) == drafted
            assert 0 <= r.accepted <= r.verified <= gamma
            assert r.tau == r.accepted + 1
            assert r.bonus == (r.accepted == r.verified)
            rebuilt += (r.drafted[: r.accepted] + [r.next_token])[: r.committed]
        # accepted drafts + the target's token, round after round, are exactly the generated tokens
        assert rebuilt == out.sequences[row, ids.shape[1] + 1:].tolist()
    assert set(out.timings) == {"prefill", "draft", "target", "total"}
    assert out.timings["total"] >= out.timings["prefill"] + out.timings["draft"] + out.timings["target"]


def test_the_output_dict_has_plain_generate_s_fields_and_refuses_the_cache_saying_why():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    want = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, pad_token_id=PAD,
                           return_dict_in_generate=True)
    out = dspark(target, tiny_draft(target), ids, mask, max_new_tokens=6)
    assert isinstance(out, type(want)) and torch.equal(out.sequences, want.sequences)
    assert [k for k in want.keys() if k not in ("cache", "past_key_values")] == ["sequences"]  # plain's, but the cache
    # plain's cache cannot hold DSpark's rows (each at its own offset): reading it says so instead of giving None
    for name in {"past_key_values", *(f.name for f in dataclasses.fields(want))} - {"sequences", "scores", "logits",
                                                                               "attentions", "hidden_states"}:
        with pytest.raises(AttributeError, match="no cache.*call generate\\(\\) again on out.sequences"):
            getattr(out, name)
        assert getattr(out, name, None) is None and name not in out  # absent, as any unset field of a ModelOutput
    assert list(out.keys()) == ["sequences", "rounds", "timings"]
    assert "rounds=" in repr(out) and out == out and list(copy.deepcopy(out).keys()) == list(out.keys())


def test_verification_length_is_an_input_of_the_round():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=20)
    out = dspark(target, oracle(target, tiny_draft(target), reference, mask, 0.0), ids, mask, max_new_tokens=20,
                 verification_policy=FixedLength(2))
    assert torch.equal(out.sequences, reference)
    assert {r.verified for rows in out.rounds for r in rows} <= {2, 1, 0}
    assert all(len(r.drafted) == (0 if r.one_token_left else 4) for rows in out.rounds for r in rows), \
        "drafting always uses the full block, but for a last round that can verify nothing"


class Recorder(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_each_round_as_it_lands():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    reference = plain(target, ids, mask, max_new_tokens=20)
    streamer = Recorder()
    out = dspark(target, oracle(target, tiny_draft(target), reference, mask, 0.0), ids, mask, max_new_tokens=20,
                 streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out.sequences[0, ids.shape[1]:].tolist()
    assert max(len(c) for c in streamer.chunks[1:]) > 1


def test_streamer_stops_where_a_custom_criterion_fires_without_eos():
    """No EOS criterion: the output ends at the stop, and so must the stream, even mid-chunk."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    free, stop = eos_inside_a_block(target, ids, mask, row=0, index=5)
    kw = dict(max_new_tokens=30, stopping_criteria=StoppingCriteriaList([StopOnToken(stop)]), eos_token_id=None)
    streamer = Recorder()
    out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.0), ids, mask, streamer=streamer, **kw)
    assert torch.equal(out.sequences, plain(target, ids, mask, **kw))
    assert sum(streamer.chunks[1:], []) == out.sequences[0, ids.shape[1]:].tolist()


def test_finished_rows_keep_their_place_and_commit_nothing_more():
    """The batch keeps its shape to the end, as plain generate()'s does (and compiled steps need): a row that has
    finished rides along, padded, until every row has."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    free, eos = eos_inside_a_block(target, ids, mask, row=0, index=1)
    rows_seen = []
    hook = target.register_forward_pre_hook(lambda m, a, kw: rows_seen.append(kw["input_ids"].shape[0]),
                                            with_kwargs=True)
    try:
        out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.0), ids, mask, max_new_tokens=30,
                     eos_token_id=eos)
    finally:
        hook.remove()
    assert len(rows_seen) > 2 and set(rows_seen) == {3}
    assert torch.equal(out.sequences, plain(target, ids, mask, max_new_tokens=30, eos_token_id=eos))
    assert sum(r.committed for r in out.rounds[0]) < sum(r.committed for r in out.rounds[1])


def test_the_public_custom_generate_route():
    target = tiny_target("qwen3")
    ids, mask = left_padded_prompts(3)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                          custom_generate=dspark_generate, draft_model=tiny_draft(target))
    assert torch.equal(out, plain(target, ids, mask, max_new_tokens=12))


def test_other_assistant_models_keep_stock_behaviour():
    target = tiny_target("llama")
    assistant = tiny_target("llama", seed=3)
    ids, mask = left_padded_prompts(1)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                          assistant_model=assistant)
    assert torch.equal(out, plain(target, ids, mask, max_new_tokens=12))
    with pytest.raises(ValueError, match="batch_size = 1"):  # transformers' own limit, untouched
        ids3, mask3 = left_padded_prompts(3)
        target.generate(input_ids=ids3, attention_mask=mask3, max_new_tokens=4, assistant_model=assistant)


def test_a_caller_s_max_length_criterion_at_or_below_the_prompt_still_gives_one_token_as_plain_generate():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    for limit in (5, ids.shape[1], ids.shape[1] + 1):
        criteria = dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(limit)]), max_new_tokens=8)
        reference = plain(target, ids, mask, **criteria)
        assert torch.equal(dspark(target, tiny_draft(target), ids, mask, **criteria).sequences, reference), limit


def test_the_verification_forward_gets_one_mask_column_per_key():
    """Models that build their own mask (ALiBi: Falcon, Bloom) need it exactly as long as past + new keys."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    seen = []

    def check(module, args, kwargs):
        cache = kwargs[CACHE_ARG]
        # a 2D mask (B, keys), or prepared per query (B, 1, Q, keys)
        seen.append(kwargs["attention_mask"].shape[-1] == cache.get_seq_length() + kwargs["input_ids"].shape[1])

    hook = target.model.register_forward_pre_hook(check, with_kwargs=True)
    try:
        dspark(target, tiny_draft(target), ids, mask, max_new_tokens=10)
    finally:
        hook.remove()
    assert len(seen) > 2 and all(seen)


def test_two_models_generate_at_the_same_time():
    jobs = {}
    for family in ("llama", "qwen3"):
        target = tiny_target(family)
        ids, mask = left_padded_prompts(3, seed=len(jobs))
        jobs[family] = (target, tiny_draft(target), ids, mask, plain(target, ids, mask, max_new_tokens=20))
    results = {}

    def run(name):
        target, draft, ids, mask, _ = jobs[name]
        results[name] = dspark(target, draft, ids, mask, max_new_tokens=20).sequences

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for name, (*_, reference) in jobs.items():
        assert torch.equal(results[name], reference)


def test_calls_on_one_draft_from_several_threads_share_nothing_and_decode_as_plain_generate():
    """The default policy hands what a greedy call learned on to the next one; calls that run at once (a server's
    threads) each learn in their own copy. Greedy calls beside sampled ones, all on one draft and target with the
    default policy, each give plain generate()'s output."""
    from transformers import set_seed

    target = tiny_target("llama")
    draft = tiny_draft(target)
    prompts = [left_padded_prompts(b, seed=b) for b in (1, 2, 3, 2)]
    references = [plain(target, ids, mask, max_new_tokens=16) for ids, mask in prompts]
    results, errors = {}, []

    def greedy(i):
        ids, mask = prompts[i]
        for _ in range(3):
            results.setdefault(i, []).append(target.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                             max_new_tokens=16, assistant_model=draft))

    def sampled(i):
        ids, mask = prompts[i]
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=16,
                              assistant_model=draft)
        results[("sampled", i)] = out

    def guarded(fn, i):
        try:
            fn(i)
        except BaseException as error:  # a thread's failure is the test's
            errors.append(error)

    set_seed(0)
    threads = [threading.Thread(target=guarded, args=(fn, i)) for i, fn in enumerate([greedy, sampled, greedy,
                                                                                      sampled])]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    assert not errors, errors
    for i in (0, 2):
        assert all(torch.equal(out, references[i]) for out in results[i])
    for i in (1, 3):
        assert torch.equal(results[("sampled", i)][:, :prompts[i][0].shape[1]], prompts[i][0])


@pytest.mark.parametrize("options, message", [
    (dict(num_beams=2), "beam"),
    (dict(cache_implementation="offloaded"), "cache_implementation='offloaded' is not supported"),
    (dict(output_scores=True), "output_scores"),
    (dict(penalty_alpha=0.6, top_k=4), "contrastive"),
    (dict(prompt_lookup_num_tokens=3), r"assisted_generation \(chosen by prompt_lookup_num_tokens=3\)"),
    (dict(guidance_scale=1.5), "guidance_scale=1.5 is not supported"),
    (dict(token_healing=True), r"heal the prompt first, input_ids = target.heal_tokens"),
    (dict(inputs_embeds=torch.zeros(1, 4, 64)), "inputs_embeds is not supported.*pass input_ids instead"),
    (dict(position_ids=torch.arange(1, 10)[None]), "Custom position_ids are not supported"),
    (dict(past_key_values=DynamicCache()), "past_key_values is not supported.*would not be filled for reuse"),
    (dict(cache=DynamicCache()), "cache is not supported.*would not be filled for reuse. Drop cache"),
    (dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=2)),
     "SynthIDTextWatermarkLogitsProcessor keeps state across calls"),
])
def test_unsupported_options_raise_clear_errors(options, message):
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    with pytest.raises(ValueError, match=message):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=tiny_draft(target),
                        **options)


@pytest.mark.parametrize("option", ["ssd", "verification_policy"])
def test_dspark_options_without_a_dspark_draft_say_to_pass_one(option):
    from dspark_hf import FullBlock, SSDConfig

    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    value = {"ssd": SSDConfig(), "verification_policy": FullBlock()}[option]
    with pytest.raises(ValueError, match=f"{option}= applies to DSpark decoding: pass assistant_model=.*NoneType"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **{option: value})


def test_a_draft_for_another_target_is_refused():
    draft = tiny_draft(tiny_target("llama", vocab=64))
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    with pytest.raises(ValueError, match="vocabulary size"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=draft)


def test_a_draft_on_another_device_than_its_target_is_refused_with_how_to_move_it():
    target = tiny_target("llama")
    draft = tiny_draft(target).to("meta")  # no second device here: "meta" stands for one
    ids, mask = left_padded_prompts(1)
    with pytest.raises(ValueError, match=r"draft's weights are on meta but the target runs on cpu.*draft\.to\(target"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=draft)


def test_a_prompt_on_another_device_moves_to_the_target_s_before_generate_builds_its_criteria_beside_it(
        monkeypatch):
    """No second device here: the target says it is on "meta", and generate() is stopped where it would begin."""
    import dspark_hf.generation.integration as integration

    target = tiny_target("llama")
    draft = tiny_draft(target)
    target.__class__ = type("OnMeta", (type(target),), {"device": property(lambda self: torch.device("meta"))})
    ids, mask = left_padded_prompts(2)
    given = {}
    monkeypatch.setattr(integration, "_original_generate", lambda model, **kw: given.update(kw) or ids)
    for prompt in (dict(inputs=ids), dict(input_ids=ids)):
        given.clear()
        target.generate(**prompt, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0),
                        max_new_tokens=4, assistant_model=draft)
        moved = [name for name in ("inputs", "input_ids", "attention_mask", "position_ids") if name in given]
        assert len(moved) == 3 and all(given[name].device.type == "meta" for name in moved)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_prompt_on_the_cpu_decodes_on_a_cuda_target_as_plain_generate_and_comes_back_on_the_cpu():
    target = tiny_target("llama").cuda()
    ids, mask = left_padded_prompts(3)
    options = dict(max_new_tokens=16, eos_token_id=95, min_new_tokens=3)  # EOS ids in a criterion and a processor
    reference = plain(target, ids, mask, **options)
    out = dspark(target, tiny_draft(target).cuda(), ids, mask, **options)
    assert out.sequences.device.type == "cpu" and torch.equal(out.sequences, reference)
    route = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, custom_generate=dspark_generate,
                            draft_model=tiny_draft(target).cuda(), **options)
    assert route.device.type == "cpu" and torch.equal(route, reference)


def test_a_target_spread_over_several_devices_is_refused_with_how_to_load_it_on_one():
    target = tiny_target("llama")
    # what accelerate records for device_map="auto" over a GPU and the CPU (no second device is needed to refuse)
    target.hf_device_map = {"model.embed_tokens": 0, "model.layers": 0, "model.norm": "cpu", "lm_head": "cpu"}
    ids, mask = left_padded_prompts(1)
    with pytest.raises(ValueError, match=r"spread over several devices \(0, cpu, from device_map\).*on one device"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=tiny_draft(target))
    target.hf_device_map = {"": "cpu"}  # device_map="cpu": one device, decoded as any other target
    target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=tiny_draft(target))


@pytest.mark.parametrize("dtype, do_sample, warns", [
    (torch.bfloat16, False, True), (torch.float16, False, True),
    (torch.float32, False, False), (torch.bfloat16, True, False),
])
def test_greedy_on_a_half_precision_target_says_identity_holds_up_to_rounding(dtype, do_sample, warns):
    target = tiny_target("llama").to(dtype)
    draft = tiny_draft(target).to(dtype)
    ids, mask = left_padded_prompts(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=do_sample,
                        assistant_model=draft)
    said = [w for w in caught if issubclass(w.category, HalfPrecisionGreedyWarning)]
    assert bool(said) == warns
    if warns:
        assert "float32 for token-identical output" in str(said[0].message)


@pytest.mark.parametrize("draft_vocab", [None, list(range(0, 96, 2))])
def test_a_bfloat16_draft_next_to_a_float32_target_keeps_greedy_output_identical(family, draft_vocab):
    target = tiny_target(family)
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=16)
    draft = tiny_draft(target, draft_vocab=draft_vocab).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HalfPrecisionGreedyWarning)  # only the target's dtype decides identity
        untrained = dspark(target, draft, ids, mask, max_new_tokens=16)
        half_right = dspark(target, oracle(target, draft, reference, mask, 0.3), ids, mask, max_new_tokens=16)
    assert torch.equal(untrained.sequences, reference) and torch.equal(half_right.sequences, reference)
    assert 0 < sum(r.accepted for rows in half_right.rounds for r in rows) < 16 * 3


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_the_fast_draft_dtype_is_bfloat16_only_where_the_cpu_computes_it_natively(monkeypatch, native, expected):
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: native, raising=False)
    assert fast_draft_dtype(tiny_target("llama")) == expected
    assert fast_draft_dtype(tiny_target("llama").to(torch.bfloat16)) == torch.bfloat16


def test_streamers_need_batch_size_one():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    with pytest.raises(ValueError, match="batch size 1"):
        dspark(target, tiny_draft(target), ids, mask, max_new_tokens=4, streamer=Recorder())


def test_a_length_limit_far_beyond_the_output_allocates_only_what_is_generated(monkeypatch):
    """max_new_tokens=10**12 ("until EOS") for rows that end within a few tokens: as in plain generate(), nothing
    is allocated for the limit (10**12 tokens a row would not fit in memory); the output buffer stays within twice
    what was generated and one round's chunk (room for which is made before the round's counts are known)."""
    from dspark_hf.generation.transcript import Transcript

    widths = []
    commit = Transcript.commit

    def recording_commit(self, *args):
        done = commit(self, *args)
        widths.append(self.gen.shape[1])
        return done

    monkeypatch.setattr(Transcript, "commit", recording_commit)
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    free = plain(target, ids, mask, max_new_tokens=12)
    eos = [int(free[row, ids.shape[1] + i]) for row, i in enumerate((3, 11, 6))]  # rows end at different rounds
    reference = plain(target, ids, mask, max_new_tokens=10**12, eos_token_id=eos)
    out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.3), ids, mask, max_new_tokens=10**12,
                 eos_token_id=eos)
    assert torch.equal(out.sequences, reference)
    generated = reference.shape[1] - ids.shape[1]
    assert generated <= 12 and max(widths) <= 2 * (generated + tiny_draft(target).config.block_size + 1)


def test_padding_tokens_fill_finished_rows():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(3)
    free, eos = eos_inside_a_block(target, ids, mask, row=2, index=1)
    out = dspark(target, oracle(target, tiny_draft(target), free, mask, 0.0), ids, mask, max_new_tokens=20,
                 eos_token_id=eos)
    new = out.sequences[2, ids.shape[1]:].tolist()
    end = new.index(eos)
    assert end < len(new) - 1 and set(new[end + 1:]) == {PAD}


def test_an_empty_prompt_is_refused_with_a_message_that_says_so():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    with pytest.raises(ValueError, match="the prompt is empty"):
        target.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4, assistant_model=draft)
    ids, mask = left_padded_prompts(3)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] of the prompt are all padding"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=draft)


@pytest.mark.parametrize("malform, message", [
    (lambda ids, mask: (ids, mask[:, 1:]), r"attention_mask has shape \(2, 8\) but input_ids \(2, 9\): pass the mask"),
    (lambda ids, mask: (ids + 200, mask), r"ids outside the target's vocabulary of 96 tokens \(min 200, max \d+\): "
                                          r"tokenize with the target's tokenizer"),
    (lambda ids, mask: (ids - 1, mask), r"outside the target's vocabulary of 96 tokens \(min -1"),
], ids=["mask of another shape", "ids past the vocabulary", "negative ids"])
def test_a_malformed_prompt_is_refused_saying_what_to_pass_instead_of_failing_inside_the_target(malform, message):
    """Plain generate() fails inside the model (a shape mismatch, an index error; on a GPU, a device-side assert)."""
    target = tiny_target("llama")
    ids, mask = malform(*left_padded_prompts(2))
    with pytest.raises(ValueError, match=message):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, assistant_model=tiny_draft(target))


@pytest.mark.parametrize("prompt_length, max_new_tokens", [(20, 6), (12, 8), (12, 4), (16, 1)])
def test_a_sequence_past_the_target_s_max_position_embeddings_is_warned_of_as_plain_generate_does(
        transformers_log, prompt_length, max_new_tokens):
    """Past 16 positions: a prompt longer than that, an output that grows past it, one that stays within it, and a
    prompt past it with one token to generate (its only length is the limit, where plain generate() says nothing)."""
    target = tiny_target("llama", max_position_embeddings=16)
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(2, length=prompt_length)

    def logged(**kw):
        transformers_log.clear()
        logging.Logger.warning_once.cache_clear()  # the second run may log what the first did
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              **kw)
        return out, [(r.levelno, r.getMessage()) for r in transformers_log if "maximum length" in r.getMessage()]

    reference, said = logged()
    out, ours = logged(assistant_model=draft, verification_policy=FullBlock())
    assert torch.equal(out, reference)
    assert ours == said
    # plain generate() shows its criterion the lengths P + 1 .. P + max_new_tokens, the last one at the limit
    assert bool(said) == (max_new_tokens > 1 and prompt_length + max_new_tokens - 1 > 16), said


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_right_padded_batch_is_refused_saying_to_pad_on_the_left(do_sample):
    """Plain generate() only warns and decodes on from the padding; DSpark would return other tokens."""
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids = torch.randint(1, 96, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[2, :2] = 0, 0  # row 0 has no padding, row 1 is padded on the right, row 2 on the left
    with pytest.raises(ValueError, match=r"rows \[1\] .*padded on the right.*padding_side = 'left'"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=do_sample,
                        assistant_model=draft)
    mask[1] = 1
    mask[1, 2:4] = 0  # a gap inside the prompt still ends flush right, and decodes as plain generate() does
    assert torch.equal(dspark(target, draft, ids, mask, max_new_tokens=6).sequences,
                       plain(target, ids, mask, max_new_tokens=6))


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_draft_whose_weights_went_non_finite_says_so_instead_of_failing_inside_sampling(do_sample):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    with torch.no_grad():
        next(p for name, p in draft.named_parameters() if name.endswith("weight")).fill_(float("nan"))
    ids, mask = left_padded_prompts(2)
    with pytest.raises(FloatingPointError, match="non-finite probabilities"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=do_sample,
                        assistant_model=draft, verification_policy=FullBlock())


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_draft_whose_confidence_head_went_non_finite_says_so_instead_of_planning_on_nan(do_sample):
    """The output would stay lossless, but every policy would plan on NaN confidences without a word."""
    target = tiny_target("llama")
    draft = tiny_draft(target)
    with torch.no_grad():
        draft.confidence.weight.fill_(float("nan"))
    ids, mask = left_padded_prompts(2)
    with pytest.raises(FloatingPointError, match="non-finite confidences.*confidence head.*Reload the draft"):
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=do_sample,
                        assistant_model=draft, verification_policy=FullBlock())


def other_family(name: str):
    """Tiny random targets of families whose configs name the MLP width otherwise (GPT-2: n_inner, None) and that
    build their own attention mask (ALiBi)."""
    import transformers as tr

    torch.manual_seed(0)
    size = dict(vocab_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    model = {
        "gpt2": lambda: tr.GPT2LMHeadModel(tr.GPT2Config(n_embd=32, n_layer=4, n_head=4, initializer_range=0.3,
                                                         **size)),
        "falcon-alibi": lambda: tr.FalconForCausalLM(tr.FalconConfig(
            hidden_size=32, num_hidden_layers=4, num_attention_heads=4, new_decoder_architecture=False,
            multi_query=True, alibi=True, initializer_range=0.3, **size)),
        "bloom": lambda: tr.BloomForCausalLM(tr.BloomConfig(hidden_size=32, n_layer=4, n_head=4,
                                                            initializer_range=0.3, **size)),
    }[name]().eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, None
    return model


@pytest.mark.parametrize("name", ["gpt2", "falcon-alibi", "bloom"])
def test_families_with_other_config_names_and_their_own_masks_decode_identically(name):
    target = other_family(name)
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask, max_new_tokens=12)
    out = dspark(target, oracle(target, tiny_draft(target), reference, mask, 0.3), ids, mask, max_new_tokens=12)
    assert torch.equal(out.sequences, reference)


@pytest.mark.parametrize("family", ["gpt2", "llama"])  # GPT-2 embeds positions, Llama rotates by them
def test_a_floating_point_attention_mask_decodes_like_plain_generate(family):
    target = other_family(family) if family == "gpt2" else tiny_target(family)
    ids, mask = left_padded_prompts(3)
    reference = plain(target, ids, mask.float(), max_new_tokens=12)
    draft = oracle(target, tiny_draft(target), reference, mask, 0.3)
    assert torch.equal(dspark(target, draft, ids, mask.float(), max_new_tokens=12).sequences, reference)


def test_processors_that_push_a_draft_vocabulary_s_missing_token_to_infinity_leave_the_draft_its_own_distribution():
    """remove_invalid_values turns the -inf of a token outside the draft vocabulary into the dtype's minimum, and an
    exponential decay penalty overflows that to +inf: such rows draft from the draft's own distribution."""
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(2)
    eos = 51
    draft = tiny_draft(target, draft_vocab=[i for i in range(96) if i != eos][:48])
    options = dict(max_new_tokens=20, eos_token_id=eos, exponential_decay_length_penalty=(2, 1.5),
                   remove_invalid_values=True)
    assert torch.equal(dspark(target, draft, ids, mask, **options).sequences, plain(target, ids, mask, **options))


def test_the_custom_generate_route_is_checked_as_the_assistant_model_route():
    target = tiny_target("llama")
    ids, mask = left_padded_prompts(1)
    draft = tiny_draft(target)
    route = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=dspark_generate)
    with pytest.raises(ValueError, match="Pass either assistant_model=<DSpark draft> or custom_generate, not both"):
        target.generate(**route, draft_model=draft, assistant_model=draft, streamer=BaseStreamer())
    for name in ("past_key_values", "cache"):  # the name of transformers <= 5.23, and of 5.24 on
        with pytest.raises(ValueError, match=f"{name} is not supported"):
            target.generate(**route, draft_model=draft, **{name: DynamicCache()})


def char_tokenizer():
    """A tokenizer that spells each id of the tiny vocabulary (1..95) as one character, so that any two generated
    tokens in a row make a stop string."""
    chars = string.ascii_letters + string.digits + string.punctuation + "§"
    tok = Tokenizer(WordLevel({"<pad>": PAD, **{c: i for i, c in enumerate(chars, 1)}}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def stop_strings_inside_the_output(target, ids, mask, tokenizer, max_new_tokens=30):
    """(the free continuation, two stop strings found in the middle of rows 1 and 2 of it)."""
    free = plain(target, ids, mask, max_new_tokens=max_new_tokens)
    new = [tokenizer.decode(row[ids.shape[1]:]) for row in free]
    return free, [new[1][5:7], new[2][11:13]]


def test_the_model_s_default_stop_strings_apply_beside_a_passed_generation_config_as_in_plain_generate():
    target, tokenizer = tiny_target("llama"), char_tokenizer()
    ids, mask = left_padded_prompts(4)
    free, stops = stop_strings_inside_the_output(target, ids, mask, tokenizer)
    target.generation_config.stop_strings = stops
    config = GenerationConfig(max_new_tokens=30, pad_token_id=PAD, eos_token_id=95, do_sample=False)
    reference = target.generate(input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tokenizer)
    assert reference.shape[1] < free.shape[1] or not torch.equal(reference, free), "the stop strings must end rows"
    out = target.generate(input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tokenizer,
                          assistant_model=oracle(target, tiny_draft(target), free, mask, 0.3),
                          verification_policy=FullBlock())
    assert torch.equal(out, reference)


def test_the_custom_generate_route_turns_stop_strings_into_a_criterion_as_the_assistant_model_route():
    target, tokenizer = tiny_target("llama"), char_tokenizer()
    ids, mask = left_padded_prompts(4)
    free, stops = stop_strings_inside_the_output(target, ids, mask, tokenizer)
    kw = dict(max_new_tokens=30, stop_strings=stops, tokenizer=tokenizer, eos_token_id=95)
    reference = plain(target, ids, mask, **kw)
    assert not torch.equal(reference, free), "the stop strings must end rows"
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, custom_generate=dspark_generate,
                          draft_model=oracle(target, tiny_draft(target), free, mask, 0.3), **kw)
    assert torch.equal(out, reference)


@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
def test_token_healing_from_the_model_s_defaults_is_refused_on_both_routes_beside_a_passed_generation_config(route):
    target = tiny_target("llama")
    target.generation_config.token_healing = True
    ids, mask = left_padded_prompts(1)
    draft = tiny_draft(target)
    how = dict(assistant_model=draft) if route == "assistant_model" else \
        dict(custom_generate=dspark_generate, draft_model=draft)
    with pytest.raises(ValueError, match="token_healing=True is not supported with a DSpark draft: heal the prompt"):
        target.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(max_new_tokens=4),
                        tokenizer=char_tokenizer(), **how)
