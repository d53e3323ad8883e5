#!/usr/bin/env bash
# Design step 2 (issue 43) restructured the decoding loop (the round over explicit state, blocks from a BlockSource,
# layers that point down), not its math: is it as fast as before? The code before (BEFORE: a checkout of 957d857,
# main just before the change landed) and after (this checkout) alternate, three runs each, of `dspark bench
# oracle` (batch 1 and 8) and `dspark bench speed` (batch 1; default policy and full block). Every run is
# normalised by its own plain generate(), so the machine's drift between runs cancels; compare.py gives the median
# of each side's speedups and their ratio. Results: experiments/design-step-2/results/before_after.json.
set -euo pipefail
BEFORE=$(cd "${1:?usage: bench_before_after.sh BEFORE_CHECKOUT (git worktree add --detach DIR 957d857)}" && pwd)
RUNS=${RUNS:-runs}/before-after
mkdir -p "$RUNS"
for i in 1 2 3; do
  for side in before after; do
    root=$([ "$side" = before ] && echo "$BEFORE" || pwd)
    PYTHONPATH=$root python -m dspark_hf bench oracle --batch-sizes 1 8 --max-new-tokens 64 --repeats 1 \
      --output "$RUNS/oracle_${side}_$i.json"
    PYTHONPATH=$root python -m dspark_hf bench speed --suite humaneval --suite mtbench --suite gsm --limit 1 \
      --batch-size 1 --max-new-tokens 64 --repeats 1 --policy auto --policy "full block" \
      --output "$RUNS/speed_${side}_$i.json"
  done
done
python experiments/design-step-2/compare.py "$RUNS" | tee experiments/design-step-2/results/before_after.json
