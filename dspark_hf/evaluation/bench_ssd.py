"""`dspark bench ssd`: speculative speculative decoding with a DSpark draft, measured on this machine.

1. **Cache hit rate by fan-out shape** (the SSD paper's Fig. 4): greedy decodes of held-out prompts with a cache of
   B blocks spread uniformly over the outcomes, then geometrically (Theorem 12) with the power law fitted to the
   uniform runs' miss rates and the acceptance rate they saw, then as measured (`measured_fan_out`: planned for
   each prompt from where the bonus stood in the other prompts' uniform rounds): the shapes at the same cache size.
   Beside them, each outcome's own hit curve (the share of rounds ending with k accepted, and how often the top F
   candidates for k held the bonus), which Theorem 12 models as one power law F^-r of misses under a geometric P(k).
2. **Hit rate and acceptance by Saguaro's C** (Fig. 5), sampled.
3. **Speed**: plain `generate()`, DSpark and DSpark + SSD at each batch size, interleaved in one run, paired;
   and the acceptance of blocks by lag (prepared for k accepted tokens: lag k + 1; drafted in time: lag 0).
4. **The speedup equation** (Theorem 7 / Corollary 16) on the measured hit rates, tokens per round and times: what
   SSD gives when the speculator runs on hardware of its own (its time hidden), beside what it gave here. A round
   (everything but drafting) and plain decoding's step are both timed without their prefill, on the same prompts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..devices import clock
from ..generation.ssd import SSDConfig
from ..options import POSITIVE, SHARE, max_new_tokens_option, option, real_in, repeats_option, report_option
from ..scheduling.policies import FullBlock
from ..generation.ssd.fan_out import fit_power_law, measured_fan_out, ssd_speedup
from .evaluate import _sampling, bench_speed, chat_batch
from .machine import machine_info


@dataclass
class SSDBench:
    """`dspark bench ssd`'s settings beside its prompts."""

    cache_sizes: list[int] = option([2, 4, 8, 16], "blocks per row in the cache", type=POSITIVE)
    saguaro_c: list[float] = option([1.0, 0.7, 0.4, 0.1], "values of C to sample with", type=SHARE)
    temperature: float = option(0.7, "of the Saguaro runs, > 0 (C reweights sampling only; greedy drafting ignores "
                                "it)", type=real_in(0.0, low_open=True))
    batch_sizes: list[int] = option([1, 4], "of the speed runs", type=POSITIVE)
    speed_cache_size: int = option(8, "cache size of the speed runs", type=POSITIVE)
    max_new_tokens: int = max_new_tokens_option(48)
    repeats: int = repeats_option(2)
    output: str = report_option("bench_ssd.json")
    plot: str | None = option(None, "write ssd.png here", metavar="DIR")


def _decode_all(target, tokenizer, draft, prompts, ssd: SSDConfig | list[SSDConfig], max_new_tokens: int,
                temperature: float) -> dict:
    """Decode every prompt alone with `ssd` (one config, or one per prompt); totals of the per-round records and
    timings, and each prompt's bonus ranks (`prompt_ranks`)."""
    totals = {"rounds": 0, "hits": 0, "accepted": 0, "verified": 0, "rejections": 0, "tokens_hit": 0, "rounds_hit": 0,
              "tokens_miss": 0, "rounds_miss": 0, "target": 0.0, "draft": 0.0, "speculate": 0.0, "wait": 0.0,
              "total": 0.0, "prefill": 0.0,
              "drafted_rounds": 0, "missed_rounds": 0, "by_lag": {}, "outcomes": Counter(), "prompt_ranks": []}
    for prompt, config in zip(prompts, ssd if isinstance(ssd, list) else [ssd] * len(prompts)):
        inputs = chat_batch(tokenizer, [prompt], target.device)
        out = target.generate(**inputs, max_new_tokens=max_new_tokens, **_sampling(temperature), assistant_model=draft,
                              verification_policy=FullBlock(), ssd=config, return_dict_in_generate=True)
        for key in ("rounds", "hits", "accepted", "verified", "rejections", "tokens_hit", "rounds_hit", "tokens_miss",
                    "rounds_miss"):
            totals[key] += out.ssd_stats[key]
        for key in ("target", "draft", "speculate", "wait", "total", "prefill"):
            totals[key] += out.timings[key]
        for lag, seen in out.ssd_stats["by_lag"].items():
            counts = totals["by_lag"].setdefault(lag, [0, 0, 0])
            totals["by_lag"][lag] = [c + s for c, s in zip(counts, seen)]
        totals["outcomes"].update(out.ssd_stats["outcomes"])
        totals["prompt_ranks"].append(out.ssd_stats["bonus_ranks"])
        records = [r for r in out.rounds[0] if r.cache_hit is not None]
        totals["drafted_rounds"] += len(records)
        totals["missed_rounds"] += sum(not r.cache_hit for r in records)
    return totals


def round_seconds_without_drafting(totals: dict) -> float:
    """Seconds of `_decode_all`'s decodes spent in rounds, less drafting and speculating (what a round costs with the
    speculator on hardware of its own, a miss's fallback apart): the prefill is left out, as `plain_step_seconds`
    leaves out plain decoding's."""
    return totals["total"] - totals["prefill"] - totals["draft"] - totals["speculate"] - totals["wait"]


def plain_step_seconds(target, tokenizer, prompts, max_new_tokens: int) -> float:
    """Plain greedy generate()'s seconds per new token past the first, prompt by prompt: each prompt decoded to
    `max_new_tokens` and to 1, the difference over the tokens between. The prefill (and the first token) cancel, so
    the step compares with a DSpark round's time without its prefill."""
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        inputs = chat_batch(tokenizer, [prompt], target.device)
        times = {}
        for n in (1, max_new_tokens):
            start = clock(target.device)
            out = target.generate(**inputs, max_new_tokens=n, do_sample=False)
            times[n] = clock(target.device) - start
        seconds += times[max_new_tokens] - times[1]
        tokens += out.shape[1] - inputs["input_ids"].shape[1] - 1
    if tokens <= 0:
        raise ValueError("plain generate() made no token past the first on these prompts: raise --max-new-tokens.")
    return seconds / tokens


def unmeasured_times(times: dict[str, float]) -> str | None:
    """Why `times` ({what: seconds}) cannot enter a report as measurements, or None when they can: a time of zero or
    less (a difference of two timed runs, which noise decides on a model this fast) is no measurement."""
    noise = [f"{what} came out at {seconds * 1e3:.3g} ms" for what, seconds in times.items() if not seconds > 0]
    if not noise:
        return None
    return (f"{'; '.join(noise)}: timing noise, not a measurement; raise --max-new-tokens or give more prompts "
            "(--limit)")


def _pooled(bonus_ranks: list[dict]) -> dict:
    """Several decodes' `ssd_stats["bonus_ranks"]` ({k: {rank: rounds}}) added up."""
    pooled = {}
    for ranks in bonus_ranks:
        for k, counts in ranks.items():
            pooled.setdefault(k, Counter()).update(counts)
    return pooled


def _measured_plans(budget: int, gamma: int, prompt_ranks: list[dict]) -> list[list[int]]:
    """For each prompt, the fan-out F_0..F_(gamma-1) `measured_fan_out` plans from the other prompts' rounds (never
    its own)."""
    return [measured_fan_out(budget, gamma, _pooled(prompt_ranks[:i] + prompt_ranks[i + 1:]))[:-1]
            for i in range(len(prompt_ranks))]


def _plan_or_none(budget: int, gamma: int, bonus_ranks: dict) -> list[int] | None:
    try:
        return measured_fan_out(budget, gamma, bonus_ranks)[:-1]
    except ValueError:  # no round a cache could hold
        return None


def _hit_curves(t: dict, gamma: int, tops=(1, 2, 4, 8, 16)) -> dict:
    """Per outcome k: its share of the rounds, and the share of its rounds whose bonus the top F candidates held."""
    rounds, pooled = max(sum(t["outcomes"].values()), 1), _pooled(t["prompt_ranks"])
    curves = {}
    for k in range(gamma + 1):
        n, ranks = t["outcomes"].get(k, 0), pooled.get(k, {})
        curves[str(k)] = {"share": n / rounds, "rounds": n, "held_by_top": None if k == gamma or not n else {
            str(F): sum(c for j, c in ranks.items() if j < F) / n for F in tops}}
    return curves


def _alpha(accepted: int, rejections: int) -> float:
    """The per-token acceptance rate of the fan-out's model, as measured (`generation.ssd.acceptance_rate` without
    its prior): accepted tokens over accepted tokens plus rejections."""
    return accepted / max(accepted + rejections, 1)


def _rates(t: dict) -> dict:
    return {"hit_rate": t["hits"] / max(t["rounds"], 1), "acceptance": _alpha(t["accepted"], t["rejections"]),
            "tokens_per_round": (t["tokens_hit"] + t["tokens_miss"]) / max(t["rounds_hit"] + t["rounds_miss"], 1)}


def bench_ssd(target, tokenizer, draft, prompts: list[dict], cache_sizes=(2, 4, 8, 16), saguaro_cs=(1.0, 0.7, 0.4, 0.1),
              batch_sizes=(1, 4), max_new_tokens: int = 48, repeats: int = 2, temperature: float = 0.7,
              speed_cache_size: int = 8, progress=None) -> dict:
    """Run the four parts (module docstring), one step each; returns a JSON-ready report."""
    run = _SSDRun(target, tokenizer, draft, prompts, max_new_tokens,
                  (lambda: progress.update(1)) if progress is not None else (lambda: None))
    shapes = _fan_out_shapes(run, cache_sizes)
    by_c = _saguaro(run, saguaro_cs, speed_cache_size, shapes.r, temperature)
    ssd = SSDConfig(speed_cache_size, "geometric", power_law_r=shapes.r, fallback="auto")
    speed = _speed(run, batch_sizes, repeats, ssd)
    skipped = {f"{what} at batch {b}": why for b, report in speed.items() for what, why in report["skipped"].items()}
    measured, overlapped, equation = _speedup_equation(run, speed_cache_size, shapes.r, skipped)
    gamma = draft.config.block_size
    return {
        "benchmark": "ssd", "max_new_tokens": max_new_tokens, "prompts": len(prompts), "repeats": repeats,
        "temperature": temperature, "block_size": gamma, "power_law_r": shapes.r, "acceptance": shapes.alpha,
        "prompt_ids": [p["id"] for p in prompts], "machine": machine_info(target, draft), "skipped": skipped,
        "fan_out": {shape: {str(B): {**_rates(t), "rounds": t["rounds"]} for B, t in runs.items()}
                    for shape, runs in (("uniform", shapes.uniform), ("geometric", shapes.geometric),
                                        ("measured", shapes.by_plan))
                    if runs},
        # the fan-outs the measured shape decoded each prompt with (planned from the other prompts), and the one all
        # the prompts' uniform rounds together give (what a user would take from this run)
        "measured_plans": {str(B): {"per_prompt": shapes.plans.get(B), "all_prompts": _plan_or_none(
            B, gamma, _pooled(shapes.uniform[B]["prompt_ranks"]))} for B in cache_sizes},
        # where each bonus stood, prompt by prompt, in the uniform runs ({k: {rank: rounds}}): to plan from again
        "uniform_bonus_ranks": {str(B): t["prompt_ranks"] for B, t in shapes.uniform.items()},
        # each outcome's share of the rounds and hit curve, from the uniform run at the largest cache size
        "outcome_hit_curves": _hit_curves(shapes.uniform[max(cache_sizes)], gamma),
        "saguaro": {str(C): {**_rates(t), "rounds": t["rounds"]} for C, t in by_c.items()},
        "speed": {str(b): {"ssd": ssd.to_dict(), **{m: {k: v[k] for k in ("tokens_per_s", "ratio_to_plain",
                                                                             "paired_ratio_to_plain",
                                                                             "acceptance_length", "identical_rows")}
                                                    for m, v in report["methods"].items()}}
                  for b, report in speed.items()},
        # the speculator in its thread beside verification: its seconds, the verification's, and how long finished
        # verifications waited for it; the same decodes one after the other for comparison
        "overlap": {"threaded": {k: overlapped[k] for k in ("speculate", "target", "wait", "draft")},
                    "sequential": {k: measured[k] for k in ("speculate", "target", "draft")}},
        "equation": equation,
        # acceptance of blocks by their lag (0: drafted in time with every feature; k + 1: prepared for k accepted)
        "acceptance_by_lag": {str(lag): {"acceptance": _alpha(a, rejected), "verified": v}
                              for lag, (a, v, rejected) in sorted(measured["by_lag"].items())},
    }


@dataclass
class _SSDRun:
    """What every step of `bench_ssd` decodes with, and its progress tick (one per decode of all the prompts)."""

    target: object
    tokenizer: object
    draft: object
    prompts: list[dict]
    max_new_tokens: int
    tick: object

    def decode(self, ssd, temperature: float = 0.0) -> dict:
        """Every prompt alone with `ssd` (one config, or one per prompt): `_decode_all`'s totals."""
        return _decode_all(self.target, self.tokenizer, self.draft, self.prompts, ssd, self.max_new_tokens,
                           temperature)


@dataclass
class _FanOuts:
    """Step 1's decodes by cache size, per fan-out shape; the power law r fitted to the uniform ones' misses and
    the acceptance rate alpha they saw; the measured shapes' plans."""

    uniform: dict
    geometric: dict
    by_plan: dict
    plans: dict
    r: float
    alpha: float


def _fan_out_shapes(run: _SSDRun, cache_sizes) -> _FanOuts:
    """1. Hit rate by fan-out shape at each cache size, greedy: uniform, then geometric (Theorem 12, with the power
    law fitted to the uniform runs), then as measured (each prompt's cache planned from the other prompts' rounds)."""
    gamma = run.draft.config.block_size
    uniform = {}
    for B in cache_sizes:
        uniform[B] = run.decode(SSDConfig(B, "uniform", fallback="draft", overlap=False))
        run.tick()
    alpha = _alpha(sum(t["accepted"] for t in uniform.values()), sum(t["rejections"] for t in uniform.values()))
    try:  # the uniform cache spreads B blocks over the gamma outcomes it can cache (k < gamma accepted)
        r = fit_power_law({B / gamma: 1 - _rates(t)["hit_rate"] for B, t in uniform.items()})
    except ValueError:  # every point at a hit rate of 0 or 1: nothing to fit, keep Theorem 12's example r = 1
        r = 1.0
    r = max(r, 1e-3)
    geometric = {}
    for B in cache_sizes:
        geometric[B] = run.decode(SSDConfig(B, "geometric", power_law_r=r, acceptance=alpha, fallback="draft",
                                            overlap=False))
        run.tick()
    # planned from rounds the decode did not see: each prompt's cache from the other prompts' rounds
    try:
        plans = {B: _measured_plans(B, gamma, uniform[B]["prompt_ranks"]) for B in cache_sizes} \
            if len(run.prompts) > 1 else {}
    except ValueError:  # the other prompts ended before any round a cache could hold: nothing to plan from
        plans = {}
    by_plan = {}
    for B in cache_sizes:
        if B in plans:
            by_plan[B] = run.decode([SSDConfig(B, F, fallback="draft", overlap=False) for F in plans[B]])
        run.tick()
    return _FanOuts(uniform, geometric, by_plan, plans, r, alpha)


def _saguaro(run: _SSDRun, saguaro_cs, cache_size: int, r: float, temperature: float) -> dict:
    """2. Saguaro's C, sampled, at the speed run's cache size: C -> the decodes' totals."""
    by_c = {}
    for C in saguaro_cs:
        by_c[C] = run.decode(SSDConfig(cache_size, "geometric", power_law_r=r, saguaro_c=C, fallback="draft",
                                       overlap=False), temperature)
        run.tick()
    return by_c


def _speed(run: _SSDRun, batch_sizes, repeats: int, ssd: SSDConfig) -> dict:
    """3. Speed, greedy, interleaved by the bench harness: plain, DSpark (full block, as SSD verifies), DSpark + SSD
    (in its thread); batch size -> `bench_speed`'s report."""
    speed = {}
    for b in batch_sizes:
        speed[b] = bench_speed(run.target, run.tokenizer, run.draft, run.prompts, b, run.max_new_tokens, repeats,
                               progress=False, policy=FullBlock, compiled=False, extra_methods={"dspark + ssd": {
                                   "assistant_model": run.draft, "ssd": ssd, "verification_policy": FullBlock}})
        run.tick()
    return speed


def _speedup_equation(run: _SSDRun, cache_size: int, r: float, skipped: dict) -> tuple[dict, dict, dict | None]:
    """4. The speedup equation on figures measured at the speed run's cache size (greedy, the draft as fallback):
    times without a speculator beside the target, then how much the speculator overlapped in a thread here. Returns
    (the sequential decodes' totals, the threaded ones', the equation or None with the reason in `skipped`)."""
    measured = run.decode(SSDConfig(cache_size, "geometric", power_law_r=r, fallback="draft", overlap=False))
    overlapped = run.decode(SSDConfig(cache_size, "geometric", power_law_r=r, fallback="draft", overlap=True))
    run.tick()
    rounds = measured["drafted_rounds"]
    # a round without its drafting: the verification forward and everything else the loop does per round (sampling,
    # bookkeeping, the last undrafted round), the prefill left out as it is from t_plain
    t_verify = round_seconds_without_drafting(measured) / max(rounds, 1)
    t_fallback = measured["draft"] / max(measured["missed_rounds"], 1)
    t_plain = plain_step_seconds(run.target, run.tokenizer, run.prompts, run.max_new_tokens) if rounds else None
    if not rounds:
        skipped["equation"] = "no drafted round (one new token per prompt): raise --max-new-tokens"
        return measured, overlapped, None
    if noise := unmeasured_times({"plain generate()'s step": t_plain, "a round without drafting": t_verify}):
        skipped["equation"] = noise
        return measured, overlapped, None
    rates = _rates(measured)
    after_hit = measured["tokens_hit"] / max(measured["rounds_hit"], 1)
    after_miss = measured["tokens_miss"] / max(measured["rounds_miss"], 1)
    return measured, overlapped, {
        "hit_rate": rates["hit_rate"], "tokens_after_hit": after_hit, "tokens_after_miss": after_miss,
        "t_verify": t_verify, "t_fallback": t_fallback, "t_plain": t_plain,
        "speculate_seconds_per_round": measured["speculate"] / max(rounds, 1),
        "speedup_speculator_apart": ssd_speedup(rates["hit_rate"], after_hit, after_miss, t_verify, t_fallback,
                                                t_plain),
        "speedup_speculator_apart_all_hits": ssd_speedup(1.0, after_hit, after_miss, t_verify, t_fallback, t_plain),
    }


def _hit_curve_table(curves: dict) -> list[str]:
    if not curves:
        return []
    tops = next((list(c["held_by_top"]) for c in curves.values() if c["held_by_top"]), [])
    lines = ["", "Each outcome's hit curve (uniform run, largest cache): share of rounds ending with k accepted, "
             "and of those, how often the top F candidates held the bonus", "",
             "| k | share | rounds | " + " | ".join(f"top {F}" for F in tops) + " |",
             "|---:|---:|---:|" + "---:|" * len(tops)]
    for k, c in curves.items():
        held = c["held_by_top"] or {}
        lines.append(f"| {k} | {c['share']:.1%} | {c['rounds']} | "
                     + " | ".join(f"{held[F]:.1%}" if F in held else "" for F in tops) + " |")
    return lines


def format_ssd_tables(report: dict) -> str:
    sizes, shapes = list(report["fan_out"]["uniform"]), list(report["fan_out"])
    lines = [f"Cache hit rate by fan-out shape (greedy; geometric with r = {report['power_law_r']:.2f}, alpha = "
             f"{report['acceptance']:.2f}; measured: planned for each prompt from the others' uniform rounds)", "",
             "| cache size | " + " | ".join(shapes) + " | measured plan F_0.. (all prompts) |",
             "|---:|" + "---:|" * len(shapes) + "---|"]
    for B in sizes:
        plan = report.get("measured_plans", {}).get(B, {}).get("all_prompts")
        lines.append(f"| {B} | " + " | ".join(f"{report['fan_out'][shape][B]['hit_rate']:.1%}" for shape in shapes)
                     + f" | {'' if plan is None else ' '.join(map(str, plan))} |")
    if "measured" not in shapes and "measured_plans" in report:  # (older reports predate the measured shape)
        lines += ["", "(measured shape not run: it plans each prompt's cache from the other prompts' rounds, and needs "
                  "two prompts with rounds a cache can hold)"]
    lines += _hit_curve_table(report.get("outcome_hit_curves", {}))  # older reports have none
    lines += ["", f"Saguaro sampling (temperature {report['temperature']})", "",
              "| C | hit rate | acceptance |", "|---:|---:|---:|"]
    for C, v in report["saguaro"].items():
        lines.append(f"| {C} | {v['hit_rate']:.1%} | {v['acceptance']:.1%} |")
    lines += ["", "| batch | method | tokens/s | paired vs plain | tau | identical |", "|---:|---|---:|---:|---:|---:|"]
    for b, methods in report["speed"].items():
        for m, v in methods.items():
            if m == "ssd":
                continue
            tau = "" if v["acceptance_length"] is None else f"{v['acceptance_length']:.2f}"
            same = "" if v["identical_rows"] is None else str(v["identical_rows"])
            lines.append(f"| {b} | {m} | {v['tokens_per_s']:.1f} | {v['paired_ratio_to_plain']:.2f}x | {tau} | "
                         f"{same} |")
    lines += ["", "| lag | acceptance | tokens verified |", "|---:|---:|---:|"]
    for lag, v in report["acceptance_by_lag"].items():
        lines.append(f"| {lag} | {v['acceptance']:.1%} | {v['verified']} |")
    e = report.get("equation")
    if e:
        lines += ["", f"Speedup equation (Theorem 7) on measured figures: hit rate {e['hit_rate']:.1%}, "
                  f"{e['tokens_after_hit']:.2f} / {e['tokens_after_miss']:.2f} tokens after a hit / miss, round "
                  f"without drafting {e['t_verify'] * 1e3:.0f} ms, fallback {e['t_fallback'] * 1e3:.0f} ms, plain step "
                  f"{e['t_plain'] * 1e3:.0f} ms: {e['speedup_speculator_apart']:.2f}x plain with the speculator on "
                  f"hardware of its own ({e['speedup_speculator_apart_all_hits']:.2f}x if every round hit)."]
    return "\n".join(lines)


def plot_ssd(report: dict, out_dir) -> list:
    """Hit rate by cache size for each fan-out shape, each outcome's hit curve, and hit rate / acceptance by C."""
    from pathlib import Path

    from .plots import pyplot

    plt = pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13.5, 3.4))
    for shape, runs in report["fan_out"].items():
        sizes = [int(B) for B in runs]
        left.plot(sizes, [runs[str(B)]["hit_rate"] for B in sizes], marker="o", label=shape)
    left.set_xscale("log", base=2)
    left.set_xlabel("cache size (blocks per row)")
    left.set_ylabel("cache hit rate")
    left.set_title("Fan-out shape (greedy)")
    left.legend()
    left.grid(alpha=0.3)
    for k, curve in report.get("outcome_hit_curves", {}).items():
        if curve["held_by_top"]:
            tops = [int(F) for F in curve["held_by_top"]]
            middle.plot(tops, list(curve["held_by_top"].values()), marker="o",
                        label=f"k = {k} ({curve['share']:.0%} of rounds)")
    middle.set_xscale("log", base=2)
    middle.set_xlabel("top F candidates for the outcome")
    middle.set_ylabel("share of its rounds held")
    middle.set_title("Each outcome's hit curve (uniform)")
    middle.legend(fontsize=7)
    middle.grid(alpha=0.3)
    Cs = [float(C) for C in report["saguaro"]]
    right.plot(Cs, [v["hit_rate"] for v in report["saguaro"].values()], marker="o", label="cache hit rate")
    right.plot(Cs, [v["acceptance"] for v in report["saguaro"].values()], marker="s", label="acceptance rate")
    right.set_xlabel("Saguaro C (1 = off)")
    right.set_ylabel("rate")
    right.set_title(f"Saguaro sampling (T = {report['temperature']})")
    right.legend()
    right.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "ssd.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]

