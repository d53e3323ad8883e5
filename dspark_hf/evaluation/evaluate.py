"""`dspark eval` and `dspark bench speed`: acceptance metrics per domain, and wall-clock speed against the
methods a user would otherwise pick, measured in one interleaved run."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch

from .. import internals
from ..eos import eos_token_ids, until_eos
from ..generation.records import DSparkRound
from ..options import (POSITIVE, TEMPERATURE, max_new_tokens_option, option, plan_profile_option, repeats_option,
                       report_option)
from ..scheduling.policies import FullBlock
from .harness import interleaved
from .machine import machine_info
from .metrics import format_tau, summarize


def _batches(prompts, size):
    for i in range(0, len(prompts), size):
        yield prompts[i: i + size]


def chat_batch(tokenizer, prompts: list[dict], device):
    """Left-padded model inputs (B, T) for prompts given as {"messages": [...]}, through the chat template."""
    texts = [tokenizer.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    # left whatever the tokenizer's own setting: generate() appends after the last column of every row
    return tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                     add_special_tokens=False).to(device)


def _sampling(temperature: float) -> dict:
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)


@dataclass
class GenerationOptions:
    """How an evaluation generates: `--max-new-tokens`, `--temperature` and `--batch-size`."""

    max_new_tokens: int = max_new_tokens_option(128)
    temperature: float = option(0.0, "0 = greedy", type=TEMPERATURE)
    batch_size: int = option(1, "prompts per generate() call", type=POSITIVE)


@dataclass
class EvalOptions:
    """What `dspark eval` writes beside its metrics."""

    output: str = report_option("results.json")
    plot: str | None = option(None, "write PNG plots here", metavar="DIR")
    threshold_sweep: bool = option(False, "add the static confidence threshold sweep")
    seed: int = option(0, "seeds sampling")


def run_eval(target, tokenizer, draft, prompts: list[dict], max_new_tokens: int = 128, temperature: float = 0.0,
             batch_size: int = 1, policy=None, progress: bool = True, seed: int = 0) -> dict:
    """Generate every prompt with DSpark and collect the paper's metrics, overall and per domain. They describe the
    draft, so every drafted block is verified in full unless `policy` (a fresh one per batch) says otherwise."""
    from tqdm.auto import tqdm

    gamma = draft.config.block_size
    records, by_domain = [], defaultdict(list)
    torch.manual_seed(seed)
    bar = tqdm(total=len(prompts), desc="eval", disable=not progress)
    for batch in _batches(prompts, batch_size):
        inputs = chat_batch(tokenizer, batch, target.device)
        out = target.generate(**inputs, max_new_tokens=max_new_tokens, assistant_model=draft,
                              return_dict_in_generate=True, verification_policy=(policy or FullBlock)(),
                              **_sampling(temperature))
        for p, rounds in zip(batch, out.rounds):
            new_tokens = 1 + sum(r.committed for r in rounds)  # + the prefill token
            records.append({"id": p["id"], "domain": p["domain"], **summarize(rounds, gamma, new_tokens),
                            "rounds_detail": [_round_dict(r) for r in rounds]})
            by_domain[p["domain"]].extend(rounds)
        bar.update(len(batch))
        bar.set_postfix(tau=format_tau(summarize([r for rs in by_domain.values() for r in rs], gamma)
                                       ["acceptance_length"]))
    bar.close()
    domains = {d: summarize(by_domain[d], gamma, sum(r["new_tokens"] for r in records if r["domain"] == d))
               for d in sorted({p["domain"] for p in prompts})}
    all_rounds = [r for rs in by_domain.values() for r in rs]
    # a domain none of whose prompts had a round has no tau; averaging it in as 0 would pull the macro down
    measured = [d["acceptance_length"] for d in domains.values() if d["acceptance_length"] is not None]
    return {
        "settings": {"max_new_tokens": max_new_tokens, "temperature": temperature, "batch_size": batch_size,
                     "block_size": gamma, "prompts": len(prompts), "draft": draft.config.to_diff_dict(),
                     "target": getattr(target.config, "_name_or_path", ""), "prompt_ids": [p["id"] for p in prompts]},
        "machine": machine_info(target, draft),
        "overall": summarize(all_rounds, gamma, sum(r["new_tokens"] for r in records)),
        "macro_acceptance_length": statistics.mean(measured) if measured else None,
        "macro_left_out": [d for d, v in domains.items() if v["acceptance_length"] is None],
        "domains": domains,
        "prompts": records,
    }


def _round_dict(r: DSparkRound) -> dict:
    return {"drafted": r.drafted, "confidences": r.confidences, "verified": r.verified, "accepted": r.accepted}


def threshold_sweep(records: list[dict], thresholds: list[float]) -> dict:
    """Paper Fig. 5, replayed on full-block rounds: verifying up to the first c_k below a threshold keeps
    min(accepted, cut) of each round. Returns tokens per step and acceptance rate per threshold, per domain."""
    out = {}
    domains = sorted({r["domain"] for r in records})
    for domain in domains + ["overall"]:
        rounds = [x for r in records if domain in ("overall", r["domain"]) for x in r["rounds_detail"]]
        rows = []
        for t in thresholds:
            tokens, verified, accepted = 0, 0, 0
            for x in rounds:
                conf = x["confidences"] or [1.0] * x["verified"]
                cut = next((k for k, c in enumerate(conf) if c < t), len(conf))
                v = min(x["verified"], cut)
                a = min(x["accepted"], v)
                tokens, verified, accepted = tokens + a + 1, verified + v, accepted + a
            rows.append({"threshold": t, "tokens_per_step": tokens / max(len(rounds), 1),
                         "acceptance_rate": accepted / verified if verified else None,
                         "verified_per_step": verified / max(len(rounds), 1),
                         "rejected_per_step": (verified - accepted) / max(len(rounds), 1)})
        out[domain] = rows
    return out


@dataclass
class SpeedBench:
    """`dspark bench speed`'s settings beside its prompts and generation options."""

    repeats: int = repeats_option(3)
    output: str = report_option("bench.json")
    policy: list[str] | None = option(None, "verification policy of DSpark: auto (default: plans against this "
                                      "machine's cached costs, drafts only while it pays), 'full block', 'fixed N', "
                                      "'threshold T', scheduled, async; repeat to run several side by side (the first "
                                      "is 'dspark', the others 'dspark (NAME)' and, compiled, 'dspark (compiled, NAME)')",
                                      action="append", metavar="NAME")
    profile: str | None = plan_profile_option()
    also_draft: list[str] | None = option(None, "another draft to run beside --draft, e.g. a single-token draft "
                                          "(--block-size 1); repeatable", action="append", metavar="NAME=PATH")
    no_compile: bool = option(False, "leave out the compiled arms (plain generate() and DSpark with a static cache "
                              "and torch.compile), which compile before timing (minutes on a CPU)")


# the compiled arms: plain generate() and DSpark with a static cache and torch.compile, and prompt lookup with a
# static cache where transformers allows it (its assisted loop refuses one in some releases)
COMPILED_PLAIN, COMPILED_DSPARK, STATIC_LOOKUP = "plain (static+compile)", "dspark (compiled)", \
    "prompt_lookup (static)"


def static_compile(max_cache_len: int | None = None) -> dict:
    """generate() options of the fair baseline: a static cache and torch.compile, on any device (transformers compiles
    off CUDA only when told to); `max_cache_len` sizes the static cache (plain generate()'s, and DSpark's decoding
    state) once for every prompt of a run, so that each compiles once and attention reads as many slots in both."""
    return {"cache_implementation": "static", "compile_config": internals.compile_config_anywhere(),
            **({"max_cache_len": max_cache_len} if max_cache_len else {})}


def bench_speed(target, tokenizer, draft, prompts: list[dict], batch_size: int = 1, max_new_tokens: int = 128,
                repeats: int = 3, temperature: float = 0.0, extra_methods: dict | None = None,
                progress: bool = True, policy=None, compiled: bool = True, extra_policies: dict | None = None
                ) -> dict:
    """Tokens/s of plain generate(), prompt lookup decoding and DSpark (and `extra_methods`: name -> generate kwargs),
    interleaved prompt by prompt in one run after a warm-up; median over repeats; ratios to plain, eager and (with
    `compiled`) with a static cache and torch.compile, the baseline a GPU user holds DSpark to. compiled also runs
    DSpark's compiled steps and prompt lookup with a static cache (where transformers allows it); every compiled arm
    decodes every batch once before timing, so that nothing compiles while the clock runs. policy: a factory of
    DSpark's verification policy (default: generate()'s own); a "verification_policy" in extra_methods is a factory
    too (policies keep per-call state, so every call gets a fresh one). extra_policies (name -> factory): DSpark under
    each beside the default, as "dspark (NAME)" and (with `compiled`) "dspark (compiled, NAME)", so that what a policy
    adds to a call is measured on both paths."""
    from tqdm.auto import tqdm

    eos_ids = eos_token_ids(target.generation_config)
    batches = [chat_batch(tokenizer, b, target.device) for b in _batches(prompts, batch_size)]
    longest = max(b["input_ids"].shape[1] for b in batches) + max_new_tokens
    dspark = {"assistant_model": draft, **({"verification_policy": policy} if policy else {})}
    methods = {"plain": {}, "dspark": dspark}
    if compiled:
        methods[COMPILED_PLAIN] = static_compile(longest)
        methods[COMPILED_DSPARK] = {**dspark, **static_compile(longest)}
    skipped = {}
    if batch_size == 1:
        methods["prompt_lookup"] = {"prompt_lookup_num_tokens": 10}
        if compiled:  # its cache holds the candidates past the last token too
            methods[STATIC_LOOKUP] = {"prompt_lookup_num_tokens": 10, **static_compile(longest + 10 + 1)}
    else:
        skipped["prompt_lookup"] = f"transformers' prompt lookup decoding refuses batch size > 1 (here {batch_size})"
    for name, make in (extra_policies or {}).items():
        methods[f"dspark ({name})"] = {"assistant_model": draft, "verification_policy": make}
        if compiled:
            methods[f"dspark (compiled, {name})"] = {**methods[f"dspark ({name})"], **static_compile(longest)}
    methods.update(extra_methods or {})
    sampling = _sampling(temperature)

    def fresh(kw):
        return {**kw, "verification_policy": kw["verification_policy"]()} if "verification_policy" in kw else kw

    def arm(kw):
        def call(inputs):
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, **sampling, **fresh(kw),
                                  **({"return_dict_in_generate": True} if "assistant_model" in kw else {}))
            return out, inputs["input_ids"].shape[1]
        return call

    def new_tokens(result) -> torch.Tensor:
        out, P = result
        return (out.sequences if hasattr(out, "sequences") else out)[:, P:]

    # warm-up: the compiled arms decode every batch in full; DSpark decodes every batch, as the default policy times
    # the rounds of each path and length of context it meets (once, cached); prompt lookup with a static cache
    # leaves the run where this transformers refuses it
    for name, kw in list(methods.items()):
        warm = batches if kw.get("cache_implementation") == "static" or "assistant_model" in kw else batches[:1]
        try:
            for inputs in warm:
                full = kw.get("cache_implementation") == "static"
                target.generate(**inputs, max_new_tokens=max_new_tokens if full else 8, **sampling, **fresh(kw))
        except (ValueError, RuntimeError) as error:
            if name != STATIC_LOOKUP:
                raise
            skipped[name] = f"transformers fails it: {type(error).__name__}: {' '.join(str(error).split())[:200]}"
            del methods[name]
    # and once more the arms of transformers' own static cache: they share the target's compiled forward (one per
    # model), which an arm warmed later recompiles for its shapes (prompt lookup: a longer cache, wider verification),
    # so that the arm warmed before it compiled again in its first timed call (plain static+compile's took 5x its time)
    for kw in (kw for kw in methods.values() if kw.get("cache_implementation") == "static" and
               "assistant_model" not in kw):
        for inputs in batches:
            target.generate(**inputs, max_new_tokens=max_new_tokens, **sampling, **fresh(kw))
    names, same = list(methods), defaultdict(list)
    bar = tqdm(total=repeats * len(batches) * len(methods), desc="bench speed", disable=not progress)

    def check(repeat, runs):  # greedy, every repeat: the default policy may draft differently from one call to the next
        if temperature == 0:
            reference = [new_tokens(r) for r in runs.results["plain"][repeat]]
            for name in (n for n in names if n != "plain"):
                same[name].append(check_identity(target, name, [new_tokens(r) for r in runs.results[name][repeat]],
                                                 reference, eos_ids))

    runs = interleaved({name: arm(methods[name]) for name in names}, batches, repeats, target.device,
                       on_call=lambda _: bar.update(1), on_repeat=check)
    bar.close()

    def work(result) -> int:
        return user_tokens(new_tokens(result), eos_ids)

    tokens = {m: [sum(map(work, calls)) for calls in runs.results[m]] for m in names}
    rounds = {m: [r for calls in runs.results[m] for out, _ in calls for rows in getattr(out, "rounds", [])
                  for r in rows] for m in names}
    rates = {m: statistics.median(runs.rates(m, work)) for m in names}

    return {
        "settings": {"batch_size": batch_size, "max_new_tokens": max_new_tokens, "repeats": repeats,
                     "temperature": temperature, "prompts": len(prompts), "block_size": draft.config.block_size,
                     "prompt_ids": [p["id"] for p in prompts],
                     "compiled_baseline": COMPILED_PLAIN if compiled else None},
        "machine": machine_info(target, draft),
        "skipped": skipped,
        "methods": {m: {"tokens_per_s": rates[m], "ratio_to_plain": rates[m] / rates["plain"],
                        "paired_ratio_to_plain": runs.paired(m, "plain", work),
                        **({"paired_ratio_to_compiled_plain": runs.paired(m, COMPILED_PLAIN, work)} if compiled
                           else {}),
                        "acceptance_length": (sum(r.tau for r in rounds[m]) / len(rounds[m])) if rounds[m] else None,
                        "seconds": runs.seconds[m], "tokens": tokens[m],
                        # greedy only: rows whose output equals plain generate()'s, in the repeat with fewest
                        "identical_rows": min(same[m]) if same[m] else None}
                    for m in methods},
    }


def identical_rows(outputs: list[torch.Tensor], reference: list[torch.Tensor], eos_ids: set[int]) -> int:
    """How many rows of the batches of new tokens `outputs` (each (B, new)) equal those of `reference` up to their
    first EOS; batches padded to different widths still compare row by row."""
    return sum(until_eos(a.tolist(), eos_ids) == until_eos(b.tolist(), eos_ids)
               for x, y in zip(outputs, reference) for a, b in zip(x, y))


def check_identity(target, name: str, outputs: list[torch.Tensor], reference: list[torch.Tensor],
                   eos_ids: set[int]) -> int:
    """`identical_rows` of greedy `outputs` against plain generate()'s `reference`; raises where all must match: with a
    float32 target, greedy speculative decoding returns plain generate()'s tokens exactly (in bf16 / fp16 near-ties
    may round either way, so there the count is only reported)."""
    same, rows = identical_rows(outputs, reference, eos_ids), sum(len(x) for x in reference)
    if target.dtype == torch.float32 and same < rows:
        raise AssertionError(f"{name}: {rows - same} of {rows} greedy rows differ from plain generate()'s with a "
                             "float32 target: lossless decoding is broken; this is a bug, please report it with the "
                             "command that showed it.")
    return same


def format_speed_table(report: dict) -> str:
    """The report as a markdown table: tokens/s, against plain generate() (eager, and with a static cache and
    torch.compile where the run measured it: the fair baseline), tokens per round, and greedy identity."""
    greedy = report["settings"]["temperature"] == 0
    compiled = report["settings"].get("compiled_baseline") is not None  # reports before it have none
    lines = ["| method | tokens/s | vs plain | paired vs plain |" + (" paired vs plain static+compile |" if compiled
                                                                    else "") + " tau |" +
             (" identical to plain |" if greedy else ""),
             "|---|---:|---:|---:|" + ("---:|" if compiled else "") + "---:|" + ("---:|" if greedy else "")]
    for name, m in report["methods"].items():
        tau = "" if m["acceptance_length"] is None else f"{m['acceptance_length']:.2f}"
        same = m.get("identical_rows")  # None for plain, sampling, and reports written before rows were compared
        cell = ("" if same is None else f" {same}/{report['settings']['prompts']}") + " |" if greedy else ""
        paired = m.get("paired_ratio_to_plain")  # absent from reports written before it was
        paired = "" if paired is None else f"{paired:.2f}x"
        against_compiled = f" {m['paired_ratio_to_compiled_plain']:.2f}x |" if compiled else ""
        lines.append(f"| {name} | {m['tokens_per_s']:.1f} | {m['ratio_to_plain']:.2f}x | {paired} |"
                     f"{against_compiled} {tau} |{cell}")
    for name, why in report.get("skipped", {}).items():
        lines.append(f"\n{name}: not measured ({why})")
    return "\n".join(lines)


def user_tokens(new: torch.Tensor, eos_ids: set[int]) -> int:
    """New tokens a user receives: each row's up to its first EOS (the rest is padding)."""
    return sum(len(until_eos(row, eos_ids)) for row in new.tolist())


def summary_table(results: dict) -> str:
    """The markdown table `dspark eval` prints: tau, rounds, new tokens and conditional acceptance by domain."""
    rows = [("overall", results["overall"])] + list(results["domains"].items())
    lines = ["| domain | tau | rounds | new tokens | conditional acceptance by position |", "|---|---:|---:|---:|---|"]
    for name, m in rows:
        ca = " ".join("-" if v is None else f"{v:.2f}" for v in m["conditional_acceptance"])
        lines.append(f"| {name} | {format_tau(m['acceptance_length'])} | {m['rounds']} | {m['new_tokens']} | {ca} |")
    lines.append(f"| macro | {format_tau(results['macro_acceptance_length'])} | | | |")
    left_out = results.get("macro_left_out")  # absent from results written before domains could lack a tau
    if left_out:
        lines += ["", f"Note: the macro leaves out {', '.join(left_out)}: no prompt of it had a round (each ended at "
                  "its first new token, or max_new_tokens is 1), so it has no tau."]
    return "\n".join(lines)
