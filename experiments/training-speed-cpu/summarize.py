"""Summaries of measure.sh's runs from their heldout.json files, the same formula for the code before and after:
answers/s = steps x global batch / seconds spent in steps (training.time.step_seconds).

    python experiments/training-speed-cpu/summarize.py speed|tau|compile experiments/training-speed-cpu/results
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


def compiled(results: Path) -> dict:
    """Each arm's answers/s over 40 steps (the compile included) and over steps 41-80 (the 80-step run's seconds less
    the 40-step run's: the same first 40 batches), and the compiled step's ratio to the eager one there."""
    out = {}
    for code in ("eager", "inductor"):
        short, long = (json.loads((results / f"compile_{code}_{n}.json").read_text())["training"] for n in (40, 80))
        later = (long["time"]["steps_this_call"] - short["time"]["steps_this_call"]) * long["global_batch"]
        out[code] = {"answers_per_second_40_steps": round(answers_per_second({"training": short}), 4),
                     "step_seconds_40": short["time"]["step_seconds"], "step_seconds_80": long["time"]["step_seconds"],
                     "answers_per_second_steps_41_80": round(later / (long["time"]["step_seconds"]
                                                                        - short["time"]["step_seconds"]), 4),
                     "mixed_precision": long.get("mixed_precision"), "target_dtype": long["target_dtype"]}
    out["inductor_over_eager_steps_41_80"] = round(out["inductor"]["answers_per_second_steps_41_80"]
                                                   / out["eager"]["answers_per_second_steps_41_80"], 4)
    return out


if __name__ == "__main__":
    what, results = sys.argv[1], Path(sys.argv[2])
    summary = {"speed": speed, "tau": tau, "compile": compiled}[what](results)
    (results / f"{what}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
