"""Copy a `dspark eval` result without its per-round detail: the repo keeps per-prompt figures (as for the shipped
draft's results), which every table and plot here is built from.

    python examples/strip_rounds.py runs/v3/eval_dspark.json experiments/recipe-v3/results/eval_v3_dspark.json
"""

import json
import sys

source, destination = sys.argv[1:3]
data = json.load(open(source))
for prompt in data["prompts"]:
    prompt.pop("rounds_detail", None)
json.dump(data, open(destination, "w"), indent=2)
