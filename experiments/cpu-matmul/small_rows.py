"""Why verifying two tokens per row costs 1.5x one token on this CPU: the float32 matmuls of SmolLM2-135M's layers for
a few rows, as `nn.Linear` computes them (x @ W.T) and with the weight on the left (W @ x.T), timed interleaved.

    python experiments/cpu-matmul/small_rows.py --output experiments/cpu-matmul/results/small_rows.json
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dspark_hf.evaluation.machine import machine_info

# (name, out_features, in_features, times per forward) for SmolLM2-135M: 30 layers, hidden 576, 3 KV heads of 64
SHAPES = [("q_proj / o_proj", 576, 576, 60), ("k_proj / v_proj", 192, 576, 60), ("gate_proj / up_proj", 1536, 576, 60),
          ("down_proj", 576, 1536, 30), ("lm_head", 49152, 576, 1)]
WAYS = {"x @ W.T (nn.Linear)": lambda x, w: F.linear(x, w), "W @ x.T": lambda x, w: (w @ x.mT).mT}


def seconds(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for name, out_features, in_features, per_forward in SHAPES:
        w = torch.randn(out_features, in_features)
        calls = max(3, int(2e8 / (out_features * in_features)))  # about the same work per timing
        for m in args.rows:
            x = torch.randn(m, in_features)
            runs = {way: [] for way in WAYS}
            # every way in every repeat, in rotating order: a machine that drifts skews no ratio
            for i in range(args.repeats):
                ways = list(WAYS)
                for way in ways[i % len(ways):] + ways[:i % len(ways)]:
                    seconds(lambda: WAYS[way](x, w), 2)
                    runs[way].append(seconds(lambda: WAYS[way](x, w), calls))
            row = {"shape": name, "out": out_features, "in": in_features, "per_forward": per_forward, "rows": m,
                   **{way: statistics.median(t) for way, t in runs.items()}}
            results.append(row)
            print(f"{name:22s} rows {m:2d}: " + "  ".join(f"{way} {row[way] * 1e3:7.3f} ms" for way in WAYS))
    per_forward = {}
    for m in args.rows:
        per_forward[m] = {way: sum(r[way] * r["per_forward"] for r in results if r["rows"] == m) for way in WAYS}
        print(f"per forward, rows {m:2d}: "
              + "  ".join(f"{way} {s * 1e3:6.1f} ms" for way, s in per_forward[m].items()))
    with open(args.output, "w") as f:
        json.dump({"machine": machine_info(), "repeats": args.repeats, "shapes": results,
                   "per_forward_seconds": per_forward}, f, indent=1)


if __name__ == "__main__":
    main()
