#!/usr/bin/env bash
# v5 (a candidate, not shipped): both v4 drafts (experiments/recipe-v4-shipped/train_default_draft.sh) trained on
# for 2 more epochs over
# 2,560 prompts, v4's 1,920 plus 640 new ones, to see whether more data and steps lift the first draft position,
# and whether DSpark's margin over the DFlash-style ablation grows when it does. Resumable; on a 2-core CPU about
# 15 min of data, 5 min of feature cache and 30 min of training (both drafts side by side), then evaluation.
set -euo pipefail
RUNS=${RUNS:-runs}
OUT=experiments/recipe-v5/results

# 1. 640 new first-turn ShareGPT prompts, answers regenerated as for v4. They start at conversation 4,017, past
#    both v4's prompts (conversations 0-2,462) and the code prompts of experiments/lora-code/lora_code.sh
#    (up to #4,016).
#    The run in docs/training.md ("Earlier recipes") has 768: it began as a 1,280-prompt run, was stopped after 288 (the shortest of those
#    1,280) and resumed with 640, which appended the 480 of its own not yet made (prepare-data now refuses such a
#    mixed resume). Its sharegpt-2560.jsonl holds 2,688 prompts; every later command is as written.
dspark prepare-data --output $RUNS/data/sharegpt-v5-640.jsonl --num-examples 640 --skip 4017 --max-new-tokens 192
cat $RUNS/data/sharegpt-1920.jsonl $RUNS/data/sharegpt-v5-640.jsonl > $RUNS/data/sharegpt-2560.jsonl

# 2. the feature cache of v4, extended to the new prompts (cached examples are not recomputed)
python examples/cache_features.py $RUNS/data/sharegpt-2560.jsonl $RUNS/features 1 14 27

# 3. both drafts trained on from their v4 weights, same data and budget, side by side on one thread each. The
#    held-out split is chosen by hashed id, so v4's held-out prompts stay held out.
COMMON="--dataset $RUNS/data/sharegpt-2560.jsonl --epochs 2 --batch-size 4 --anchors 48 --lr 1e-3
        --feature-cache $RUNS/features --mixed-precision bf16"
OMP_NUM_THREADS=1 dspark train $COMMON --init-from $RUNS/v4/dspark --output-dir $RUNS/v5/dspark &
OMP_NUM_THREADS=1 dspark train $COMMON --init-from $RUNS/v4/dflash --output-dir $RUNS/v5/dflash &
wait
cp $RUNS/v5/dspark/heldout.json $OUT/heldout_v5_dspark.json
cp $RUNS/v5/dflash/heldout.json $OUT/heldout_v5_dflash.json

# 4. greedy evaluation on prompts never used in training, as for v4 (float32 target and drafts)
EVAL="--suite humaneval --suite mtbench --suite gsm --limit 20 --max-new-tokens 128 --batch-size 8
      --draft-dtype float32"
for draft in dspark dflash; do
  OMP_NUM_THREADS=1 dspark eval $EVAL --draft $RUNS/v5/$draft --output $RUNS/v5/eval_$draft.json &
done
wait
for draft in dspark dflash; do
  python examples/strip_rounds.py $RUNS/v5/eval_$draft.json $OUT/eval_v5_$draft.json
done
