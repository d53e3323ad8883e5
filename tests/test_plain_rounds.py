"""A round after which nothing is drafted is plain generate()'s step: the target over one token per row, reading no
more cache slots than plain generate()'s cache holds, no work of the draft's, one read of the device. The target's
features of such rounds are kept, and projected into the draft's context the first time it drafts again, so that a
block drafted after a pause is the block drafted without one.
"""

import pytest
import torch

from conftest import cpu_compile_config, left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import FixedLength, Policy
from dspark_hf.generation import decoding
from dspark_hf.generation.cache import DecodingCache
from test_host_reads import HostReads


class Paused(Policy):
    """Drafts the blocks whose index is in `drafted` (verifying `length` tokens of each), none of the others; with
    `verify_instead`, drafts every block and verifies none of those others, which commits what a paused round commits
    while the draft's context is projected every round."""

    def __init__(self, drafted: set[int], length: int, verify_instead: bool = False):
        self.drafted, self.length, self.verify_instead, self.block = drafted, length, verify_instead, -1

    def draft_this_round(self, num_rows: int) -> bool:
        self.block += 1  # asked once per block, before the block is planned
        return self.verify_instead or self.block in self.drafted

    def __call__(self, confidences, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.full((num_rows,), self.length if self.block in self.drafted else 0, dtype=torch.long)


def path_options(path: str, prompt_length: int, max_new_tokens: int) -> dict:
    if path == "eager":
        return {}
    return {"cache_implementation": "static", "compile_config": cpu_compile_config(),
            "max_cache_len": prompt_length + max_new_tokens}


def plain_cache(output):
    """The cache plain generate() returned (`cache` from transformers 5.24, `past_key_values` before)."""
    return output["cache"] if "cache" in output else output["past_key_values"]


class AttentionMasks:
    """Whether each eager SDPA call (one per layer and forward) is given a mask: a boolean one costs SDPA a conversion
    in every layer."""

    def __init__(self, monkeypatch):
        self.given = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spied(*args, attn_mask=None, **kwargs):
            self.given.append(attn_mask is not None)
            return sdpa(*args, attn_mask=attn_mask, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spied)


class Spy:
    """What each `_round` runs: the target's query tokens and the cache slots its attention reads, whether its
    writes are plain copies (a slice), whether its eager attention is given a mask, how many of the draft's modules
    run (eagerly: a compiled step's modules run inside its graph, unseen), whether the draft's context changes, and
    how many times the host reads the device."""

    def __init__(self, monkeypatch, draft):
        self.rounds, self._current = [], None
        round_, frame = decoding._round, DecodingCache.frame
        masks = AttentionMasks(monkeypatch)

        def spied_round(s, candidates, state, plan):
            self._current = {"queries": [], "width": [], "copies": [], "draft_modules": 0, "reads": 0}
            masks.given.clear()
            context = [t.clone() for t in state.context_keys + state.context_values]
            with HostReads() as reads:
                try:
                    return round_(s, candidates, state, plan)
                finally:
                    self._current["reads"] = reads.count
                    self._current["masked"] = sorted(set(masks.given))
                    self._current["context_written"] = not all(
                        torch.equal(a, b) for a, b in zip(context, state.context_keys + state.context_values))
                    self.rounds.append(self._current)
                    self._current = None

        def spied_frame(cache, index, queries, width):
            if self._current is not None:
                self._current["queries"].append(queries)
                self._current["width"].append(width)
                self._current["copies"].append(isinstance(index, slice))
            return frame(cache, index, queries, width)

        def counted(*_):
            if self._current is not None:
                self._current["draft_modules"] += 1

        monkeypatch.setattr(decoding, "_round", spied_round)
        monkeypatch.setattr(DecodingCache, "frame", spied_frame)
        for module in draft.modules():
            monkeypatch.setattr(module, "_forward_pre_hooks", module._forward_pre_hooks.copy())
            module.register_forward_pre_hook(counted)


# the fast suite's compiled subset: batch 3 (padded rows) compiled; batch 1 compiled (36 s) runs with the slow tests
@pytest.mark.parametrize("path, batch", [("eager", 1), ("eager", 3),
                                         pytest.param("compiled", 1, marks=pytest.mark.slow), ("compiled", 3)])
def test_a_round_that_drafts_nothing_runs_plain_generate_s_step_and_nothing_of_the_draft(path, batch, monkeypatch):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(batch)
    P, new = ids.shape[1], 16
    options = path_options(path, P, new)
    plain_masks = AttentionMasks(monkeypatch)
    reference = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                return_dict_in_generate=True, **options)
    plain_masked = sorted(set(plain_masks.given[4:]))  # its steps after the prompt's (4 layers)
    spy = Spy(monkeypatch, draft)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                          assistant_model=draft, verification_policy=Paused(drafted=set(), length=0), **options)
    assert torch.equal(out, reference.sequences)
    assert len(spy.rounds) == new - 1  # the prefill's token, then one token a round
    for i, seen in enumerate(spy.rounds):
        assert seen["draft_modules"] == 0 and not seen["context_written"], (i, seen)
        assert seen["queries"] == [1], (i, seen)
        # plain generate()'s step reads its cache: eagerly the tokens so far (the prompt's slots, the new token's,
        # the tokens before it), compiled the static cache's whole length
        plain_width = P + i + 1 if path == "eager" else plain_cache(reference).layers[0].get_mask_sizes(1)[0]
        assert seen["width"] == [plain_width], (i, seen)
        assert seen["reads"] <= 1, (i, seen)
        if path == "eager":  # the rows end at one slot (left padding): writes are copies; a mask where plain's has one
            assert seen["copies"] == [True] and seen["masked"] == plain_masked == [batch > 1], (i, seen)


def test_fixed_length_zero_never_drafts_so_every_round_is_plain_generate_s_step(monkeypatch):
    """`FixedLength(0)` (`--policy 'fixed 0'` of the benchmarks): the one-token round without a policy's probes."""
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(3)
    new = 12
    reference = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
    spy = Spy(monkeypatch, draft)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                          assistant_model=draft, verification_policy=FixedLength(0))
    assert torch.equal(out, reference)
    assert len(spy.rounds) == new - 1
    assert all(seen["draft_modules"] == 0 and not seen["context_written"] and seen["queries"] == [1]
               for seen in spy.rounds), spy.rounds


def test_rows_that_have_finished_move_on_with_the_others_so_one_token_rounds_stay_plain_copies(monkeypatch):
    """Eagerly, in rounds of one token, a row that has met its EOS keeps moving along with the others (as plain
    generate()'s cache goes on taking its padding), so that the rows still end at one slot and write plain copies."""
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(3)
    new = 16
    free = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new)[:, ids.shape[1]:]
    eos = next(t for t in free[0, 2:].tolist() if t not in free[1:].flatten().tolist())  # row 0 alone ends early
    reference = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                eos_token_id=eos)
    spy = Spy(monkeypatch, draft)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                          assistant_model=draft, verification_policy=Paused(drafted=set(), length=0))
    assert torch.equal(out, reference)
    assert (out[0, ids.shape[1]:] == eos).nonzero()[0, 0] < new - 3, "row 0 finished with rounds to go"
    assert len(spy.rounds) == new - 1 and all(seen["copies"] == [True] for seen in spy.rounds), spy.rounds


@pytest.mark.parametrize("path", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_a_block_drafted_after_a_pause_is_the_block_drafted_without_one(path):
    """Rows that accept different amounts (their ends apart), then a pause of several rounds, then blocks again: the
    drafts after the pause read the context the paused rounds left to project, as drafts do after rounds that
    projected their own."""
    target = tiny_target("llama", vocab=6)  # a random draft then accepts often enough for the rows to part
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(3, vocab=6)
    new = 24
    options = path_options(path, ids.shape[1], new)
    drafted = {0, 1, 2, 8, 9, 10, 11}  # blocks 3-7 paused

    def decode(policy):
        return target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                               assistant_model=draft, verification_policy=policy, return_dict_in_generate=True,
                               **options)

    paused = decode(Paused(drafted, length=2))
    projected = decode(Paused(drafted, length=2, verify_instead=True))
    assert torch.equal(paused.sequences, projected.sequences)
    compared = 0
    for rows_paused, rows_projected in zip(paused.rounds, projected.rounds):
        assert len(rows_paused) == len(rows_projected)
        for i, (a, b) in enumerate(zip(rows_paused, rows_projected)):
            assert a.committed == b.committed, i
            if a.drafted and i >= 8:  # drafted after the pause
                assert a.drafted == b.drafted, i
                assert a.draft_probs == pytest.approx(b.draft_probs, abs=1e-5), i
                compared += 1
    assert compared >= 3
    assert any(len({r.accepted for r in rows[:3]}) > 1 for rows in zip(*paused.rounds)), "rows accepted apart"


def test_the_round_that_verifies_the_last_block_before_a_pause_projects_its_features_as_drafting_rounds_do(monkeypatch):
    """Compiled, a verification graph is keyed on its width and on whether it projects the target's features into
    the draft's context: one-token rounds do not (plain generate()'s step), wider ones do, and those are the graphs
    the default policy's pricing builds before a call times anything. The round that verifies the last block before
    a pause is wide: it projects as drafting rounds do, so that a pause starting after a block of any width compiles
    nothing new in the middle of a call."""
    from dspark_hf.generation.steps import Steps

    seen, real_verify = set(), Steps.verify

    def verify(self, state, tokens, encode=True):
        seen.add((tokens.shape[1], encode))
        return real_verify(self, state, tokens, encode)

    monkeypatch.setattr(Steps, "verify", verify)
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(2)
    for length in (1, 2, 3):  # blocks 3-5 paused after blocks verifying 1, 2 or 3 drafted tokens
        out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                              assistant_model=draft, verification_policy=Paused({0, 1, 2, 6, 7, 8}, length))
        assert torch.equal(out, target.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                                max_new_tokens=16))
    assert (1, False) in seen and {w for w, encode in seen if w > 1} == {2, 3, 4}, seen
    assert all(encode for w, encode in seen if w > 1), seen
