"""Five bad inputs whose messages named the wrong problem: each now gets one line that says what is wrong and how to
fix it."""

import json

import pytest
from transformers import AutoModelForCausalLM

from conftest import cli_error, left_padded_prompts, tiny_draft, tiny_target


def test_a_folder_without_config_json_is_said_to_hold_no_saved_draft(tmp_path):
    """transformers built a default DSparkConfig and failed on its missing target fields."""
    tiny_draft(tiny_target("llama")).save_pretrained(tmp_path / "draft")
    (tmp_path / "draft" / "config.json").unlink()
    from dspark_hf import DSparkDraftModel

    with pytest.raises(OSError, match=r"draft holds no config.json, so it is not a saved DSpark draft: give the folder "
                                      r"save_pretrained wrote .* or build a new draft with .*from_target"):
        DSparkDraftModel.from_pretrained(tmp_path / "draft")


@pytest.mark.parametrize("block_size, says", [(100, "block_size is 100 but confidence_temperatures has 4 entries"),
                                              (0, "block_size must be an int >= 1, got 0")])
def test_a_block_size_assigned_after_loading_is_checked_where_the_call_starts(block_size, says):
    """The check from_pretrained(dir, block_size=...) makes; before, a raw shape RuntimeError or an IndexError came
    from inside the draft."""
    target = tiny_target("llama")
    draft = tiny_draft(target, confidence_temperatures=[1.0, 1.5, 2.0, 1.0])
    ids, mask = left_padded_prompts(2)
    draft.config.block_size = block_size
    with pytest.raises(ValueError, match=f"The draft's config was changed into one from_pretrained would refuse: "
                                         f"{says}") as raised:
        target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, assistant_model=draft)
    assert "\n" not in str(raised.value)


def test_float_input_ids_are_refused_as_plain_generate_refuses_them():
    """They were truncated to integers and decoded: other tokens than the caller's, without a word."""
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, mask = left_padded_prompts(2)
    with pytest.raises(Exception):  # plain generate() fails in the embedding lookup
        target.generate(input_ids=ids.float(), attention_mask=mask, max_new_tokens=4)
    for bad in (ids.float() + 0.7, ids.bool()):
        with pytest.raises(ValueError, match=r"input_ids are (float32|bool), but token ids are integers: pass the ids "
                                             r"the tokenizer returned"):
            target.generate(input_ids=bad, attention_mask=mask, max_new_tokens=4, assistant_model=draft)


def test_a_dataset_that_is_a_folder_is_named_as_one_with_the_files_in_it(tmp_path, capsys):
    """It said "no such file" of a folder that exists."""
    tiny_target("llama").save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    (data / "answers.jsonl").write_text("")
    line = cli_error(capsys, ["train", "--target", str(tmp_path / "target"), "--dataset", str(data),
                              "--output-dir", str(tmp_path / "out")])
    assert f"{data} is a folder: give one JSONL file in it (answers.jsonl)" in line
    (data / "answers.jsonl").unlink()
    line = cli_error(capsys, ["train", "--target", str(tmp_path / "target"), "--dataset", str(data),
                              "--output-dir", str(tmp_path / "out")])
    assert "it holds no .jsonl file (`dspark prepare-data --output FILE.jsonl` writes one)" in line


def test_export_of_a_folder_that_holds_no_draft_says_so_before_asking_for_the_base_model(tmp_path, capsys):
    """It asked for --base-model, then passed on transformers' "no file named model.safetensors"."""
    (tmp_path / "not_a_draft").mkdir()
    (tmp_path / "not_a_draft" / "notes.txt").write_text("hello")
    line = cli_error(capsys, ["export", str(tmp_path / "not_a_draft"), "--output", str(tmp_path / "x")])
    assert "not_a_draft holds no config.json, so it is not a saved DSpark draft" in line
    assert "--base-model" not in line


def test_a_draft_loaded_as_a_causal_lm_says_how_it_loads_and_runs(tmp_path):
    """transformers listed every causal-LM config class it knows (3 kB), with no hint."""
    tiny_draft(tiny_target("llama")).save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match=r"draft is a DSpark draft, not a causal LM: .* Load it with "
                                         r"AutoModel.from_pretrained .* assistant_model=draft") as raised:
        AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    assert len(str(raised.value)) < 400
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    from dspark_hf import DSparkConfig

    with pytest.raises(ValueError, match="describes a draft, not a causal LM: build one with DSparkDraftModel"):
        AutoModelForCausalLM.from_config(DSparkConfig(**{k: v for k, v in config.items()
                                                         if k not in ("architectures", "auto_map", "model_type",
                                                                      "transformers_version", "dtype")}))

