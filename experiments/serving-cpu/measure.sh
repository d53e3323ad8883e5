#!/usr/bin/env bash
# DSpark under live traffic (issue 61), measured on this CPU: `dspark bench serve --arrivals poisson` at three
# arrival rates with every arm (no speculation, MTP-1, fixed 2 and 4, the full block, the default policy), the
# shipped draft beside SmolLM2-135M-Instruct, greedy, float32, 32 new tokens, 16 requests a rate, 8 rows, 2 repeats.
# Then the default policy and MTP-1 alone beside no speculation, 4 repeats (the bar's measurement). Results and the
# frontier plot in results/. Run from the repository root: bash experiments/serving-cpu/measure.sh
set -euo pipefail
OUT=experiments/serving-cpu/results
mkdir -p "$OUT"
python -m dspark_hf bench serve --arrivals poisson --rates 0.5 1.5 3 --requests 16 --max-batch-size 8 \
  --max-new-tokens 32 --repeats 2 --output $OUT/bench_serve_poisson.json --plot $OUT
python -m dspark_hf bench serve --arrivals poisson --rates 0.5 1.5 3 --requests 16 --max-batch-size 8 \
  --max-new-tokens 32 --repeats 4 --policies auto mtp-1 --output $OUT/bench_serve_poisson_auto_4repeats.json
