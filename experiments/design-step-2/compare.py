"""Speedups over plain generate() of the runs bench_before_after.sh wrote, before and after, and their ratio.

    python experiments/design-step-2/compare.py runs/before-after
"""
import json
import statistics
import sys
from pathlib import Path

runs = Path(sys.argv[1])


def speedups(side: str) -> dict[str, list[float]]:
    found = {}
    for path in sorted(runs.glob(f"oracle_{side}_*.json")):
        for row in json.loads(path.read_text())["results"]:
            found.setdefault(f"oracle, batch {row['batch_size']}", []).append(row["speedup"])
    for path in sorted(runs.glob(f"speed_{side}_*.json")):
        report = json.loads(path.read_text())
        names = report["settings"]["policies"]
        for method, figures in report["methods"].items():
            if method in names:
                found.setdefault(f"bench speed, batch 1, {names[method]}", []).append(figures["paired_ratio_to_plain"])
    return found


before, after = speedups("before"), speedups("after")
machine = json.loads(next(runs.glob("speed_after_*.json")).read_text())["machine"]


def figure(name: str) -> dict:
    b, a = statistics.median(before[name]), statistics.median(after[name])
    return {"before": b, "after": a, "after_over_before": a / b, "runs_before": before[name], "runs_after": after[name]}


print(json.dumps({"machine": {k: machine.get(k) for k in ("cpu", "date", "time", "torch_threads", "code")},
                  "figures": {name: figure(name) for name in before if name in after}}, indent=2))
