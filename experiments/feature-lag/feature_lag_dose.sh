#!/usr/bin/env bash
# feature_lag.sh's question at a larger dose: the shipped draft fine-tuned for 256 steps (not 48) without and
# with `--feature-lag 8` or shaped lags (below), plus the no-lag fine-tune again from another seed (the noise any
# difference must beat), on the recipe study's 800 mixed answers (chat, code, math), whose feature cache spares
# every step the target's forward; all measured teacher-forced at lags 0, 1, 4 and 8 on that data's held-out 10%,
# which no fine-tune saw. Needs the recipe study's data and cache (`bash experiments/recipe-study/recipe_study.sh`
# makes both in its first two steps). About 40 minutes on a 2-core Intel Xeon, two jobs on one thread each.
# RESULTS= names the results folder (default results-256).
set -euo pipefail
RUNS=${RUNS:-runs}
STEPS=${STEPS:-256}
DATA=$RUNS/recipe/data.jsonl
FEATURES=$RUNS/recipe/features
OUT=$RUNS/feature-lag-$STEPS
R=${RESULTS:-experiments/feature-lag/results-$STEPS}
SHIP=dspark_hf/assets/dspark-smollm2-135m-instruct
if [ ! -f "$DATA" ] || [ ! -d "$FEATURES" ]; then
  echo "no $DATA or $FEATURES: run experiments/recipe-study/recipe_study.sh first (its steps 1-2 make them)" >&2
  exit 1
fi
mkdir -p "$OUT" "$R"

COMMON="--dataset $DATA --feature-cache $FEATURES --init-from $SHIP --max-steps $STEPS --batch-size 4
  --heldout-fraction 0.1"
train() {  # NAME FLAGS...: one fine-tune on one thread, skipped when done or already measured at every lag
  local name=$1; shift
  [ -f "$OUT/$name/heldout.json" ] || [ -f "$R/${name}_lag8.json" ] && return
  # shellcheck disable=SC2086  # COMMON is a list of flags
  OMP_NUM_THREADS=1 dspark train $COMMON "$@" --output-dir "$OUT/$name" > "$OUT/$name.log" 2>&1
}
measure() {  # NAME DRAFT: expected greedy tau on the held-out split at each lag
  for lag in 0 1 4 8; do
    [ -f "$R/${1}_lag$lag.json" ] || OMP_NUM_THREADS=1 python examples/heldout_acceptance.py "$2" "$DATA" \
      --heldout-fraction 0.1 --feature-cache "$FEATURES" --lag "$lag" --output "$R/${1}_lag$lag.json" > /dev/null
  done
}

pair() {  # run two commands (each one quoted string) side by side; fail if either fails
  bash -ec "$1" & local a=$!
  bash -ec "$2" & local b=$!
  wait $a; wait $b
}
export -f train measure && export COMMON OUT R DATA FEATURES
pair "train lag0" "train lag8 --feature-lag 8"
# Shaped lags (added 2026-11-24, after results-256): SSD with the shipped draft verifies at lags 0, 1 and 2 in the
# proportion 507 : 150 : 6 (`git show e2a3f7c:experiments/ssd/results/bench_ssd.json`, acceptance_by_lag), so
# `ssd-lags` draws them so; `half0` keeps half the blocks unlagged and spreads the rest uniformly over lags 1..8.
pair "train ssd-lags --feature-lag 2 --feature-lag-weights 507 150 6" \
  "train half0 --feature-lag 8 --feature-lag-weights 8 1 1 1 1 1 1 1 1"
pair "train lag0-seed1 --seed 1" "for arm in lag0 lag8 ssd-lags half0; do measure \$arm $OUT/\$arm; done"
pair "measure shipped $SHIP" "measure lag0-seed1 $OUT/lag0-seed1"
python experiments/feature-lag/table.py "$R"
