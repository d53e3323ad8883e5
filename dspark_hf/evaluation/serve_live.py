"""`dspark bench serve --arrivals poisson`: verification policies under live traffic (paper sec. 5.4, Fig. 7).

Requests (the packaged suites' prompts, through the chat template) arrive at Poisson times at each rate (requests a
second; the same seeded arrival times for every arm) and are served by a [`DSparkServer`] of `max_batch_size` rows:
they join the running batch as rows free up and leave when they finish. Each arm has one server for every rate and
repeat, as a long-running server would: its policy prices its rounds once, at its first round. Arms: no speculation
(the same loop drafting nothing, `FixedLength(0)`: rounds of one token, what plain decoding does), MTP-1 (one
drafted token a round: the shipped draft's first position, `FixedLength(1)`), fixed lengths, the full block, and the
default policy (auto). At each rate the arms run one after another in a rotated order, each repeat; the median
repeat counts.

Per arm and rate: aggregate throughput (user tokens over the seconds from the first arrival to the last finish),
per-user speed (a request's tokens after its first over the seconds from its first token to its last; median and
10th percentile), time to first token (median), and drafted tokens verified per request per round. Greedy outputs
are compared with no speculation's, request by request: with a float32 target any difference raises.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from ..eos import eos_token_ids
from ..options import POSITIVE, option
from ..scheduling.named import named_policy
from .evaluate import chat_batch
from .machine import machine_info

NO_SPECULATION, MTP1 = "no speculation", "mtp-1"


@dataclass
class LiveServeOptions:
    """`dspark bench serve`'s live-traffic flags."""

    arrivals: str = option("static", "static: concurrency sweeps of static batches; poisson: requests arriving at "
                           "--rates, joining and leaving a running batch", choices=["static", "poisson"])
    rates: list[float] = option([0.5, 1.0, 2.0], "poisson: arrival rates to measure, requests a second",
                                type=float, metavar="RATE")
    requests: int = option(16, "poisson: requests per rate and arm (prompts reused round robin)", type=POSITIVE)
    max_batch_size: int = option(8, "poisson: rows the server decodes at once", type=POSITIVE)


def live_arms(draft, fixed_lengths: list[int], only: list[str] | None = None) -> dict:
    """name -> factory of a fresh verification policy (None: the default)."""
    arms = {NO_SPECULATION: lambda: named_policy("fixed 0")(), MTP1: lambda: named_policy("fixed 1")(),
            **{f"fixed {n}": named_policy(f"fixed {n}") for n in fixed_lengths if n > 1},
            "full block": named_policy("full block"), "auto": lambda: None}
    if only:
        unknown = set(only) - set(arms)
        if unknown:
            raise ValueError(f"bench serve --arrivals poisson has no policy {sorted(unknown)}; the policies are "
                             f"{list(arms)}.")
        arms = {name: make for name, make in arms.items() if name == NO_SPECULATION or name in only}
    return arms


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """n arrival times (seconds from the start) of a Poisson process of `rate` requests a second."""
    g, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += g.expovariate(rate)
        times.append(t)
    return times


def serve_arrivals(server, prompts: list[list[int]], arrivals: list[float], max_new_tokens: int) -> list[dict]:
    """Submit prompts[i] at arrivals[i] (wall clock from now), stepping the server whenever it has work; returns per
    request its tokens and its arrival, first-token and finish times (seconds from the start)."""
    start, nxt, served = time.perf_counter(), 0, []
    times: dict[int, dict] = {}
    while nxt < len(prompts) or server.busy:
        now = time.perf_counter() - start
        while nxt < len(prompts) and arrivals[nxt] <= now:
            request = server.submit(prompts[nxt], max_new_tokens)
            served.append(request)
            times[request.id] = {"arrival": arrivals[nxt]}
            nxt += 1
        if not server.busy:
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - start)))
            continue
        committed = server.step()
        at = time.perf_counter() - start
        for request in committed:
            times[request.id].setdefault("first", at)
            if request.done:
                times[request.id]["finish"] = at
    return [{"tokens": r.tokens, **times[r.id]} for r in served]


def _summary(requests: list[dict], stats) -> dict:
    tokens = sum(len(r["tokens"]) for r in requests)
    span = max(r["finish"] for r in requests) - min(r["arrival"] for r in requests)
    speeds = sorted((len(r["tokens"]) - 1) / (r["finish"] - r["first"]) for r in requests
                    if len(r["tokens"]) > 1 and r["finish"] > r["first"])
    return {"throughput": tokens / span, "per_user_median": statistics.median(speeds) if speeds else None,
            "per_user_p10": speeds[len(speeds) // 10] if speeds else None,
            "ttft_median": statistics.median(r["first"] - r["arrival"] for r in requests),
            "verified_per_request_round": stats.verified_per_request_round,
            "accepted_per_request_round": stats.accepted / stats.row_rounds if stats.row_rounds else 0.0,
            "rounds": stats.rounds}


def bench_live(target, tokenizer, draft, prompts: list[dict], rates=(0.5, 1.0, 2.0), requests: int = 16,
               max_batch_size: int = 8, max_new_tokens: int = 32, repeats: int = 2, fixed_lengths=(2, 4),
               only: list[str] | None = None, seed: int = 0, progress: bool = True) -> dict:
    """Every arm at every arrival rate (see the module); greedy."""
    from tqdm.auto import tqdm

    from ..generation.serving import DSparkServer, ServerStats

    eos_ids = eos_token_ids(target.generation_config)
    arms = live_arms(draft, [n for n in fixed_lengths if n < draft.config.block_size], only)
    ids = [chat_batch(tokenizer, [p], target.device)["input_ids"][0].tolist() for p in prompts]
    ids = [ids[i % len(ids)] for i in range(requests)]
    max_length = max(map(len, ids)) + max_new_tokens
    names = list(arms)
    bar = tqdm(total=len(rates) * repeats * len(names), desc="bench serve (poisson)", disable=not progress)

    # one server an arm, serving every rate and repeat as a long-running server would (the default policy prices
    # its rounds once, at its first round, and learns on from rate to rate); idle between runs, every row free
    servers = {name: DSparkServer(target, draft, max_batch_size=max_batch_size, max_length=max_length,
                                  policy=arms[name](), eos_token_id=sorted(eos_ids)) for name in names}
    for warm in servers.values():  # warm-up: the first round prices, every arm runs its code once
        for prompt in ids[:max_batch_size]:
            warm.submit(prompt, 4)
        warm.drain()
    results = {}
    for rate in rates:
        arrivals = poisson_arrivals(requests, rate, seed)
        runs = {name: [] for name in names}
        for repeat in range(repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for name in order:
                s = servers[name]
                s.stats = ServerStats()
                runs[name].append((serve_arrivals(s, ids, arrivals, max_new_tokens), s.stats))
                bar.update(1)
                bar.set_postfix(rate=rate)
        reference = [r["tokens"] for r in runs[NO_SPECULATION][0][0]]
        plain = [_summary(served, stats)["throughput"] for served, stats in runs[NO_SPECULATION]]
        by_arm = {}
        for name in names:
            for served, _ in runs[name]:
                differ = sum(r["tokens"] != ref for r, ref in zip(served, reference))
                if differ and target.dtype == torch.float32:
                    raise AssertionError(f"{name}: {differ} of {len(served)} served requests differ from no "
                                         "speculation's with a float32 target: lossless decoding is broken; this is "
                                         "a bug, please report it with the command that showed it.")
            summaries = [_summary(served, stats) for served, stats in runs[name]]
            middle = sorted(range(repeats), key=lambda i: summaries[i]["throughput"])[repeats // 2]
            by_arm[name] = {**summaries[middle], "runs": [x["throughput"] for x in summaries],
                            "vs_no_speculation": statistics.median(x["throughput"] / p
                                                                   for x, p in zip(summaries, plain))}
        results[rate] = by_arm
    bar.close()
    return {"settings": {"arrivals": "poisson", "rates": list(rates), "requests": requests,
                         "max_batch_size": max_batch_size, "max_new_tokens": max_new_tokens, "repeats": repeats,
                         "seed": seed, "prompts": [p["id"] for p in prompts], "greedy": True},
            "machine": machine_info(target, draft), "results": results}


def format_live_table(report: dict) -> str:
    """Markdown: per rate and arm, aggregate tokens/s, per-user tokens/s (median, p10), TTFT, verified tokens per
    request per round, and the paired ratio to no speculation's throughput."""
    lines = ["| rate (req/s) | arm | tokens/s | vs no spec | per-user median | per-user p10 | TTFT s | verified/req/round |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for rate, by_arm in report["results"].items():
        for name, r in by_arm.items():
            lines.append(f"| {rate} | {name} | {r['throughput']:.1f} | {r['vs_no_speculation']:.3f}x | "
                         f"{_num(r['per_user_median'])} | {_num(r['per_user_p10'])} | {r['ttft_median']:.2f} | "
                         f"{r['verified_per_request_round']:.2f} |")
    return "\n".join(lines)


def _num(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot_live(report: dict, out_dir) -> list:
    """The frontier (paper Fig. 7): aggregate throughput against per-user speed, one line per arm over the rates."""
    from pathlib import Path

    from .plots import pyplot
    from .serve import _save

    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {float(rate): v for rate, v in report["results"].items()}
    rates = sorted(results)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, name in enumerate(results[rates[0]]):
        points = [(results[r][name]["per_user_median"], results[r][name]["throughput"]) for r in rates]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name, color=f"C{i}",
                linewidth=2.5 if name == "auto" else 1.2)
        if name == NO_SPECULATION:
            for r, (x, y) in zip(rates, points):
                ax.annotate(f"{r:g}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user tokens/s (median)")
    ax.set_ylabel("aggregate tokens/s")
    return [_save(plt, fig, ax, "Live traffic: throughput against per-user speed by arrival rate",
                  out_dir / "serve_frontier.png")]
