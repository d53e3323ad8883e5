"""`dspark bench serve`: verification policies under load (paper Fig. 7 and 8).

At each concurrency R, every one of the N prompts decodes, R requests together, in ceil(N / R) batches; the last
batch is filled up to R by wrapping around to the first prompts (so R requests always decode together, which is what
serving at concurrency R means, and a few prompts decode twice), and R > N repeats prompts the same way. The report
names the prompts of each batch at each R ("prompt_ids"). Every batch decodes with every policy in turn: no
speculation (plain generate()), the default policy (auto), the full block, fixed verification lengths, a static
confidence threshold and, given a profile, the hardware-aware scheduler. Policies are interleaved batch by batch in
one run and repeated, in a rotated order; the median run counts.
Total throughput is user tokens (up to each row's EOS) over the seconds of all the batches of one run; per-user speed
is that divided by R. Greedy outputs are compared with no speculation's in every repeat ("identical_rows"): with a
float32 target any difference raises.
Shared machines drift by tens of percent within minutes, so each policy's speedup over no speculation is the median
of ratios taken within the same repeat, and the spread of no speculation's own runs is reported as the noise.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..eos import eos_token_ids
from ..options import POSITIVE, SHARE, batch_sizes_option, max_new_tokens_option, option, repeats_option, report_option
from ..scheduling.named import named_policy
from .evaluate import chat_batch, check_identity, user_tokens
from .harness import interleaved
from .machine import machine_info


@dataclass
class ServeBench:
    """`dspark bench serve`'s settings beside its prompts."""

    batch_sizes: list[int] = batch_sizes_option([1, 2, 4, 8, 16, 32])
    max_new_tokens: int = max_new_tokens_option(32)
    repeats: int = repeats_option(2)
    fixed_lengths: list[int] | None = option(None, "fixed verification lengths, each below the draft's block "
                                             "(default: 1 2 4, those below it)", type=POSITIVE)
    threshold: float = option(0.5, "static confidence threshold baseline", type=SHARE)
    profile: str | None = option(None, "a `dspark profile` JSON: adds the hardware-aware scheduler")
    policies: list[str] | None = option(None, 'run only these policies, e.g. --policies scheduled "fixed 1" (no '
                                        "speculation always runs)", metavar="NAME")
    output: str = report_option("bench_serve.json")
    plot: str | None = option(None, "write the Pareto and budget PNGs here", metavar="DIR")


def fixed_lengths_for(draft, asked=None) -> list[int]:
    """The fixed verification lengths to measure: those asked for, each below the draft's block, else 1, 2 and 4
    below it."""
    if asked is None:
        return [n for n in (1, 2, 4) if n < draft.config.block_size]
    too_long = [n for n in asked if n >= draft.config.block_size]
    if too_long:
        raise ValueError(f"fixed lengths {too_long}: the draft drafts {draft.config.block_size} tokens per block; give "
                         "lengths below that (the full block is always measured).")
    return list(asked)


def serve_policies(draft, fixed_lengths: list[int], threshold: float = 0.5, profile: str | None = None) -> dict:
    """name -> factory of generate() kwargs (a fresh policy per call: schedulers keep per-call state)."""
    names = ["auto", "full block"] + [f"fixed {n}" for n in fixed_lengths]
    names += [f"threshold {threshold:g}"] + (["scheduled"] if profile is not None else [])
    methods: dict[str, Callable[[], dict]] = {"no speculation": lambda: {}}
    for name in names:
        make = named_policy(name, profile)
        methods[name] = lambda make=make: {"assistant_model": draft, "verification_policy": make()}
    return methods


def bench_serve(target, tokenizer, draft, prompts: list[dict], batch_sizes=(1, 2, 4, 8, 16, 32),
                max_new_tokens: int = 32, repeats: int = 2, fixed_lengths=None, threshold: float = 0.5,
                profile: str | None = None, progress: bool = True, only: list[str] | None = None) -> dict:
    """Throughput and per-user speed of every policy at every concurrency (greedy); see the module docstring.
    only: names of the policies to run (default all); no speculation always runs, it is the baseline."""
    from tqdm.auto import tqdm

    eos_ids = eos_token_ids(target.generation_config)
    fixed_lengths = fixed_lengths_for(draft, fixed_lengths)
    methods = serve_policies(draft, fixed_lengths, threshold, profile)
    if only:
        unknown = set(only) - set(methods)
        if unknown:
            raise ValueError(f"bench serve has no policy {sorted(unknown)}; the policies are {list(methods)} "
                             "(scheduled needs a profile).")
        methods = {name: make for name, make in methods.items() if name == "no speculation" or name in only}
    gamma = draft.config.block_size
    results, prompt_ids = {}, {}
    prompts = _round_robin(prompts)
    names = list(methods)
    bar = tqdm(total=len(batch_sizes) * repeats * len(methods), desc="bench serve", disable=not progress)

    def arm(make):
        def call(batch):
            out = target.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                  return_dict_in_generate=True, **make())
            return out, batch["input_ids"].shape[1]
        return call

    def new_tokens(result):
        out, P = result
        return out.sequences[:, P:]

    def work(result) -> int:
        return user_tokens(new_tokens(result), eos_ids)

    for R in batch_sizes:
        batches = concurrent_batches(prompts, R)
        prompt_ids[R] = [[p["id"] for p in batch] for batch in batches]
        inputs = [chat_batch(tokenizer, batch, target.device) for batch in batches]
        for make in methods.values():  # warm-up: the default policy times its rounds for each length of context
            for batch in inputs:
                target.generate(**batch, max_new_tokens=4, do_sample=False, **make())

        def progressed(repeat, runs):
            bar.update(len(names))
            bar.set_postfix(R=R)

        timed = interleaved({name: arm(methods[name]) for name in names}, inputs, repeats, target.device,
                            on_repeat=progressed)
        plain = timed.rates("no speculation", work)
        reference = [[new_tokens(r) for r in calls] for calls in timed.results["no speculation"]]
        runs = defaultdict(list)  # per policy and repeat: (tokens/s, rounds, rows identical to no speculation's)
        for name in names:
            for i, (rate, calls) in enumerate(zip(timed.rates(name, work), timed.results[name])):
                rounds = [r for out, _ in calls for rows in (getattr(out, "rounds", None) or []) for r in rows]
                same = None if name == "no speculation" else check_identity(
                    target, name, [new_tokens(r) for r in calls], reference[i], eos_ids)
                runs[name].append((rate, rounds, same))
        results[R] = {name: _summary(runs[name], plain, R, gamma) for name in names}
    bar.close()
    return {"settings": {"batch_sizes": list(batch_sizes), "max_new_tokens": max_new_tokens, "repeats": repeats,
                         "block_size": gamma, "threshold": threshold, "fixed_lengths": list(fixed_lengths),
                         "profile": profile, "prompts": len(prompts), "greedy": True,
                         "prompt_ids": {R: ids for R, ids in prompt_ids.items()}},
            "machine": machine_info(target, draft), "results": results}


def concurrent_batches(prompts: list, R: int) -> list[list]:
    """ceil(N / R) batches of R that cover the N prompts, the last filled up by wrapping around to the first."""
    return [[prompts[(start + i) % len(prompts)] for i in range(R)] for start in range(0, len(prompts), R)]


def _round_robin(prompts: list[dict]) -> list[dict]:
    """Interleave domains so that every concurrency mixes them (code, chat, math, code, ...)."""
    by_domain = defaultdict(list)
    for p in prompts:
        by_domain[p.get("domain", "default")].append(p)
    queues = list(by_domain.values())
    return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]


def _summary(runs: list[tuple[float, list, int | None]], plain: list[float], R: int, gamma: int) -> dict:
    """One policy at one concurrency from its runs (throughput, rounds, rows identical to no speculation's);
    `plain`: no speculation's throughput in the same repeats."""
    throughputs = [t for t, *_ in runs]
    throughput = statistics.median(throughputs)
    rounds = [r for _, rs, _ in runs for r in rs]
    same = [s for *_, s in runs if s is not None]
    could_draft = [r for r in rounds if not r.one_token_left]  # a last round with one token left verifies nothing
    drafted = [r for r in could_draft if r.drafted]
    return {"throughput": throughput, "per_user": throughput / R, "runs": throughputs,
            "vs_no_speculation": statistics.median(t / t0 for t, t0 in zip(throughputs, plain)),
            "spread": (max(throughputs) - min(throughputs)) / throughput,
            "rounds": len(rounds) // len(runs),
            "mean_verified": statistics.mean(r.verified for r in rounds) if rounds else None,
            "tau": statistics.mean(r.tau for r in rounds) if rounds else None,
            "drafting_off": (1 - len(drafted) / len(could_draft)) if could_draft else None,
            # of every run's rows, in the run with fewest; None for no speculation, the reference
            "identical_rows": min(same) if same else None}


MIN_REPEATS_FOR_SPREAD = 3


def best_fixed(by_method: dict) -> str:
    """The fixed policy (full block included) with the highest throughput at one concurrency ("-" if none ran)."""
    fixed = {m: v for m, v in by_method.items() if m == "full block" or m.startswith("fixed")}
    return max(fixed, key=lambda m: fixed[m]["throughput"]) if fixed else "-"


def format_serve_table(report: dict) -> str:
    """Markdown: total tokens/s by policy and concurrency, the best fixed policy, and each speculative policy's
    paired speedup over no speculation next to the run-to-run spread of no speculation (the noise)."""
    methods = list(next(iter(report["results"].values())))
    # the spread of one or two runs says nothing of the noise (one run: always 0)
    few = report["settings"]["repeats"] < MIN_REPEATS_FOR_SPREAD
    lines = ["| R | " + " | ".join(methods) + " | best fixed | auto / no spec | noise |",
             "|---:|" + "---:|" * len(methods) + "---|---:|---:|"]
    for R, by_method in report["results"].items():
        cells = [f"{by_method[m]['throughput']:.1f}" for m in methods]
        ratio = by_method.get("auto", {}).get("vs_no_speculation")
        ratio = f"{ratio:.2f}x" if ratio is not None else "-"
        noise = "n/a" if few else f"±{by_method['no speculation']['spread'] / 2:.0%}"
        lines.append(f"| {R} | " + " | ".join(cells) + f" | {best_fixed(by_method)} | {ratio} | {noise} |")
    if few:
        lines += ["", f"Note: noise n/a: {report['settings']['repeats']} repeat(s) give no measure of it; run with "
                  f"--repeats {MIN_REPEATS_FOR_SPREAD} or more to see it."]
    return "\n".join(lines)


def plot_serve(report: dict, out_dir: str | Path) -> list[Path]:
    """Pareto plot (total throughput vs per-user speed, paper Fig. 7) and the verification budget by concurrency
    (mean verified draft tokens per request per round, Fig. 8)."""
    from .plots import pyplot

    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {int(R): v for R, v in report["results"].items()}
    Rs = sorted(results)
    methods = list(results[Rs[0]])
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, m in enumerate(methods):
        xs, ys = [results[R][m]["per_user"] for R in Rs], [results[R][m]["throughput"] for R in Rs]
        ax.plot(xs, ys, marker="o", label=m, color=f"C{i}", linewidth=2.5 if m == "auto" else 1.2)
        if m == "no speculation":
            for R, x, y in zip(Rs, xs, ys):
                ax.annotate(f"R={R}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("total tokens/s")
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter  # plain numbers on the log axis (2, 5, 10, 20), not 2x10^0

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    paths = [_save(plt, fig, ax, "Throughput vs per-user speed by concurrency R", out_dir / "serve_pareto.png")]

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, m in enumerate(methods):
        if m != "no speculation":  # colours as in the Pareto plot
            ax.plot(Rs, [results[R][m]["mean_verified"] for R in Rs], marker="o", label=m, color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(Rs, [str(R) for R in Rs])
    ax.set_xlabel("concurrent requests R")
    ax.set_ylabel("mean verified draft tokens / request / round")
    paths.append(_save(plt, fig, ax, "Verification budget under load", out_dir / "serve_budget.png"))
    return paths


def _save(plt, fig, ax, title: str, path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
