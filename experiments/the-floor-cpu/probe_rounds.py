"""What a paused default policy's probe costs in a call (issue 57, sections 3d and 3e): every round of the compiled
DSpark arm (or the eager one, `--eager`) timed as it ends, at batch 1 or more (batches of `--batch-size` MT-Bench
prompts, or of the packaged suites', `--suites`), the shipped draft, greedy, float32, a fresh default policy each
call (what it learned carried from call to call, as in `dspark bench speed`); for each probe, the times of the round
that drafts its block, the round that verifies it and the round after, against the call's median round, beside what
the policy's costs put the probe at. Draft passes are counted per round too.

    python experiments/the-floor-cpu/probe_rounds.py --output results/probe_rounds.json
    python experiments/the-floor-cpu/probe_rounds.py --batch-size 8 --limit 16 --output results/probe_rounds_b8.json
    python experiments/the-floor-cpu/probe_rounds.py --batch-size 8 --limit 8 --suites --eager \
        --output results/probe_rounds_b8_suites_eager.json
"""

import argparse
import json
import statistics
import time

import dspark_hf
from dspark_hf.evaluation.evaluate import chat_batch, static_compile
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.evaluation.suites import load_prompts
from dspark_hf.generation import decoding
from dspark_hf.generation.candidate_generator import DSparkCandidateGenerator
from dspark_hf.scheduling.auto import AutoScheduled


class RoundTimes:
    """The time the prefill and each round ended, and what each round verified (its longest row): the loop's own
    steps timed (a streamer would serve batch 1 only). On a CPU a step's end is its work's end."""

    def __init__(self):
        self.ends, self.verified = [], []
        self._prefill, self._round = decoding._prefill, decoding._round

    def __enter__(self):
        def prefill(s, candidates, state):
            plan = self._prefill(s, candidates, state)
            self.ends.append(time.perf_counter())
            return plan

        def round_(s, candidates, state, plan):
            following = self._round(s, candidates, state, plan)
            self.ends.append(time.perf_counter())
            self.verified.append(plan.longest)
            return following

        decoding._prefill, decoding._round = prefill, round_
        return self

    def __exit__(self, *exc):
        decoding._prefill, decoding._round = self._prefill, self._round


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--suites", action="store_true", help="the packaged suites (humaneval, mtbench, gsm) "
                        "interleaved, --limit of each, rather than MT-Bench alone")
    parser.add_argument("--eager", action="store_true", help="the eager calls rather than the compiled ones")
    args = parser.parse_args()
    target, tokenizer = dspark_hf.default_target()
    draft = dspark_hf.default_draft(target)
    prompts = load_prompts(None, ["humaneval", "mtbench", "gsm"] if args.suites else ["mtbench"], args.limit)
    B = args.batch_size
    groups = [prompts[i:i + B] for i in range(0, len(prompts), B)]
    batches = [chat_batch(tokenizer, g, target.device) for g in groups]
    options = {} if args.eager else static_compile(max(b["input_ids"].shape[1] for b in batches) + args.max_new_tokens)
    passes, propose = [], DSparkCandidateGenerator.propose

    def counted(self, anchor, positions, context, process, drafting):  # one proposal a round (and the prefill's)
        passes.append(bool(drafting))
        return propose(self, anchor, positions, context, process, drafting)

    DSparkCandidateGenerator.propose = counted

    def call(inputs):
        policy = AutoScheduled(progress=False)
        passes.clear()
        with RoundTimes() as times:
            target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=draft,
                            verification_policy=policy, **options)
        return policy, times, list(passes)

    for inputs in batches:  # warm: compiled, priced
        call(inputs)
    calls = []
    for _ in range(args.repeats):
        for group, inputs in zip(groups, batches):
            policy, times, drafted = call(inputs)
            ms = [1e3 * (b - a) for a, b in zip(times.ends, times.ends[1:])]  # ms[k]: round k
            median = statistics.median(ms)
            probes = [k for k, v in enumerate(times.verified) if v > 0 and k > 0]
            calls.append({"prompts": [p["id"] for p in group], "rounds": len(ms), "median_round_ms": median,
                          "draft_passes": sum(drafted),
                          "probes": [{"round": k, "verified": times.verified[k],
                                      "ms": [ms[j] for j in (k - 1, k, k + 1) if 0 <= j < len(ms)]}
                                     for k in probes]})
    costs = policy.costs
    priced = {"plain_ms": 1e3 * costs.plain(B), "draft_ms": 1e3 * costs.draft(B),
              "verify_ms": {n: 1e3 * costs.verify(B, n) for n in range(1, draft.config.block_size + 2)}}
    # a probe's extra time: its three rounds over three of the call's median rounds, in ms and in rounds
    extra = [(sum(p["ms"]) - 3 * c["median_round_ms"], c["median_round_ms"]) for c in calls for p in c["probes"]
             if len(p["ms"]) == 3]
    steps = [e / median for e, median in extra]
    priced_steps = [policy._probe_overhead(B, p["verified"]) for c in calls for p in c["probes"]]
    extra = [e for e, _ in extra]
    report = {"settings": vars(args), "machine": machine_info(target, draft), "costs": priced, "calls": calls,
              "probe_extra_ms_median": statistics.median(extra) if extra else None,
              "probe_extra_steps_median": statistics.median(steps) if steps else None,
              "probe_priced_steps_median": statistics.median(priced_steps) if priced_steps else None,
              "probes_per_call": sum(len(c["probes"]) for c in calls) / len(calls),
              "draft_passes_per_call": sum(c["draft_passes"] for c in calls) / len(calls)}
    print(json.dumps({k: report[k] for k in ("costs", "probe_extra_ms_median", "probe_extra_steps_median",
                                              "probe_priced_steps_median", "probes_per_call", "draft_passes_per_call")}, indent=1))
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
