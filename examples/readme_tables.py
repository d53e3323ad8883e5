"""Print the result tables of README and docs/results.md from the JSON files the commands wrote (evaluations,
speed, oracle, serve and SSD benchmarks, calibration, held-out acceptance), so that no table is typed by hand.
Figures quoted from other files (profiles, loop costs) name their file where they are quoted.

    python examples/readme_tables.py runs/eval_dspark.json runs/eval_dflash.json experiments/*/results/*.json
"""

import sys

from dspark_hf.evaluation.evaluate import summary_table
from dspark_hf.evaluation.bench_oracle import format_oracle_table
from dspark_hf.evaluation.bench_ssd import format_ssd_tables
from dspark_hf.evaluation.evaluate import format_speed_table
from dspark_hf.evaluation.machine import describe
from dspark_hf.evaluation.serve import format_serve_table
from dspark_hf.hub import read_json

KNOWN = ("`dspark eval` results, `dspark bench speed|oracle|serve|ssd` reports, calibration.json of `dspark "
         "calibrate`, heldout.json of `dspark train`")


def read(path: str):
    """The JSON in `path`, or a string saying why it cannot be read."""
    try:
        return read_json(path)
    except OSError as error:
        return f"cannot read it ({error.strerror})"
    except ValueError as error:
        return str(error)


for path in sys.argv[1:]:
    data = read(path)
    print(f"\n### {path}\n")
    if isinstance(data, str):
        print(f"no table: {data}")
    elif not isinstance(data, dict):
        print(f"no table: a JSON {type(data).__name__}, not a result file; tables come from {KNOWN}")
    elif data.get("benchmark") == "oracle":
        print(f"{describe(data['machine'])}\n\n{format_oracle_table(data)}")
    elif data.get("benchmark") == "ssd":
        print(f"{describe(data['machine'])}\n\n{format_ssd_tables(data)}")
    elif "results" in data and "settings" in data:  # bench serve
        print(f"{describe(data['machine'])}\n\n{format_serve_table(data)}")
    elif "methods" in data:
        s = data["settings"]
        print(f"{describe(data['machine'])}; {s['prompts']} prompts, batch {s['batch_size']}, "
              f"max_new_tokens={s['max_new_tokens']}, median of {s['repeats']}\n")
        print(format_speed_table(data))
    elif "overall" in data:
        s = data["settings"]
        print(f"{describe(data['machine'])}; {s['prompts']} prompts, max_new_tokens={s['max_new_tokens']}, "
              f"temperature={s['temperature']}\n")
        print(summary_table(data))
    elif "before" in data:
        b, a = data["before"], data["after"]
        print(f"STS on {data['rounds']} held-out rounds ({data['prompts']} prompts): ECE {b['ece']:.2%} -> "
              f"{a['ece']:.2%}, ROC-AUC {b['roc_auc']:.3f} -> {a['roc_auc']:.3f}; temperatures "
              f"{[round(t, 2) for t in data['temperatures']]}")
    elif "acceptance_per_position" in data:
        print(f"{data['sequences']} held-out sequences: acceptance (1 - TV) by position "
              f"{' '.join(f'{a:.2f}' for a in data['acceptance_per_position'])}, "
              f"expected tau {data['expected_tau_from_acceptance']:.2f}")
    elif "benchmark" in data:
        print(f"no table: a `dspark bench {data['benchmark']}` report, which has no table here; tables come from "
              f"{KNOWN}")
    else:
        print(f"no table: not a result file this script knows (its keys: {', '.join(list(data)[:8])}"
              f"{', ...' if len(data) > 8 else ''}); tables come from {KNOWN}")
