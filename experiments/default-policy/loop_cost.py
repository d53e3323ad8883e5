"""What the DSpark decoding loop itself costs next to plain generate(), with drafting switched off in every round
(the default policy's state in most rounds when the draft does not pay): the same target forwards, our bookkeeping
around them.

    python experiments/default-policy/loop_cost.py [--batch-sizes 1 16] [--max-new-tokens 96 32] [--repeats 10]
        [--output FILE.json]

The embedded target and the shipped draft on the CPU, greedy, float32; the first --batch-sizes prompts of
DEFAULT_PROMPTS (cycled); both methods run in every repeat, in alternating order. A forward hook on the target
times its forwards, so the time outside them (per round: per forward) is what each loop adds to the same model calls.
"""

import argparse
import json
import statistics
import time

import torch

import dspark_hf
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.evaluation.suites import DEFAULT_PROMPTS, chat_inputs


class DraftingOff(dspark_hf.Policy):
    """Never drafts: every round is one plain step through the DSpark loop."""

    def draft_this_round(self, num_rows: int) -> bool:
        return False

    def __call__(self, confidences, gamma: int, num_rows: int) -> torch.Tensor:
        return torch.zeros(num_rows, dtype=torch.long)


class ForwardClock:
    """Seconds spent inside the model's forward, and how many forwards ran, since the last reset."""

    def __init__(self, model):
        self.seconds, self.calls, self._start = 0.0, 0, None
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave)

    def _enter(self, module, args):
        self._start = time.perf_counter()

    def _leave(self, module, args, output):
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def reset(self):
        self.seconds, self.calls = 0.0, 0


def measure(target, draft, inputs, max_new_tokens: int, repeats: int, clock: ForwardClock) -> dict:
    methods = {
        "plain": lambda: target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False),
        "dspark, drafting off": lambda: target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                                        assistant_model=draft, verification_policy=DraftingOff()),
    }
    outputs = {name: run() for name, run in methods.items()}  # warm-up, and the outputs must agree
    identical = torch.equal(*outputs.values())
    runs = {name: [] for name in methods}
    for i in range(repeats):
        for name in (list(methods) if i % 2 == 0 else list(methods)[::-1]):
            clock.reset()
            start = time.perf_counter()
            methods[name]()
            seconds = time.perf_counter() - start
            runs[name].append({"seconds": seconds, "outside_forward_ms_per_round":
                               1000 * (seconds - clock.seconds) / clock.calls, "forwards": clock.calls})
    plain, ours = runs["plain"], runs["dspark, drafting off"]
    return {
        "identical_outputs": identical,
        "speed_vs_plain_paired_median": statistics.median(p["seconds"] / o["seconds"] for p, o in zip(plain, ours)),
        "outside_forward_ms_per_round_median": {name: statistics.median(r["outside_forward_ms_per_round"] for r in rs)
                                                for name, rs in runs.items()},
        "runs": runs,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[96, 32],
                        help="one per batch size, or one for all")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", help="write the figures here as JSON")
    args = parser.parse_args()
    lengths = args.max_new_tokens * len(args.batch_sizes) if len(args.max_new_tokens) == 1 else args.max_new_tokens
    if len(lengths) != len(args.batch_sizes):
        parser.error("give one --max-new-tokens per batch size, or one for all")

    target, tokenizer = dspark_hf.default_target(device="cpu")
    draft = dspark_hf.default_draft(target)
    clock = ForwardClock(target)
    report = {"settings": vars(args), "machine": machine_info(target, draft), "batch_sizes": {}}
    for R, tokens in zip(args.batch_sizes, lengths):
        prompts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(R)]
        result = measure(target, draft, chat_inputs(tokenizer, prompts), tokens, args.repeats, clock)
        report["batch_sizes"][R] = {"max_new_tokens": tokens, **result}
        print(f"R={R}: {result['speed_vs_plain_paired_median']:.3f}x plain, outside the forward per round (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in result["outside_forward_ms_per_round_median"].items())
              + f", identical: {result['identical_outputs']}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
