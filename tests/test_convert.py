"""Converting public DSpark / DFlash checkpoint layouts (DeepSpec, SpecForge, z-lab DFlash) into DSparkDraftModel.

Each synthetic checkpoint is one of our tiny drafts written back in a public layout: its key names and config.json
fields as the public code writes them (see dspark_hf/model/convert.py for where each was read), plus the copies of
the target's embedding and LM head that DeepSpec stores. Converting it must give back the same weights and the same
drafts, and generation with it must stay identical to plain generate().
"""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from conftest import cli_error, cut_in_half, left_padded_prompts, tiny_draft, tiny_target
from dspark_hf import DSparkDraftModel, FullBlock
from dspark_hf.model.convert import convert_checkpoint
from dspark_hf.generation.block_sources import sample_block

# our parameter prefix -> the public one (DeepSpec and SpecForge share these names; DFlash has only the backbone)
PUBLIC_NAMES = {"context_norm.": "hidden_norm.", "w1.": "markov_head.markov_w1.", "w2.": "markov_head.markov_w2.",
                "rnn_proj.": "markov_head.joint_proj.", "confidence.": "confidence_head.proj."}


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")  # Qwen3: per-head q/k norms, like every public layout's backbone


def public_state_dict(draft, target=None, dtype=None) -> dict[str, torch.Tensor]:
    """The draft's weights under the public names; with `target`, DeepSpec's copies of its embedding and LM head."""
    out = {}
    for key, value in draft.state_dict().items():
        prefix = next((p for p in PUBLIC_NAMES if key.startswith(p)), None)
        out[PUBLIC_NAMES[prefix] + key[len(prefix):] if prefix else key] = value
    if target is not None:
        out["embed_tokens.weight"] = target.get_input_embeddings().weight
        out["lm_head.weight"] = target.get_output_embeddings().weight
    return {k: v.detach().to(dtype or v.dtype).clone().contiguous() for k, v in out.items()}


def qwen3_fields(draft) -> dict:
    """The Qwen3 config fields a SpecForge / z-lab draft config.json carries (as in SpecForge's configs/*.json)."""
    c = draft.config
    return dict(model_type="qwen3", hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
                rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                attention_bias=False, attention_dropout=0.0, vocab_size=c.target_vocab_size,
                num_target_layers=c.target_num_hidden_layers, layer_types=["full_attention"] * c.num_hidden_layers,
                use_sliding_window=False, sliding_window=None, tie_word_embeddings=False, dtype="float32")


def deepspec_config(draft, target) -> dict:
    """DeepSpec's build_draft_config: a copy of the target's config with the draft's fields set on it."""
    c = draft.config
    raw = target.config.to_dict()
    raw.update(architectures=["Qwen3DSparkModel"], num_target_layers=raw["num_hidden_layers"],
               num_hidden_layers=c.num_hidden_layers, block_size=c.block_size, tie_word_embeddings=False,
               layer_types=["full_attention"] * c.num_hidden_layers, mask_token_id=c.mask_token_id,
               target_layer_ids=c.target_layer_ids, num_anchors=512, enable_confidence_head=c.confidence_head,
               markov_rank=c.markov_rank if c.head_type != "none" else 0)
    if c.confidence_head:
        raw["confidence_head_with_markov"] = c.head_type != "none"
    if c.head_type != "none":
        raw["markov_head_type"] = {"markov": "vanilla", "rnn": "rnn"}[c.head_type]
    return raw


def specforge_config(draft) -> dict:
    c = draft.config
    return dict(qwen3_fields(draft), architectures=["DSparkDraftModel"], block_size=c.block_size,
                rope_theta=c.rope_theta, rope_scaling=None,  # transformers-4 style, as in SpecForge's configs
                auto_map={"AutoModel": "dspark.DSparkDraftModel"},
                dflash_config=dict(attention_mode="gqa", confidence_head_alpha=1.0, confidence_head_with_markov=True,
                                   enable_confidence_head=True, markov_head_type="vanilla", markov_rank=c.markov_rank,
                                   mask_token_id=c.mask_token_id, projector_type="dspark",
                                   target_layer_ids=c.target_layer_ids))


def dflash_config(draft) -> dict:
    c = draft.config
    return dict(qwen3_fields(draft), architectures=["DFlashDraftModel"], block_size=c.block_size + 1,
                rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
                auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                dflash_config=dict(mask_token_id=c.mask_token_id, target_layer_ids=c.target_layer_ids))


def write_checkpoint(folder, config: dict, tensors: dict, shards: int = 1):
    """config.json + model.safetensors, or `shards` files with a model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, folder / "model.safetensors")
        return folder
    keys, weight_map = sorted(tensors), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: tensors[k] for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ---------------------------------------------------------------------------------------------------------------
def assert_same_weights(converted, original):
    mine, theirs = converted.state_dict(), original.state_dict()
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert mine[key].dtype == theirs[key].dtype and torch.equal(mine[key], theirs[key]), key


def assert_drafts_like(converted, original, target):
    """Same blocks, distributions and confidences from the same context, greedy and sampled."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, original.config.target_vocab_size, (2, 10), generator=g)
    hidden = target(ids[:, :9], output_hidden_states=original.hidden_states_request).hidden_states
    positions = torch.arange(9).expand(2, -1)
    for do_sample in (False, True):
        blocks = []
        for draft in (original, converted):
            context = draft.encode_context(draft.target_features(hidden), positions, torch.ones_like(positions) > 0)
            gen = torch.Generator().manual_seed(1)
            blocks.append(sample_block(draft, ids[:, 9], torch.full((2,), 9), context, do_sample, generator=gen))
        assert blocks[0].tokens.shape == (2, original.config.block_size)
        assert torch.equal(blocks[0].tokens, blocks[1].tokens)
        assert torch.equal(blocks[0].probs, blocks[1].probs)
        assert (blocks[0].confidences is None) == (blocks[1].confidences is None)
        if blocks[0].confidences is not None:
            assert torch.equal(blocks[0].confidences, blocks[1].confidences)


def assert_generates_losslessly(converted, original, target):
    """generate() with the converted draft equals plain generate(), round by round as with the original draft (with
    the full block: the default policy's rounds follow costs measured per draft shape, which differ by noise)."""
    ids, mask = left_padded_prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    plain = target.generate(**kwargs)
    assert torch.equal(target.generate(**kwargs, assistant_model=converted), plain)
    runs = [target.generate(**kwargs, assistant_model=d, verification_policy=FullBlock(), return_dict_in_generate=True)
            for d in (original, converted)]
    assert torch.equal(runs[1].sequences, plain)
    assert [[r.drafted for r in row] for row in runs[1].rounds] == [[r.drafted for r in row] for row in runs[0].rounds]


def check_conversion(src, dst, source, original, target):
    converted = convert_checkpoint(src, dst, source, target=target)
    assert_same_weights(converted, original)
    assert_drafts_like(converted, original, target)
    assert_generates_losslessly(converted, original, target)
    reloaded = DSparkDraftModel.from_pretrained(dst).bind_target(target)
    assert_same_weights(reloaded, original)
    assert reloaded.config.block_size == original.config.block_size
    assert reloaded.config.anchor_predicts == original.config.anchor_predicts
    return converted


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_type", ["markov", "rnn", "none"])
def test_deepspec_checkpoint_converts_to_the_same_draft(tmp_path, target, head_type):
    # head_type "none" is DeepSpec's DFlash baseline: markov_rank 0, no confidence head, same model class
    original = tiny_draft(target, head_type=head_type, confidence_head=head_type != "none")
    src = write_checkpoint(tmp_path / "src", deepspec_config(original, target), public_state_dict(original, target))
    check_conversion(src, tmp_path / "dst", "deepspec", original, target)
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert saved["model_type"] == "dspark" and saved["target_model_type"] == "qwen3"


def test_specforge_sharded_checkpoint_converts_to_the_same_draft(tmp_path, target):
    original = tiny_draft(target, head_type="markov", confidence_head=True)
    src = write_checkpoint(tmp_path / "src", specforge_config(original), public_state_dict(original), shards=3)
    check_conversion(src, tmp_path / "dst", "specforge", original, target)


def test_early_specforge_checkpoints_with_heads_under_logit_head_convert_the_same(tmp_path, target):
    original = tiny_draft(target, head_type="markov", confidence_head=True)
    tensors = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
               for k, v in public_state_dict(original).items()}
    src = write_checkpoint(tmp_path / "src", specforge_config(original), tensors)
    assert_same_weights(convert_checkpoint(src, tmp_path / "dst", "specforge", target=target), original)


@pytest.mark.parametrize("model_type", ["qwen3", "dspark"])
def test_checkpoints_of_specforge_s_first_dspark_trainer_with_head_settings_at_the_top_level_convert_the_same(
        tmp_path, target, model_type):
    # commit 9facb330: a Qwen3Config carrying the head settings at the top level (DSparkConfig, model_type "dspark",
    # when saved through that class), mask_token_id and target_layer_ids alone in dflash_config
    from dspark_hf.model.convert import check_conversion_folder

    original = tiny_draft(target, head_type="markov", confidence_head=True)
    config = specforge_config(original)
    c = config["dflash_config"]
    config["dflash_config"] = dict(mask_token_id=c["mask_token_id"], target_layer_ids=c["target_layer_ids"])
    config.update(model_type=model_type, markov_rank=c["markov_rank"], markov_head_type="vanilla",
                  enable_confidence_head=True, confidence_head_with_markov=True)
    src = write_checkpoint(tmp_path / "src", config, public_state_dict(original))
    check_conversion(src, tmp_path / "dst", "specforge", original, target)
    with pytest.raises(ValueError, match="not an earlier conversion"):  # not taken for a dspark-hf draft
        check_conversion_folder(tmp_path / "dst", src)


def test_a_dspark_hf_draft_is_not_converted_but_loaded(tmp_path, target):
    tiny_draft(target).save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="is a dspark-hf draft already: load it with DSparkDraftModel.from_pretrained"):
        convert_checkpoint(tmp_path / "draft", tmp_path / "dst", "specforge", target=target)


def test_dflash_checkpoint_becomes_a_headless_draft_reading_the_mask_rows(tmp_path, target):
    original = tiny_draft(target, head_type="none", confidence_head=False, anchor_predicts=False, block_size=4)
    src = write_checkpoint(tmp_path / "src", dflash_config(original), public_state_dict(original))
    converted = check_conversion(src, tmp_path / "dst", "dflash", original, target)
    # a DFlash block of 5 rows drafts 4 tokens
    assert (converted.config.block_size, converted.config.head_type, converted.w1, converted.confidence) == \
        (4, "none", None, None)


def test_without_anchor_prediction_the_block_is_the_mask_rows_of_a_block_one_longer(target):
    # the DFlash reading: feed [x_0, m * gamma] and draft from rows 1..gamma, the anchor row's output unused
    dflash = tiny_draft(target, head_type="none", confidence_head=False, anchor_predicts=False, block_size=4)
    longer = tiny_draft(target, head_type="none", confidence_head=False, block_size=5)
    longer.load_state_dict(dflash.state_dict())
    ids = torch.randint(1, 96, (2, 9))
    hidden = target(ids, output_hidden_states=dflash.hidden_states_request).hidden_states
    positions = torch.arange(9).expand(2, -1)
    context = dflash.encode_context(dflash.target_features(hidden), positions, torch.ones_like(positions) > 0)
    anchors, anchor_positions = torch.tensor([[5, 7], [1, 2]]), torch.tensor([[4, 8], [6, 9]])
    h = dflash.backbone(anchors, anchor_positions, context)
    assert h.shape == (2, 2, 4, 32)
    assert torch.equal(h, longer.backbone(anchors, anchor_positions, context)[:, :, 1:])


def test_weights_keep_the_checkpoint_dtype(tmp_path, target):
    original = tiny_draft(target, head_type="markov")
    tensors = public_state_dict(original, target, dtype=torch.bfloat16)
    src = write_checkpoint(tmp_path / "src", deepspec_config(original, target), tensors)
    converted = convert_checkpoint(src, tmp_path / "dst", "deepspec", target=target)
    assert converted.fc.weight.dtype == torch.bfloat16
    assert torch.equal(converted.fc.weight, tensors["fc.weight"])
    assert DSparkDraftModel.from_pretrained(tmp_path / "dst").fc.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
def test_unknown_missing_and_misshaped_keys_are_all_reported_by_name(tmp_path, target):
    original = tiny_draft(target, head_type="markov")
    tensors = public_state_dict(original, target)
    tensors["layers.0.self_attn.sinks"] = torch.zeros(4)
    del tensors["layers.1.mlp.up_proj.weight"]
    tensors["fc.weight"] = torch.zeros(32, 64)
    src = write_checkpoint(tmp_path / "src", deepspec_config(original, target), tensors)
    with pytest.raises(ValueError) as error:
        convert_checkpoint(src, tmp_path / "dst", "deepspec", target=target)
    message = str(error.value)
    assert "unknown keys: layers.0.self_attn.sinks" in message
    assert "missing keys: layers.1.mlp.up_proj.weight" in message
    assert "fc.weight (32, 64) -> fc.weight (32, 32)" in message
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda src: cut_in_half(src / "model.safetensors"), r"model\.safetensors are damaged or cut short.*download them "
                                                         r"again"),
    (lambda src: cut_in_half(src / "config.json"), r"config\.json does not read as JSON .*download the checkpoint "
                                                   r"again"),
    (lambda src: (src / "config.json").unlink(), r"src: no config\.json in it: give the folder of the checkpoint"),
    (lambda src: shutil.rmtree(src), r"src: no such folder: give the folder of the checkpoint"),
], ids=["weights cut short", "config cut short", "no config", "no folder"])
def test_a_source_checkpoint_missing_or_damaged_is_refused_in_one_line(tmp_path, target, capsys, damage, message):
    original = tiny_draft(target, head_type="markov")
    src = write_checkpoint(tmp_path / "src", deepspec_config(original, target), public_state_dict(original, target))
    damage(src)
    with pytest.raises((OSError, ValueError), match=message):
        convert_checkpoint(src, tmp_path / "dst", "deepspec", target=target)
    assert re.search(message, cli_error(capsys, ["convert", "--from", "deepspec", str(src), str(tmp_path / "dst")]))
    assert not (tmp_path / "dst").exists()


def test_head_weights_under_an_unexpected_layout_are_unknown_keys(tmp_path, target):
    # a DSpark checkpoint's Markov head read as DFlash (head-less): its head keys cannot be silently dropped
    original = tiny_draft(target, head_type="markov", confidence_head=False, anchor_predicts=False)
    src = write_checkpoint(tmp_path / "src", dflash_config(original), public_state_dict(original))
    with pytest.raises(ValueError, match=r"unknown keys: markov_head.markov_w1.weight, markov_head.markov_w2.weight"):
        convert_checkpoint(src, tmp_path / "dst", "dflash", target=target)


def test_a_target_copy_that_differs_from_the_target_raises(tmp_path, target):
    original = tiny_draft(target, head_type="markov")
    tensors = public_state_dict(original, target)
    tensors["embed_tokens.weight"][3, 0] += 1.0
    src = write_checkpoint(tmp_path / "src", deepspec_config(original, target), tensors)
    with pytest.raises(ValueError, match="embed_tokens.weight .* differs from the target's"):
        convert_checkpoint(src, tmp_path / "dst", "deepspec", target=target)


def test_target_copies_without_a_target_ask_for_one(tmp_path, target):
    original = tiny_draft(target, head_type="markov")
    src = write_checkpoint(tmp_path / "src", deepspec_config(original, target), public_state_dict(original, target))
    with pytest.raises(ValueError, match=r"embed_tokens.weight', 'lm_head.weight'.*--target"):
        convert_checkpoint(src, tmp_path / "dst", "deepspec")


def test_without_target_copies_no_target_is_needed(tmp_path, target):
    original = tiny_draft(target, head_type="markov", confidence_head=True)
    src = write_checkpoint(tmp_path / "src", specforge_config(original), public_state_dict(original))
    converted = convert_checkpoint(src, tmp_path / "dst", "specforge")
    assert_same_weights(converted, original)
    assert_drafts_like(converted.bind_target(target), original, target)


@pytest.mark.parametrize("change, message", [
    (dict(markov_head_type="gated"), "markov_head_type='gated'"),
    (dict(confidence_head_with_markov=False), "confidence_head_with_markov=False"),
    (dict(target_layer_ids=[-1, 1]), "embedding output"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "RoPE"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8), r"Draft layers \[0\]"),
    (dict(architectures=["Gemma4DSparkModel"], model_type="gemma4_text"), "Gemma4DSparkModel"),
    (dict(architectures=["DFlashDraftModel"]), "use --from dflash"),
])
def test_semantics_we_cannot_reproduce_are_refused_by_name(tmp_path, target, change, message):
    original = tiny_draft(target, head_type="markov", confidence_head=True)
    config = dict(deepspec_config(original, target), **change)
    src = write_checkpoint(tmp_path / "src", config, public_state_dict(original, target))
    with pytest.raises(NotImplementedError, match=message):
        convert_checkpoint(src, tmp_path / "dst", "deepspec", target=target)


def test_dflash_sliding_window_drafts_are_refused(tmp_path, target):
    # z-lab's newer drafts enable sliding windows without listing layer_types (Qwen3Config derives them)
    original = tiny_draft(target, head_type="none", confidence_head=False, anchor_predicts=False)
    config = dflash_config(original)
    del config["layer_types"]
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    src = write_checkpoint(tmp_path / "src", config, public_state_dict(original))
    with pytest.raises(NotImplementedError, match="sliding-window"):
        convert_checkpoint(src, tmp_path / "dst", "dflash", target=target)


def test_dspark_convert_cli_checks_against_the_target_and_writes_a_loadable_draft(tmp_path, target, capsys):
    from dspark_hf.cli import main

    original = tiny_draft(target)
    target.save_pretrained(tmp_path / "target")
    write_checkpoint(tmp_path / "src", deepspec_config(original, target), public_state_dict(original, target))
    assert main(["convert", "--from", "deepspec", str(tmp_path / "src"), str(tmp_path / "dst"),
                 "--target", str(tmp_path / "target")]) == 0
    assert "head markov, block 4" in capsys.readouterr().out
    assert_same_weights(DSparkDraftModel.from_pretrained(tmp_path / "dst"), original)


@pytest.mark.parametrize("head_type", ["markov", "rnn", "none"])
def test_a_draft_exported_in_deepspec_layout_converts_back_to_the_same_draft(tmp_path, target, head_type):
    from dspark_hf.model.convert import export_deepspec

    original = tiny_draft(target, head_type=head_type, confidence_head=head_type != "none")
    export_deepspec(original, target, tmp_path / "deepspec")
    assert json.loads((tmp_path / "deepspec" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    check_conversion(tmp_path / "deepspec", tmp_path / "back", "deepspec", original, target)


def test_dspark_export_deepspec_from_the_cli_and_what_deepspec_cannot_express(tmp_path, target, capsys):
    from conftest import cli_error
    from dspark_hf.cli import main

    original = tiny_draft(target)
    target.save_pretrained(tmp_path / "target")
    original.save_pretrained(tmp_path / "draft")
    assert main(["export", str(tmp_path / "draft"), "--format", "deepspec", "--target", str(tmp_path / "target"),
                 "--dtype", "float32", "--output", str(tmp_path / "deepspec")]) == 0
    back = convert_checkpoint(tmp_path / "deepspec", tmp_path / "back", "deepspec", target=target)
    assert_same_weights(back, original)

    llama = tiny_target("llama")  # a Llama target's new draft norms q and k per head, as the engines' layers do
    llama.save_pretrained(tmp_path / "llama")
    tiny_draft(llama).save_pretrained(tmp_path / "llama-draft")
    assert main(["export", str(tmp_path / "llama-draft"), "--format", "deepspec", "--target", str(tmp_path / "llama"),
                 "--output", str(tmp_path / "llama-deepspec")]) == 0
    tiny_draft(llama, qk_norm=False).save_pretrained(tmp_path / "unnormed")  # as drafts were made before 2026-11-28
    error = cli_error(capsys, ["export", str(tmp_path / "unnormed"), "--format", "deepspec", "--target",
                               str(tmp_path / "llama"), "--output", str(tmp_path / "no")])
    assert "cannot be written in DeepSpec's layout" in error and "qk_norm=False" in error


def test_a_deepspec_export_carries_what_deepspec_s_constructor_requires_and_marks_itself_ours(tmp_path, target):
    from dspark_hf.model.convert import export_deepspec

    export_deepspec(tiny_draft(target), target, tmp_path / "deepspec")
    config = json.loads((tmp_path / "deepspec" / "config.json").read_text())
    assert config["num_anchors"] == 512 and "dspark_hf_export" in config


def test_a_deepspec_export_records_the_dtype_of_its_tensors_not_the_target_s(tmp_path):
    from safetensors import safe_open

    from dspark_hf.model.convert import export_deepspec

    target = tiny_target("qwen3")
    target.config.dtype = torch.float32  # as `dspark export --format deepspec` loads it
    export_deepspec(tiny_draft(target).to(torch.bfloat16), target, tmp_path / "deepspec")
    config = json.loads((tmp_path / "deepspec" / "config.json").read_text())
    with safe_open(tmp_path / "deepspec" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert config["dtype"] == "bfloat16" and config.get("torch_dtype", "bfloat16") == "bfloat16"


def test_what_deepspec_cannot_express_includes_a_scaled_embedding_and_not_calibration(target):
    from dspark_hf.model.convert import deepspec_blockers

    calibrated = tiny_draft(target)  # exported with its raw confidences: engines drop the temperatures, and say so
    calibrated.set_confidence_temperatures([1.5] * calibrated.config.block_size)
    assert deepspec_blockers(calibrated, target) == []
    gemma = tiny_target("gemma3")  # embeddings scaled by sqrt(hidden size), where DeepSpec's are plain
    gemma.config.final_logit_softcapping = None
    (why,) = deepspec_blockers(tiny_draft(gemma, qk_norm=True), gemma)
    assert "Gemma3TextScaledWordEmbedding" in why
    assert deepspec_blockers(tiny_draft(target), target) == []


def test_a_checkpoint_mixing_dtypes_converts_to_float32_holding_every_value(tmp_path, target):
    original = tiny_draft(target)
    tensors = {k: v.to(torch.bfloat16) if k.startswith("layers.") else v
               for k, v in public_state_dict(original).items()}
    src = write_checkpoint(tmp_path / "src", specforge_config(original), tensors)
    converted = convert_checkpoint(src, tmp_path / "dst", "specforge", target=target)
    assert {p.dtype for p in converted.parameters()} == {torch.float32}
    layer = next(k for k in tensors if k.startswith("layers."))
    assert torch.equal(converted.state_dict()[layer], tensors[layer].float())
    ids = torch.tensor([[5, 9, 3]])
    assert torch.equal(target.generate(input_ids=ids, max_new_tokens=6, do_sample=False, assistant_model=converted),
                       target.generate(input_ids=ids, max_new_tokens=6, do_sample=False))


def test_convert_and_export_write_only_into_new_folders_or_their_own_earlier_output(tmp_path, target, capsys):
    from conftest import cli_error
    from dspark_hf.cli import main

    original = tiny_draft(target)
    target.save_pretrained(tmp_path / "target")
    original.save_pretrained(tmp_path / "draft")
    src = write_checkpoint(tmp_path / "src", specforge_config(original), public_state_dict(original), shards=2)
    convert = ["convert", "--from", "specforge", str(src)]
    assert "is the checkpoint being converted" in cli_error(capsys, convert + [str(src)])
    assert "not an earlier conversion" in cli_error(capsys, convert + [str(tmp_path / "target")])
    assert main(convert + [str(tmp_path / "converted")]) == 0
    assert main(convert + [str(tmp_path / "converted")]) == 0  # its own earlier output may be replaced

    export = ["export", str(tmp_path / "draft"), "--format", "deepspec", "--target", str(tmp_path / "target"),
              "--dtype", "float32", "--output"]
    downloaded = write_checkpoint(tmp_path / "downloaded", deepspec_config(original, target),
                                  public_state_dict(original, target), shards=2)  # a public DeepSpec checkpoint
    assert "not an earlier DeepSpec export" in cli_error(capsys, export + [str(downloaded)])
    assert main(export + [str(tmp_path / "deepspec")]) == 0
    (tmp_path / "deepspec" / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # as if sharded before
    assert main(export + [str(tmp_path / "deepspec")]) == 0
    assert sorted(p.name for p in (tmp_path / "deepspec").iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_convert_checkpoint_in_python_refuses_its_source_and_a_downloaded_checkpoint_as_the_cli_does(
        tmp_path, target, capsys):
    from conftest import cli_error

    original = tiny_draft(target)
    src = write_checkpoint(tmp_path / "src", deepspec_config(original, target), public_state_dict(original, target))
    other = write_checkpoint(tmp_path / "other", specforge_config(original), public_state_dict(original))
    files = {p: p.read_bytes() for folder in (src, other) for p in folder.iterdir()}
    for dst, message in ((src, "is the checkpoint being converted"), (other, "not an earlier conversion")):
        with pytest.raises(ValueError, match=message) as error:
            convert_checkpoint(src, dst, "deepspec", target=target)
        said = cli_error(capsys, ["convert", "--from", "deepspec", str(src), str(dst)])
        assert said.startswith(f"dspark convert: error: {error.value} ")
    assert {p: p.read_bytes() for p in files} == files and set(files) == {*src.iterdir(), *other.iterdir()}


def test_export_deepspec_in_python_writes_only_into_a_new_folder_or_its_own_earlier_export(tmp_path, target):
    from dspark_hf.model.convert import export_deepspec

    original = tiny_draft(target)
    downloaded = write_checkpoint(tmp_path / "downloaded", deepspec_config(original, target),
                                  public_state_dict(original, target), shards=2)
    original.save_pretrained(tmp_path / "draft")  # the draft being exported: a dspark-hf draft, not a DeepSpec export
    for folder in (downloaded, tmp_path / "draft"):
        files = {p: p.read_bytes() for p in folder.iterdir()}
        with pytest.raises(ValueError, match="not an earlier DeepSpec export"):
            export_deepspec(original, target, folder)
        assert {p: p.read_bytes() for p in folder.iterdir()} == files
    ours = export_deepspec(original, target, tmp_path / "ours")
    (ours / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # as if sharded before
    export_deepspec(original, target, ours)
    assert sorted(p.name for p in ours.iterdir()) == ["README.md", "config.json", "model.safetensors"]


@pytest.mark.parametrize("where", ["dflash_config", "top level"])
def test_a_dflash_soft_cap_is_carried_over_and_drafts_the_same(tmp_path, target, where):
    # z-lab's newer DFlash code caps the LM-head logits, reading the cap from dflash_config or else the top level
    original = tiny_draft(target, head_type="none", confidence_head=False, anchor_predicts=False,
                          final_logit_softcapping=0.5)  # small enough to change every distribution
    config = dflash_config(original)
    (config["dflash_config"] if where == "dflash_config" else config)["final_logit_softcapping"] = 0.5
    src = write_checkpoint(tmp_path / "src", config, public_state_dict(original))
    assert check_conversion(src, tmp_path / "dst", "dflash", original, target).config.final_logit_softcapping == 0.5


@pytest.mark.parametrize("setting, value", [("input_embedding_scale", 8.0), ("output_multiplier", 0.5),
                                            ("is_causal", True)])
@pytest.mark.parametrize("where", ["dflash_config", "top level"])
def test_dflash_settings_that_change_the_draft_are_refused_by_name_and_neutral_values_pass(
        tmp_path, target, setting, value, where):
    original = tiny_draft(target, head_type="none", confidence_head=False, anchor_predicts=False)
    neutral = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "is_causal": False}[setting]
    for v in (neutral, value):
        config = dflash_config(original)
        (config["dflash_config"] if where == "dflash_config" else config)[setting] = v
        config["unrelated_key_real_checkpoints_carry"] = 3  # unknown harmless keys are not refused
        src = write_checkpoint(tmp_path / f"src-{v}", config, public_state_dict(original))
        if v == neutral:
            convert_checkpoint(src, tmp_path / "dst", "dflash", target=target)
            continue
        with pytest.raises(NotImplementedError, match=rf"^{setting}={value!r} .*dspark-hf does not reproduce it"):
            convert_checkpoint(src, tmp_path / "refused", "dflash", target=target)
        assert not (tmp_path / "refused").exists()


def test_a_converted_draft_s_card_says_what_it_was_converted_from_not_that_dspark_hf_trained_it(tmp_path, target):
    original = tiny_draft(target, head_type="none", confidence_head=False, anchor_predicts=False)
    snapshot = tmp_path / "hub" / "models--z-lab--Qwen3-8B-DFlash-b16" / "snapshots" / ("0123456789ab" + "c" * 28)
    local = tmp_path / "my-dflash"
    for src in (snapshot, local):
        write_checkpoint(src, dflash_config(original), public_state_dict(original))
        convert_checkpoint(src, tmp_path / src.name / "dst", "dflash", target=target)
        card = (tmp_path / src.name / "dst" / "README.md").read_text()
        assert "trained with\ndspark-hf" not in card and "Not recorded" not in card
        assert str(tmp_path) not in card  # the card names no path of this machine
    # z-lab's Hub checkpoint, downloaded into the Hugging Face cache, is named by its Hub id
    assert "converted by dspark-hf from a DFlash checkpoint (`z-lab/Qwen3-8B-DFlash-b16` at revision 0123456789ab)" \
        in (tmp_path / snapshot.name / "dst" / "README.md").read_text()
    assert "converted by dspark-hf from a DFlash checkpoint (a local folder named `my-dflash`)" in card
    assert "Not trained with dspark-hf: converted by `dspark convert`" in card
