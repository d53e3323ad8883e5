"""What drafted rounds and one-token rounds cost inside a real decode, against what the default policy's costs say
(issue 57, why `AutoScheduled(margin=...)`): the shipped draft on the packaged suites at batch 8 (the prompts of
`bench_speed_b8.json`), compiled, greedy, 96 new tokens, the default policy at `--margin` (1.0: break-even, the
policy before the margin), each call paired with plain generate() with a static cache + torch.compile. Every round
is timed (wall clock around the loop's `_round`) and sorted by what it did: drafted (verified a block) or not; per
kind the median milliseconds and the tokens committed per live row.

    python experiments/the-floor-cpu/mixed_rounds.py --margin 1.0 --output results/mixed_rounds_margin1.0.json
"""

import argparse
import json
import statistics
import time
from collections import defaultdict

import dspark_hf
from dspark_hf.evaluation.evaluate import chat_batch, static_compile
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.evaluation.suites import load_prompts
from dspark_hf.generation import decoding


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--margin", type=float, required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    target, tokenizer = dspark_hf.default_target()
    draft = dspark_hf.default_draft(target)
    prompts = load_prompts(suites=["humaneval", "mtbench", "gsm"], limit=8)
    new, rows = 96, 8
    batches = [chat_batch(tokenizer, prompts[i:i + rows], "cpu") for i in range(0, len(prompts), rows)]
    options = static_compile(max(b["input_ids"].shape[1] for b in batches) + new)

    seconds = []  # of each round of the current call
    real_round = decoding._round

    def timed_round(*a):
        start = time.perf_counter()
        plan = real_round(*a)
        seconds.append(time.perf_counter() - start)
        return plan

    decoding._round = timed_round

    policies = []

    def dspark(inputs):
        policies.append(dspark_hf.AutoScheduled(margin=args.margin))
        return target.generate(**inputs, max_new_tokens=new, do_sample=False, assistant_model=draft, **options,
                               verification_policy=policies[-1], return_dict_in_generate=True)

    def plain(inputs):
        return target.generate(**inputs, max_new_tokens=new, do_sample=False, **options)

    for inputs in batches:  # warm: compiled graphs, the policy's costs
        dspark(inputs), plain(inputs)
    kinds, wall = defaultdict(lambda: {"ms": [], "tokens_per_row": []}), {"dspark": 0.0, "plain": 0.0}
    identical = True
    for _ in range(args.repeats):
        for inputs in batches:
            seconds.clear()
            start = time.perf_counter()
            out = dspark(inputs)
            wall["dspark"] += time.perf_counter() - start
            start = time.perf_counter()
            reference = plain(inputs)
            wall["plain"] += time.perf_counter() - start
            identical &= out.sequences.tolist() == reference.tolist()
            for i, s in enumerate(seconds):
                live = [r[i] for r in out.rounds if len(r) > i]
                kind = "drafted" if any(x.verified for x in live) else "one token"
                kinds[kind]["ms"].append(s * 1e3)
                kinds[kind]["tokens_per_row"].append(sum(x.committed for x in live) / len(live))
    costs = policies[-1].costs  # what the policy priced the rounds at (the last call's; cached, so every call's)
    report = {"machine": machine_info(target, draft), "margin": args.margin, "batch_size": rows,
              "max_new_tokens": new, "repeats": args.repeats, "identical": identical,
              "dspark_over_plain_seconds": wall["dspark"] / wall["plain"],
              "rounds": {k: {"count": len(v["ms"]), "median_ms": statistics.median(v["ms"]),
                             "tokens_per_row": statistics.mean(v["tokens_per_row"]),
                             "ms_per_token": sum(v["ms"]) / sum(v["tokens_per_row"])} for k, v in kinds.items()},
              "priced_ms": {"one token (plain's step)": costs.plain(rows) * 1e3, "draft": costs.draft(rows) * 1e3,
                            **{f"verify {n}": costs.verify(rows, n) * 1e3 for n in range(1, 9)}}}
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
