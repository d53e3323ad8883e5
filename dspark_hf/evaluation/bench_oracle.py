"""The ceiling our decoding loop allows: plain generate() vs DSpark with an oracle draft, in one interleaved run.

The oracle proposes the target's own greedy continuation, so every verified token is accepted; the draft forward
still runs, so a round costs what it would with a real draft. Each round's time is split into draft forward
(block sampling included), target forward and everything else (bookkeeping in our loop).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..eos import eos_token_ids
from ..model.modeling_dspark import DSparkDraftModel
from ..options import (batch_sizes_option, max_new_tokens_option, option, plan_profile_option, repeats_option,
                       report_option)
from ..scheduling.policies import FullBlock
from .evaluate import COMPILED_PLAIN, check_identity, static_compile
from .harness import interleaved
from .machine import machine_info
from .oracle import OracleDraft
from .suites import DEFAULT_PROMPTS, chat_inputs


def _new_tokens(sequences: torch.Tensor, prompt_len: int, pad_id: int, eos_ids: set[int]) -> int:
    """Tokens a user receives: each row up to and including its EOS."""
    total = 0
    for row in sequences[:, prompt_len:].tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos_ids:
                n = i + 1
                break
        total += n
    return total


def check_max_new_tokens(max_new_tokens: int) -> None:
    """Refuse a length with no round to time (the CLI calls it before the models load)."""
    if max_new_tokens < 2:  # the first new token comes from the prefill: no round would be left to time
        raise ValueError(f"max_new_tokens={max_new_tokens}: the oracle benchmark times speculative rounds, and the "
                         "first new token comes from the prefill; give at least 2.")


@dataclass
class OracleBench:
    """`dspark bench oracle`'s settings."""

    batch_sizes: list[int] = batch_sizes_option([1, 8])
    max_new_tokens: int = max_new_tokens_option(64)
    repeats: int = repeats_option(3)
    policy: list[str] | None = option(None, "verification policy (default: 'full block', the ceiling); repeat to "
                                      "compare others in the same run, e.g. --policy 'full block' --policy auto",
                                      action="append", metavar="NAME")
    no_compile: bool = option(False, "leave out the compiled arms (plain generate() with a static cache and "
                              "torch.compile; DSpark's compiled steps), which compile before timing")
    profile: str | None = plan_profile_option()
    output: str = report_option("bench_oracle.json")


def bench_oracle(target, tokenizer, draft: DSparkDraftModel, batch_sizes=(1, 8), max_new_tokens: int = 64,
                 repeats: int = 3, prompts: list[str] | None = None, progress=None,
                 policies: dict | None = None, compiled: bool = True) -> dict:
    """Run the benchmark; returns a JSON-ready dict with one entry per batch size. policies: name -> factory of the
    verification policy (default: the full block only); the first gives each entry's main figures, and every one
    its speedup under "policies", all interleaved in one run, in an order rotated each repeat. compiled: also plain
    generate() with a static cache and torch.compile (the fair baseline) and the first policy on DSpark's compiled
    steps, each warmed up (compiled) before timing; their figures go under "compiled".

    At batch size B the first B prompts decode (wrapping around past the last); each entry names them by their index
    in `prompts` (DEFAULT_PROMPTS when None). Its "paired_speedup" is the median over repeats of plain's seconds
    over DSpark's in the same repeat (drift between repeats cancels); "speedup" is the ratio of the two medians, the
    headline of reports written before paired_speedup was."""
    check_max_new_tokens(max_new_tokens)
    policies = policies or {"full block": FullBlock}
    prompts = prompts or DEFAULT_PROMPTS
    eos_ids = eos_token_ids(target.generation_config)
    pad_id = target.generation_config.pad_token_id
    first = next(iter(policies))
    fast = f"{first} (compiled)"
    results = []
    for batch in batch_sizes:
        ids = [i % len(prompts) for i in range(batch)]
        inputs = chat_inputs(tokenizer, [prompts[i] for i in ids], target.device)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
        reference = target.generate(**inputs, **kw)
        oracle = OracleDraft.from_draft(draft).set_references(target, reference, inputs["attention_mask"])
        P = inputs["input_ids"].shape[1]
        tokens = _new_tokens(reference, P, pad_id, eos_ids)
        # name -> (generate() options, a factory of its policy or None for plain generate())
        arms = {"plain": ({}, None), **{name: ({"assistant_model": oracle}, make) for name, make in policies.items()}}
        if compiled:
            arms[COMPILED_PLAIN] = (static_compile(P + max_new_tokens), None)
            arms[fast] = ({"assistant_model": oracle, **static_compile(P + max_new_tokens)}, policies[first])

        def call(name):
            options, make = arms[name]
            if make is None:
                return target.generate(**inputs, **kw, **options)
            return target.generate(**inputs, **kw, **options, return_dict_in_generate=True,
                                   verification_policy=make())

        for name in arms:  # warm-up: the default policy measures costs, the compiled arms compile
            call(name)
        timed = interleaved({name: lambda _, name=name: call(name) for name in arms}, [None], repeats, target.device,
                            on_repeat=lambda *_: progress.update(1) if progress is not None else None)
        seconds, splits = timed.seconds, []
        runs = {name: {"taus": [], "same": batch} for name in arms if arms[name][1] is not None}
        for name in runs:
            for (out,) in timed.results[name]:
                same = check_identity(target, name, [out.sequences[:, P:]], [reference[:, P:]], eos_ids)
                runs[name]["same"] = min(runs[name]["same"], same)
                runs[name]["taus"].append(statistics.mean(r.tau for rows in out.rounds for r in rows))
                if name == first:
                    t = out.timings
                    rounds_s = t["total"] - t["prefill"]
                    splits.append({"draft": t["draft"] / rounds_s, "target": t["target"] / rounds_s,
                                   "other": (rounds_s - t["draft"] - t["target"]) / rounds_s})

        main, plain_s = runs[first], seconds["plain"]
        plain_med, dspark_med = statistics.median(plain_s), statistics.median(seconds[first])
        entry = {
            "batch_size": batch,
            "prompt_ids": ids,
            "new_tokens": tokens,
            "plain_tokens_per_s": tokens / plain_med,
            "dspark_tokens_per_s": tokens / dspark_med,
            "speedup": plain_med / dspark_med,
            "paired_speedup": timed.paired(first, "plain"),
            "tokens_per_round": statistics.mean(main["taus"]),
            "identical_rows": main["same"],
            "round_split": {k: statistics.mean(s[k] for s in splits) for k in ("draft", "target", "other")},
            "plain_seconds": plain_s,
            "dspark_seconds": seconds[first],
            "policies": {name: {"speedup": plain_med / statistics.median(seconds[name]),
                                "paired_speedup": timed.paired(name, "plain"),
                                "tokens_per_round": statistics.mean(runs[name]["taus"]),
                                "identical_rows": runs[name]["same"], "dspark_seconds": seconds[name]}
                         for name in policies},
        }
        if compiled:
            entry["compiled"] = {
                "plain_tokens_per_s": tokens / statistics.median(seconds[COMPILED_PLAIN]),
                "dspark_tokens_per_s": tokens / statistics.median(seconds[fast]),
                # the fair comparison: DSpark's compiled steps against plain generate() compiled alike
                "paired_speedup": timed.paired(fast, COMPILED_PLAIN),
                "paired_speedup_vs_eager_plain": timed.paired(fast, "plain"),
                "plain_compiled_vs_eager": timed.paired(COMPILED_PLAIN, "plain"),
                "eager_dspark_vs_compiled_plain": timed.paired(first, COMPILED_PLAIN),
                "tokens_per_round": statistics.mean(runs[fast]["taus"]), "identical_rows": runs[fast]["same"],
                "plain_seconds": seconds[COMPILED_PLAIN], "dspark_seconds": seconds[fast]}
        results.append(entry)
    return {"benchmark": "oracle", "max_new_tokens": max_new_tokens, "repeats": repeats, "policies": list(policies),
            "block_size": draft.config.block_size, "draft_layers": draft.config.num_hidden_layers,
            "prompts": list(prompts), "machine": machine_info(target, draft), "results": results}


def format_oracle_table(report: dict) -> str:
    """The speedup column is the paired median (`paired_speedup`); reports written before it was give their ratio of
    medians (`speedup`), which the note under the table then says."""
    lines = ["| batch | plain tok/s | DSpark (oracle) tok/s | speedup | tokens/round | draft | target | other |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        s = r["round_split"]
        lines.append(f"| {r['batch_size']} | {r['plain_tokens_per_s']:.1f} | {r['dspark_tokens_per_s']:.1f} | "
                     f"{r.get('paired_speedup', r['speedup']):.2f}x | {r['tokens_per_round']:.2f} | {s['draft']:.0%} | "
                     f"{s['target']:.0%} | {s['other']:.0%} |")
    if any("paired_speedup" not in r for r in report["results"]):
        lines += ["", "(speedup: the ratio of the median times; this report predates the paired median)"]
    if len(report.get("policies", [])) > 1:
        lines += ["", "| batch | " + " | ".join(f"{p}: speedup (paired)" for p in report["policies"]) + " |",
                  "|---:|" + "---:|" * len(report["policies"])]
        for r in report["results"]:
            cells = [f"{v['speedup']:.2f}x ({v['paired_speedup']:.2f}x)" for v in r["policies"].values()]
            lines.append(f"| {r['batch_size']} | " + " | ".join(cells) + " |")
    compiled = [r for r in report["results"] if "compiled" in r]
    if compiled:
        lines += ["", "With a static cache and torch.compile (DSpark's compiled steps against plain generate() compiled "
                  "alike, the fair baseline):", "",
                  "| batch | plain static+compile tok/s | DSpark compiled tok/s | speedup | vs eager plain | "
                  "plain static+compile vs eager | eager DSpark vs plain static+compile |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in compiled:
            c = r["compiled"]
            lines.append(f"| {r['batch_size']} | {c['plain_tokens_per_s']:.1f} | {c['dspark_tokens_per_s']:.1f} | "
                         f"{c['paired_speedup']:.2f}x | {c['paired_speedup_vs_eager_plain']:.2f}x | "
                         f"{c['plain_compiled_vs_eager']:.2f}x | {c['eager_dspark_vs_compiled_plain']:.2f}x |")
    return "\n".join(lines)
