#!/usr/bin/env bash
# A/B: for a draft used with greedy decoding, is it worth regenerating the training answers greedily
# (`prepare-data --temperature 0`) rather than sampling them as the paper does (T=0.7)? The shipped draft (v4,
# experiments/recipe-v4-shipped/train_default_draft.sh) is trained on for 3 epochs over the same 640 prompts,
# once with their sampled answers (v4's own data) and once with greedy ones, side by side on one thread each; then
# both are evaluated greedily on prompts never used in training. On a 2-core CPU: 15 min of data, 5 min of feature
# cache, 12 min of training, 12 min of evaluation, 10 min of teacher-forced figures. Needs the data of
# experiments/recipe-v4-shipped/train_default_draft.sh. Results: experiments/greedy-vs-sampled-answers/results/.
set -euo pipefail
RUNS=${RUNS:-runs}
OUT=$RUNS/greedy
R=experiments/greedy-vs-sampled-answers/results

dspark prepare-data --output $RUNS/data/sharegpt-640-greedy.jsonl --num-examples 640 --temperature 0 \
  --max-new-tokens 192
python examples/cache_features.py $RUNS/data/sharegpt-640-greedy.jsonl $RUNS/features_greedy 1 14 27

COMMON="--epochs 3 --batch-size 4 --anchors 48 --lr 1e-3 --mixed-precision bf16 --init-from $RUNS/v4/dspark"
OMP_NUM_THREADS=1 dspark train $COMMON --dataset $RUNS/data/sharegpt-640-greedy.jsonl \
  --feature-cache $RUNS/features_greedy --output-dir $OUT/greedy &
OMP_NUM_THREADS=1 dspark train $COMMON --dataset $RUNS/data/sharegpt-640.jsonl --feature-cache $RUNS/features \
  --output-dir $OUT/sampled &
wait

EVAL="--suite humaneval --suite mtbench --suite gsm --limit 20 --max-new-tokens 128 --batch-size 8
      --draft-dtype float32"
for answers in greedy sampled; do
  OMP_NUM_THREADS=1 dspark eval $EVAL --draft $OUT/$answers --output $OUT/eval_$answers.json &
done
wait
for answers in greedy sampled; do
  python examples/strip_rounds.py $OUT/eval_$answers.json $R/eval_ab_${answers}_answers.json
done

# teacher-forced acceptance on v4's 85 held-out prompts, with their sampled answers (v4's data) and greedy ones
python - $RUNS <<'PY'
import json, sys
from dspark_hf.training.data import load_dataset, split_heldout
from dspark_hf.training.prompts import read_sharegpt
runs = sys.argv[1]
held = {e.id for e in split_heldout(load_dataset(f"{runs}/data/sharegpt-1920.jsonl"), 0.05)[1]}
with open(f"{runs}/data/heldout85_prompts.jsonl", "w") as f:
    for p in read_sharegpt():
        if p["id"] in held:
            f.write(json.dumps({"id": p["id"], "messages": p["messages"]}) + "\n")
PY
dspark prepare-data --prompts $RUNS/data/heldout85_prompts.jsonl --output $RUNS/data/heldout85_greedy.jsonl \
  --num-examples 85 --temperature 0 --max-new-tokens 192
for draft in $RUNS/v4/dspark $OUT/greedy $OUT/sampled; do
  name=$(basename $draft); [ $name = dspark ] && name=v4 || name=ab_${name}_answers
  python examples/heldout_acceptance.py $draft $RUNS/data/heldout85_greedy.jsonl --all \
    --output $R/teacher_forced_${name}_on_greedy_heldout.json
  python examples/heldout_acceptance.py $draft $RUNS/data/sharegpt-1920.jsonl \
    --output $R/teacher_forced_${name}_on_sampled_heldout.json
done
