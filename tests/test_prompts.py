"""Training prompts: each source reads only installed packages, prompt files travel gzipped, and mixing sources keeps
every prompt once."""

import builtins
import importlib.util
import json

import pytest

from dspark_hf.training import DataFileError, read_prompts
from dspark_hf.training.data import read_jsonl
from dspark_hf.training.prompts import (GYM_CODE, GYM_MATH, collect_prompts, gym_prompts, read_sharegpt,
                                        stdlib_functions, stdlib_prompts, write_prompts)

needs_gym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                               reason="needs `pip install --no-deps reasoning-gym` (CI installs it)")


def test_sharegpt_first_turns_are_read_up_to_the_truncated_tail(tmp_path):
    path = tmp_path / "sharegpt.json"
    conversations = [{"id": "a", "conversations": [{"from": "human", "value": " Hi there "}, {"from": "gpt"}]},
                     {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn first"}]},
                     {"id": "c", "conversations": [{"from": "human", "value": "Second"}]}]
    path.write_text(json.dumps(conversations)[:-40])  # cut inside the last conversation, as the package's file is
    found = [(p["id"], p["domain"], p["messages"][0]["content"]) for p in read_sharegpt(path)]
    assert found == [("a", "chat", "Hi there")]


def test_sharegpt_gives_each_first_turn_text_once_so_no_copy_straddles_the_held_out_split(tmp_path):
    path = tmp_path / "sharegpt.json"
    conversations = [{"id": i, "conversations": [{"from": "human", "value": text}]}
                     for i, text in (("a", "Hello"), ("b", "Write a poem"), ("c", " Hello\n"), ("d", "Hello"))]
    path.write_text(json.dumps(conversations))
    assert [(p["id"], p["messages"][0]["content"]) for p in read_sharegpt(path)] == [("a", "Hello"),
                                                                                      ("b", "Write a poem")]


def test_stdlib_prompts_ask_for_documented_public_functions_as_completions_and_instructions(tmp_path):
    (tmp_path / "shapes.py").write_text('''
def area(width, height):
    """Return the area of a rectangle of the given width and height, in square units."""

def _hidden(x):
    """A private helper that is documented well enough to be asked for."""

class Circle:
    def scale(self, factor):
        """Return a circle whose radius is this one's multiplied by factor."""
    def radius(self):
        """Return the radius; takes no argument besides self, so it is not asked for."""
''')
    (tmp_path / "_private.py").write_text('def f(x):\n    """Documented, but the module is private, so skipped."""\n')
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "t.py").write_text('def g(x):\n    """A test helper with a long enough docstring."""\n')
    assert [name for name, _, _ in stdlib_functions(tmp_path)] == ["shapes.area", "shapes.Circle.scale"]
    prompts = list(stdlib_prompts(tmp_path))
    assert [p["id"] for p in prompts[:2]] == ["stdlib/shapes.area/completion", "stdlib/shapes.area/instruction"]
    assert prompts[0]["group"] == prompts[1]["group"] == "stdlib/shapes.area"  # held out together, or trained on
    completion, instruction = (p["messages"][0]["content"] for p in prompts[:2])
    assert completion.startswith("Complete the following Python function.") and "def area(width, height):" in completion
    assert instruction == ("Write a Python function `area(width, height)`. Return the area of a rectangle of the "
                           "given width and height, in square units.")
    assert {p["domain"] for p in prompts} == {"code"}


def test_the_real_standard_library_gives_over_a_thousand_functions():
    assert sum(1 for _ in stdlib_functions()) > 1000


@needs_gym
@pytest.mark.parametrize("kind", ["math", "code"])
def test_reasoning_gym_prompts_are_procedural_reproducible_and_read_no_data_file(kind, monkeypatch):
    opened, real_open = [], builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    table = {"math": GYM_MATH, "code": GYM_CODE}[kind]
    count = 2 * sum(len(names) for names in table.values())
    prompts = gym_prompts(kind, count, seed=3)
    assert len(prompts) == count and len({p["id"] for p in prompts}) == count
    assert not [f for f in opened if "reasoning_gym" in f], "a generator read a bundled data file"
    assert [p["messages"] for p in gym_prompts(kind, count, seed=3)] == [p["messages"] for p in prompts]
    assert {p["id"].split("/")[1] for p in prompts} == {name for names in table.values() for name in names}
    if kind == "code":
        assert all(p["messages"][0]["content"].startswith("Write a Python function") for p in prompts)


def test_collected_prompts_are_unique_filtered_and_mixed(monkeypatch):
    from dspark_hf.training import prompts as module

    def source(name, texts):
        return lambda count, seed: [{"id": f"{name}{i}", "domain": name, "source": name,
                                     "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]

    monkeypatch.setitem(module.PROMPT_SOURCES, "a", source("a", ["x", "y", "x", "long " * 50]))
    monkeypatch.setitem(module.PROMPT_SOURCES, "b", source("b", ["y", "z"]))
    kept = collect_prompts({"a": None, "b": None}, keep=lambda p: len(p["messages"][0]["content"]) < 100,
                           progress=False)
    assert sorted(p["messages"][0]["content"] for p in kept) == ["x", "y", "z"]  # each text once, short ones only
    assert collect_prompts({"a": None, "b": None}, seed=1, progress=False) != collect_prompts(
        {"a": None, "b": None}, seed=2, progress=False)  # shuffled by seed
    with pytest.raises(ValueError, match="unknown prompt source"):
        collect_prompts({"nope": None}, progress=False)


def test_prompt_files_round_trip_gzipped(tmp_path):
    prompts = [{"id": "1", "domain": "math", "source": "s", "messages": [{"role": "user", "content": "2 + 2 = ? é"}]}]
    path = write_prompts(prompts, tmp_path / "p.jsonl.gz")
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # gzip
    assert list(read_prompts(path)) == prompts


def test_a_missing_file_is_one_clear_error(tmp_path):
    with pytest.raises(DataFileError, match="missing.jsonl: no such file"):
        list(read_jsonl(tmp_path / "missing.jsonl"))
