"""The expected greedy tau of each draft at each lag, from feature_lag.sh or feature_lag_dose.sh result files."""

import json
import sys
from pathlib import Path

results = Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/feature-lag/results")
rows = {}
for path in sorted(results.glob("*_lag*.json")):
    name, _, lag = path.stem.rpartition("_lag")
    report = json.loads(path.read_text())
    rows.setdefault(name, {})[int(lag)] = report["expected_greedy_tau"]
lags = sorted({lag for by_lag in rows.values() for lag in by_lag})
print("| draft | " + " | ".join(f"lag {lag}" for lag in lags) + " |")
print("|---|" + "---:|" * len(lags))
for name, by_lag in rows.items():
    print(f"| {name} | " + " | ".join(f"{by_lag[lag]:.3f}" if lag in by_lag else "" for lag in lags) + " |")
