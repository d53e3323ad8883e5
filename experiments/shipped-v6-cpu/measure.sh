#!/usr/bin/env bash
# What a user gets on this CPU with the draft shipped since 2026-11-26 (the first GPU run's, recipe v6), float32
# target, greedy, every figure paired with plain generate() in one run; the draft shipped before it (v4) beside it
# where the default policy must still hold 0.95x. Results in experiments/shipped-v6-cpu/results/.
set -euo pipefail
OUT=experiments/shipped-v6-cpu/results
RUNS=${RUNS:-runs}
mkdir -p "$OUT" "$RUNS/v4-draft"
# v4, the draft shipped until 2026-11-26, from git history
for f in config.json model.safetensors; do
  git show c20a66c:dspark_hf/assets/dspark-smollm2-135m-instruct/$f > "$RUNS/v4-draft/$f"
done
SUITES="--suite humaneval --suite mtbench --suite gsm"

# 1. batch 1, 9 held-out prompts, 96 new tokens: plain generate(), prompt lookup, DSpark with the default policy,
#    the full block and fixed verification lengths 1-3; v4 beside it with the default policy
dspark bench speed $SUITES --limit 3 --batch-size 1 --max-new-tokens 96 --repeats 3 --policy auto \
  --policy "full block" --policy "fixed 1" --policy "fixed 2" --policy "fixed 3" --also-draft "v4=$RUNS/v4-draft" \
  --output "$OUT/bench_speed_b1.json"

# 2. batch 8, 24 held-out prompts (3 batches), 96 new tokens
dspark bench speed $SUITES --limit 8 --batch-size 8 --max-new-tokens 96 --repeats 3 --policy auto \
  --policy "full block" --policy "fixed 1" --policy "fixed 2" --also-draft "v4=$RUNS/v4-draft" \
  --output "$OUT/bench_speed_b8.json"

# 3. under load: 1-32 concurrent 32-token requests, every prompt at every concurrency, against no speculation
dspark bench serve --limit 4 --batch-sizes 1 2 4 8 16 32 --max-new-tokens 32 --repeats 3 \
  --policies auto "full block" "fixed 1" "fixed 2" --output "$OUT/bench_serve.json" --plot "$OUT"

# 4. the main job as a newcomer runs it
dspark generate | tee "$OUT/generate.txt"
