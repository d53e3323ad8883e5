"""Where the compiled default policy's last 2-3% against plain static+compile goes (issue 57, section 3d): compiled
arms only, paired and interleaved as `dspark bench speed` runs them, on MT-Bench prompts: plain static+compile; DSpark
compiled with the default policy as the bench calls it (`return_dict_in_generate=True`, whose round records the
bench reads for tau) and without it; DSpark compiled with `FixedLength(0)`, which never drafts (so no probes), with
and without the records. `--with-eager` puts an eager plain call and an eager DSpark call between them, as the bench
does. Float32 target, greedy, every output checked identical to plain's.

    python experiments/the-floor-cpu/compiled_split.py --batch-size 1 --limit 8 --output results/compiled_split_b1.json
"""

import argparse
import json
import statistics

import dspark_hf
from dspark_hf.evaluation.evaluate import _batches, chat_batch, identical_rows, static_compile, user_tokens
from dspark_hf.evaluation.harness import interleaved
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.evaluation.suites import load_prompts
from dspark_hf.scheduling.auto import AutoScheduled
from dspark_hf.scheduling.policies import FixedLength
from dspark_hf.eos import eos_token_ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--with-eager", action="store_true")
    args = parser.parse_args()
    target, tokenizer = dspark_hf.default_target()
    draft = dspark_hf.default_draft(target)
    prompts = load_prompts(None, ["mtbench"], args.limit)
    batches = [chat_batch(tokenizer, b, target.device) for b in _batches(prompts, args.batch_size)]
    longest = max(b["input_ids"].shape[1] for b in batches) + args.max_new_tokens
    compiled = static_compile(longest)
    new = args.max_new_tokens
    arms = {
        "plain (static+compile)": lambda x: target.generate(**x, max_new_tokens=new, do_sample=False, **compiled),
        "auto, records": lambda x: target.generate(**x, max_new_tokens=new, do_sample=False, **compiled,
                                                   assistant_model=draft, verification_policy=AutoScheduled(),
                                                   return_dict_in_generate=True).sequences,
        "auto": lambda x: target.generate(**x, max_new_tokens=new, do_sample=False, **compiled,
                                          assistant_model=draft, verification_policy=AutoScheduled()),
        "fixed 0, records": lambda x: target.generate(**x, max_new_tokens=new, do_sample=False, **compiled,
                                                      assistant_model=draft, verification_policy=FixedLength(0),
                                                      return_dict_in_generate=True).sequences,
        "fixed 0": lambda x: target.generate(**x, max_new_tokens=new, do_sample=False, **compiled,
                                             assistant_model=draft, verification_policy=FixedLength(0)),
    }
    if args.with_eager:
        arms["plain (eager)"] = lambda x: target.generate(**x, max_new_tokens=new, do_sample=False)
        arms["auto (eager)"] = lambda x: target.generate(**x, max_new_tokens=new, do_sample=False,
                                                         assistant_model=draft)
    for call in arms.values():  # warm: every batch compiled and priced, and plain's steps once more after DSpark's
        for x in batches:
            call(x)
    for x in batches:
        arms["plain (static+compile)"](x)
    eos = eos_token_ids(target.generation_config)
    identical = []

    def new_tokens(outs):
        return [out[:, x["input_ids"].shape[1]:] for out, x in zip(outs, batches)]

    def check(repeat, runs):
        reference = new_tokens(runs.results["plain (static+compile)"][repeat])
        for name in runs.results:
            identical.append(identical_rows(new_tokens(runs.results[name][repeat]), reference, eos) == len(prompts))

    runs = interleaved(arms, batches, args.repeats, target.device, on_repeat=check)

    report = {"settings": vars(args), "machine": machine_info(target, draft), "identical": all(identical),
              "arms": {}}
    tokens = [user_tokens(t, eos) for t in new_tokens(runs.results["plain (static+compile)"][0])]
    for name in arms:
        paired = [p / s for p, s in zip(runs.seconds["plain (static+compile)"], runs.seconds[name])]
        report["arms"][name] = {"seconds": runs.seconds[name], "paired_ratio": statistics.median(paired),
                                "paired_range": [min(paired), max(paired)]}
        print(f"{name:24s} {statistics.median(runs.seconds[name]):7.2f} s  {statistics.median(paired):.3f}x "
              f"({min(paired):.3f}-{max(paired):.3f})")
    report["tokens"] = sum(tokens)
    print(f"identical: {all(identical)}; {sum(tokens)} tokens a repeat")
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
