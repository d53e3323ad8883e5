#!/usr/bin/env bash
# The shipped draft from what the first GPU run brought back: its card regenerated from this folder's result files
# (tests/test_hub.py checks the package's card is exactly what this writes). DRAFT is the folder the run brought back
# (`../shared/gpu-run-2026-11-26/draft`, sha256 in results/model.sha256); the export keeps its bf16 weights byte for
# byte. The evaluation (step 2) is the one a user gets on a CPU: float32 target, 20 prompts of each packaged suite.
set -euo pipefail
DRAFT=${1:?usage: ship.sh DRAFT_FOLDER}
RUNS=${RUNS:-runs}
R=experiments/recipe-v6-gpu-shipped
SHIP=dspark_hf/assets/dspark-smollm2-135m-instruct
(cd "$DRAFT" && sha256sum -c "$OLDPWD/$R/results/model.sha256")

# 1. the weights and config as they came back
dspark export "$DRAFT" --output $SHIP --base-model HuggingFaceTB/SmolLM2-135M-Instruct --license apache-2.0 \
  --calibration $R/results/dspark_calibrated/calibration.json

# 2. evaluation on prompts never used in training (HumanEval, MT-Bench, GSM-symbolic), float32, on this machine
dspark eval --suite humaneval --suite mtbench --suite gsm --limit 20 --max-new-tokens 128 --batch-size 8 \
  --draft-dtype float32 --draft $SHIP --output $RUNS/v6/eval_cpu.json --plot $RUNS/v6/plots --threshold-sweep
python examples/strip_rounds.py $RUNS/v6/eval_cpu.json $R/results/eval_dspark_cpu.json
cp $RUNS/v6/plots/*.png $R/results/

# 3. the card: Training from this run's files, Results from step 2, the calibration the run fitted
python $R/card_recipe.py > $R/recipe.md
dspark export "$DRAFT" --output $SHIP --base-model HuggingFaceTB/SmolLM2-135M-Instruct --license apache-2.0 \
  --eval $R/results/eval_dspark_cpu.json --recipe $R/recipe.md --calibration $R/results/dspark_calibrated/calibration.json
sha256sum $SHIP/model.safetensors
