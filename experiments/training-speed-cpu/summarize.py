"""Summaries of measure.sh's runs from their heldout.json files, the same formula for the code before and after:
answers/s = steps x global batch / seconds spent in steps (training.time.step_seconds).

    python experiments/training-speed-cpu/summarize.py speed|tau experiments/training-speed-cpu/results
"""

import json
import statistics
import sys
from pathlib import Path

ARMS = ("old", "new", "bf16")  # the step before, the new one (this CPU's default, float32), the new one in bfloat16


def answers_per_second(report: dict) -> float:
    t = report["training"]
    return t["time"]["steps_this_call"] * t["global_batch"] / t["time"]["step_seconds"]


def speed(results: Path) -> dict:
    pairs = []
    for r in (1, 2, 3):
        old, new, bf16 = (json.loads((results / f"speed_{code}_{r}.json").read_text()) for code in ARMS)
        pairs.append({"repeat": r, "old_answers_per_s": round(answers_per_second(old), 4),
                      "new_answers_per_s": round(answers_per_second(new), 4),
                      "bf16_answers_per_s": round(answers_per_second(bf16), 4),
                      "ratio": round(answers_per_second(new) / answers_per_second(old), 4),
                      "bf16_ratio": round(answers_per_second(bf16) / answers_per_second(old), 4),
                      "new_padded_share": new["training"]["throughput"]["padded_share"],
                      "new_mfu": new["training"]["throughput"]["mfu"],
                      "bf16_mfu": bf16["training"]["throughput"]["mfu"]})
    summary = {"repeats": pairs}
    for key in ("ratio", "bf16_ratio"):
        values = [p[key] for p in pairs]
        summary[key] = {"median": statistics.median(values), "range": [min(values), max(values)]}
    return summary


def tau(results: Path) -> dict:
    out = {}
    for code in ARMS:
        report = json.loads((results / f"tau_{code}.json").read_text())
        out[code] = {"expected_greedy_tau": round(report["expected_greedy_tau"], 4),
                     "expected_tau_from_acceptance": round(report["expected_tau_from_acceptance"], 4),
                     "heldout_sequences": report["heldout_sequences"], "steps": report["training"]["steps"],
                     "answers_per_second": round(answers_per_second(report), 4)}
    for code in ARMS[1:]:
        difference = out[code]["expected_greedy_tau"] - out["old"]["expected_greedy_tau"]
        out[f"{code}_minus_old_greedy_tau"] = round(difference, 4)
    return out


if __name__ == "__main__":
    what, results = sys.argv[1], Path(sys.argv[2])
    summary = {"speed": speed, "tau": tau}[what](results)
    (results / f"{what}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
