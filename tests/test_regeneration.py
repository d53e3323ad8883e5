"""Regenerating answers: the static engine (one batch shape, so that a GPU compiles the decoding step once) writes
what the generate() engine writes and keeps to its time budget; a run adds answers to prompts that have none first."""

import json

import pytest

from conftest import tiny_target
from dspark_hf.training import GenerationSettings, load_dataset, prepare_data
from dspark_hf.training.data import answered_ids, manifest_path
from test_training import TinyTokenizer

PROMPTS = [{"id": f"p{i}", "domain": ["chat", "code"][i % 2], "source": "toy",
            "messages": [{"role": "user", "content": f"question {i} " * (1 + i % 3)}]} for i in range(6)]


def test_the_static_engine_writes_what_generate_writes(tmp_path):
    target = tiny_target("llama")
    greedy = GenerationSettings(temperature=0, max_new_tokens=12)
    made = {}
    for engine in ("generate", "static"):
        path = prepare_data(target, TinyTokenizer(), iter(PROMPTS), tmp_path / f"{engine}.jsonl", None, batch_size=4,
                            settings=greedy, max_prompt_tokens=40, progress=False, engine=engine)
        made[engine] = [json.loads(line) for line in path.read_text().splitlines()]
        manifest = json.loads(manifest_path(path).read_text())
        assert manifest["engine"] == engine and manifest["examples"] == 6
        assert manifest["this_call"]["answer_tokens"] == manifest["answer_tokens"] > 0
    # the same lines, key for key: 6 prompts in a batch of 4 and one of 2 (filled to 4 by the static engine)
    assert made["static"] == made["generate"]
    assert len(load_dataset(tmp_path / "static.jsonl")) == 6


def test_the_static_engine_warms_up_outside_the_time_budget_estimate_and_stops_inside_it(tmp_path, monkeypatch):
    import dspark_hf.training.data as data

    target = tiny_target("llama")
    now = [0.0]
    monkeypatch.setattr(data.time, "perf_counter", lambda: now[0])
    real_generate = target.generate
    calls = []

    def timed_generate(*args, **kwargs):  # the warm-up (it compiles on a GPU) takes 20 s, a batch 10 s
        warmup = kwargs.get("stopping_criteria") is not None
        calls.append(("warm-up" if warmup else "batch", kwargs["input_ids"].shape))
        now[0] += 20 if warmup else 10
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", timed_generate)
    path = tmp_path / "data.jsonl"
    prepare_data(target, TinyTokenizer(), iter(PROMPTS), path, None, batch_size=2, max_prompt_tokens=40,
                 settings=GenerationSettings(max_new_tokens=8), progress=False, engine="static", time_budget=45)
    # warm-up to 20 s, batches to 30 and 40 s; a third would end past 45 s
    assert [kind for kind, _ in calls] == ["warm-up", "batch", "batch"]
    assert {shape for _, shape in calls} == {(2, 40)}, "one shape for every call: nothing to compile again"
    assert len(path.read_text().splitlines()) == 4
    this_call = json.loads(manifest_path(path).read_text())["this_call"]
    assert this_call["warmup_seconds"] == 20 and this_call["generation_seconds"] == 20
    assert this_call["answer_tokens_per_second"] == pytest.approx(this_call["answer_tokens"] / 20)


def test_a_run_answers_the_prompts_that_have_no_answer_first_then_adds_second_answers(tmp_path):
    target = tiny_target("llama")
    twice = GenerationSettings(max_new_tokens=8, samples_per_prompt=2)
    first = prepare_data(target, TinyTokenizer(), iter(PROMPTS[:2]), tmp_path / "part-001.jsonl", None,
                         batch_size=4, settings=twice, progress=False)  # p0 and p1, twice each
    assert answered_ids([first]) == {"p0#0", "p0#1", "p1#0", "p1#1"}
    path = tmp_path / "part-002.jsonl"
    prepare_data(target, TinyTokenizer(), iter(PROMPTS), path, None, batch_size=4, settings=twice, seed=1,
                 progress=False, answered=answered_ids([first]))
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert {i for i in ids[:4]} == {"p2#0", "p3#0", "p4#0", "p5#0"}  # first answers first
    assert sorted(ids) == sorted(f"p{i}#{k}" for i in range(2, 6) for k in range(2))
    assert json.loads(manifest_path(path).read_text())["this_call"]["answered_elsewhere"] == 4
    with pytest.raises(ValueError, match="every answer these prompts ask for"):
        prepare_data(target, TinyTokenizer(), iter(PROMPTS[:2]), tmp_path / "none.jsonl", None, settings=twice,
                     progress=False, answered=answered_ids([first]))


def test_a_dataset_is_resumed_with_the_engine_it_was_started_with(tmp_path):
    target = tiny_target("llama")
    path = tmp_path / "data.jsonl"
    kw = dict(batch_size=4, settings=GenerationSettings(max_new_tokens=8), max_prompt_tokens=40, progress=False)
    prepare_data(target, TinyTokenizer(), iter(PROMPTS[:4]), path, None, engine="generate", **kw)
    with pytest.raises(ValueError, match="engine 'generate' -> 'static'"):
        prepare_data(target, TinyTokenizer(), iter(PROMPTS[:4]), path, None, engine="static", **kw)
    manifest = json.loads(manifest_path(path).read_text())
    del manifest["engine"]  # a dataset made before engines existed: made by generate(), and resumed so
    manifest_path(path).write_text(json.dumps(manifest))
    prepare_data(target, TinyTokenizer(), iter(PROMPTS), path, None, engine="generate", **kw)
    assert len(load_dataset(path)) == 6
