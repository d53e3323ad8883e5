"""Where a round that drafts nothing spends its time beyond plain generate()'s step (issue 57): plain generate() and
DSpark with a policy that never drafts, eager, batch 1 and 8, 96 new tokens, each decoded once under cProfile after
a warm-up; per round, the milliseconds of the parts they differ in. cProfile adds its own cost to every Python call
(more to DSpark's, which makes more of them), so the parts are read against each other, and the paired timings
without it (one_token_round.py) are the figures. Runs on whatever dspark_hf is importable (the code before the
change too, from a git worktree).

    python experiments/the-floor-cpu/breakdown.py --output results/breakdown.json
"""

import argparse
import cProfile
import json
import pstats

import dspark_hf
from dspark_hf.evaluation.machine import machine_info

from one_token_round import PROMPTS, NeverDrafts

def seconds(stats: pstats.Stats, where: str, function: str, calls: int | None = None, largest=False) -> float:
    """Cumulative seconds of `function` in files whose path ends with `where` (summed over such functions, or the
    largest, e.g. of the model's several `forward`s called `calls` times: the top one)."""
    found = [cum for (path, _, name), (_, n, _, cum, _) in stats.stats.items()
             if name == function and path.endswith(where) and (calls is None or n == calls)]
    return (max(found) if largest else sum(found)) if found else 0.0


def parts(stats: pstats.Stats, forwards: int) -> dict:
    """Seconds of what a plain step and a DSpark round differ in, over the whole call."""
    total = seconds(stats, "generation/utils.py", "generate", largest=True)
    forward = seconds(stats, "modeling_llama.py", "forward", calls=forwards, largest=True)
    return {
        "generate(), all of it": total,
        "the target's forwards": forward,
        "outside them (the loop, its bookkeeping, the draft's context)": total - forward,
        "  KV cache writes (the cache's update)": seconds(stats, "cache_utils.py", "update")
        + seconds(stats, "generation/cache.py", "update"),
        "  attention (SDPA)": seconds(stats, "sdpa_attention.py", "sdpa_attention_forward"),
        "  masks built per row (DecodingState._masks)": seconds(stats, "generation/state.py", "_masks"),
        "  the draft's context projected (encode_context)": seconds(stats, "modeling_dspark.py", "encode_context"),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    target, tokenizer = dspark_hf.default_target()
    draft = dspark_hf.default_draft(target)
    tokenizer.padding_side = "left"
    results = []
    for batch in (1, 8):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in PROMPTS[:batch]]
        inputs = tokenizer(texts, return_tensors="pt", padding=True)
        runs = {"plain": lambda: target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False),
                "dspark": lambda: target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                                  assistant_model=draft, verification_policy=NeverDrafts())}
        entry = {"batch_size": batch}
        for name, run in runs.items():
            run()
            profile = cProfile.Profile()
            profile.enable()
            run()
            profile.disable()
            measured = parts(pstats.Stats(profile), forwards=args.max_new_tokens)
            entry[name] = {label: s * 1e3 / args.max_new_tokens for label, s in measured.items()}  # ms a token
        results.append(entry)
        for label in entry["plain"]:
            print(f"batch {batch} {label}: plain {entry['plain'][label]:.2f} ms, DSpark {entry['dspark'][label]:.2f} ms")
    with open(args.output, "w") as f:
        json.dump({"machine": machine_info(target, draft), "max_new_tokens": args.max_new_tokens,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
