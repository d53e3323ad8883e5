#!/usr/bin/env bash
# DSpark at accelerator speed, measured on this CPU (issue 47): every arm of `dspark bench speed` (plain generate()
# eager and with a static cache + torch.compile, prompt lookup eager and static, DSpark eager and on its compiled
# fast path) at batch 1 and 8, and the oracle's ceiling against both baselines; beside each speed run, the same
# command on the loop before this change (code 37f58d4, in a git worktree). Float32 target, greedy, every figure
# paired with plain generate() in one run. Results in experiments/accelerator-speed-cpu/results/.
# Run from the repository root: bash experiments/accelerator-speed-cpu/measure.sh [b1|b8|oracle|before ...]
set -euo pipefail
OUT=experiments/accelerator-speed-cpu/results
BEFORE=${BEFORE:-/tmp/dspark-before}  # a worktree of the code before the change
mkdir -p "$OUT"
SUITES="--suite humaneval --suite mtbench --suite gsm"
B1="$SUITES --limit 3 --batch-size 1 --max-new-tokens 96 --repeats 3 --policy auto"
B8="$SUITES --limit 8 --batch-size 8 --max-new-tokens 96 --repeats 3 --policy auto"
before() {
  [ -d "$BEFORE" ] || git worktree add --detach "$BEFORE" 37f58d4
  (cd "$BEFORE" && PYTHONPATH="$BEFORE" python -m dspark_hf "$@")
}

# shellcheck disable=SC2086  # the flags are lists
for step in "${@:-b1 before b8 oracle}"; do
  for s in $step; do
    case $s in
      b1) python -m dspark_hf bench speed $B1 --output "$OUT/bench_speed_b1.json" ;;
      b8) python -m dspark_hf bench speed $B8 --output "$OUT/bench_speed_b8.json" ;;
      before)  # the eager loop this change replaced, at both batch sizes
        before bench speed $B1 --output "$PWD/$OUT/bench_speed_b1_before.json"
        before bench speed $B8 --output "$PWD/$OUT/bench_speed_b8_before.json" ;;
      oracle)  # the loop's ceiling: an oracle draft, batch 1 and 8, against both baselines
        python -m dspark_hf bench oracle --batch-sizes 1 8 --max-new-tokens 96 --repeats 3 \
          --output "$OUT/bench_oracle.json" ;;
      *) echo "unknown step $s: choose from b1, b8, before, oracle" >&2; exit 2 ;;
    esac
  done
done
