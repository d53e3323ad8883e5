#!/usr/bin/env bash
# DSpark at accelerator speed, measured on this CPU (issue 47): the five arms of `dspark bench speed` (plain
# generate() eager and with a static cache + torch.compile, prompt lookup, DSpark eager and on its compiled fast
# path) at batch 1 and 8, and the oracle's ceiling against both baselines; beside each speed run, the same command on
# the loop before this change (today's eager DSpark, code 37f58d4, in a git worktree), alternating so that the
# machine's drift falls on both. Float32 target, greedy, every figure paired with plain generate() in one run.
# Results in experiments/accelerator-speed-cpu/results/.
set -euo pipefail
OUT=experiments/accelerator-speed-cpu/results
BEFORE=${BEFORE:-/tmp/dspark-before}  # a worktree of the code before the change
mkdir -p "$OUT"
[ -d "$BEFORE" ] || git worktree add --detach "$BEFORE" 37f58d4
SUITES="--suite humaneval --suite mtbench --suite gsm"
B1="$SUITES --limit 3 --batch-size 1 --max-new-tokens 96 --repeats 3 --policy auto"
B8="$SUITES --limit 8 --batch-size 8 --max-new-tokens 96 --repeats 3 --policy auto"
before() { (cd "$BEFORE" && PYTHONPATH="$BEFORE" python -m dspark_hf "$@"); }

# shellcheck disable=SC2086  # the flags are lists
python -m dspark_hf bench speed $B1 --output "$OUT/bench_speed_b1.json"
before bench speed $B1 --output "$PWD/$OUT/bench_speed_b1_before.json"
python -m dspark_hf bench speed $B8 --output "$OUT/bench_speed_b8.json"
before bench speed $B8 --output "$PWD/$OUT/bench_speed_b8_before.json"
# the loop's ceiling: an oracle draft, batch 1 and 8, against both baselines
python -m dspark_hf bench oracle --batch-sizes 1 8 --max-new-tokens 96 --repeats 3 --output "$OUT/bench_oracle.json"
