"""Each side's paired ratios over plain generate() in the runs measure.sh wrote, their medians and after/before.

    python experiments/design-step-4/compare.py experiments/design-step-4/results/runs
"""
import json
import statistics
import sys
from pathlib import Path

runs = Path(sys.argv[1])
BASELINES = {"dspark": "paired_ratio_to_plain", "dspark (compiled)": "paired_ratio_to_compiled_plain"}


def ratios(side: str) -> dict[str, list[float]]:
    """'batch N, arm' -> the ratio of each run of `side`, in run order."""
    found = {}
    for path in sorted(runs.glob(f"speed_b*_{side}_*.json")):
        report = json.loads(path.read_text())
        batch = report["settings"]["batch_size"]
        for arm, key in BASELINES.items():
            if arm in report["methods"]:
                found.setdefault(f"batch {batch}, {arm} vs plain {'eager' if arm == 'dspark' else 'static+compile'}",
                                 []).append(report["methods"][arm][key])
    return found


def tau(side: str) -> dict[str, list[float]]:
    found = {}
    for path in sorted(runs.glob(f"speed_b*_{side}_*.json")):
        report = json.loads(path.read_text())
        for arm in BASELINES:
            if arm in report["methods"]:
                found.setdefault(f"batch {report['settings']['batch_size']}, {arm}", []).append(
                    report["methods"][arm]["acceptance_length"])
    return found


before, after = ratios("before"), ratios("after")
codes = {side: sorted({json.loads(p.read_text())["machine"]["code"] for p in runs.glob(f"speed_b*_{side}_*.json")})
         for side in ("before", "after")}
machine = json.loads(next(runs.glob("speed_b*_after_*.json")).read_text())["machine"]


def figure(name: str) -> dict:
    b, a = statistics.median(before[name]), statistics.median(after[name])
    return {"before": b, "after": a, "after_over_before": a / b, "runs_before": before[name],
            "runs_after": after[name], "spread_before": max(before[name]) - min(before[name]),
            "spread_after": max(after[name]) - min(after[name])}


print(json.dumps({"machine": {k: machine.get(k) for k in ("cpu", "date", "time", "torch_threads", "torch",
                                                          "transformers")},
                  "code": codes, "tau": {"before": tau("before"), "after": tau("after")},
                  "figures": {name: figure(name) for name in before if name in after}}, indent=2))
