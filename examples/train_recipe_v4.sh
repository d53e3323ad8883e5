#!/usr/bin/env bash
# The v3 recipe (examples/train_recipe_v3.sh; run it first: this reuses its data and feature cache) with 3 layers
# for 5 epochs, under bf16 autocast: on a CPU with bf16 matrix units (here AVX512-BF16) a training step takes
# 0.55x the fp32 time, so ~2.5x v3's 3-layer compute fits in about an hour with both trainings side by side.
# Then greedy evaluation in fp32 (as for every row of the README table) and the batch-1 speed in fp32 and bf16.
set -euo pipefail
RUNS=${RUNS:-runs}

# 1. DSpark and the DFlash-style ablation, same data and budget, side by side on one thread each
COMMON="--dataset $RUNS/data/sharegpt-1920.jsonl --layers 3 --target-layer-ids 1 14 27 --markov-rank 128
        --draft-vocab-size 8192 --block-size 7 --epochs 5 --batch-size 4 --anchors 48 --lr 3e-3
        --feature-cache $RUNS/features --copy-target-layers --mixed-precision bf16"
OMP_NUM_THREADS=1 dspark train $COMMON --head-type markov --output-dir $RUNS/v4/dspark &
OMP_NUM_THREADS=1 dspark train $COMMON --head-type none --output-dir $RUNS/v4/dflash &
wait
cp $RUNS/v4/dspark/heldout.json examples/results/heldout_v4_dspark.json
cp $RUNS/v4/dflash/heldout.json examples/results/heldout_v4_dflash.json

# 2. greedy evaluation on prompts never used in training (fp32), side by side
EVAL="--suite humaneval --suite mtbench --suite gsm --limit 20 --max-new-tokens 128 --batch-size 8"
for draft in dspark dflash; do
  OMP_NUM_THREADS=1 dspark eval $EVAL --draft $RUNS/v4/$draft --output $RUNS/v4/eval_$draft.json &
done
wait
for draft in dspark dflash; do
  python examples/strip_rounds.py $RUNS/v4/eval_$draft.json examples/results/eval_v4_$draft.json
done

# 3. batch-1 speed of the v4 draft, in fp32 (token-identical) and in bf16 (identical up to rounding)
SPEED="--suite humaneval --suite mtbench --suite gsm --limit 2 --max-new-tokens 128 --batch-size 1 --repeats 3"
dspark bench speed $SPEED --draft $RUNS/v4/dspark --output examples/results/bench_speed_b1_v4.json
dspark bench speed $SPEED --draft $RUNS/v4/dspark --dtype bfloat16 --output examples/results/bench_speed_b1_v4_bf16.json
