"""Training: losses on hand-computed cases, anchor sampling, data files, and short runs that learn."""

import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from transformers import BatchEncoding

from conftest import VOCAB, cli_error, cut_in_half, tiny_draft, tiny_target
from dspark_hf import DSparkDraftModel
from dspark_hf.training import DataFileError, GenerationSettings, load_dataset, prepare_data, read_prompts
from dspark_hf.training.prompts import write_prompts
from dspark_hf.training.data import MOST_ROWS, Example, manifest_path, rows_that_fit, split_heldout
from dspark_hf.training.features import CachedFeatures, OnlineFeatures
from dspark_hf.training.losses import (LossWeights, dspark_losses, position_weights, sample_anchors,
                                      target_distribution_on)
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.drafts import make_draft
from dspark_hf.training.heldout import evaluate_heldout
from dspark_hf.training.objective import gather_blocks, target_distribution_at, target_logits
from dspark_hf.training.trainer import train


def test_position_weights_follow_the_reference_decay():
    torch.testing.assert_close(position_weights(3, 4.0), torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


def test_identical_distributions_have_zero_l1_and_full_acceptance():
    logits = torch.randn(2, 3, 5)
    out = dspark_losses(logits, logits, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))
    assert float(out["l1"]) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(out["acceptance"], torch.ones(2, 3))


def test_confidence_label_is_one_minus_total_variation():
    draft = torch.log(torch.tensor([[[0.5, 0.5, 0.0 + 1e-12]]]))
    target = torch.log(torch.tensor([[[0.2, 0.3, 0.5]]]))
    out = dspark_losses(draft, target, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                        confidence_logits=torch.zeros(1, 1))
    # |0.5-0.2| + |0.5-0.3| + |0-0.5| = 1.0, so TV = 0.5 and c* = 0.5
    assert float(out["l1"]) == pytest.approx(1.0, abs=1e-5)
    assert float(out["acceptance"]) == pytest.approx(0.5, abs=1e-5)
    assert float(out["confidence"]) == pytest.approx(math.log(2), abs=1e-5)  # BCE(0.5, sigmoid(0))


def test_greedy_agreement_is_one_where_the_argmaxes_match():
    target = torch.log(torch.tensor([[[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]]))
    draft = torch.log(torch.tensor([[[0.1, 0.2, 0.7], [0.3, 0.4, 0.3]]]))  # 1 - TV is 0.8 and 0.7 here
    out = dspark_losses(draft, target, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(out["agreement"], torch.tensor([[1.0, 0.0]]))


def test_greedy_agreement_is_exact_with_a_partial_draft_vocabulary():
    # draft vocabulary = target ids 0 and 1. Row 1: the target's argmax, id 0, is inside it although the mass outside
    # (0.5) exceeds its probability; row 2: the target's argmax, id 2, is outside it
    target = torch.log(torch.tensor([[[0.40, 0.10, 0.25, 0.25], [0.30, 0.15, 0.45, 0.10]]]))
    draft = torch.log(torch.tensor([[[0.9, 0.1], [0.9, 0.1]]]))
    out = dspark_losses(draft, target, torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                        draft_vocab=torch.tensor([0, 1]), target_to_draft=torch.tensor([0, 1, 2, 2]))
    torch.testing.assert_close(out["agreement"], torch.tensor([[1.0, 0.0]]))


def test_cross_entropy_is_the_weighted_mean_over_valid_positions():
    logits = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]))
    labels = torch.tensor([[1, 0]])
    w = position_weights(2, 4.0)
    out = dspark_losses(logits, logits, labels, torch.ones(1, 2, dtype=torch.bool),
                        weights=LossWeights(ce=1.0, l1=0.0, confidence=0.0))
    expected = (w[0] * -math.log(0.75) + w[1] * -math.log(0.5)) / w.sum()
    assert float(out["ce"]) == pytest.approx(float(expected), rel=1e-5)
    masked = dspark_losses(logits, logits, labels, torch.tensor([[True, False]]))
    assert float(masked["ce"]) == pytest.approx(-math.log(0.75), rel=1e-5)


def test_target_mass_outside_the_draft_vocabulary_counts_in_l1():
    target = torch.log(torch.tensor([[[0.6, 0.3, 0.1]]]))
    draft_on_subset = torch.log(torch.tensor([[[0.6 / 0.9, 0.3 / 0.9]]]))
    out = dspark_losses(draft_on_subset, target, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool),
                        draft_vocab=torch.tensor([0, 1]), target_to_draft=torch.tensor([0, 1, 2]))
    assert float(out["l1"]) == pytest.approx(abs(0.6 / 0.9 - 0.6) + abs(0.3 / 0.9 - 0.3) + 0.1, abs=1e-5)
    assert float(out["ce"]) == 0.0  # the label cannot be proposed by the draft: no CE term


def test_anchors_stay_inside_the_answer_and_leave_room_for_the_next_token():
    g = torch.Generator().manual_seed(0)
    answer_start, lengths = torch.tensor([3, 5, 9]), torch.tensor([10, 7, 10])
    anchors, valid = sample_anchors(answer_start, lengths, 4, g)
    for b in range(3):
        picked = anchors[b][valid[b]]
        assert bool(((picked >= answer_start[b]) & (picked <= lengths[b] - 2)).all())
        assert len(set(picked.tolist())) == len(picked)
    assert valid.sum(1).tolist() == [4, 1, 0]


def test_gather_blocks_takes_anchor_plus_k():
    x = torch.arange(10)[None]
    assert gather_blocks(x, torch.tensor([[2, 7]]), 3).tolist() == [[[2, 3, 4], [7, 8, 9]]]


@pytest.mark.parametrize("draft_vocab", [None, torch.tensor([0, 3, 5, 17, 40])])
def test_the_target_distribution_computed_once_per_position_is_the_one_of_each_block(draft_vocab):
    target = tiny_target("llama")
    last = torch.randn(2, 12, target.config.hidden_size)
    anchors = torch.tensor([[0, 3, 4, 9], [2, 5, 6, 10]])  # overlapping blocks, and blocks running past the end
    per_block = target_distribution_on(draft_vocab, target_logits(target, gather_blocks(last, anchors, 4)))
    for once, expected in zip(target_distribution_at(target, last, anchors, 4, draft_vocab), per_block):
        torch.testing.assert_close(once, expected)
    # computed over each row's span only (its answer): the same at every block position inside the span
    spans = [(0, 12), (2, 11)]
    inside = torch.arange(4)[None, None] + anchors[..., None] < torch.tensor([12, 11])[:, None, None]
    for once, expected in zip(target_distribution_at(target, last, anchors, 4, draft_vocab, spans), per_block):
        torch.testing.assert_close(once[inside], expected[inside])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_draft_started_from_the_target_reads_the_context_as_the_copied_layer_does(family):
    target = tiny_target(family)  # 4 layers: the draft copies layers 2 and 3; layer 1's output is what 2 reads
    with torch.no_grad():
        for name, weight in target.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)  # norms start at 1: make copying them observable
    config = TrainConfig(dataset="", output_dir="", copy_target_layers=True,
                         draft=dict(num_hidden_layers=2, target_layer_ids=[0, 1], markov_rank=4, block_size=3))
    draft = make_draft(target, config, [])
    for own, theirs in zip(draft.layers, target.model.layers[2:]):
        for name, weight in theirs.state_dict().items():
            torch.testing.assert_close(own.state_dict()[name], weight)
        if family == "llama":  # no q/k norms to copy: the draft's start as the identity
            assert all(torch.equal(norm.weight, torch.ones_like(norm.weight))
                       for norm in (own.self_attn.q_norm, own.self_attn.k_norm))
    hidden = target.model(torch.randint(1, VOCAB, (1, 6)), output_hidden_states=True).hidden_states
    features = torch.cat([hidden[1], hidden[2]], dim=-1)
    read_by_the_copied_layer = target.model.layers[2].input_layernorm(hidden[2])
    torch.testing.assert_close(draft.context_norm(draft.fc(features)), read_by_the_copied_layer)


def test_starting_from_the_target_needs_layers_shaped_like_the_drafts():
    config = TrainConfig(dataset="", output_dir="", copy_target_layers=True, draft=dict(num_hidden_layers=2))
    with pytest.raises(ValueError, match="do not match the draft's.*pre_feedforward_layernorm"):
        make_draft(tiny_target("gemma3"), config, [])  # Gemma layers carry two more norms
    narrow = TrainConfig(dataset="", output_dir="", copy_target_layers=True,
                         draft=dict(num_hidden_layers=2, intermediate_size=16))
    with pytest.raises(ValueError, match="mlp.down_proj.weight"):
        make_draft(tiny_target("llama"), narrow, [])


def test_prompt_files_with_errors_name_the_line(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b"}\n')
    with pytest.raises(DataFileError, match=r"prompts.jsonl:2"):
        list(read_prompts(path))
    path.write_text('{"id": "a", "prompt": "hi"}\nnot json\n')
    with pytest.raises(DataFileError, match=r"prompts.jsonl:2: not valid JSON"):
        list(read_prompts(path))


def test_dataset_files_are_validated(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3], "answer_start": 3}) + "\n")
    with pytest.raises(DataFileError, match="answer_start=3"):
        load_dataset(path)
    path.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 999], "answer_start": 1}) + "\n")
    with pytest.raises(DataFileError, match="another tokenizer"):
        load_dataset(path, vocab_size=VOCAB)


class TinyTokenizer:
    """Characters as tokens, enough for prepare_data on a tiny target."""

    pad_token_id = 0
    padding_side = "left"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return messages[-1]["content"]

    def __call__(self, texts, return_tensors=None, padding=False, add_special_tokens=True):
        if isinstance(texts, str):
            return {"input_ids": [1 + ord(c) % (VOCAB - 1) for c in texts]}
        rows = [[1 + ord(c) % (VOCAB - 1) for c in t] for t in texts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        return BatchEncoding({"input_ids": ids, "attention_mask": (ids != 0).long()})


def tiny_dataset(tmp_path, target, n=12):
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 3)}]}
               for i in range(n)]
    path = tmp_path / "data.jsonl"
    prepare_data(target, TinyTokenizer(), iter(prompts), path, n, batch_size=4,
                 settings=GenerationSettings(max_new_tokens=24), progress=False)
    return path


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_new_dataset_s_batch_on_a_gpu_holds_as_many_rows_as_their_kv_cache_fits_in_half_the_free_memory(family):
    target = tiny_target(family)
    cache = target(torch.zeros(1, 40, dtype=torch.long), use_cache=True).past_key_values  # one row of 40 tokens
    row = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    logits = 2 * target.config.vocab_size * 4  # the step's logits and scores, float32
    free = 10 * 2**20
    rows = rows_that_fit(target, 40, free)
    assert rows * (row + logits) <= free / 2 < (rows + 1) * (row + logits)
    assert rows_that_fit(target, 80, free) == int(free / 2) // (2 * row + logits)  # twice the tokens: about half
    assert rows_that_fit(target, 40, 2**50) == MOST_ROWS and rows_that_fit(target, 40, 1) == 1


def test_prepare_data_is_deterministic_and_resumable(tmp_path):
    target = tiny_target("llama")
    full = tiny_dataset(tmp_path, target).read_text().splitlines()
    again = tmp_path / "again"
    again.mkdir()
    assert tiny_dataset(again, target).read_text().splitlines() == full
    made = manifest_path(tmp_path / "data.jsonl").read_text()  # as written before the first answer
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "data.jsonl").write_text("\n".join(full[:4]) + "\n")  # the first batch of 4 survived a crash
    (partial / "data.manifest.json").write_text(made)
    assert tiny_dataset(partial, target).read_text().splitlines() == full
    for n, cut in enumerate([6, 5]):  # a crash inside the second batch: after its 2nd line, and inside its 2nd line
        torn = tmp_path / f"torn{n}"
        torn.mkdir()
        (torn / "data.jsonl").write_text("\n".join(full[:cut]) + "\n" + (full[cut][:20] if cut == 5 else ""))
        (torn / "data.manifest.json").write_text(made)
        assert sorted(tiny_dataset(torn, target).read_text().splitlines()) == sorted(full)
    examples = load_dataset(tmp_path / "data.jsonl", vocab_size=VOCAB)
    assert len(examples) == 12 and all(len(e.input_ids) > e.answer_start for e in examples)


def test_prepare_data_refuses_to_resume_a_file_started_with_other_settings(tmp_path):
    target = tiny_target("llama")
    path = tiny_dataset(tmp_path, target, n=12)
    before = path.read_text()
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(12)]
    with pytest.raises(ValueError, match="another --num-examples"):
        prepare_data(target, TinyTokenizer(), iter(prompts), path, 8, batch_size=4, progress=False,
                     settings=GenerationSettings(max_new_tokens=24))
    assert path.read_text() == before


@pytest.mark.parametrize("change", ["temperature", "max_new_tokens", "seed", "batch_size", "max_prompt_tokens",
                                    "target", "target_dtype", "no record"])
def test_a_resumed_regeneration_refuses_answers_made_otherwise_than_those_the_file_holds(tmp_path, change):
    target = tiny_target("llama")
    full = tiny_dataset(tmp_path, target, n=8)
    made = json.loads(manifest_path(full).read_text())
    assert (made["settings"]["max_new_tokens"], made["batch_size"], made["seed"]) == (24, 4, 0)
    assert len(made["target_fingerprint"]) == 16 and made["complete"]
    path = tmp_path / "resumed.jsonl"
    path.write_text("".join(full.read_text().splitlines(keepends=True)[:4]))  # the first batch, then killed
    manifest_path(path).write_text(manifest_path(full).read_text())  # as recorded before the first answer
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 3)}]}
               for i in range(8)]
    kw = dict(batch_size=4, settings=GenerationSettings(max_new_tokens=24), seed=0, max_prompt_tokens=384)
    if change in ("temperature", "max_new_tokens"):
        kw["settings"] = GenerationSettings(**{change: {"temperature": 0.0, "max_new_tokens": 8}[change]})
    elif change in ("seed", "batch_size", "max_prompt_tokens"):
        kw[change] = {"seed": 1, "batch_size": 2, "max_prompt_tokens": 100}[change]
    elif change == "target":
        target = tiny_target("llama", seed=5)
    elif change == "target_dtype":
        target = target.to(torch.bfloat16)
    else:
        manifest_path(path).unlink()
    before = path.read_text()
    with pytest.raises(ValueError) as refused:
        prepare_data(target, TinyTokenizer(), iter(prompts), path, 8, progress=False, **kw)
    message = str(refused.value)
    assert "\n" not in message and path.read_text() == before
    if change == "no record":
        assert "its manifest resumed.manifest.json, which records how they were made, is missing" in message
    else:
        assert "answers made otherwise" in message and ("target weights" if change == "target" else change) in message


@pytest.mark.parametrize("change", ["time budget", "path of the target"])
def test_a_resumed_regeneration_may_change_how_long_it_runs_and_where_its_target_lies(tmp_path, change):
    target = tiny_target("llama")
    full = tiny_dataset(tmp_path, target, n=8)
    path = tmp_path / "resumed.jsonl"
    path.write_text("".join(full.read_text().splitlines(keepends=True)[:4]))
    manifest_path(path).write_text(manifest_path(full).read_text())
    kw = {}
    if change == "time budget":
        kw["time_budget"] = 3600.0
    else:  # the target is known by its weights, not by the path that named it
        target.config._name_or_path = str(tmp_path / "moved" / "same-target")
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 3)}]}
               for i in range(8)]
    prepare_data(target, TinyTokenizer(), iter(prompts), path, 8, batch_size=4, progress=False,
                 settings=GenerationSettings(max_new_tokens=24), **kw)
    assert path.read_text() == full.read_text()


def test_prompts_that_share_an_id_are_refused(tmp_path):
    prompts = [{"id": "a", "messages": [{"role": "user", "content": "hi"}]},
               {"id": "a", "messages": [{"role": "user", "content": "other"}]}]
    with pytest.raises(ValueError, match="two prompts share the id 'a'"):
        prepare_data(tiny_target("llama"), TinyTokenizer(), iter(prompts), tmp_path / "d.jsonl", None,
                     progress=False, settings=GenerationSettings(max_new_tokens=4))
    assert not (tmp_path / "d.jsonl").exists()


def test_temperature_zero_regenerates_the_targets_greedy_answers(tmp_path):
    target = tiny_target("llama")
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": "ab" * (1 + i)}]} for i in range(6)]
    path = tmp_path / "greedy.jsonl"
    prepare_data(target, TinyTokenizer(), iter(prompts), path, 6, batch_size=4,
                 settings=GenerationSettings(temperature=0, max_new_tokens=12), progress=False)
    for ex in load_dataset(path, vocab_size=VOCAB):
        ids = torch.tensor([ex.input_ids])
        argmax = target(ids).logits[0, ex.answer_start - 1: -1].argmax(-1)
        assert argmax.tolist() == ex.input_ids[ex.answer_start:]  # every answer token is the target's argmax
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        prepare_data(target, TinyTokenizer(), iter(prompts), tmp_path / "x.jsonl", 6,
                     settings=GenerationSettings(temperature=-1), progress=False)


def test_one_question_in_two_phrasings_falls_on_one_side_of_the_split(tmp_path):
    target = tiny_target("llama")
    prompts = [{"id": f"q{i}/{kind}", "group": f"q{i}", "messages": [{"role": "user", "content": f"{kind} {i}"}]}
               for i in range(8) for kind in ("completion", "instruction")]  # as stdlib_prompts asks each function
    path = tmp_path / "data.jsonl"
    write_prompts(prompts, tmp_path / "prompts.jsonl")
    prepare_data(target, TinyTokenizer(), read_prompts(tmp_path / "prompts.jsonl"), path, None, batch_size=8,
                 progress=False, settings=GenerationSettings(max_new_tokens=4))
    examples = load_dataset(path)
    assert {e.group for e in examples} == {f"q{i}" for i in range(8)}
    for fraction in (0.3, 0.5, 0.7):
        train_groups, held_groups = ({e.group for e in part} for part in split_heldout(examples, fraction))
        assert held_groups and not train_groups & held_groups


def test_several_samples_per_prompt_are_different_answers_that_share_a_prompt_and_a_split(tmp_path):
    target = tiny_target("llama")
    prompts = [{"id": f"p{i}", "domain": "math" if i % 2 else "chat", "source": "toy",
                "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    path = tmp_path / "data.jsonl"
    prepare_data(target, TinyTokenizer(), iter(prompts), path, None, batch_size=4, progress=False,
                 settings=GenerationSettings(max_new_tokens=16, samples_per_prompt=2))
    examples = load_dataset(path)
    assert sorted(e.id for e in examples) == sorted(f"p{i}#{k}" for i in range(6) for k in range(2))
    answers = {}
    for e in examples:
        answers.setdefault(e.prompt_id, []).append(e.input_ids[e.answer_start:])
    assert all(a != b for a, b in answers.values()), "two draws of one prompt gave the same answer"
    assert {e.domain for e in examples} == {"chat", "math"}
    for fraction in (0.3, 0.5, 0.7):
        train_ids, held_ids = ({e.prompt_id for e in part} for part in split_heldout(examples, fraction))
        assert not train_ids & held_ids  # a prompt's answers never straddle the split

    manifest = json.loads(manifest_path(path).read_text())
    assert (manifest["prompts"], manifest["examples"], manifest["complete"]) == (6, 12, True)
    assert manifest["by_domain"]["math"]["examples"] == 6 and manifest["by_source"]["toy"]["prompts"] == 6
    assert manifest["answer_tokens"] == sum(len(a) for pair in answers.values() for a in pair)
    with pytest.raises(ValueError, match="Greedy answers .* are the same every time"):
        prepare_data(target, TinyTokenizer(), iter(prompts), tmp_path / "g.jsonl", None, progress=False,
                     settings=GenerationSettings(temperature=0, samples_per_prompt=2))


def test_regeneration_stops_at_its_time_budget_and_resumes(tmp_path, monkeypatch):
    import dspark_hf.training.data as data

    target = tiny_target("llama")
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(12)]
    now = [0.0]
    monkeypatch.setattr(data.time, "perf_counter", lambda: now[0])
    real_generate = target.generate

    def slow_generate(*args, **kwargs):  # every batch takes 10 s of the (fake) clock
        now[0] += 10
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", slow_generate)
    path = tmp_path / "data.jsonl"
    kw = dict(batch_size=4, settings=GenerationSettings(max_new_tokens=8), progress=False)
    prepare_data(target, TinyTokenizer(), iter(prompts), path, None, time_budget=25, **kw)
    assert len(path.read_text().splitlines()) == 8  # a third batch would have ended after 25 s
    twice = tmp_path / "twice.jsonl"
    prepare_data(target, TinyTokenizer(), iter(prompts[:4]), twice, None, time_budget=15, batch_size=4,
                 settings=GenerationSettings(max_new_tokens=8, samples_per_prompt=2), progress=False)
    assert sorted(e.prompt_id for e in load_dataset(twice)) == ["p0", "p1", "p2", "p3"]  # first answers first
    assert json.loads(manifest_path(path).read_text())["complete"] is False
    prepare_data(target, TinyTokenizer(), iter(prompts), path, None, **kw)
    assert len(load_dataset(path)) == 12 and json.loads(manifest_path(path).read_text())["complete"] is True


def test_heldout_report_gives_sampled_and_greedy_acceptance_per_position(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    examples = load_dataset(tiny_dataset(tmp_path, target, n=4))
    report = evaluate_heldout(draft, target, examples, OnlineFeatures(target, draft.config.target_layer_ids), 4,
                              LossWeights())
    for rates, tau in (("acceptance_per_position", "expected_tau_from_acceptance"),
                       ("greedy_agreement_per_position", "expected_greedy_tau")):
        a = report[rates]
        assert len(a) == draft.config.block_size and all(0 <= x <= 1 for x in a)
        assert report[tau] == pytest.approx(1 + sum(math.prod(a[: k + 1]) for k in range(len(a))))


def test_cached_features_equal_online_features(tmp_path):
    target = tiny_target("qwen3")
    examples = load_dataset(tiny_dataset(tmp_path, target))
    online = OnlineFeatures(target, [1, 2])
    cached = CachedFeatures(tmp_path / "cache", target, [1, 2], examples, progress=False)
    a, b = online(examples[:3]), cached(examples[:3])
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=1e-2)  # the cache stores fp16
    with pytest.raises(ValueError, match="built for .* not for layers \\[0\\]"):
        CachedFeatures(tmp_path / "cache", target, [0], examples, progress=False)


def test_each_process_computes_a_fixed_share_of_the_feature_cache_whatever_the_others_wrote_already(tmp_path):
    """Process 1 of 2 starts after process 0 has written part of its share: its own share is still the same examples
    (cut before looking at what exists), so that none falls in nobody's share (a race two-process runs once lost)."""
    target = tiny_target("qwen3")
    examples = load_dataset(tiny_dataset(tmp_path, target))[:6]
    first = CachedFeatures(tmp_path / "cache", target, [1, 2], examples[0:1] + examples[2:3], progress=False)
    second = CachedFeatures(tmp_path / "cache", target, [1, 2], examples, progress=False, shard=(1, 2))
    assert all(second._path(e).exists() for e in examples[1::2])  # its share: 1, 3, 5
    assert not second._path(examples[4]).exists() and first._path(examples[2]).exists()  # 4 is process 0's


def test_a_feature_cache_for_layers_the_target_lacks_is_refused_before_anything_is_written(tmp_path):
    target = tiny_target("llama")  # 4 layers: features come from layers 0 to 2
    examples = load_dataset(tiny_dataset(tmp_path, target, n=2))
    with pytest.raises(ValueError, match=r"target layer ids \[3, 99\] are out of range for a target with 4 layers: "
                                         r"use ids in \[0, 2\]"):
        CachedFeatures(tmp_path / "cache", target, [1, 3, 99], examples, progress=False)
    assert not (tmp_path / "cache").exists()
    CachedFeatures(tmp_path / "cache", target, [1, 2], examples, progress=False)  # so the corrected run goes ahead


def test_a_cache_never_serves_features_of_another_answer_to_the_same_prompt(tmp_path):
    target = tiny_target("llama")
    examples = load_dataset(tiny_dataset(tmp_path, target, n=4))
    CachedFeatures(tmp_path / "cache", target, [1, 2], examples, progress=False)
    regenerated = []  # the same prompt ids with other answers
    for e in examples:
        other_answer = [1 + t % (VOCAB - 1) for t in e.input_ids[e.answer_start:]]
        regenerated.append(Example(e.id, e.input_ids[: e.answer_start] + other_answer, e.answer_start))
    cached = CachedFeatures(tmp_path / "cache", target, [1, 2], regenerated, progress=False)
    for e in regenerated:
        for x, y in zip(OnlineFeatures(target, [1, 2])([e]), cached([e])):
            torch.testing.assert_close(x, y, atol=2e-2, rtol=1e-2)


def test_a_cache_run_killed_mid_write_resumes_without_reading_a_torn_file(tmp_path, monkeypatch):
    import dspark_hf.training.features as features_module

    target = tiny_target("llama")
    examples = load_dataset(tiny_dataset(tmp_path, target))
    real_save = features_module.save_file

    def killed_after_half_a_file(tensors, path):
        real_save(tensors, path)
        with open(path, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(features_module, "save_file", killed_after_half_a_file)
    with pytest.raises(KeyboardInterrupt):
        CachedFeatures(tmp_path / "cache", target, [1, 2], examples, progress=False)
    monkeypatch.setattr(features_module, "save_file", real_save)
    resumed = CachedFeatures(tmp_path / "cache", target, [1, 2], examples, progress=False)
    for x, y in zip(OnlineFeatures(target, [1, 2])(examples[:1]), resumed(examples[:1])):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("head_type", ["markov", "none"])
def test_a_short_training_run_lowers_the_loss_and_saves_a_loadable_draft(tmp_path, head_type):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=16)
    config = TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), epochs=12, batch_size=4,
                         anchors_per_sequence=8, learning_rate=3e-3, heldout_fraction=0.0, save_every=5,
                         draft=dict(num_hidden_layers=1, markov_rank=8, block_size=3, head_type=head_type,
                                    draft_vocab_size=40))
    examples = load_dataset(data)

    def loss_of(draft):
        from dspark_hf.training.objective import train_step

        torch.manual_seed(0)
        losses, _ = train_step(draft, target, examples, OnlineFeatures(target, draft.config.target_layer_ids), 8,
                               LossWeights(), torch.Generator().manual_seed(0))
        return float(losses["total"].detach())

    before = loss_of(make_draft(target, config, examples))
    draft = train(config, target=target, progress=False)
    after = loss_of(draft)
    assert after < before * 0.95
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "run").bind_target(target)
    assert loaded.config.draft_vocab_size == 40 and loaded.config.head_type == head_type
    assert loss_of(loaded) == pytest.approx(after, rel=1e-3)


def checkpointed_run(tmp_path, target, **settings) -> dict:
    """TrainConfig settings of a small run into tmp_path/run on 8 sequences, 2 steps an epoch, a checkpoint every 2."""
    data = tiny_dataset(tmp_path, target, n=8)
    return dict(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
                heldout_fraction=0.0, save_every=2, draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3),
                **settings)


def test_training_resumes_from_the_last_checkpoint_and_says_from_which_step(tmp_path, capsys):
    target = tiny_target("llama")
    kw = checkpointed_run(tmp_path, target)
    train(TrainConfig(epochs=2, **kw), target=target, progress=False)  # 4 steps, checkpoints at 2 and 4
    assert (tmp_path / "run" / "checkpoint-4" / "trainer_state.pt").exists()
    assert "resuming" not in capsys.readouterr().out
    resumed = train(TrainConfig(epochs=3, **kw), target=target, progress=False)  # continues at step 4
    assert (tmp_path / "run" / "checkpoint-6").exists() and resumed is not None
    assert re.search(r"resuming .*run from checkpoint-4 at step 4 of 6", capsys.readouterr().out)


class FakeClock:
    """time.perf_counter for the trainer, advanced by `step_seconds` for every training step."""

    def __init__(self, monkeypatch, step_seconds: float):
        import dspark_hf.training.trainer as trainer

        self.now, real_step = 0.0, trainer.train_step
        monkeypatch.setattr(trainer.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(trainer, "clock", lambda device: self.now)

        def timed_step(*args, **kwargs):
            self.now += step_seconds
            return real_step(*args, **kwargs)

        monkeypatch.setattr(trainer, "train_step", timed_step)


def test_a_time_budget_fits_the_schedule_and_finishes_inside_it(tmp_path, monkeypatch):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    fake = FakeClock(monkeypatch, step_seconds=1.0)
    draft = train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), time_budget=0.5, epochs=1,
                              batch_size=4, anchors_per_sequence=4, heldout_fraction=0.3, save_every=1000,
                              draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)),
                  target=target, progress=False)
    report = json.loads((tmp_path / "run" / "heldout.json").read_text())
    assert fake.now <= 30  # the held-out report's steps (each 1 s here) included
    assert report["training"]["steps"] >= 15  # far more than epochs=1 (2-3 steps) would give: the budget rules
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "run")
    assert loaded.config.num_hidden_layers == 1 and draft is not None


def test_any_prefix_of_the_held_out_batches_costs_one_forward_pass_a_batch():
    # the report batches each domain apart, so the time budget's reserve must count its batches the same way
    from types import SimpleNamespace

    from dspark_hf.training.trainer import _domain_batches

    examples = [SimpleNamespace(domain=f"d{i % 9}", i=i) for i in range(30)]  # 9 domains of 3-4 examples
    batches = _domain_batches(examples, batch_size=4)
    assert len(batches) == 9 and {b[0].domain for b in batches[:3]} == {"d0", "d1", "d2"}
    for k in range(len(batches) + 1):
        measured = [ex for b in batches[:k] for ex in b]
        per_domain = {d: sum(ex.domain == d for ex in measured) for d in {ex.domain for ex in measured}}
        assert sum(math.ceil(n / 4) for n in per_domain.values()) == k


def test_an_invocation_that_reaches_stop_after_saves_and_the_next_one_finishes(tmp_path, monkeypatch):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    kw = dict(dataset=str(data), output_dir=str(tmp_path / "run"), time_budget=0.8, stop_after=0.5, batch_size=4,
              anchors_per_sequence=4, heldout_fraction=0.3, save_every=1000,
              draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    fake = FakeClock(monkeypatch, step_seconds=1.0)
    train(TrainConfig(**kw), target=target, progress=False)
    assert fake.now <= 30 and not (tmp_path / "run" / "heldout.json").exists()
    state = torch.load(next((tmp_path / "run").glob("checkpoint-*")) / "trainer_state.pt", weights_only=False)
    assert state["step"] > 0 and 0 < state["clock"]["spent"] <= 30

    fake = FakeClock(monkeypatch, step_seconds=1.0)  # a new process: its own clock from 0
    train(TrainConfig(**kw), target=target, progress=False)
    report = json.loads((tmp_path / "run" / "heldout.json").read_text())
    assert report["training"]["steps"] > state["step"] and report["training"]["minutes"] <= 0.8


@pytest.mark.parametrize("stop_after_steps", [1, 4])  # inside the first epoch of 3 steps, and inside the second
def test_a_run_stopped_inside_an_epoch_and_resumed_ends_where_an_uninterrupted_one_does(tmp_path, monkeypatch,
                                                                                         stop_after_steps):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    kw = dict(dataset=str(data), batch_size=4, anchors_per_sequence=4, heldout_fraction=0.0, save_every=1000,
              epochs=2, draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    straight = train(TrainConfig(output_dir=str(tmp_path / "straight"), **kw), target=target, progress=False)
    FakeClock(monkeypatch, step_seconds=60.0)  # a minute a step: stop_after counts steps
    train(TrainConfig(output_dir=str(tmp_path / "resumed"), stop_after=stop_after_steps + 0.5, **kw), target=target,
          progress=False)
    monkeypatch.undo()
    resumed = train(TrainConfig(output_dir=str(tmp_path / "resumed"), **kw), target=target, progress=False)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name  # the same anchors and lags were drawn after the resume


def test_a_resumed_run_keeps_the_batch_size_auto_find_chose_when_it_started(tmp_path, monkeypatch):
    import dspark_hf.training.trainer as trainer

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    kw = dict(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, auto_find_batch_size=True,
              anchors_per_sequence=4, heldout_fraction=0.0, save_every=1000, epochs=2,
              draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    found = iter([2, 6])  # the memory a resume sees may fit another batch
    monkeypatch.setattr(trainer, "find_batch_size", lambda *a: next(found))
    FakeClock(monkeypatch, step_seconds=60.0)
    train(TrainConfig(stop_after=1.5, **kw), target=target, progress=False)
    state = torch.load(next((tmp_path / "run").glob("checkpoint-*")) / "trainer_state.pt", weights_only=False)
    assert state["batch_size"] == 2
    train(TrainConfig(**kw), target=target, progress=False)
    assert next(found) == 6, "the resumed run did not search again: it goes on in the batches it started with"


def test_the_learning_rate_warms_up_then_decays_to_zero_without_wasting_a_step():
    from dspark_hf.training.trainer import lr_factor

    steps = [(s / 20, (s + 1) / 20) for s in range(20)]  # each step spans [start, end] of the run
    factors = [lr_factor(a, b, 0.1) for a, b in steps]
    assert factors[:2] == [0.5, 1.0] and lr_factor(0.55, 0.6, 0.1) == pytest.approx(0.5)
    assert factors[2:] == sorted(factors[2:], reverse=True) and 0 < factors[-1] < 0.05
    assert lr_factor(0.0, 1.0, 0.04) == 1.0  # a one-step run trains at full rate


def test_forward_kl_to_the_target_is_added_when_weighted():
    target = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    draft = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))
    args = (draft, target, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    plain, with_kl = dspark_losses(*args), dspark_losses(*args, weights=LossWeights(kl=2.0))
    kl = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)  # sum p_t log(p_t / p_d)
    assert "kl" not in plain and float(with_kl["kl"]) == pytest.approx(kl, abs=1e-6)
    assert float(with_kl["total"] - plain["total"]) == pytest.approx(2.0 * kl, abs=1e-6)


def test_the_heldout_report_gives_each_domain_and_their_macro(tmp_path):
    target = tiny_target("llama")
    draft = tiny_draft(target)
    prompts = [{"id": f"p{i}", "domain": ["chat", "code"][i % 2], "messages": [{"role": "user", "content": "ab" * i}]}
               for i in range(1, 7)]
    path = tmp_path / "data.jsonl"
    prepare_data(target, TinyTokenizer(), iter(prompts), path, None, batch_size=4, progress=False,
                 settings=GenerationSettings(max_new_tokens=12))
    report = evaluate_heldout(draft, target, load_dataset(path), OnlineFeatures(target, draft.config.target_layer_ids),
                              4, LossWeights())
    assert set(report["domains"]) == {"chat", "code"} and report["sequences"] == 6
    assert report["macro_expected_greedy_tau"] == pytest.approx(
        (report["domains"]["chat"]["expected_greedy_tau"] + report["domains"]["code"]["expected_greedy_tau"]) / 2)


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one mixed-precision setting per process; let a test choose its own, then restore."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.mark.parametrize("mixed_precision, native, autocast", [
    ("auto", True, torch.bfloat16), ("auto", False, None), ("no", True, None), ("bf16", False, torch.bfloat16)])
def test_training_on_cpu_autocasts_in_bf16_where_the_cpu_has_bf16_units_or_when_asked(
        tmp_path, fresh_accelerate_state, monkeypatch, mixed_precision, native, autocast):
    """By default a CPU trains as a GPU does where it has bfloat16 matrix units (AVX512-BF16, AMX): the draft under
    bf16 autocast, the target in bfloat16; elsewhere in fp32."""
    from dspark_hf.training import trainer

    monkeypatch.setattr(trainer, "computes_bfloat16_natively", lambda device: native)
    seen, real_forward = [], DSparkDraftModel.forward

    def recording_forward(self, *args, **kwargs):  # what the draft's layers run under, whoever wraps forward
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(DSparkDraftModel, "forward", recording_forward)
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    draft = train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), epochs=2, batch_size=4,
                              anchors_per_sequence=4, heldout_fraction=0.3, save_every=100,
                              mixed_precision=mixed_precision,
                              draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)),
                  target=target, progress=False)
    steps = len(seen) - 1  # the last call is the held-out evaluation, in the draft's own dtype
    assert steps >= 2 and seen[:steps] == [autocast] * steps and seen[-1] is None
    assert {p.dtype for p in draft.parameters()} == {torch.float32}  # autocast keeps fp32 master weights
    assert target.dtype == (torch.bfloat16 if native else torch.float32)  # target_dtype "auto"


def test_unusable_mixed_precision_settings_are_refused(tmp_path):
    kw = dict(dataset=str(tmp_path / "unused.jsonl"), output_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        train(TrainConfig(mixed_precision="fp8", **kw), target=tiny_target("llama"))
    if not torch.cuda.is_available():  # accelerate would train in fp32 and say nothing
        with pytest.raises(ValueError, match="fp16.*needs a GPU"):
            train(TrainConfig(mixed_precision="fp16", **kw), target=tiny_target("llama"))


def test_fine_tuning_refuses_a_draft_shape_it_would_ignore(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    tiny_draft(target).save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="fine-tuning .* keeps the saved draft's shape"):
        TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), init_from=str(tmp_path / "saved"),
                    draft={"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="draft_vocab_size"):
        TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), lora=True, draft={"draft_vocab_size": 0})
    with pytest.raises(ValueError, match="copy_target_layers initialises a fresh draft"):
        TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), init_from=str(tmp_path / "saved"),
                    copy_target_layers=True)
    assert not (tmp_path / "run").exists(), "refused before anything is written"


def test_dspark_train_flags_shape_a_fresh_draft_and_are_refused_when_fine_tuning(tmp_path, monkeypatch, capsys):
    from dspark_hf.cli import main

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)  # tiny target: none
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=8)
    run = ["train", "--target", str(tmp_path / "target"), "--dataset", str(data), "--epochs", "1",
           "--batch-size", "8", "--heldout-fraction", "0", "--anchors", "2"]
    assert main(run + ["--output-dir", str(tmp_path / "fresh"), "--layers", "1", "--draft-vocab-size", "16"]) == 0
    config = json.loads((tmp_path / "fresh" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["draft_vocab_size"]) == (1, 16)
    assert (config["head_type"], config["markov_rank"], config["block_size"]) == ("markov", 128, 7)  # defaults
    assert config["trained_block_size"] == 7  # what a later load compares its block_size with

    assert main(run + ["--output-dir", str(tmp_path / "tuned"), "--init-from", str(tmp_path / "fresh")]) == 0
    assert "num_hidden_layers" in cli_error(capsys, run + ["--output-dir", str(tmp_path / "bad"), "--init-from",
                                                        str(tmp_path / "fresh"), "--layers", "2"])


def test_add_qk_norm_gives_a_saved_draft_the_engines_layer_shape_and_keeps_every_other_weight(tmp_path, monkeypatch,
                                                                                             capsys):
    from dspark_hf.cli import main

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)  # tiny target: none
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    DSparkDraftModel.from_target(target, qk_norm=False).save_pretrained(tmp_path / "unnormed")  # as drafts were made
    data = tiny_dataset(tmp_path, target, n=8)
    run = ["train", "--target", str(tmp_path / "target"), "--dataset", str(data), "--max-steps", "1", "--lr", "1e-12",
           "--batch-size", "8", "--heldout-fraction", "0", "--anchors", "2", "--init-from", str(tmp_path / "unnormed")]
    assert main(run + ["--output-dir", str(tmp_path / "normed"), "--add-qk-norm"]) == 0
    before = DSparkDraftModel.from_pretrained(tmp_path / "unnormed").state_dict()
    after = DSparkDraftModel.from_pretrained(tmp_path / "normed")
    assert after.config.qk_norm
    added = {k: v for k, v in after.state_dict().items() if k not in before}
    assert sorted(added) == sorted(f"layers.{i}.self_attn.{n}_norm.weight" for i in range(len(after.layers))
                                   for n in "qk")
    # one step of 1e-12 leaves every weight where the run started it
    assert all(torch.allclose(v, torch.ones_like(v), rtol=0, atol=1e-9) for v in added.values())  # at one
    assert all(torch.allclose(after.state_dict()[k], v, rtol=0, atol=1e-9) for k, v in before.items())  # carried
    # a fresh draft has them, and a draft that has them needs none added
    assert "--init-from" in cli_error(capsys, run[:-2] + ["--output-dir", str(tmp_path / "x"), "--add-qk-norm"])
    assert "already" in cli_error(capsys, run[:-1] + [str(tmp_path / "normed"), "--output-dir", str(tmp_path / "y"),
                                                      "--add-qk-norm"])


def test_fine_tuning_a_bf16_checkpoint_trains_fp32_weights(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    tiny_draft(target).to(torch.bfloat16).save_pretrained(tmp_path / "exported")  # as `dspark export` saves
    draft = train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), epochs=1, batch_size=4,
                              anchors_per_sequence=4, heldout_fraction=0.0, init_from=str(tmp_path / "exported")),
                  target=target, progress=False)
    assert {p.dtype for p in draft.parameters()} == {torch.float32}


def test_a_feature_cache_serves_any_subset_of_its_layers_and_refuses_others(tmp_path):
    target = tiny_target("llama")
    examples = load_dataset(tiny_dataset(tmp_path, target, n=4))
    CachedFeatures(tmp_path / "cache", target, [0, 1], examples, progress=False)
    subset = CachedFeatures(tmp_path / "cache", target, [1, 0], examples, progress=False)
    for x, y in zip(subset(examples[:2]), OnlineFeatures(target, [1, 0])(examples[:2])):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="not for layers \\[2\\]"):
        CachedFeatures(tmp_path / "cache", target, [2], examples, progress=False)
    with pytest.raises(ValueError, match="in torch.bfloat16"):
        CachedFeatures(tmp_path / "cache", target.to(torch.bfloat16), [0], examples, progress=False)
    retrained = tiny_target("llama", seed=1)  # the same name, shape and dtype; other weights
    with pytest.raises(ValueError, match="with other weights"):
        CachedFeatures(tmp_path / "cache", retrained, [0], examples, progress=False)


def test_dspark_train_flags_are_train_config_s_fields_with_its_defaults():
    from dataclasses import fields

    from dspark_hf.cli import build_parser

    args = build_parser().parse_args(["train", "--dataset", "d.jsonl", "--output-dir", "out"])
    config = TrainConfig(dataset="d.jsonl", output_dir="out")
    for f in fields(TrainConfig):
        if f.name != "draft":
            assert getattr(args, f.name) == getattr(config, f.name), f.name
    tuned = build_parser().parse_args(["train", "--dataset", "d", "--output-dir", "o", "--lr", "3e-3", "--anchors",
                                       "96", "--loss-ce", "0.5", "--lora-heads", "confidence", "--lora"])
    assert (tuned.learning_rate, tuned.anchors_per_sequence, tuned.loss_ce, tuned.lora_heads, tuned.lora) == \
        (3e-3, 96, 0.5, "confidence", True)


def test_a_fresh_draft_has_one_default_shape_from_the_api_and_from_training(tmp_path):
    from dspark_hf import DSparkConfig

    target = tiny_target("llama")
    defaults = DSparkConfig()
    from_api = DSparkDraftModel.from_target(target).config
    trained = make_draft(target, TrainConfig(dataset="d", output_dir="o"), []).config
    for config in (from_api, trained):
        assert (config.num_hidden_layers, config.markov_rank, config.block_size, config.head_type) == \
            (defaults.num_hidden_layers, defaults.markov_rank, defaults.block_size, defaults.head_type)


def test_feature_lag_trains_blocks_that_see_their_last_tokens_without_features(tmp_path, monkeypatch):
    """`dspark train --feature-lag 3`: each block's last 0..3 context tokens enter as known tokens (the ids right
    before the anchor, right-aligned), the context the block sees ends before them, and lag 0 is training as usual;
    `--feature-lag-weights` draws the lags in proportion to the weights given."""
    from unittest.mock import ANY

    from dspark_hf.training import objective
    from dspark_hf.training.objective import lagged_tokens, train_step

    ids = torch.arange(100, 120)[None].expand(2, -1)
    anchors = torch.tensor([[1, 10, 15], [2, 8, 19]])
    known = lagged_tokens(ids, anchors, 3, torch.Generator().manual_seed(0))
    assert known.shape == (2, 3, 3)
    for b in range(2):
        for a in range(3):
            row, anchor = known[b, a].tolist(), int(anchors[b, a])
            lag = sum(t >= 0 for t in row)
            assert row == [-1] * (3 - lag) + list(range(100 + anchor - lag, 100 + anchor)), "ids right before it"
    lags = {sum(t >= 0 for t in row) for row in lagged_tokens(ids, anchors.repeat(1, 30), 3,
                                                              torch.Generator().manual_seed(1)).view(-1, 3).tolist()}
    assert lags == {0, 1, 2, 3}
    weighted = lagged_tokens(ids, torch.tensor([[5, 10, 15]]).repeat(2, 2000), 3, torch.Generator().manual_seed(2),
                             lag_weights=[6, 3, 0, 1])  # as SSD meets them: mostly lag 0, never lag 2 here
    counts = torch.bincount((weighted >= 0).sum(-1).flatten(), minlength=4) / weighted[..., 0].numel()
    assert counts[2] == 0 and counts.tolist() == pytest.approx([0.6, 0.3, 0.0, 0.1], abs=0.02)
    exact = lagged_tokens(ids, anchors, 3, None, exact=True)  # what heldout reports at one lag use
    assert exact[0, 1].tolist() == [107, 108, 109] and exact[0, 0].tolist() == [-1, -1, 100], "none before 0"

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=4)
    examples = load_dataset(data)
    draft = make_draft(target, TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"),
                                           draft=dict(num_hidden_layers=1, markov_rank=8, block_size=3)), examples)
    seen = []
    forward = draft.forward

    def recording(*args, **kwargs):
        seen.append(kwargs["known"])
        return forward(*args, **kwargs)

    draft.forward = recording
    features = OnlineFeatures(target, draft.config.target_layer_ids)
    plain, _ = train_step(draft, target, examples, features, 4, LossWeights(), torch.Generator().manual_seed(0))
    lagged, _ = train_step(draft, target, examples, features, 4, LossWeights(), torch.Generator().manual_seed(0),
                           feature_lag=4)
    assert seen[0] is None and seen[1].shape[-1] == 4 and bool((seen[1] >= 0).any())
    assert float(lagged["total"].detach()) != pytest.approx(float(plain["total"].detach()))
    with pytest.raises(ValueError, match="feature_lag=-1"):
        TrainConfig(dataset="d", output_dir="o", feature_lag=-1)
    drawn = []
    monkeypatch.setattr(objective, "lagged_tokens", lambda *args: drawn.append(args[2:]) or lagged_tokens(*args))
    train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "weighted"), max_steps=2, feature_lag=3,
                      feature_lag_weights=[0, 0, 0, 1]), target=target, progress=False)
    assert drawn == [(3, ANY, False, [0, 0, 0, 1])] * 2, "`dspark train` draws its lags by the weights given"
    for lag, weights in ((3, [1, 1]), (0, [1]), (1, [1, -1]), (1, [0, 0])):
        with pytest.raises(ValueError, match=r"feature_lag_weights=.*one per lag 0..feature_lag"):
            TrainConfig(dataset="d", output_dir="o", feature_lag=lag, feature_lag_weights=weights)


def test_a_fresh_draft_beside_a_bfloat16_target_trains_float32_weights_as_a_resumed_one_does():
    target = tiny_target("llama").to(torch.bfloat16)
    config = TrainConfig(dataset="", output_dir="", copy_target_layers=True,
                         draft=dict(num_hidden_layers=2, markov_rank=4, block_size=3))
    draft = make_draft(target, config, [])
    assert {p.dtype for p in draft.parameters()} == {torch.float32}
    for own, theirs in zip(draft.layers, target.model.layers[2:]):  # copied exactly (bf16 values fit float32)
        for name, weight in theirs.state_dict().items():
            assert torch.equal(own.state_dict()[name], weight.float())


def test_a_run_resumes_only_with_the_settings_that_define_it(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    kw = dict(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
              heldout_fraction=0.0, save_every=2, max_steps=4, draft=dict(num_hidden_layers=1, markov_rank=4,
                                                                          block_size=3))
    train(TrainConfig(**kw), target=target, progress=False)  # checkpoints at 2 and 4
    saved = (tmp_path / "run" / "train_config.json").read_text()
    for change, named in ((dict(draft=dict(num_hidden_layers=2, markov_rank=4, block_size=5)), "draft"),
                          (dict(heldout_fraction=0.3), "heldout_fraction 0.0 -> 0.3"), (dict(seed=1), "seed"),
                          (dict(learning_rate=3e-3), "learning_rate"), (dict(dataset=str(tmp_path / "x.jsonl")),
                                                                        "dataset")):
        with pytest.raises(ValueError, match=f"holds a run started with other settings \\({named}") as refused:
            train(TrainConfig(**{**kw, **change}), target=target, progress=False)
        assert "\n" not in str(refused.value)
        assert (tmp_path / "run" / "train_config.json").read_text() == saved, "the record still says what it holds"
    # how long, how often it saves and where it runs may change
    train(TrainConfig(**{**kw, "max_steps": 6, "save_every": 3, "device": "cpu", "stop_after": 60.0}),
          target=target, progress=False)
    assert (tmp_path / "run" / "checkpoint-6").exists()
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["max_steps"] == 6


def test_lora_beside_a_bfloat16_target_trains_float32_adapters_and_heads_and_resumes_them(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    tiny_draft(target, num_hidden_layers=1, markov_rank=4, block_size=3).save_pretrained(tmp_path / "base")
    kw = dict(dataset=str(data), output_dir=str(tmp_path / "run"), lora=True, init_from=str(tmp_path / "base"),
              target_dtype="bfloat16", batch_size=4, anchors_per_sequence=4, heldout_fraction=0.0, save_every=2)
    for steps in (2, 3):  # a fresh run, then one resumed from its checkpoint
        model = train(TrainConfig(max_steps=steps, **kw), target=target, progress=False)
        trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
        assert any("confidence" in n for n in trained) and set(trained.values()) == {torch.float32}, trained


def test_a_checkpoint_killed_while_saving_leaves_the_one_before_to_resume_from(tmp_path, monkeypatch):
    import dspark_hf.training.checkpoints as checkpoints

    target = tiny_target("llama")
    kw = checkpointed_run(tmp_path, target)
    train(TrainConfig(max_steps=4, **kw), target=target, progress=False)
    real_save = torch.save

    def killed(obj, path):  # the process dies halfway through writing the trainer state
        Path(path).write_bytes(b"PK\x03\x04" + b"\0" * 64)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(max_steps=6, **kw), target=target, progress=False)
    monkeypatch.setattr(checkpoints.torch, "save", real_save)
    assert not (tmp_path / "run" / "checkpoint-6" / "trainer_state.pt").exists(), "written whole or not at all"
    # a state torn by an earlier version (written in place) is passed over, with a word, for the one before
    state = tmp_path / "run" / "checkpoint-4" / "trainer_state.pt"
    cut_in_half(state)
    with pytest.warns(UserWarning, match="state of checkpoint-4 .* does not load .* resuming from checkpoint-2"):
        train(TrainConfig(max_steps=6, **kw), target=target, progress=False)
    assert torch.load(tmp_path / "run" / "checkpoint-6" / "trainer_state.pt", weights_only=False)["step"] == 6


def test_a_block_longer_than_every_answer_is_refused_before_anything_is_written(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)  # answers of 24 tokens: block positions up to 23 learn
    kw = dict(dataset=str(data), batch_size=4, anchors_per_sequence=4, heldout_fraction=0.0, max_steps=1)
    with pytest.raises(ValueError, match="block_size 24 is more than the longest training answer .* at most 23"):
        train(TrainConfig(output_dir=str(tmp_path / "run"), draft=dict(num_hidden_layers=1, markov_rank=4,
                                                                         block_size=24), **kw), target=target)
    assert not (tmp_path / "run").exists()
    train(TrainConfig(output_dir=str(tmp_path / "ok"), draft=dict(num_hidden_layers=1, markov_rank=4, block_size=23),
                      **kw), target=target, progress=False)


def test_a_missing_init_from_folder_is_named(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=4)
    with pytest.raises(ValueError, match="init_from .*nowhere: no such folder"):
        train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), init_from=str(tmp_path / "nowhere")),
              target=target)
    assert not (tmp_path / "run").exists()


def test_an_invocation_stopped_before_its_first_step_says_so_and_dspark_train_does_not_claim_a_saved_draft(
        tmp_path, monkeypatch, capsys):
    from dspark_hf.cli import main

    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: None)  # tiny target: none
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=8)
    run = ["train", "--target", str(tmp_path / "target"), "--dataset", str(data), "--output-dir",
           str(tmp_path / "run"), "--max-steps", "2", "--batch-size", "4", "--anchors", "2", "--heldout-fraction", "0",
           "--layers", "1", "--markov-rank", "4", "--block-size", "3"]
    capsys.readouterr()
    with pytest.warns(UserWarning) as warned:  # 1.2 s: less than the time a checkpoint is given to save
        assert main(run + ["--stop-after", "0.02"]) == 0
    messages = [str(w.message) for w in warned]
    assert any("stop_after=0.02 min ran out before the first training step" in m for m in messages), messages
    assert not any("time_budget" in m for m in messages), messages
    out = capsys.readouterr().out
    assert "not finished" in out and "run the same command again" in out and "draft saved" not in out
    assert main(run) == 0  # the next invocation resumes and finishes
    assert "draft saved to" in capsys.readouterr().out


def _as_saved_on_a_gpu(state_file: Path) -> None:
    """Rewrite a trainer state as torch.save writes it on a GPU: its tensors tagged cuda:0, the optimizer fused."""
    import torch.serialization as serialization

    state = torch.load(state_file, weights_only=False)
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = True
    real_tag = serialization.location_tag
    serialization.location_tag = lambda storage: "cuda:0"
    try:
        torch.save(state, state_file)
    finally:
        serialization.location_tag = real_tag


def test_a_checkpoint_saved_on_a_gpu_resumes_on_a_cpu(tmp_path):
    target = tiny_target("llama")
    kw = checkpointed_run(tmp_path, target, device="cpu")
    train(TrainConfig(max_steps=2, **kw), target=target, progress=False)
    _as_saved_on_a_gpu(tmp_path / "run" / "checkpoint-2" / "trainer_state.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no word of a torn save: the checkpoint is whole
        train(TrainConfig(max_steps=4, **kw), target=target, progress=False)
    state = torch.load(tmp_path / "run" / "checkpoint-4" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and state["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"


def test_a_whole_checkpoint_that_fails_to_load_is_reported_not_passed_over_as_torn(tmp_path, monkeypatch):
    import dspark_hf.training.checkpoints as checkpoints

    target = tiny_target("llama")
    kw = checkpointed_run(tmp_path, target)
    train(TrainConfig(max_steps=4, **kw), target=target, progress=False)

    def unloadable(*args, **kwargs):
        raise RuntimeError("a reason that has nothing to do with a killed save")

    monkeypatch.setattr(checkpoints.torch, "load", unloadable)
    with pytest.raises(ValueError, match="checkpoint-4/trainer_state.pt is whole but does not load .*a reason that") \
            as refused:
        train(TrainConfig(max_steps=6, **kw), target=target, progress=False)
    assert "\n" not in str(refused.value)


def test_a_checkpoint_whose_weights_were_damaged_after_its_state_says_to_remove_it_and_the_one_before_resumes(
        tmp_path):
    target = tiny_target("llama")
    kw = checkpointed_run(tmp_path, target)
    train(TrainConfig(max_steps=4, **kw), target=target, progress=False)
    damaged = tmp_path / "run" / "checkpoint-4"
    cut_in_half(damaged / "model.safetensors")
    with pytest.raises(ValueError, match=rf"weights of {damaged} do not load \(.*incomplete metadata.*\): remove "
                                         rf"{damaged} to resume from the checkpoint before it"):
        train(TrainConfig(max_steps=6, **kw), target=target, progress=False)
    shutil.rmtree(damaged)
    train(TrainConfig(max_steps=6, **kw), target=target, progress=False)
    assert (tmp_path / "run" / "checkpoint-6").exists()


def test_heldout_json_is_written_last_and_whole_so_a_run_killed_while_saving_its_draft_does_not_read_as_finished(
        tmp_path, monkeypatch):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    real_save = DSparkDraftModel.save_pretrained

    def killed_in_the_final_save(self, path, *args, **kwargs):
        if Path(path) == tmp_path / "run":  # checkpoints go to checkpoint-N
            raise KeyboardInterrupt
        return real_save(self, path, *args, **kwargs)

    monkeypatch.setattr(DSparkDraftModel, "save_pretrained", killed_in_the_final_save)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
                          heldout_fraction=0.3, max_steps=2, save_every=1000,
                          draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)), target=target, progress=False)
    assert not (tmp_path / "run" / "heldout.json").exists()


def test_under_stop_after_a_call_killed_during_the_held_out_report_resumes_at_the_last_step(tmp_path, monkeypatch):
    import dspark_hf.training.trainer as trainer

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    kw = dict(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
              heldout_fraction=0.3, max_steps=3, save_every=1000, stop_after=60.0,
              draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    real_report = trainer.evaluate_heldout

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "evaluate_heldout", killed)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**kw), target=target, progress=False)
    assert torch.load(tmp_path / "run" / "checkpoint-3" / "trainer_state.pt", weights_only=False)["step"] == 3
    monkeypatch.setattr(trainer, "evaluate_heldout", real_report)
    train(TrainConfig(**kw), target=target, progress=False)
    assert json.loads((tmp_path / "run" / "heldout.json").read_text())["training"]["steps"] == 3


def test_a_held_out_report_that_would_run_past_stop_after_is_left_to_the_next_call(tmp_path, monkeypatch, capsys):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=12)
    # two steps of a minute, then a report of about a minute: past stop_after 2.5
    kw = dict(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
              heldout_fraction=0.3, max_steps=2, save_every=1000, stop_after=2.5,
              draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3))
    fake = FakeClock(monkeypatch, step_seconds=60.0)
    assert train(TrainConfig(**kw), target=target, progress=False).training  # unfinished
    assert fake.now <= 150 and not (tmp_path / "run" / "heldout.json").exists()
    assert "before the held-out report and the final save" in capsys.readouterr().out
    fake = FakeClock(monkeypatch, step_seconds=60.0)  # the next call: it takes no step, and reports
    assert not train(TrainConfig(**kw), target=target, progress=False).training
    assert json.loads((tmp_path / "run" / "heldout.json").read_text())["training"]["steps"] == 2 and fake.now == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_every_data_parallel_rank_takes_the_same_number_of_steps_each_with_examples(tmp_path, monkeypatch, rank):
    import accelerate

    import dspark_hf.training.trainer as trainer

    class OneOfTwoProcesses(accelerate.Accelerator):  # what `accelerate launch` on two GPUs gives each process
        num_processes = property(lambda self: 2)
        process_index = property(lambda self: rank)
        is_main_process = property(lambda self: rank == 0)

    monkeypatch.setattr(accelerate, "Accelerator", OneOfTwoProcesses)
    batches, real_step, real_must_stop = [], trainer.train_step, trainer.RunClock.must_stop

    def recorded(draft, target, examples, *args, **kwargs):
        batches.append(len(examples))
        return real_step(draft, target, examples, *args, **kwargs)

    def bounded(self):  # a rank whose loop goes round without stepping would otherwise never return
        assert len(batches) <= 4, "more steps than two epochs of two"
        bounded.checks = getattr(bounded, "checks", 0) + 1
        assert bounded.checks < 100, f"looping without a step after {len(batches)} steps"
        return real_must_stop(self)

    monkeypatch.setattr(trainer, "train_step", recorded)
    monkeypatch.setattr(trainer.RunClock, "must_stop", bounded)
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=9)  # 2 steps an epoch of 2 x 4: 5 examples for one rank, 4 for the other
    train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
                      heldout_fraction=0.0, epochs=2, save_every=1000,
                      draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)), target=target, progress=False)
    assert len(batches) == 4 and min(batches) >= 1, batches


def test_auto_find_batch_size_finds_a_batch_whose_steps_with_the_longest_feature_lag_fit(tmp_path, monkeypatch):
    import contextlib
    from types import SimpleNamespace

    import dspark_hf.training.trainer as trainer
    from dspark_hf.training.trainer import find_batch_size

    target = tiny_target("llama")
    examples = load_dataset(tiny_dataset(tmp_path, target, n=8))
    draft = tiny_draft(target, num_hidden_layers=1, markov_rank=4, block_size=3)
    config = TrainConfig(dataset="", output_dir="", batch_size=8, anchors_per_sequence=4, feature_lag=4)
    real_step = trainer.train_step

    def in_a_gpu_of_20_block_rows(draft, target, batch, *args, feature_lag=0, **kwargs):
        if len(batch) * (draft.config.block_size + feature_lag) > 20:  # a lagged block holds its lag's tokens too
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real_step(draft, target, batch, *args, feature_lag=feature_lag, **kwargs)

    monkeypatch.setattr(trainer, "train_step", in_a_gpu_of_20_block_rows)
    gpu = SimpleNamespace(device=torch.device("cuda"), autocast=contextlib.nullcontext)
    size = find_batch_size(draft, target, examples, OnlineFeatures(target, draft.config.target_layer_ids), config,
                           LossWeights(), gpu)
    assert size == 2  # 2 x (3 + 4) rows fit; 4 x 7 do not, although 4 x 3 would


def _lora_adapter(tmp_path, target, data) -> Path:
    tiny_draft(target, num_hidden_layers=1, markov_rank=4, block_size=3).save_pretrained(tmp_path / "base")
    train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "adapter"), lora=True, max_steps=1,
                      init_from=str(tmp_path / "base"), batch_size=4, anchors_per_sequence=4, heldout_fraction=0.0),
          target=target, progress=False)
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    return tmp_path / "adapter"


def test_fine_tuning_from_a_lora_adapter_trains_the_whole_merged_draft_and_saves_a_draft(tmp_path):
    from dspark_hf.loading import load_draft

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    adapter = _lora_adapter(tmp_path, target, data)
    merged = load_draft(str(adapter), target, torch.float32)
    model = train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), init_from=str(adapter),
                              max_steps=1, learning_rate=1e-9, batch_size=4, anchors_per_sequence=4,
                              heldout_fraction=0.0), target=target, progress=False)
    assert type(model) is DSparkDraftModel and all(p.requires_grad for p in model.parameters())
    assert (tmp_path / "run" / "model.safetensors").exists() and not (tmp_path / "run" / "adapter_config.json").exists()
    saved = DSparkDraftModel.from_pretrained(tmp_path / "run").state_dict()
    for name, weight in merged.state_dict().items():  # started from the merged draft (a step at lr 1e-9 moves little)
        torch.testing.assert_close(saved[name].float(), weight, atol=1e-4, rtol=1e-4, msg=name)


def test_lora_on_a_lora_adapter_is_refused_in_one_line(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    adapter = _lora_adapter(tmp_path, target, data)
    with pytest.raises(ValueError, match="is a LoRA adapter .* merge it into its base first") as refused:
        train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), lora=True, init_from=str(adapter),
                          max_steps=1, batch_size=4, anchors_per_sequence=4, heldout_fraction=0.0),
              target=target, progress=False)
    assert "\n" not in str(refused.value)


def _target_with_massive_activations():
    target = tiny_target("llama")
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(3e5)  # hidden states of the first layers about 1e5, past fp16's 65504
    return target


def test_a_feature_cache_refuses_features_that_fp16_cannot_hold_naming_the_layer(tmp_path):
    target = _target_with_massive_activations()
    examples = load_dataset(tiny_dataset(tmp_path, tiny_target("llama"), n=4))
    with pytest.raises(ValueError, match="layer 0 reaches .* fp16 cannot hold: train without --feature-cache") as no:
        CachedFeatures(tmp_path / "cache", target, [0, 1], examples, progress=False)
    assert "\n" not in str(no.value)
    assert not list((tmp_path / "cache").glob("*.safetensors"))


def test_training_stops_in_one_line_at_a_loss_that_is_not_finite(tmp_path, monkeypatch):
    import dspark_hf.training.trainer as trainer

    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=8)
    real_step = trainer.train_step

    def overflowing(*args, **kwargs):
        losses, valid = real_step(*args, **kwargs)
        return {**losses, "total": losses["total"] * math.inf}, valid

    monkeypatch.setattr(trainer, "train_step", overflowing)
    with pytest.raises(ValueError, match="step 1: the training loss is (inf|nan)") as stopped:
        train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), batch_size=4, anchors_per_sequence=4,
                          heldout_fraction=0.0, max_steps=2, draft=dict(num_hidden_layers=1, markov_rank=4,
                                                                        block_size=3)), target=target, progress=False)
    assert "\n" not in str(stopped.value) and not (tmp_path / "run" / "model.safetensors").exists()


def test_a_run_resumes_only_with_the_target_it_was_trained_for(tmp_path):
    target = tiny_target("llama")
    target.config._name_or_path = "first-target"
    kw = checkpointed_run(tmp_path, target)
    train(TrainConfig(max_steps=2, **kw), target=target, progress=False)
    other = tiny_target("llama", seed=1)  # the same shape, other weights
    other.config._name_or_path = "other-target"
    refusal = "trained for the target first-target, .* \\(other-target\\) has other weights"
    with pytest.raises(ValueError, match=refusal) as refused:
        train(TrainConfig(max_steps=4, **kw), target=other, progress=False)
    assert "\n" not in str(refused.value) and not (tmp_path / "run" / "checkpoint-4").exists()
    train(TrainConfig(max_steps=4, **kw), target=target.to(torch.bfloat16), progress=False)  # its dtype may change
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    del saved["target_fingerprint"]  # as a run recorded before train_config.json named its target
    (tmp_path / "run" / "train_config.json").write_text(json.dumps(saved))
    train(TrainConfig(max_steps=6, **kw), target=target, progress=False)
    assert (tmp_path / "run" / "checkpoint-6").exists()


def test_dspark_train_and_prompts_name_a_missing_target_and_a_draft_passed_as_the_target_in_one_line(tmp_path,
                                                                                                   capsys):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=4)
    tiny_draft(target).save_pretrained(tmp_path / "draft")
    run = ["train", "--dataset", str(data), "--output-dir", str(tmp_path / "run"), "--max-steps", "1"]
    assert "the target ./missing_target: no such folder" in cli_error(capsys, run + ["--target", "./missing_target"])
    assert f"the target {tmp_path / 'draft'} is a DSpark draft: pass it as the draft" in cli_error(
        capsys, run + ["--target", str(tmp_path / "draft")])
    assert "the target ./missing_target: no such folder" in cli_error(
        capsys, ["prompts", "--output", str(tmp_path / "p.jsonl"), "--source", "stdlib", "--target",
                 "./missing_target"])
    assert not (tmp_path / "run").exists()


def test_dspark_train_loads_its_target_in_the_dtype_it_trains_with(tmp_path, monkeypatch):
    import dspark_hf.training.trainer as trainer
    from dspark_hf.cli import main

    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    data = tiny_dataset(tmp_path, target, n=8)
    given = []
    monkeypatch.setattr(trainer, "train", lambda config, target, **kw: given.append(target.dtype) or tiny_draft(target))
    main(["train", "--target", str(tmp_path / "target"), "--dataset", str(data), "--output-dir",
          str(tmp_path / "run"), "--target-dtype", "bfloat16"])
    assert given == [torch.bfloat16]  # loaded so, not in float32 and converted: half the host memory


def test_under_bf16_mixed_precision_a_float32_target_teaches_in_float32_and_the_draft_autocasts(
        tmp_path, fresh_accelerate_state, monkeypatch):
    import dspark_hf.training.objective as objective

    seen = {"target": set(), "teacher_logits": set(), "draft": set()}

    def recording(name, forward):
        def recorded(*args, **kwargs):
            seen[name].add(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
            return forward(*args, **kwargs)
        return recorded

    target = tiny_target("llama")
    monkeypatch.setattr(type(target.model), "forward", recording("target", type(target.model).forward))
    # the target's LM head on its last hidden state (the draft's forward also uses that head, for its own logits)
    monkeypatch.setattr(objective, "target_logits", recording("teacher_logits", objective.target_logits))
    monkeypatch.setattr(DSparkDraftModel, "forward", recording("draft", DSparkDraftModel.forward))
    data = tiny_dataset(tmp_path, target, n=8)
    seen["target"].clear()  # the answers' regeneration
    train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), max_steps=2, batch_size=4,
                      anchors_per_sequence=4, heldout_fraction=0.0, mixed_precision="bf16", target_dtype="float32",
                      draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)), target=target, progress=False)
    assert seen == {"target": {None}, "teacher_logits": {None}, "draft": {torch.bfloat16}}, seen


def test_a_dataset_of_answers_given_as_the_prompts_is_refused_naming_the_line(tmp_path):
    data = tiny_dataset(tmp_path, tiny_target("llama"), n=4)  # its lines carry the chat-templated "prompt"
    with pytest.raises(DataFileError, match="data.jsonl:1: a line of a dataset of answers .* pass the prompt file"):
        list(read_prompts(data))


def test_a_torn_last_answer_line_is_cut_in_place_so_a_run_killed_while_cutting_it_keeps_the_answers_before(
        tmp_path, monkeypatch):
    target = tiny_target("llama")
    full = tiny_dataset(tmp_path, target).read_text().splitlines()
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "data.jsonl").write_text("\n".join(full[:5]) + "\n" + full[5][:20])  # killed inside its 6th line
    (torn / "data.manifest.json").write_text(manifest_path(tmp_path / "data.jsonl").read_text())

    def killed_while_rewriting(self, *args, **kwargs):  # the file opened for writing (emptied), then the kill
        self.open("w").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_while_rewriting)
    try:
        tiny_dataset(torn, target)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert (torn / "data.jsonl").read_text().splitlines()[:5] == full[:5]


def test_a_feature_cache_that_names_a_file_is_refused_in_one_line(tmp_path):
    target = tiny_target("llama")
    data = tiny_dataset(tmp_path, target, n=4)
    with pytest.raises(ValueError, match="--feature-cache\\) .*data.jsonl is a file: give a folder"):
        train(TrainConfig(dataset=str(data), output_dir=str(tmp_path / "run"), feature_cache=str(data), max_steps=1,
                          draft=dict(num_hidden_layers=1, markov_rank=4, block_size=3)), target=target, progress=False)
