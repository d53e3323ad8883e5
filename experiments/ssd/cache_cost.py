"""What one round's speculation costs with the shipped draft: drafting A blocks for one row (A = the cache size)
with the distributions kept over the 49k-token target vocabulary, against the same blocks kept over the draft's
8k vocabulary until one is used (what SSD does since this measurement), interleaved, median of repeats.

    python experiments/ssd/cache_cost.py [--cache-sizes 8 16 64] [--repeats 5] [--output FILE.json]

The context is a real chat prompt's target features; sampling at temperature 0.7, as `dspark bench ssd` does.
"""

import argparse
import json
import statistics
import time

import torch

import dspark_hf
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.evaluation.suites import DEFAULT_PROMPTS, chat_inputs
from dspark_hf.generation.block_sources import sample_block

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--cache-sizes", type=int, nargs="+", default=[8, 16, 64])
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--output", help="write the figures here as JSON")
args = parser.parse_args()

target, tokenizer = dspark_hf.default_target(device="cpu")
draft = dspark_hf.default_draft(target)
inputs = chat_inputs(tokenizer, DEFAULT_PROMPTS[:1])
with torch.no_grad():
    out = target(**inputs, output_hidden_states=True)
mask = inputs["attention_mask"]
positions = (mask.cumsum(1) - 1).clamp_min(0)
context = draft.encode_context(draft.target_features(out.hidden_states), positions, mask.bool())
temperature = lambda prefix, logits: logits / 0.7  # noqa: E731  (a processor that reads only the scores)

rows = []
for A in args.cache_sizes:
    anchors = inputs["input_ids"][:, -1:].repeat(1, A)
    anchor_positions = torch.full((1, A), mask.shape[1])
    seconds = {True: [], False: []}
    for _ in range(args.repeats + 1):  # the first pass of each warms up
        for wide in (True, False):
            start = time.perf_counter()
            block = sample_block(draft, anchors, anchor_positions, context, True, process_logits=temperature,
                                 target_vocab=wide)
            if not wide:
                block.index(0, 0).in_target_vocab(draft.config.target_vocab_size)  # the one block a hit uses
            seconds[wide].append(time.perf_counter() - start)
    full, compact = (statistics.median(seconds[w][1:]) for w in (True, False))
    rows.append({"cache_size": A, "target_vocab_seconds": full, "draft_vocab_seconds": compact,
                 "ratio": full / compact})
    print(f"cache {A:3d}: target vocabulary {full * 1000:7.1f} ms, draft vocabulary {compact * 1000:7.1f} ms "
          f"({full / compact:.1f}x)")

report = {"rows": rows, "repeats": args.repeats, "machine": machine_info(target, draft)}
if args.output:
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
