"""The expected greedy tau of each draft at each lag, from feature_lag.sh or feature_lag_dose.sh result files.

    python experiments/feature-lag/table.py [RESULTS] [--mix W0 W1 ...]

--mix adds a column: the tau averaged over lags 0, 1, ... weighted by W0, W1, ... (e.g. the number of tokens SSD
verified at each lag, `acceptance_by_lag` in `dspark bench ssd`'s JSON); every lag with a weight must be measured.
"""

import argparse
import json
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("results", nargs="?", default="experiments/feature-lag/results", type=Path)
parser.add_argument("--mix", type=float, nargs="+", metavar="W", help="weights of lags 0, 1, ...")
args = parser.parse_args()

rows = {}
for path in sorted(args.results.glob("*_lag*.json")):
    name, _, lag = path.stem.rpartition("_lag")
    report = json.loads(path.read_text())
    rows.setdefault(name, {})[int(lag)] = report["expected_greedy_tau"]
lags = sorted({lag for by_lag in rows.values() for lag in by_lag})
mix = {lag: w for lag, w in enumerate(args.mix or []) if w > 0}
if mix and not all(lag in lags for lag in mix):
    parser.error(f"--mix weighs lags {sorted(mix)}, but {args.results} measures lags {lags} only")
mix_header = " | at the mix" if mix else ""
print("| draft | " + " | ".join(f"lag {lag}" for lag in lags) + mix_header + " |")
print("|---|" + "---:|" * (len(lags) + bool(mix)))
for name, by_lag in rows.items():
    cells = [f"{by_lag[lag]:.3f}" if lag in by_lag else "" for lag in lags]
    if mix:
        complete = all(lag in by_lag for lag in mix)
        cells.append(f"{sum(w * by_lag[lag] for lag, w in mix.items()) / sum(mix.values()):.3f}" if complete else "")
    print(f"| {name} | " + " | ".join(cells) + " |")
if mix:
    print(f"\nmix: lag weights {', '.join(f'{lag}: {w:g}' for lag, w in mix.items())}")
