#!/usr/bin/env bash
# Training throughput on this CPU with one process and with two (issue "Training on several processes"): the same
# `dspark train` run (the embedded SmolLM2 target, a fresh draft of the default shape, answers from
# experiments/smollm2-answers, 24 steps of 4 sequences per process) started once as one process with both cores and
# once by torchrun as two processes with one core each (gloo). Examples/s = steps x global batch / seconds in steps,
# from each run's heldout.json. Results in experiments/several-processes-cpu/results/.
# Run from the repository root: bash experiments/several-processes-cpu/measure.sh
set -euo pipefail
OUT=experiments/several-processes-cpu/results
WORK=${WORK:-/tmp/several-processes-cpu}
mkdir -p "$OUT"
rm -rf "$WORK"
FLAGS=(--dataset experiments/smollm2-answers/part-001.jsonl.gz --max-steps 24 --batch-size 4 --save-every 1000
       --heldout-fraction 0.002 --max-length 384)
OMP_NUM_THREADS=2 python -m dspark_hf train "${FLAGS[@]}" --output-dir "$WORK/one" 2>&1 | tail -3
OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 -m dspark_hf train "${FLAGS[@]}" \
  --output-dir "$WORK/two" 2>&1 | tail -3
python - "$WORK" "$OUT/throughput.json" <<'PY'
import json, sys, datetime, platform, subprocess
import torch
work, out = sys.argv[1:]
runs = {}
for name in ("one", "two"):
    t = json.load(open(f"{work}/{name}/heldout.json"))["training"]
    runs[name] = {"processes": t["processes"], "batch_per_process": t["batch_size"], "global_batch": t["global_batch"],
                  "steps": t["steps"], "step_seconds": t["time"]["step_seconds"],
                  "examples_per_s": round(t["steps"] * t["global_batch"] / t["time"]["step_seconds"], 3)}
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"runs": runs, "machine": {"cpu": cpu, "cores": torch.get_num_threads(), "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "code": code,
           "command": "bash experiments/several-processes-cpu/measure.sh"}}, open(out, "w"), indent=2)
print(json.dumps(runs, indent=2))
PY
