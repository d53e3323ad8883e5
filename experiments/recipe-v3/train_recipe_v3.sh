#!/usr/bin/env bash
# The v2 recipe (experiments/recipe-v2/train_recipe_v2.sh) on three times the data at about the same training compute:
# 1,920 ShareGPT prompts instead of 640 (the first 640 plus 1,280 more, none shared with them), 3 epochs instead of 8.
# Measures whether data is what holds the draft back, then (step 4) whether depth is (docs/training.md, "Earlier
# recipes"). Resumable step by step; on a 2-core CPU: 26 min of new data, 8 min of feature cache, then the two
# trainings run side by side on one thread each (two 1-thread processes get more out of 2 cores than one after the
# other).
set -euo pipefail
RUNS=${RUNS:-runs}
OUT=experiments/recipe-v3/results

# 1. data: the 640 prompts of the v1 recipe, plus 1,280 more from the ShareGPT conversations after them
#    (the 640 come from the first 864 conversations; prepare-data skips the ones it cannot use)
dspark prepare-data --output $RUNS/data/sharegpt-640.jsonl --num-examples 640 --max-new-tokens 192
dspark prepare-data --output $RUNS/data/sharegpt-more-1280.jsonl --num-examples 1280 --skip 864 --max-new-tokens 192
cat $RUNS/data/sharegpt-640.jsonl $RUNS/data/sharegpt-more-1280.jsonl > $RUNS/data/sharegpt-1920.jsonl

# 2. DSpark and the DFlash-style ablation, same data and budget; the feature cache is keyed by example id, so it
#    grows from the 640 examples cached by the v1 recipe (filled once here, before the two runs share it)
COMMON="--dataset $RUNS/data/sharegpt-1920.jsonl --layers 2 --target-layer-ids 1 14 27 --markov-rank 128
        --draft-vocab-size 8192 --block-size 7 --epochs 3 --batch-size 4 --anchors 48 --lr 3e-3
        --feature-cache $RUNS/features --copy-target-layers"
python examples/cache_features.py $RUNS/data/sharegpt-1920.jsonl $RUNS/features 1 14 27
OMP_NUM_THREADS=1 dspark train $COMMON --head-type markov --output-dir $RUNS/v3/dspark &
OMP_NUM_THREADS=1 dspark train $COMMON --head-type none --output-dir $RUNS/v3/dflash &
wait
cp $RUNS/v3/dspark/heldout.json $OUT/heldout_v3_dspark.json
cp $RUNS/v3/dflash/heldout.json $OUT/heldout_v3_dflash.json

# 3. greedy evaluation on prompts never used in training, as for v2
EVAL="--suite humaneval --suite mtbench --suite gsm --limit 20 --max-new-tokens 128 --batch-size 8
      --draft-dtype float32"
for draft in dspark dflash; do
  dspark eval $EVAL --draft $RUNS/v3/$draft --output $RUNS/v3/eval_$draft.json
  python examples/strip_rounds.py $RUNS/v3/eval_$draft.json $OUT/eval_v3_$draft.json
done

# 4. steps or depth? One epoch with 2 and with 4 layers (side by side, one thread each; held-out acceptance only),
#    then 3 layers (the deepest full-width draft under the 32 MB shipping limit) for 2 epochs, about the compute of
#    step 2's 3 epochs of 2 layers (alone on both threads). A later --layers overrides the one in COMMON.
C1="${COMMON/--epochs 3/--epochs 1} --head-type markov"
OMP_NUM_THREADS=1 dspark train $C1 --layers 2 --output-dir $RUNS/v3/1epoch-2layers &
OMP_NUM_THREADS=1 dspark train $C1 --layers 4 --output-dir $RUNS/v3/1epoch-4layers &
wait
cp $RUNS/v3/1epoch-2layers/heldout.json $OUT/heldout_v3_1epoch_2layers.json
cp $RUNS/v3/1epoch-4layers/heldout.json $OUT/heldout_v3_1epoch_4layers.json
dspark train ${COMMON/--epochs 3/--epochs 2} --head-type markov --layers 3 --output-dir $RUNS/v3/dspark-3layers
cp $RUNS/v3/dspark-3layers/heldout.json $OUT/heldout_v3_3layers.json
dspark eval $EVAL --draft $RUNS/v3/dspark-3layers --output $RUNS/v3/eval_dspark_3layers.json
python examples/strip_rounds.py $RUNS/v3/eval_dspark_3layers.json $OUT/eval_v3_3layers.json
# --policy "full block": bench_speed_b1_v3_3layers.json (2026-11-22) predates bench speed's default policy (255cc95)
dspark bench speed --suite humaneval --suite mtbench --suite gsm --limit 2 --max-new-tokens 128 --batch-size 1 \
  --policy "full block" --draft-dtype float32 --repeats 3 --draft $RUNS/v3/dspark-3layers \
  --output $OUT/bench_speed_b1_v3_3layers.json
