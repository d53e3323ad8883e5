"""DSpark's drafting step is a transformers `CandidateGenerator` (`DSparkCandidateGenerator`): DSpark's loop drafts
through it and nothing else, it keeps transformers' contract (`get_candidates`, `update_candidate_strategy`, the
target's hidden states through `requires_model_outputs`), and transformers' own assisted loop runs it."""

import pytest
import torch
from transformers.generation.candidate_generator import CandidateGenerator

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import DSparkCandidateGenerator, FullBlock
from dspark_hf.evaluation import OracleDraft
from dspark_hf.generation.block_sources import Drafter
from dspark_hf.internals import original_generate
from dspark_hf.model.sampling import sample_block
from dspark_hf.scheduling.policies import as_policy


def test_the_loop_drafts_every_block_through_a_transformers_candidate_generator(monkeypatch):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(3)
    generators, through, real_propose, real_draft = [], [], DSparkCandidateGenerator.propose, Drafter.propose

    def propose(self, *args, **kwargs):
        generators.append(self)
        through.append(True)
        try:
            return real_propose(self, *args, **kwargs)
        finally:
            through.pop()

    def drafted(self, *args, **kwargs):
        assert through, "a block was drafted outside the candidate generator"
        return real_draft(self, *args, **kwargs)

    monkeypatch.setattr(DSparkCandidateGenerator, "propose", propose)
    monkeypatch.setattr(Drafter, "propose", drafted)
    plain = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                          assistant_model=draft, verification_policy=FullBlock())
    assert torch.equal(out, plain)
    assert generators and all(isinstance(g, CandidateGenerator) for g in generators)


def test_get_candidates_gives_each_row_of_a_batch_its_block_trimmed_by_the_policy():
    """Rows verify what the policy plans for each (here 1, 3 and 0 tokens): the candidates are the prompt and the
    block up to the longest, `verify_lengths` says each row's own; the draft reads the target's hidden states of
    the prompt from the target's forward, as transformers' loop hands them over."""
    target = tiny_target("llama")
    draft = tiny_draft(target).bind_target(target)
    prompt = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(0))
    per_row = as_policy(lambda confidences, gamma, rows: torch.tensor([1, 3, 0]))
    generator = DSparkCandidateGenerator(draft, Drafter(draft, do_sample=False), per_row)
    with torch.no_grad():
        out = target(input_ids=prompt, **generator.model_kwargs_overrides)
        ids = torch.cat([prompt, out.logits[:, -1].argmax(-1, keepdim=True)], 1)  # the target's own next token
        first = generator.get_candidates(ids, is_first_iteration=True)  # nothing to draft from before the prefill
        assert first[0] is ids and first[1] is None
        candidates, logits = generator.get_candidates(ids, model_outputs=out, n_last_matches=0)
        positions = torch.arange(6).expand(3, -1)
        context = draft.encode_context(draft.target_features(out.hidden_states), positions,
                                       torch.ones_like(positions, dtype=torch.bool))
    assert generator.verify_lengths == [1, 3, 0]
    block = sample_block(draft, ids[:, -1], torch.full((3,), 6), context)
    assert torch.equal(candidates[:, :7], ids) and torch.equal(candidates[:, 7:], block.tokens[:, :3])
    assert torch.allclose(logits.softmax(-1), block.probs[:, :3])  # transformers softmaxes the logits it is given


def test_get_candidates_without_the_target_s_hidden_states_says_how_to_get_them():
    target = tiny_target("llama")
    draft = tiny_draft(target).bind_target(target)
    generator = DSparkCandidateGenerator(draft, Drafter(draft, do_sample=False), FullBlock())
    with pytest.raises(ValueError, match="needs model_outputs with the target's hidden states: run the target's "
                                         "forward with model_kwargs_overrides"):
        generator.get_candidates(torch.ones(1, 4, dtype=torch.long), model_outputs=None)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_transformers_own_assisted_loop_runs_the_generator_and_gets_plain_generate_s_tokens(family, monkeypatch):
    """transformers has no hook for a candidate generator: `_get_candidate_generator` is patched to build this one,
    and transformers' `_assisted_decoding` (not DSpark's loop: `import dspark_hf`'s route is bypassed) runs it at
    batch 1, greedy. An oracle draft that corrupts a fifth of its tokens makes rounds accept some of a block and
    reject the rest."""
    target = tiny_target(family)
    ids = torch.randint(3, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = target.generate(input_ids=ids, do_sample=False, max_new_tokens=24)
    draft = OracleDraft.from_draft(tiny_draft(target)).set_references(target, reference, torch.ones_like(ids),
                                                                      corruption=0.2)
    made, matches = [], []

    def candidate_generator(self, generation_config, input_ids, inputs_tensor, assistant_model, logits_processor,
                            *args, **kwargs):
        assert assistant_model is draft
        made.append(DSparkCandidateGenerator.assisting(self, assistant_model, generation_config, logits_processor))
        return made[-1]

    real_update = DSparkCandidateGenerator.update_candidate_strategy

    def update(self, input_ids, scores, num_matches):
        matches.append(int(num_matches))
        return real_update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(type(target), "_get_candidate_generator", candidate_generator)
    monkeypatch.setattr(DSparkCandidateGenerator, "update_candidate_strategy", update)
    out = original_generate(target, input_ids=ids, do_sample=False, max_new_tokens=24, assistant_model=draft)
    assert len(made) == 1 and torch.equal(out, reference)
    assert sum(matches) > 0 and len(matches) < 24, "rounds accepted drafted tokens"
    assert any(0 < m < draft.config.block_size for m in matches), "and some rejected the rest of a block"
