#!/usr/bin/env bash
# Does the default verification policy (AutoScheduled) keep generate(assistant_model=draft) from losing to plain
# generate()? Every figure in one run each on this machine, greedy, float32 target; results in
# experiments/default-policy/results/.
set -euo pipefail
OUT=experiments/default-policy/results
mkdir -p "$OUT"

# 1. the shipped draft at batch 1 on prompts never used in training, 96 new tokens: plain generate(), prompt lookup,
#    DSpark with the default policy and with the full block, interleaved, paired ratios
dspark bench speed --suite humaneval --suite mtbench --suite gsm --limit 3 --batch-size 1 --max-new-tokens 96 \
  --repeats 3 --policy auto --policy "full block" --output "$OUT/bench_speed_b1.json"

# 2. the ceiling: an oracle draft (every verified token accepted), the default policy against the full block
dspark bench oracle --batch-sizes 1 8 --max-new-tokens 64 --repeats 3 --policy "full block" --policy auto \
  --output "$OUT/bench_oracle.json"

# 3. under load: every policy at 1-32 concurrent requests against no speculation, paired ratios
dspark bench serve --batch-sizes 1 2 4 8 16 32 --max-new-tokens 32 --repeats 3 --output "$OUT/bench_serve.json" \
  --plot "$OUT"

# 4. what the first call costs when it measures this machine (an empty cost cache), against the same call cached
python experiments/default-policy/profiling_overhead.py --batch-size 1 --max-new-tokens 96 --output "$OUT/profiling_overhead.json"

# 5. what our decoding loop adds to the same target forwards, with drafting off in every round (the default policy's
#    state in most rounds when the draft does not pay), against plain generate(). results/loop_cost.json was not
#    written here: this command was run by hand with --output /tmp/loop_cost_after.json and the file copied
python experiments/default-policy/loop_cost.py --batch-sizes 1 16 --max-new-tokens 96 32 --repeats 4 \
  --output "$OUT/loop_cost.json"
