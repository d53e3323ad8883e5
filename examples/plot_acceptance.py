"""Position-wise acceptance of drafts side by side, from the files `dspark eval` and `dspark train` wrote.

    python examples/plot_acceptance.py OUT_DIR "DSpark (Markov)=eval_dspark.json" "DFlash-style=eval_dflash.json"

Each LABEL=FILE is an eval result (greedy conditional acceptance per domain, tau per domain:
conditional_acceptance.png, acceptance_length.png) or a held-out report from training (heldout.json: acceptance
1 - TV per position, heldout_acceptance.png).
"""

import sys

from dspark_hf.evaluation.plots import plot_eval, plot_heldout_acceptance
from dspark_hf.hub import read_json

if len(sys.argv) < 3 or not all("=" in a for a in sys.argv[2:]):
    sys.exit(__doc__)
out_dir = sys.argv[1]
evals, heldout = [], []
for label, path in (a.split("=", 1) for a in sys.argv[2:]):
    try:
        result = read_json(path)
    except OSError as error:
        sys.exit(f"plot_acceptance.py: error: cannot read {path} ({error.strerror}).")
    except ValueError as error:
        sys.exit(f"plot_acceptance.py: error: {error}")
    keys = set(result) if isinstance(result, dict) else set()
    if "overall" in keys:
        evals.append((label, result))
    elif "acceptance_per_position" in keys:
        heldout.append((label, result))
    else:
        sys.exit(f"plot_acceptance.py: error: {path}: neither a `dspark eval` result nor a heldout.json from "
                 "`dspark train`.")
paths = (plot_eval(evals, out_dir) if evals else []) + ([plot_heldout_acceptance(heldout, out_dir)] if heldout else [])
print("plots: " + ", ".join(map(str, paths)))
