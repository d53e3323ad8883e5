"""The DSpark draft model: shapes, attention pattern, sequential heads, confidences, target checks, checkpoints."""

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModel

from conftest import VOCAB, cut_in_half, tiny_draft, tiny_target
import dspark_hf
from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.generation.block_sources import sample_block

GAMMA = 4


def context_for(draft, target, length=10, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, draft.config.target_vocab_size, (batch, length), generator=g)
    out = target(ids, output_hidden_states=draft.hidden_states_request)
    features = draft.target_features(out.hidden_states)
    positions = torch.arange(length).expand(batch, -1)
    return ids, features, positions


def encode(draft, features, positions):
    return draft.encode_context(features, positions, torch.ones_like(positions, dtype=torch.bool))


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square goodness of fit; bins with expected count < min_expected are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


# ---------------------------------------------------------------------------------------------------------------
def test_from_target_gives_a_working_draft_for_every_family(family):
    target = tiny_target(family)
    draft = tiny_draft(target)
    ids, features, positions = context_for(draft, target)
    context = encode(draft, features, positions)

    anchors = torch.tensor([[3, 7], [2, 5]])
    tokens = torch.randint(0, VOCAB, (2, 2, GAMMA))
    out = draft(ids.gather(1, anchors), anchors, context, block_tokens=tokens)
    assert out.logits.shape == (2, 2, GAMMA, VOCAB)
    assert out.confidence_logits.shape == (2, 2, GAMMA)

    block = sample_block(draft, ids[:, -1], positions[:, -1], context, do_sample=True)
    assert block.tokens.shape == (2, GAMMA)
    assert block.probs.shape == (2, GAMMA, VOCAB)


def test_from_target_follows_the_reference_layer_rule():
    target = tiny_target("llama", num_hidden_layers=12)
    assert tiny_draft(target, num_hidden_layers=5).config.target_layer_ids == [1, 3, 5, 7, 9]
    assert tiny_draft(target, num_hidden_layers=1).config.target_layer_ids == [1]


def test_new_drafts_norm_queries_and_keys_per_head_whatever_the_target_and_softcap_as_the_target_does():
    """Per-head q/k norms are what vLLM, SGLang and llama.cpp apply to every draft layer, so every new draft has them
    (an older draft without them still loads: qk_norm=False in its config)."""
    assert all(tiny_draft(tiny_target(family)).config.qk_norm for family in ("llama", "qwen3", "gemma3"))
    assert tiny_draft(tiny_target("llama"), qk_norm=False).config.qk_norm is False
    assert tiny_draft(tiny_target("gemma3")).config.final_logit_softcapping == 5.0


def test_block_rows_attend_bidirectionally_within_the_block():
    target = tiny_target("llama")
    draft = tiny_draft(target, head_type="none")
    ids, features, positions = context_for(draft, target)
    context = encode(draft, features, positions)
    anchor, pos = ids[:, -1:], positions[:, -1:]
    before = draft.backbone(anchor, pos, context)
    draft.config.mask_token_id = 5  # change every later block token
    after = draft.backbone(anchor, pos, context)
    assert not torch.allclose(before[:, :, 0], after[:, :, 0]), "the anchor row must see the later block rows"


def test_nothing_leaks_from_context_at_or_after_the_anchor():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, features, positions = context_for(draft, target)
    anchor_pos = torch.tensor([[5], [5]])
    anchor = ids.gather(1, anchor_pos)
    tokens = torch.randint(0, VOCAB, (2, 1, GAMMA))
    base = draft(anchor, anchor_pos, encode(draft, features, positions), block_tokens=tokens).logits

    future = features.clone()
    future[:, 5:] = torch.randn_like(future[:, 5:])
    same = draft(anchor, anchor_pos, encode(draft, future, positions), block_tokens=tokens).logits
    torch.testing.assert_close(same, base)

    past = features.clone()
    past[:, 4] = torch.randn_like(past[:, 4])
    changed = draft(anchor, anchor_pos, encode(draft, past, positions), block_tokens=tokens).logits
    assert not torch.allclose(changed, base)


def test_blocks_of_different_anchors_do_not_see_each_other():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, features, positions = context_for(draft, target)
    context = encode(draft, features, positions)
    tokens = torch.randint(0, VOCAB, (2, 2, GAMMA))
    pair = draft(ids[:, [3, 7]], torch.tensor([[3, 7]] * 2), context, block_tokens=tokens).logits
    alone = draft(ids[:, [7]], torch.tensor([[7]] * 2), context, block_tokens=tokens[:, 1:]).logits
    torch.testing.assert_close(pair[:, 1:], alone, rtol=1e-5, atol=1e-5)


def test_grouped_heads_read_their_shared_key_value_head():
    """Block attention repeats each key/value head for its group of query heads (what SDPA's enable_gqa does), so
    a masked attention keeps CUDA's memory-efficient kernel; the result is the grouped attention's."""
    import torch.nn.functional as F

    target = tiny_target("llama")  # 4 query heads, 2 key/value heads
    attn = tiny_draft(target, qk_norm=False).layers[0].self_attn  # queries as q_proj gives them
    g = torch.Generator().manual_seed(0)
    x, context_k, context_v = (torch.randn(2, 5, 32, generator=g), torch.randn(2, 2, 6, 8, generator=g),
                               torch.randn(2, 2, 6, 8, generator=g))
    mask = torch.rand(2, 5, 11, generator=g) > 0.3
    mask[..., 6] = True
    cos, sin = torch.ones(2, 1, 5, 8), torch.zeros(2, 1, 5, 8)
    out = attn(x, cos, sin, context_k, context_v, mask)

    q = attn._heads(attn.q_proj(x), 4)
    k, v = attn.key_value(x, cos, sin)
    expected = F.scaled_dot_product_attention(q, torch.cat([context_k, k], 2), torch.cat([context_v, v], 2),
                                              attn_mask=mask[:, None], enable_gqa=True)
    torch.testing.assert_close(out, attn.o_proj(expected.transpose(1, 2).reshape(2, 5, -1)))


@pytest.mark.parametrize("head_type", ["markov", "rnn"])
def test_sequential_conditionals_are_exact_softmaxes_of_the_sampled_prefix(head_type):
    target = tiny_target("llama")
    draft = tiny_draft(target, head_type=head_type)
    ids, features, positions = context_for(draft, target)
    context = encode(draft, features, positions)
    block = sample_block(draft, ids[:, -1], positions[:, -1], context, do_sample=True)

    assert torch.allclose(block.probs.sum(-1), torch.ones(2, GAMMA))
    forced = draft(ids[:, -1:], positions[:, -1:], context, block_tokens=block.tokens[:, None])
    torch.testing.assert_close(block.probs, torch.softmax(forced.logits[:, 0].float(), -1))

    other = block.tokens.clone()
    other[:, 0] = (other[:, 0] + 1) % VOCAB
    reforced = draft(ids[:, -1:], positions[:, -1:], context, block_tokens=other[:, None]).logits
    assert torch.allclose(reforced[:, 0, 0], forced.logits[:, 0, 0]), "position 1 only sees the anchor"
    assert not torch.allclose(reforced[:, 0, 1], forced.logits[:, 0, 1]), "position 2 depends on x_1"


def test_no_head_draft_positions_are_independent_of_sampled_tokens():
    target = tiny_target("llama")
    draft = tiny_draft(target, head_type="none")
    ids, features, positions = context_for(draft, target)
    context = encode(draft, features, positions)
    a = sample_block(draft, ids[:, -1], positions[:, -1], context, do_sample=True)
    b = sample_block(draft, ids[:, -1], positions[:, -1], context, do_sample=True)
    torch.testing.assert_close(a.probs, b.probs)


def test_sampled_blocks_follow_the_returned_distributions():
    """x_1 and x_2 | x_1 drawn by sample_block match probs, by a chi-square test at significance 0.001."""
    target = tiny_target("llama", vocab=12)
    draft = tiny_draft(target, initializer_range=0.5)
    ids, features, positions = context_for(draft, target, batch=1)
    n = 6000
    context = encode(draft, features.expand(n, -1, -1), positions.expand(n, -1))
    torch.manual_seed(0)
    block = sample_block(draft, ids[:, -1].expand(n), positions[:, -1].expand(n), context, do_sample=True)

    first = torch.bincount(block.tokens[:, 0], minlength=12).float()
    assert chi_square_p_value(first, block.probs[0, 0]) > 1e-3

    mode = int(first.argmax())
    rows = block.tokens[:, 0] == mode
    second = torch.bincount(block.tokens[rows, 1], minlength=12).float()
    assert chi_square_p_value(second, block.probs[rows][0, 1]) > 1e-3


def test_confidences_are_probabilities_and_sts_temperatures_apply():
    target = tiny_target("llama")
    draft = tiny_draft(target)
    ids, features, positions = context_for(draft, target)
    context = encode(draft, features, positions)
    torch.manual_seed(0)
    raw = sample_block(draft, ids[:, -1], positions[:, -1], context, do_sample=True).confidences
    assert raw.shape == (2, GAMMA) and bool(((raw > 0) & (raw < 1)).all())

    draft.set_confidence_temperatures([2.0] * GAMMA)
    torch.manual_seed(0)
    cooled = sample_block(draft, ids[:, -1], positions[:, -1], context, do_sample=True).confidences
    logit = torch.logit(raw.double())
    torch.testing.assert_close(cooled.double(), torch.sigmoid(logit / 2), rtol=1e-4, atol=1e-5)


def test_sts_temperatures_live_on_the_draft_s_device_exactly_through_one_setter(tmp_path):
    """A round copies nothing to the device for the temperatures: they are a buffer beside the weights, set with the
    config field by one setter, kept exact in a bfloat16 draft and after a save and load (where they are config.json's
    field only); an assignment to the field alone is refused where the draft would be used or saved."""
    temps = [1.25, 0.7, 1.9, 3.3]
    draft = tiny_draft(tiny_target("llama"))
    logits = torch.linspace(-3, 3, 8).view(2, GAMMA)
    torch.testing.assert_close(draft.calibrated(logits), torch.sigmoid(logits), rtol=0, atol=0)

    draft.set_confidence_temperatures(temps)
    expected = torch.sigmoid(logits / torch.tensor(temps))
    assert draft.config.confidence_temperatures == temps
    torch.testing.assert_close(draft.calibrated(logits), expected, rtol=0, atol=0)
    torch.testing.assert_close(draft.to(torch.bfloat16).calibrated(logits), expected, rtol=0, atol=0)
    draft.save_pretrained(tmp_path / "draft")
    assert "sts_temperatures" not in safe_open(tmp_path / "draft" / "model.safetensors", "pt").keys()
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "draft")
    torch.testing.assert_close(loaded.calibrated(logits), expected, rtol=0, atol=0)

    with pytest.raises(ValueError, match="block_size is 4 but confidence_temperatures has 2"):
        loaded.set_confidence_temperatures([1.0, 2.0])
    assert loaded.config.confidence_temperatures == temps  # a refused value changes nothing
    loaded.config.confidence_temperatures = [2.0] * GAMMA
    for use in (loaded.check_config, lambda: loaded.save_pretrained(tmp_path / "again")):
        with pytest.raises(ValueError, match=r"confidence_temperatures was assigned, so the draft still calibrates "
                                             r"with \[1.25, 0.7, 1.9, 3.3\]: set them with "
                                             r"draft.set_confidence_temperatures"):
            use()


def test_draft_vocabulary_subset_only_proposes_its_tokens():
    target = tiny_target("llama")
    keep = list(range(10, 40))
    draft = tiny_draft(target, draft_vocab=keep)
    ids, features, positions = context_for(draft, target)
    block = sample_block(draft, ids[:, -1], positions[:, -1], encode(draft, features, positions), do_sample=True)
    assert set(block.tokens.flatten().tolist()) <= set(keep)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[keep] = False
    assert float(block.probs[..., outside].abs().max()) == 0.0


@pytest.mark.parametrize("change, message", [
    (dict(vocab=80), "vocabulary size"),
    (dict(hidden_size=48, num_attention_heads=4), "hidden size"),
    (dict(num_hidden_layers=2), "target_layer_ids"),
])
def test_binding_to_a_different_target_raises_a_clear_error(change, message):
    draft = tiny_draft(tiny_target("llama", num_hidden_layers=6), num_hidden_layers=3)
    other = tiny_target("llama", **change)
    with pytest.raises(ValueError, match=message) as err:
        draft.bind_target(other)
    assert "from_target" in str(err.value)


def test_a_model_without_an_lm_head_is_refused_as_a_target_saying_what_a_target_is():
    """A draft borrows its target's LM head: a draft, or a base model loaded with AutoModel, has none."""
    target = tiny_target("llama")
    draft = tiny_draft(target)
    for bind in (DSparkDraftModel.from_target, tiny_draft(target).bind_target):
        with pytest.raises(ValueError, match=r"is a DSpark draft, not a target: pass the causal LM it drafts for"):
            bind(draft)
        with pytest.raises(ValueError, match=r"LlamaModel has no LM head.*AutoModelForCausalLM"):
            bind(target.model)


def test_a_teacher_forced_forward_without_the_target_s_context_says_what_to_pass():
    draft = tiny_draft(tiny_target("llama"))
    ids = torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="pass context= .*or context_features, context_positions and context_valid"):
        draft(ids, ids, block_tokens=torch.ones(1, 1, GAMMA, dtype=torch.long))


def test_a_draft_asked_to_generate_says_to_generate_with_its_target():
    draft = tiny_draft(tiny_target("llama"))
    with pytest.raises(AttributeError, match=r"does not generate on its own.*target\.generate\(\*\*inputs, "
                                             r"assistant_model=draft\)"):
        draft.generate(torch.ones(1, 3, dtype=torch.long))
    assert not hasattr(draft, "generate") and not DSparkDraftModel.can_generate()


def test_config_rejects_the_final_layer_and_bad_head_types():
    with pytest.raises(ValueError, match="never the last layer"):
        DSparkConfig(target_layer_ids=[3], target_num_hidden_layers=4, target_vocab_size=10)
    with pytest.raises(ValueError, match="head_type"):
        DSparkConfig(head_type="lstm")


@pytest.mark.parametrize("bad, message", [
    (dict(block_size=0), "block_size must be an int >= 1"),
    (dict(block_size=2.5), "block_size must be an int >= 1"),
    (dict(num_attention_heads=0), "num_attention_heads must be an int >= 1"),
    (dict(hidden_act="nope"), "hidden_act='nope' is not an activation"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps must be > 0"),
    (dict(confidence_temperatures=[0.0] * 4), "confidence_temperatures must be finite and > 0"),
    (dict(draft_vocab_size=500), r"draft_vocab_size \(500\) cannot exceed the target's vocabulary \(96\)"),
], ids=str)
def test_settings_that_cannot_work_are_refused_however_they_arrive(tmp_path, bad, message):
    target = tiny_target("llama")
    tiny_draft(target).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        tiny_draft(target, **bad)
    with pytest.raises(ValueError, match=message):  # transformers sets these overrides after the config is built
        DSparkDraftModel.from_pretrained(tmp_path, **bad)
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path, **bad)


@pytest.mark.parametrize("field, value, message", [
    ("confidence_temperatures", [1.0, 2.0], "block_size is 4 but confidence_temperatures has 2 entries"),
    ("confidence_temperatures", [0.0, 1.0, 1.0, 1.0], "confidence_temperatures must be finite and > 0"),
    ("head_type", "Markov", "head_type='Markov' is not one of"),
], ids=str)
def test_a_config_changed_after_construction_is_checked_before_saving(tmp_path, field, value, message):
    """Calibration sets config.confidence_temperatures on a built draft: a bad value is refused when saving, not
    later by the folder's from_pretrained."""
    draft = tiny_draft(tiny_target("llama"))
    setattr(draft.config, field, value)
    with pytest.raises(ValueError, match=f"config was changed into one from_pretrained would refuse: {message}"):
        draft.save_pretrained(tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_a_block_size_edited_in_a_calibrated_draft_s_config_is_refused_naming_block_size(tmp_path):
    import json

    draft = tiny_draft(tiny_target("llama"))
    draft.set_confidence_temperatures([1.0] * draft.config.block_size)
    draft.save_pretrained(tmp_path / "draft")
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    (tmp_path / "draft" / "config.json").write_text(json.dumps({**config, "block_size": 100}))
    with pytest.raises(ValueError, match=f"block_size is 100 but confidence_temperatures has {draft.config.block_size}"
                                         f" entries.*set block_size back to {draft.config.block_size}"):
        DSparkDraftModel.from_pretrained(tmp_path / "draft")


def test_a_draft_loaded_with_another_block_size_than_it_was_trained_with_warns(tmp_path):
    import json
    import warnings

    from dspark_hf.model.binding import BlockSizeWarning

    draft = tiny_draft(tiny_target("llama"))
    draft.config.trained_block_size = trained = draft.config.block_size
    draft.save_pretrained(tmp_path / "draft")
    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockSizeWarning)
        DSparkDraftModel.from_pretrained(tmp_path / "draft")  # as trained: not a word
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    (tmp_path / "draft" / "config.json").write_text(json.dumps({**config, "block_size": 100,
                                                                "confidence_temperatures": [1.0] * 100}))
    with pytest.warns(BlockSizeWarning, match=f"trained with block_size {trained} but its config says 100.*positions "
                                              f"past {trained} were never trained. Set block_size back to {trained}"):
        DSparkDraftModel.from_pretrained(tmp_path / "draft")


def test_a_folder_of_another_model_or_a_misspelled_field_is_refused(tmp_path):
    target = tiny_target("llama")
    target.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config of a 'llama' model, not of a DSpark draft"):
        DSparkDraftModel.from_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"fields that DSparkConfig does not have: \['num_layers'\]"):
        DSparkDraftModel.from_target(target, num_layers=1)
    with pytest.raises(ValueError, match="ids must be distinct; 1 are repeated"):
        DSparkDraftModel.from_target(target, draft_vocab=[1, 1, 2])
    with pytest.raises(ValueError, match=r"target ids in \[0, 96\), got \[1000\]"):
        DSparkDraftModel.from_target(target, draft_vocab=[1, 1000])


def test_copies_of_a_draft_borrow_the_target_and_pickles_leave_it_out():
    import copy
    import io

    target = tiny_target("llama")
    draft = tiny_draft(target)
    twin = copy.deepcopy(draft)
    assert twin.is_bound_to(target) and twin.binding.embed is target.get_input_embeddings()
    buffer = io.BytesIO()
    torch.save(draft, buffer)  # the binding was the pickle's only way to the target's modules
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.binding is None and draft.is_bound_to(target)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), draft.state_dict().values()))


def test_save_and_auto_load_round_trip_bit_identically_without_target_weights(tmp_path):
    target = tiny_target("qwen3")
    draft = tiny_draft(target)
    draft.save_pretrained(tmp_path)

    assert AutoConfig.from_pretrained(tmp_path).model_type == "dspark"
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DSparkDraftModel)
    for (name, a), (_, b) in zip(draft.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    # and it computes the same thing (guards state that is not in the state dict, e.g. RoPE frequencies)
    loaded.bind_target(target)
    ids, features, positions = context_for(draft, target)
    torch.manual_seed(0)
    before = sample_block(draft, ids[:, -1], positions[:, -1], encode(draft, features, positions), do_sample=True)
    torch.manual_seed(0)
    after = sample_block(loaded, ids[:, -1], positions[:, -1], encode(loaded, features, positions), do_sample=True)
    assert torch.equal(before.tokens, after.tokens) and torch.equal(before.probs, after.probs)

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = list(f.keys())
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in keys)
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert stored == sum(p.numel() for p in draft.parameters())
    assert stored < target.get_input_embeddings().weight.numel() + sum(p.numel() for p in draft.parameters())

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dspark.DSparkDraftModel"


@pytest.mark.parametrize("dropped", [["layers.0.self_attn.q_proj.weight", "w2.weight"], ["draft_vocab"]], ids=str)
def test_a_checkpoint_missing_any_tensor_is_refused_naming_them(tmp_path, dropped):
    """A draft has no optional weights: transformers would start missing ones random, and the draft-vocabulary
    buffers uninitialised (generate then indexed with garbage)."""
    from safetensors.torch import load_file, save_file

    tiny_draft(tiny_target("llama"), draft_vocab=list(range(20, 80))).save_pretrained(tmp_path, model_card=False)
    weights = load_file(tmp_path / "model.safetensors")
    for name in dropped:
        del weights[name]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    message = f"{tmp_path} is not a complete DSpark draft: its weights lack {', '.join(dropped)}.*save_pretrained"
    with pytest.raises(ValueError, match=message):
        DSparkDraftModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoModel.from_pretrained(tmp_path)


def test_a_folder_that_does_not_exist_is_refused_as_such_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for missing in (tmp_path / "nope", Path("runs/nope"), "./runs/nope", "~/no-such-dspark-draft"):
        with pytest.raises(OSError, match=r"nope: no such folder: give the folder a draft was saved to|"
                                          r"no-such-dspark-draft: no such folder"):
            DSparkDraftModel.from_pretrained(missing)


def test_a_checkpoint_cut_short_is_refused_as_damaged_saying_to_download_or_save_it_again(tmp_path):
    """safetensors' own error says only 'incomplete metadata'; a target's weights are read by the same rule."""
    from dspark_hf.loading import load_target_model

    target = tiny_target("llama")
    tiny_draft(target).save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    for folder in ("draft", "target"):
        cut_in_half(tmp_path / folder / "model.safetensors")
    message = r"weights of .*{} are damaged or cut short \(.*incomplete.*\).*download them again.*save_pretrained"
    with pytest.raises(OSError, match=message.format("draft")):
        DSparkDraftModel.from_pretrained(tmp_path / "draft")
    with pytest.raises(OSError, match=message.format("target")):
        load_target_model(str(tmp_path / "target"))


def test_a_checkpoint_that_does_not_match_its_config_is_refused_in_one_line(tmp_path):
    """Weights the config has no place for (an rnn draft under a config edited to markov) would be dropped, and
    weights of another shape, with ignore_mismatched_sizes=True, started random: either way the draft would load and
    draft something else."""
    tiny_draft(tiny_target("llama"), head_type="rnn").save_pretrained(tmp_path, model_card=False)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "head_type": "markov"}))
    with pytest.raises(ValueError, match=rf"^{tmp_path} does not match its config: its weights hold rnn_proj.bias, "
                                         r"rnn_proj.weight, which a draft with this config does not have and would "
                                         r"drop\. Load it with the config it was saved with\.$"):
        DSparkDraftModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**saved, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=rf"^{tmp_path} does not match its config: its layers.0.mlp.down_proj.weight "
                                         r"is \(32, 64\), the config makes it \(32, 48\) \(and 5 more\), which "
                                         r"ignore_mismatched_sizes would start random\. Load it with the config it was "
                                         r"saved with\.$"):
        DSparkDraftModel.from_pretrained(tmp_path, ignore_mismatched_sizes=True)


def test_output_loading_info_still_returns_the_report(tmp_path):
    tiny_draft(tiny_target("llama")).save_pretrained(tmp_path)
    draft, info = DSparkDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(draft, DSparkDraftModel) and info["missing_keys"] == set() == info["unexpected_keys"]


def test_a_fresh_process_loads_the_draft_with_remote_code_and_no_dspark_hf(tmp_path):
    """...and the remote code, a copy of the package's file, refuses a checkpoint missing a tensor as it does."""
    from safetensors.torch import load_file, save_file

    draft = tiny_draft(tiny_target("llama"))
    draft.save_pretrained(tmp_path / "draft")
    expected = draft.fc.weight.sum().item()
    draft.save_pretrained(tmp_path / "partial")
    weights = load_file(tmp_path / "partial" / "model.safetensors")
    del weights["w2.weight"]
    save_file(weights, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    script = (
        "import sys; sys.modules['dspark_hf'] = None\n"  # make `import dspark_hf` fail in this process
        "from transformers import AutoModel\n"
        f"m = AutoModel.from_pretrained({str(tmp_path / 'draft')!r}, trust_remote_code=True)\n"
        "print(type(m).__name__, m.fc.weight.sum().item())\n"
        "try:\n"
        f"    AutoModel.from_pretrained({str(tmp_path / 'partial')!r}, trust_remote_code=True)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env={"HF_HUB_OFFLINE": "1", "PATH": ""}, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, refused = out.stdout.splitlines()
    name, total = loaded.split()
    assert name == "DSparkDraftModel" and float(total) == pytest.approx(expected)
    assert refused.startswith(f"{tmp_path / 'partial'} is not a complete DSpark draft: its weights lack w2.weight")


def test_a_draft_loaded_as_remote_code_before_dspark_hf_says_how_to_load_it_for_generate(tmp_path):
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    tiny_draft(target).save_pretrained(tmp_path / "draft")
    script = (  # the folder's own modeling file defines another DSparkDraftModel class than the package's
        "import torch\n"
        "from transformers import AutoModel, AutoModelForCausalLM\n"
        "draft = AutoModel.from_pretrained('draft', trust_remote_code=True)\n"
        "import dspark_hf\n"
        "target = AutoModelForCausalLM.from_pretrained('target')\n"
        "target.generate(input_ids=torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, assistant_model=draft)\n"
    )
    package_root = str(Path(dspark_hf.__file__).parents[1])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "", "PYTHONPATH": package_root})
    assert "loaded as remote code before dspark_hf was imported: load it with dspark_hf.DSparkDraftModel" \
        in out.stderr.splitlines()[-1], out.stderr


def test_unbound_draft_says_how_to_bind(tmp_path):
    draft = tiny_draft(tiny_target("llama"))
    draft.save_pretrained(tmp_path)
    loaded = DSparkDraftModel.from_pretrained(tmp_path)
    ids = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="bind_target"):
        loaded.backbone(ids, ids, loaded.empty_context(1))


def test_the_shipped_drafts_remote_code_is_the_librarys_own():
    from dspark_hf.defaults import SHIPPED_DRAFT_DIR

    model_dir = Path(dspark_hf.__file__).parent / "model"
    for name in ("modeling_dspark.py", "configuration_dspark.py", "binding.py"):
        assert (SHIPPED_DRAFT_DIR / name).read_bytes() == (model_dir / name).read_bytes(), (
            f"{SHIPPED_DRAFT_DIR / name} differs from dspark_hf/model/{name}: copy it over (the asset loads with "
            "trust_remote_code=True where dspark-hf is not installed)")


def test_a_draft_bound_to_a_target_of_its_shape_but_other_weights_warns_once_naming_both():
    from dspark_hf.model.binding import OtherTargetWarning

    target, other = tiny_target("llama"), tiny_target("llama", seed=5)
    target.config._name_or_path, other.config._name_or_path = "org/trained-for", "org/other-weights"
    draft = tiny_draft(target)
    assert draft.config.target_fingerprint and draft.config.target_name_or_path == "org/trained-for"
    ids = torch.randint(1, VOCAB, (1, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            other.generate(input_ids=ids, max_new_tokens=4, do_sample=False, assistant_model=draft)
    (warning,) = [w for w in caught if issubclass(w.category, OtherTargetWarning)]
    assert "org/trained-for" in str(warning.message) and "org/other-weights" in str(warning.message)

    with warnings.catch_warnings():
        warnings.simplefilter("error", OtherTargetWarning)  # its own weights in another dtype: no warning
        draft.bind_target(target.to(torch.bfloat16))


def test_the_shipped_draft_carries_the_package_s_own_modeling_and_configuration_files():
    """trust_remote_code loads them from the draft's folder: a stale copy would model another draft."""
    from dspark_hf.defaults import SHIPPED_DRAFT_DIR

    for name in ("modeling_dspark.py", "configuration_dspark.py", "binding.py"):
        package = Path(dspark_hf.__file__).parent / "model" / name
        assert (SHIPPED_DRAFT_DIR / name).read_bytes() == package.read_bytes(), name


def test_the_model_package_imports_nothing_of_hub_cards_or_generation():
    """model/ models; sharing (hub/, cards.py) imports the model, never the reverse: no cycle. The files that ship
    beside every saved draft (for trust_remote_code) import only each other: transformers copies a shipped file's
    relative imports into the draft's folder, and one reaching outside model/ breaks every save."""
    import ast

    shipped = {"configuration_dspark", "modeling_dspark", "binding"}
    allowed = shipped | {"sampling", "convert", "engines"}
    for path in (Path(dspark_hf.__file__).parent / "model").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                # the rest of model/ may read the package's leaves, which import none of it: the file rules
                # (files.py) and the errors a user can fix (errors.py)
                leaf = path.stem not in shipped and node.level == 2 and node.module in ("files", "errors")
                within = node.level == 1 and (node.module or "").split(".")[0] in (shipped if path.stem in shipped
                                                                                     else allowed | {""})
                assert leaf or within, (path.name, node.module)
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = getattr(node, "module", None) or ""
            assert not any(n.startswith("dspark_hf") for n in names) and not module.startswith("dspark_hf"), path.name
    for leaf in ("files.py", "errors.py"):
        tree = ast.parse((Path(dspark_hf.__file__).parent / leaf).read_text())
        assert not any(isinstance(node, ast.ImportFrom) and node.level > 0 for node in ast.walk(tree))


@pytest.mark.parametrize("make", [
    lambda tr: tr.MambaForCausalLM(tr.MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2)),
    lambda tr: tr.Lfm2ForCausalLM(tr.Lfm2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                                layer_types=["full_attention", "conv"])),
], ids=["mamba", "lfm2"])
def test_targets_with_recurrent_or_convolutional_layers_are_refused(make):
    import transformers

    target = make(transformers).eval()
    with pytest.raises(ValueError, match="state cannot be cut back to the accepted part of a verified block"):
        DSparkDraftModel.from_target(target)
    draft = tiny_draft(tiny_target("llama"))
    with pytest.raises(ValueError, match="DSpark needs a target whose layers are all attention"):
        draft.check_target(target)


def test_targets_whose_layers_pass_several_hidden_streams_are_refused():
    import transformers

    layers = ["sliding_attention", "full_attention"]
    target = transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(
        vocab_size=64, vocab_size_per_layer_input=64, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        laurel_rank=4, altup_num_inputs=2, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0],
        layer_types=layers)).eval()
    with pytest.raises(ValueError, match="AltUp layers .* cannot read as one hidden state per layer"):
        DSparkDraftModel.from_target(target)
    with pytest.raises(ValueError, match="AltUp layers"):
        tiny_draft(tiny_target("llama")).check_target(target)
