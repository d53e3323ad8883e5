#!/usr/bin/env bash
# Never slower than plain generate() (issue 57), measured on this CPU: what a round that drafts nothing costs against
# plain generate()'s step, on the code before the change (a git worktree of 28bc7f5) and after it (round, before);
# where its extra time went before (breakdown); and the default policy against both baselines with `dspark bench
# speed` (greedy, float32, 96 new tokens, paired, 5 repeats) at batch 1 and 8, on the packaged suites and on the
# chat-heavy MT-Bench set (b1, b1chat, b8, b8chat), and the oracle's ceiling (oracle); what drafted and one-token
# rounds cost inside a batch-8 compiled decode, at break-even and at the default margin (mixed); the default policy
# beside FixedLength(0), which never drafts, on 8 MT-Bench prompts at batch 8 (probes), and on the compiled path alone
# (split; b1chat and b8chat run it beside the default on both paths too); the eager arms alone at batch 8 over 9
# repeats (b8eager). Results in results/.
# Run from the repository root: bash experiments/the-floor-cpu/measure.sh [round before breakdown b1 ...]
set -euo pipefail
HERE=experiments/the-floor-cpu
OUT=$HERE/results
BEFORE=${BEFORE:-/tmp/dspark-before}  # a worktree of the code before the change
mkdir -p "$OUT"
before() {
  [ -d "$BEFORE" ] || git worktree add --detach "$BEFORE" 28bc7f5
  PYTHONPATH="$BEFORE:$PWD/$HERE" python "$@"
}
SUITES="--suite humaneval --suite mtbench --suite gsm"
SPEED="--max-new-tokens 96 --repeats 5 --policy auto"

# shellcheck disable=SC2086  # the flags are lists
for step in "${@:-round before breakdown b1 b1chat b8 b8chat probes oracle mixed}"; do
  for s in $step; do
    case $s in
      round) python $HERE/one_token_round.py --output $OUT/one_token_round.json ;;
      before) before $HERE/one_token_round.py --output $OUT/one_token_round_before.json ;;
      breakdown) before $HERE/breakdown.py --output $OUT/breakdown_before.json
                 python $HERE/breakdown.py --output $OUT/breakdown.json ;;
      b1) python -m dspark_hf bench speed $SUITES --limit 3 --batch-size 1 $SPEED --output $OUT/bench_speed_b1.json ;;
      b1chat) python -m dspark_hf bench speed --suite mtbench --limit 8 --batch-size 1 $SPEED --policy 'fixed 0' \
                --output $OUT/bench_speed_b1_chat.json ;;
      b8) python -m dspark_hf bench speed $SUITES --limit 8 --batch-size 8 $SPEED --output $OUT/bench_speed_b8.json ;;
      b8chat) python -m dspark_hf bench speed --suite mtbench --limit 24 --batch-size 8 $SPEED --policy 'fixed 0' \
                --output $OUT/bench_speed_b8_chat.json ;;
      b8eager) for set in suites chat; do  # the eager arms only, 9 repeats: this machine's spread at batch 8 is wider
                 if [ $set = suites ]; then prompts="$SUITES --limit 8"; else prompts="--suite mtbench --limit 24"; fi
                 python -m dspark_hf bench speed $prompts --batch-size 8 --max-new-tokens 96 --repeats 9 --policy auto \
                   --policy 'fixed 0' --no-compile --output $OUT/bench_speed_b8_${set}_eager9.json
               done ;;
      probes) python -m dspark_hf bench speed --suite mtbench --limit 8 --batch-size 8 $SPEED --policy 'fixed 0' \
                --output $OUT/bench_speed_b8_chat8_fixed0.json ;;  # the default policy beside one that never drafts
      oracle) python -m dspark_hf bench oracle --batch-sizes 1 8 --max-new-tokens 96 --repeats 3 \
                --output $OUT/bench_oracle.json ;;
      split) for b in 1 8; do  # compiled arms only: the default policy, FixedLength(0), with and without records
               python $HERE/compiled_split.py --batch-size $b --limit 8 --output $OUT/compiled_split_b$b.json
             done ;;
      mixed) for m in 1.0 1.1; do
               python $HERE/mixed_rounds.py --margin $m --output $OUT/mixed_rounds_margin$m.json
             done ;;
      *) echo "unknown step $s: choose from round, before, breakdown, b1, b1chat, b8, b8chat, b8eager, probes, split, oracle, mixed" >&2
         exit 2 ;;
    esac
  done
done
