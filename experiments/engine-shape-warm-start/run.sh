#!/usr/bin/env bash
# Should the first draft of the engine-ready shape (per-head q/k norms) start from the shipped draft's weights, with
# the norms added at one (`--init-from ... --add-qk-norm`), or fresh? A short A/B on this CPU (issue "Train here,
# serve anywhere"): both arms take the same 150 steps of 8 answers on the first 1,600 answers of
# experiments/smollm2-answers (the shipped draft's training data), side by side with one thread each; the warm start at
# a fine-tuning learning rate (3e-4), the fresh draft at dspark train's default (1e-3), each with dspark train's other
# defaults. Then tau on the packaged prompts (examples/prompts/sample.jsonl, greedy, 128 new tokens, default policy)
# for both, for the warm start before training, and for the shipped draft. The trained warm start is also the draft
# experiments/llama-cpp-cpu checks llama.cpp with.
# Run from the repository root: bash experiments/engine-shape-warm-start/run.sh [WORK]  (about 35 minutes)
set -euo pipefail
OUT=experiments/engine-shape-warm-start/results
WORK=${1:-runs/engine-shape-warm-start}
SHIPPED=dspark_hf/assets/dspark-smollm2-135m-instruct
mkdir -p "$OUT" "$WORK"
python - "$WORK/subset.jsonl.gz" <<'PY'
import gzip, itertools, sys
with gzip.open("experiments/smollm2-answers/part-001.jsonl.gz", "rt") as f, gzip.open(sys.argv[1], "wt") as g:
    g.writelines(itertools.islice(f, 1600))
PY
common=(--dataset "$WORK/subset.jsonl.gz" --max-steps 150 --batch-size 8 --device cpu --save-every 50)
OMP_NUM_THREADS=1 python -m dspark_hf train "${common[@]}" --output-dir "$WORK/warm" --init-from "$SHIPPED" \
  --add-qk-norm --lr 3e-4 > "$WORK/train_warm.log" 2>&1 &
OMP_NUM_THREADS=1 python -m dspark_hf train "${common[@]}" --output-dir "$WORK/fresh" > "$WORK/train_fresh.log" 2>&1 &
wait
python - "$SHIPPED" "$WORK/warm-untrained" <<'PY'
import sys, torch
from dspark_hf.defaults import default_target
from dspark_hf.loading import load_draft
from dspark_hf.training.drafts import with_qk_norms
target, _ = default_target(device="cpu")
with_qk_norms(load_draft(sys.argv[1], target, torch.float32), target).save_pretrained(sys.argv[2])
PY
for arm in shipped warm-untrained warm fresh; do
  draft=$WORK/$arm; [ $arm = shipped ] && draft=$SHIPPED
  python -m dspark_hf eval --draft "$draft" --prompts examples/prompts/sample.jsonl --max-new-tokens 128 \
    --output "$OUT/eval_$arm.json"
done
for arm in warm fresh; do cp "$WORK/$arm/train_report.json" "$OUT/train_report_$arm.json" 2>/dev/null || true; done
