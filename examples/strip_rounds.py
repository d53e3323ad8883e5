"""Copy a `dspark eval` result without its per-round detail: the repo keeps per-prompt figures (as for the shipped
draft's results), which every table and plot here is built from.

    python examples/strip_rounds.py runs/v3/eval_dspark.json experiments/recipe-v3/results/eval_v3_dspark.json
"""

import argparse
import json
import sys

from dspark_hf.files import write_atomic
from dspark_hf.hub import read_json

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("source", help="the results.json `dspark eval` wrote")
parser.add_argument("destination", help="where to write the copy")
args = parser.parse_args()

try:
    data = read_json(args.source)
except OSError as error:
    sys.exit(f"strip_rounds.py: error: cannot read {args.source} ({error.strerror}).")
except ValueError as error:
    sys.exit(f"strip_rounds.py: error: {error}")
if not isinstance(data, dict) or not isinstance(data.get("prompts"), list):
    sys.exit(f"strip_rounds.py: error: {args.source} has no per-prompt list: give the results.json `dspark eval` "
             "wrote.")
for prompt in data["prompts"]:
    prompt.pop("rounds_detail", None)
try:
    write_atomic(args.destination, json.dumps(data, indent=2))
except OSError as error:
    sys.exit(f"strip_rounds.py: error: cannot write {args.destination} ({error.strerror}).")
