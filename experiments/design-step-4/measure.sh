#!/usr/bin/env bash
# Design step 4 (issue 60) moved the round's host copies into one mirror, made DSparkCandidateGenerator keep
# transformers' contract, kept the confidence temperatures on the device, gave the policies one interface and split
# modules by job: is generate() as fast as before? `dspark bench speed` (float32 target, greedy, 96 new tokens, every
# output checked identical to plain generate(); eager and compiled arms) at batch 1 (the three suites, one prompt
# each) and batch 8 (the first 8 MT-Bench prompts, one batch), on the code before (BEFORE: a worktree of 6d35ef5,
# main just before the change) and after (this checkout, or AFTER), alternated three times (before first in runs 1 and 3).
# Each run is normalised by its own plain generate(), so the machine's drift between runs cancels; each side keeps
# its own cost cache, so the default policy prices its own rounds. compare.py: the median of each side's ratios and
# after/before. Results in experiments/design-step-4/results/. Run from the repository root:
#   bash experiments/design-step-4/measure.sh        # about 45 minutes on 2 cores
set -euo pipefail
HERE=$PWD/experiments/design-step-4
RUNS=${RUNS:-$HERE/results/runs}
BATCHES=${BATCHES:-"b1 b8"}  # e.g. BATCHES=b8 REPEATS=3 RUNS=.../runs-b8: batch 8 alone, 3 repeats a run
REPEATS=${REPEATS:-1}
BEFORE=${BEFORE:-/tmp/dspark-before60}
AFTER=${AFTER:-$PWD}  # or a worktree of this commit, to edit the checkout meanwhile
[ -d "$BEFORE" ] || git worktree add --detach "$BEFORE" 6d35ef5
# both sides' benchmark warms the fair baseline after every arm (3febc52, a fix to the harness, not the library):
# without it plain static+compile recompiles in its first timed call, on both sides alike
for root in "$BEFORE" "$AFTER"; do
  grep -q "once more the arms of transformers' own static cache" "$root/dspark_hf/evaluation/evaluate.py" ||
    git show 3febc52 -- dspark_hf/evaluation/evaluate.py | git -C "$root" apply
done
mkdir -p "$RUNS"
B1="--suite humaneval --suite mtbench --suite gsm --limit 1 --batch-size 1"
B8="--suite mtbench --limit 8 --batch-size 8"
SPEED="--max-new-tokens 96 --repeats $REPEATS --policy auto"
run() {  # side, run number
  local root=$AFTER; [ "$1" = before ] && root=$BEFORE
  for batch in $BATCHES; do
    local flags=$B1; [ $batch = b8 ] && flags=$B8
    # shellcheck disable=SC2086  # the flags are lists
    (cd "$root" && PYTHONPATH="$root" DSPARK_HF_PROFILE_CACHE="$RUNS/profiles_$1" \
      python -m dspark_hf bench speed $flags $SPEED --output "$RUNS/speed_${batch}_$1_$2.json")
  done
}
for i in 1 2 3; do
  if [ $((i % 2)) = 1 ]; then run before $i; run after $i; else run after $i; run before $i; fi
done
python "$HERE/compare.py" "$RUNS" | tee "$RUNS/../$(basename "$RUNS" | sed s/^runs/before_after/).json"
