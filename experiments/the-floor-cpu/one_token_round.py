"""What a round that drafts nothing costs against plain generate()'s step (issue 57): the shipped draft with a policy
that never drafts, so that every DSpark round verifies one token, paired and interleaved with plain generate() on
the same prompts, eager and with a static cache + torch.compile, at batch 1 and 8. Float32 target, greedy, every
output checked identical. Runs on whatever dspark_hf is importable (the script also serves the code before the
change, from a git worktree).

    python experiments/the-floor-cpu/one_token_round.py --output results/one_token_round.json [--repeats 5]
"""

import argparse
import json
import statistics
import time

import torch

import dspark_hf
from dspark_hf.evaluation.evaluate import static_compile
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.scheduling.policies import Policy

PROMPTS = ["Tell me about the history of Rome in a few paragraphs.", "Write a python function that sorts a list.",
           "What is 17 times 23?", "Give me three tips for sleeping well.", "Explain photosynthesis to a child.",
           "Write a haiku about the sea.", "How do I make pancakes?", "What is the capital of Australia and why?"]


class NeverDrafts(Policy):
    """Every round verifies one token: the round a paused default policy runs."""

    def draft_this_round(self, num_rows: int) -> bool:
        return False

    def keep_drafted(self, num_rows: int) -> bool:
        return False

    def __call__(self, confidences, gamma, num_rows):
        return torch.zeros(num_rows, dtype=torch.long)


def measure(target, tokenizer, draft, batch: int, path: str, new: int, repeats: int) -> dict:
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in PROMPTS[:batch]]
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    options = static_compile(inputs["input_ids"].shape[1] + new) if path == "compiled" else {}

    def plain():
        return target.generate(**inputs, max_new_tokens=new, do_sample=False, **options)

    def dspark():
        return target.generate(**inputs, max_new_tokens=new, do_sample=False, assistant_model=draft,
                               verification_policy=NeverDrafts(), **options)

    identical = torch.equal(plain(), dspark()) and torch.equal(plain(), dspark())  # warm: compiled, costs
    seconds = {"plain": [], "dspark": []}
    for i in range(repeats):
        for name in (["plain", "dspark"] if i % 2 == 0 else ["dspark", "plain"]):
            start = time.perf_counter()
            (plain if name == "plain" else dspark)()
            seconds[name].append(time.perf_counter() - start)
    paired = [p / d for p, d in zip(seconds["plain"], seconds["dspark"])]
    return {"batch_size": batch, "path": path, "max_new_tokens": new, "identical": identical,
            "plain_ms_per_step": statistics.median(seconds["plain"]) / new * 1e3,
            "dspark_ms_per_round": statistics.median(seconds["dspark"]) / new * 1e3,
            "paired_ratio": statistics.median(paired), "paired_range": [min(paired), max(paired)],
            "seconds": seconds}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    target, tokenizer = dspark_hf.default_target()
    draft = dspark_hf.default_draft(target)
    results = [measure(target, tokenizer, draft, batch, path, args.max_new_tokens, args.repeats)
               for path in ("eager", "compiled") for batch in (1, 8)]
    for r in results:
        print(f"{r['path']:9s} batch {r['batch_size']}: plain {r['plain_ms_per_step']:.2f} ms a step, DSpark "
              f"{r['dspark_ms_per_round']:.2f} ms a round, {r['paired_ratio']:.3f}x "
              f"({r['paired_range'][0]:.3f}-{r['paired_range'][1]:.3f}), identical {r['identical']}")
    report = {"machine": machine_info(target, draft), "results": results}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
