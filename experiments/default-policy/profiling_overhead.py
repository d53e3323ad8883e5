"""What the default policy's first call costs: generate() with an empty cost cache (it measures this machine's costs
for the batch size in use), then the same call again, which reads them from the cache.

    python experiments/default-policy/profiling_overhead.py [--batch-size 1] [--max-new-tokens 96] [--output FILE.json]

Both calls use the embedded target and the shipped draft on the CPU, greedy; the cache lives in a fresh temporary
folder ($DSPARK_HF_PROFILE_CACHE), so the user's own cache is untouched.
"""

import argparse
import json
import os
import tempfile
import time

import torch

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--output", help="write the figures here as JSON")
args = parser.parse_args()

os.environ["DSPARK_HF_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="dspark-profiles-")
import dspark_hf  # noqa: E402  (after the cache folder is chosen)
from dspark_hf.evaluation.suites import DEFAULT_PROMPTS, chat_inputs  # noqa: E402
from dspark_hf.evaluation.machine import machine_info  # noqa: E402

target, tokenizer = dspark_hf.default_target(device="cpu")
draft = dspark_hf.default_draft(target)
inputs = chat_inputs(tokenizer, DEFAULT_PROMPTS[: args.batch_size])
target.generate(**inputs, max_new_tokens=4)  # warm-up of plain decoding
seconds, outputs = [], []
for _ in range(2):
    start = time.perf_counter()
    outputs.append(target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                   assistant_model=draft))
    seconds.append(time.perf_counter() - start)
assert torch.equal(outputs[0], outputs[1])
report = {"first_call_seconds": seconds[0], "cached_call_seconds": seconds[1],
          "profiling_overhead_seconds": seconds[0] - seconds[1], "batch_size": args.batch_size,
          "max_new_tokens": args.max_new_tokens, "machine": machine_info(target, draft)}
print(json.dumps(report, indent=2))
if args.output:
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
