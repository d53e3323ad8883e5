#!/usr/bin/env bash
# Every GPU minute a training minute (issue 58), measured on this CPU: where a step's time goes, before and after
# (breakdown); the default recipe of `dspark train` on the same 800 answers and seed, the step of the code before the
# change (a git worktree of c767fb1) and the new one alternated, 3 repeats of 40 steps, with the new step in bfloat16 as a third arm (speed); and 150 steps of each (three)
# from the same start, held-out expected tau compared (tau). Results in results/.
# The draft's forward and backward compiled (--compile inductor) against the eager step (compile).
# Run from the repository root: bash experiments/training-speed-cpu/measure.sh [breakdown speed tau heldout compile estimates]
# DATA: the answers of the first GPU run (../shared/gpu-run-2026-11-26/data.jsonl.gz; 9,728 answers of SmolLM2-135M).
set -euo pipefail
HERE=experiments/training-speed-cpu
OUT=$PWD/$HERE/results
DATA=${DATA:-../shared/gpu-run-2026-11-26/data.jsonl.gz}
BEFORE=${BEFORE:-/tmp/dspark-train-before}  # a worktree of the code before the change
WORK=${WORK:-/tmp/dspark-train-speed}
mkdir -p "$OUT" "$WORK"
[ -d "$BEFORE" ] || git worktree add --detach "$BEFORE" c767fb1
[ -f "$WORK/data.jsonl" ] || zcat "$DATA" | sed -n 1,800p > "$WORK/data.jsonl"  # sed reads to the end: no SIGPIPE under pipefail
ROOT=$PWD

# the code before runs from outside the checkout, so that only the worktree's dspark_hf is importable
old() { (cd "$WORK" && PYTHONPATH="$BEFORE" python "$@"); }
new() { (cd "$WORK" && PYTHONPATH="$ROOT" python "$@"); }
# the new step in bfloat16 on this CPU (AVX512-BF16): the draft under autocast, the frozen target in bfloat16, as on
# a GPU; not the CPU's default (float32)
bf16() { new "$@" --mixed-precision bf16 --target-dtype bfloat16; }
TRAIN="-m dspark_hf train --dataset $WORK/data.jsonl --seed 0"

for step in "${@:-breakdown speed tau heldout estimates}"; do
  for s in $step; do
    case $s in
      breakdown)
        old "$ROOT/$HERE/breakdown.py" --dataset "$WORK/data.jsonl" --output "$OUT/breakdown_before.json"
        new "$ROOT/$HERE/breakdown.py" --dataset "$WORK/data.jsonl" --output "$OUT/breakdown.json" --group-by-length ;;
      speed)
        for r in 1 2 3; do
          # alternated: the old step first in repeats 1 and 3, the new one in repeat 2
          for code in $([ "$r" = 2 ] && echo "bf16 new old" || echo "old new bf16"); do
            rm -rf "$WORK/speed-$code-$r"
            $code $TRAIN --max-steps 40 --output-dir "$WORK/speed-$code-$r" > "$WORK/speed-$code-$r.log" 2>&1
            cp "$WORK/speed-$code-$r/heldout.json" "$OUT/speed_${code}_$r.json"
          done
        done
        python "$HERE/summarize.py" speed "$OUT" ;;
      tau)
        for code in old new bf16; do
          rm -rf "$WORK/tau-$code"
          $code $TRAIN --max-steps 150 --output-dir "$WORK/tau-$code" > "$WORK/tau-$code.log" 2>&1
          cp "$WORK/tau-$code/heldout.json" "$OUT/tau_$code.json"
        done
        python "$HERE/summarize.py" tau "$OUT" ;;
      heldout)  # the tau runs' drafts measured alike: one evaluator, every held-out sequence, the float32 target
        new "$ROOT/$HERE/heldout_fp32.py" --dataset "$WORK/data.jsonl" --output "$OUT/heldout_fp32.json" \
          old="$WORK/tau-old" new="$WORK/tau-new" bf16="$WORK/tau-bf16" ;;
      compile)  # the default step eager and with --compile inductor; 40 and 80 steps each, so that steps 41-80
                # (the same batches in both arms) time the compiled step after its compile; a first run of 2 steps
                # fills inductor's cache, so that the 40- and the 80-step run compile alike (from the cache)
        rm -rf "$WORK/compile-warm"
        new $TRAIN --max-steps 2 --output-dir "$WORK/compile-warm" --compile inductor > "$WORK/compile-warm.log" 2>&1
        for code in eager inductor; do
          for n in 40 80; do
            rm -rf "$WORK/compile-$code-$n"
            new $TRAIN --max-steps $n --output-dir "$WORK/compile-$code-$n" \
              $([ $code = inductor ] && echo --compile inductor) > "$WORK/compile-$code-$n.log" 2>&1
            cp "$WORK/compile-$code-$n/heldout.json" "$OUT/compile_${code}_$n.json"
          done
        done
        python "$HERE/summarize.py" compile "$OUT" ;;
      estimates)
        new "$ROOT/$HERE/estimates.py" --output "$OUT/estimates.json" ;;
      *) echo "unknown step $s: choose from breakdown, speed, tau, heldout, compile, estimates" >&2; exit 2 ;;
    esac
  done
done
