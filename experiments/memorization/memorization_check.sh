#!/usr/bin/env bash
# Sanity check of the training pipeline and the decoding loop (not a quality result): fine-tune the shipped draft on
# the target's own greedy answers to 8 evaluation prompts (4 HumanEval, 4 GSM), then measure acceptance and batch-1
# speed on those same prompts. If anchors, features, positions or verification were misaligned, tau would stay
# near 1 however long it trains; a draft that has seen the answers shows what the loop does with a right draft.
# About 15 minutes on a 2-core CPU.
set -euo pipefail
RUNS=${RUNS:-runs}/memorize
mkdir -p $RUNS
python - "$RUNS/prompts.jsonl" <<'PY'
import json, sys
from dspark_hf.evaluation.suites import load_prompts
with open(sys.argv[1], "w") as f:
    for p in load_prompts(None, ["humaneval", "gsm"], 4):
        f.write(json.dumps({"id": p["id"], "messages": p["messages"]}) + "\n")
PY
dspark prepare-data --prompts $RUNS/prompts.jsonl --num-examples 8 --top-k 1 --max-new-tokens 128 --batch-size 8 \
  --output $RUNS/data.jsonl                                          # top-k 1: the target's greedy answers
dspark train --dataset $RUNS/data.jsonl --init-from dspark_hf/assets/dspark-smollm2-135m-instruct \
  --output-dir $RUNS/draft --heldout-fraction 0 --epochs 60 --batch-size 4 --anchors 48 --lr 1e-3
dspark eval --suite humaneval --suite gsm --limit 4 --max-new-tokens 128 --batch-size 8 --draft $RUNS/draft \
  --draft-dtype float32 --output experiments/memorization/results/memorize_eval.json
# --policy "full block": memorize_speed.json (2026-11-22) predates the default policy in bench speed (commit 255cc95)
dspark bench speed --suite humaneval --suite gsm --limit 4 --max-new-tokens 128 --batch-size 1 --repeats 1 \
  --policy "full block" --draft-dtype float32 --draft $RUNS/draft \
  --output experiments/memorization/results/memorize_speed.json
