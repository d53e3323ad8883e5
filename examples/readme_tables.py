"""Print the result tables of README and docs/results.md from the JSON files the commands wrote (evaluations,
speed, oracle, serve and SSD benchmarks, calibration, held-out acceptance), so that no table is typed by hand.
Figures quoted from other files (profiles, loop costs) name their file where they are quoted.

    python examples/readme_tables.py runs/eval_dspark.json runs/eval_dflash.json experiments/*/results/*.json
"""

import json
import sys

from dspark_hf.evaluation.evaluate import summary_table
from dspark_hf.evaluation.bench_oracle import format_oracle_table
from dspark_hf.evaluation.bench_ssd import format_ssd_tables
from dspark_hf.evaluation.evaluate import format_speed_table
from dspark_hf.evaluation.machine import describe
from dspark_hf.evaluation.serve import format_serve_table

for path in sys.argv[1:]:
    data = json.load(open(path))
    print(f"\n### {path}\n")
    if data.get("benchmark") == "oracle":
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
