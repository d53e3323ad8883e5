"""DSpark's drafting step is a transformers `CandidateGenerator` (`DSparkCandidateGenerator`): the loop drafts through
it and nothing else, and its `get_candidates` gives each row of a batch its block trimmed by the policy."""

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from conftest import left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import DSparkCandidateGenerator, FullBlock
from dspark_hf.generation.drafting import Drafter
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
    block up to the longest, `verify_lengths` says each row's own."""
    target = tiny_target("llama")
    draft = tiny_draft(target).bind_target(target)
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=draft.hidden_states_request)
        positions = torch.arange(6).expand(3, -1)
        context = draft.encode_context(draft.target_features(out.hidden_states), positions,
                                       torch.ones_like(positions, dtype=torch.bool))
    anchor, at = out.logits[:, -1].argmax(-1), torch.full((3,), 6)
    per_row = as_policy(lambda confidences, gamma, rows: torch.tensor([1, 3, 0]))
    generator = DSparkCandidateGenerator(draft, Drafter(draft, do_sample=False), per_row)
    candidates, probs = generator.get_candidates(ids, anchor=anchor, anchor_positions=at, context=context)
    assert generator.verify_lengths == [1, 3, 0]
    block = sample_block(draft, anchor, at, context)
    assert torch.equal(candidates[:, :6], ids) and torch.equal(candidates[:, 6:], block.tokens[:, :3])
    assert probs.shape == (3, 3, block.probs.shape[-1])
