#!/usr/bin/env bash
# The recipe study: which training choices to take to the GPU, decided on the CPU at one fixed small budget.
# Every arm changes one lever of the base recipe and trains the same number of steps on the same data; all are
# measured the same way, teacher-forced on the same held-out prompts (greedy agreement by position, the expected
# greedy tau it implies, per domain). Resumable; two arms at a time on one thread each.
#
#   bash experiments/recipe-study/recipe_study.sh            # STEPS=150 by default; RUNS=runs
#
# Results: experiments/recipe-study/results/ (one held-out report per arm, the data manifest) and the table that
# `python experiments/recipe-study/recipe_table.py experiments/recipe-study/results` prints (docs/training.md,
# "Choosing the recipe").
set -euo pipefail
RUNS=${RUNS:-runs}
R=$RUNS/recipe
STEPS=${STEPS:-150}
OUT=experiments/recipe-study/results
mkdir -p "$R" "$OUT"

# 1. data: the first 800 prompts of the mixed prompt file the GPU campaign carries (ShareGPT, stdlib code,
#    reasoning-gym math and code, shuffled together), answered once each by the float32 target, in two halves
#    side by side; then the chat-only variant of the same data for the data-mix arm
[ -f "$RUNS/data/prompts-all.jsonl.gz" ] || dspark prompts --output "$RUNS/data/prompts-all.jsonl.gz" \
  --source sharegpt --source stdlib --source gym-math=4000 --source gym-code=2000
for i in 0 1; do
  OMP_NUM_THREADS=1 dspark prepare-data --prompts "$RUNS/data/prompts-all.jsonl.gz" --output "$R/data-$i.jsonl" \
    --skip $((i * 400)) --num-examples 400 --device cpu &
done
wait
cat "$R/data-0.jsonl" "$R/data-1.jsonl" > "$R/data.jsonl"
python -c "import json, sys; [print(l, end='') for l in open(sys.argv[1]) if json.loads(l)['domain'] == 'chat']" \
  "$R/data.jsonl" > "$R/data-chat.jsonl"
python -c "import json, sys; m = [json.load(open(p)) for p in sys.argv[1:3]]; print(json.dumps({
  'parts': m, 'examples': sum(x['examples'] for x in m), 'answer_tokens': sum(x['answer_tokens'] for x in m)},
  indent=2))" "$R/data-0.manifest.json" "$R/data-1.manifest.json" > "$OUT/data.manifest.json"

# 2. the target's features of every layer any arm reads, once (fp16 on disk); each arm reads its subset
for i in 0 1; do
  OMP_NUM_THREADS=1 python examples/cache_features.py "$R/data-$i.jsonl" "$R/features" 1 7 14 20 27 &
done
wait

# 3. the arms: base recipe = the shipped draft's (3 layers started from the target's last three, target layers
#    1/14/27, 0.1 CE + 0.9 L1, 48 anchors per sequence, lr 3e-3, the mixed data), each arm changing one thing, and
#    the base recipe again from another seed, which measures what the arms' differences are worth. (The run in
#    docs/training.md trained base-seed1 beside the kl / anchors96 pair, three processes on two cores; steps are
#    the budget.)
BASE="--layers 3 --copy-target-layers --markov-rank 128 --draft-vocab-size 8192 --batch-size 4 --max-steps $STEPS
      --heldout-fraction 0.1 --feature-cache $R/features --mixed-precision no --save-every 100000 --device cpu"
declare -A ARMS=(
  [base]="--target-layer-ids 1 14 27"
  [base-seed1]="--target-layer-ids 1 14 27 --seed 1"
  [layers5]="--target-layer-ids 1 7 14 20 27"
  [kl]="--target-layer-ids 1 14 27 --loss-kl 1.0"
  [anchors96]="--target-layer-ids 1 14 27 --anchors 96"
  [lr6e-4]="--target-layer-ids 1 14 27 --lr 6e-4"
  [chat-only]="--target-layer-ids 1 14 27 --dataset $R/data-chat.jsonl"
  [block1]="--target-layer-ids 1 14 27 --block-size 1"
  [dflash]="--target-layer-ids 1 14 27 --head-type none"
)
ORDER=(base layers5 kl anchors96 lr6e-4 chat-only block1 dflash base-seed1)  # base-seed1: the noise
train_arm() {
  local arm=$1
  [ -f "$R/$arm/heldout.json" ] && return
  # shellcheck disable=SC2086  # flag lists; an arm's --dataset / --lr / --anchors comes after BASE's and wins
  OMP_NUM_THREADS=1 dspark train --dataset "$R/data.jsonl" --output-dir "$R/$arm" --anchors 48 --lr 3e-3 \
    $BASE ${ARMS[$arm]} > "$R/$arm.log" 2>&1
}
for ((i = 0; i < ${#ORDER[@]}; i += 2)); do
  train_arm "${ORDER[i]}" &
  [ $((i + 1)) -lt ${#ORDER[@]} ] && train_arm "${ORDER[i + 1]}" &
  wait
done

# 4. every arm measured alike: the mixed data's held-out prompts, 48 anchors per sequence, features from the cache
for arm in "${ORDER[@]}"; do
  OMP_NUM_THREADS=2 python examples/heldout_acceptance.py "$R/$arm" "$R/data.jsonl" --heldout-fraction 0.1 \
    --feature-cache "$R/features" --output "$OUT/heldout_$arm.json"
  python -c "import json, sys; r = json.load(open(sys.argv[1])); t = json.load(open(sys.argv[2]))['training'];
json.dump({**r, 'training': t}, open(sys.argv[1], 'w'), indent=2)" "$OUT/heldout_$arm.json" "$R/$arm/heldout.json"
done
python experiments/recipe-study/recipe_table.py "$OUT"
