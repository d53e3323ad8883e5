#!/usr/bin/env bash
# Design step 3 (issue 51) changed how the loop drafts (DSparkCandidateGenerator), where a call's learned policy is
# kept (under a lock) and what generate() checks and returns: is generate() as fast as before on this CPU? `dspark
# bench speed` (plain generate() eager, prompt lookup at batch 1, DSpark with the default policy; float32 target,
# greedy, every output checked identical) at batch 1 and 8, on the code before the change (2593481, in a git worktree)
# and after it, one after the other in one run. Results in experiments/design-step-3/results/.
# Run from the repository root: bash experiments/design-step-3/measure.sh
set -euo pipefail
OUT=$PWD/experiments/design-step-3/results
BEFORE=${BEFORE:-/tmp/dspark-before51}  # a worktree of the code before the change
[ -d "$BEFORE" ] || git worktree add --detach "$BEFORE" 2593481
mkdir -p "$OUT"
SUITES="--suite humaneval --suite mtbench --suite gsm"
B1="$SUITES --limit 3 --batch-size 1 --max-new-tokens 96 --repeats 3 --policy auto --no-compile"
B8="$SUITES --limit 8 --batch-size 8 --max-new-tokens 96 --repeats 3 --policy auto --no-compile"
# shellcheck disable=SC2086  # the flags are lists
for batch in b1 b8; do
  flags=$B1; [ $batch = b8 ] && flags=$B8
  (cd "$BEFORE" && PYTHONPATH="$BEFORE" python -m dspark_hf bench speed $flags --output "$OUT/bench_speed_${batch}_before.json")
  python -m dspark_hf bench speed $flags --output "$OUT/bench_speed_${batch}_after.json"
done
