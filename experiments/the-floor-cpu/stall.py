"""Section 3b's open question: does DSpark's compiled arm compile anything after `dspark bench speed`'s warm-up?

The compiled DSpark arm alone, as `bench speed` calls it (the shipped draft, the default policy fresh each call,
static cache + torch.compile, greedy, float32, batch 1, 96 new tokens, the same warm-up: every prompt decoded in full),
then `--repeats` passes over the prompts, each call timed. torch's recompile and graph-break logs are counted per
call (`torch._logging.set_logs(recompiles=True)` writes them through the `torch._dynamo` logger, caught here), so a
call that compiles says so next to its seconds.

    python experiments/the-floor-cpu/stall.py --output experiments/the-floor-cpu/results/stall.json
"""

import argparse
import json
import logging
import statistics
import time

import torch

import dspark_hf
from dspark_hf.evaluation.evaluate import chat_batch, static_compile
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.evaluation.suites import load_prompts


class Counter(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage().splitlines()[0][:300])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="mtbench")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    target, tokenizer = dspark_hf.default_target()
    draft = dspark_hf.default_draft(target)
    prompts = load_prompts(None, [args.suite], args.limit)
    batches = [chat_batch(tokenizer, [p], target.device) for p in prompts]
    longest = max(b["input_ids"].shape[1] for b in batches) + args.max_new_tokens
    kw = {"assistant_model": draft, **static_compile(longest), "do_sample": False,
          "max_new_tokens": args.max_new_tokens}

    counter = Counter()
    for name in ("torch._dynamo", "torch._inductor"):
        logging.getLogger(name).addHandler(counter)
    torch._logging.set_logs(recompiles=True, graph_breaks=True)

    def call(inputs, **extra):
        before = len(counter.lines)
        start = time.perf_counter()
        out = target.generate(**inputs, **kw, **extra)
        return time.perf_counter() - start, counter.lines[before:], out

    warm = [call(b)[:2] for b in batches]  # as bench speed's warm-up: every batch in full, no round records
    repeats = []
    for r in range(args.repeats):
        calls = []
        for i, b in enumerate(batches):
            seconds, logs, out = call(b, return_dict_in_generate=True)
            rounds = [r for row in out.rounds for r in row]  # per row, its rounds (batch 1: one row)
            calls.append({"prompt": prompts[i]["id"], "seconds": seconds, "compile_logs": logs,
                          "rounds": len(rounds), "drafted_rounds": sum(r.verified > 0 for r in rounds)})
        repeats.append(calls)
        print(f"repeat {r}: {sum(c['seconds'] for c in calls):.1f} s, "
              f"{sum(len(c['compile_logs']) for c in calls)} compile log lines")
    report = {"settings": vars(args), "machine": machine_info(target, draft),
              "warm_up": [{"prompt": p["id"], "seconds": s, "compile_logs": logs} for p, (s, logs) in zip(prompts, warm)],
              "repeats": repeats,
              "repeat_seconds": [sum(c["seconds"] for c in calls) for calls in repeats],
              "median_repeat_seconds": statistics.median(sum(c["seconds"] for c in calls) for calls in repeats)}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("repeat_seconds", "median_repeat_seconds")}))


if __name__ == "__main__":
    main()
