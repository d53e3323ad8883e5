"""How far a bfloat16 target's training signal is from the float32 target's, on a dataset's held-out sequences.

    python experiments/bf16-fidelity/bf16_target_fidelity.py DATASET [--limit N] [--layers 1 14 27] [--output FILE.json]

A GPU regenerates answers and computes target features in bfloat16; the draft then serves a float32 target. This
measures, on the answer tokens of held-out sequences, what the draft would learn from either target: how often
their argmaxes agree (what greedy decoding accepts), 1 - TV between their next-token distributions (what sampling
accepts), and the cosine similarity of the features the draft reads.
"""

import argparse
import json

import torch

from dspark_hf import default_target
from dspark_hf.training.data import load_dataset, split_heldout
from dspark_hf.training.features import OnlineFeatures
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.objective import target_logits

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("dataset")
parser.add_argument("--limit", type=int, default=24, help="held-out sequences to measure")
parser.add_argument("--layers", type=int, nargs="+", default=[1, 14, 27], help="target layers the draft reads")
parser.add_argument("--heldout-fraction", type=float, default=TrainConfig.heldout_fraction)
parser.add_argument("--output", help="write the figures here as JSON")
args = parser.parse_args()

targets = {dtype: default_target(dtype=getattr(torch, dtype), device="cpu")[0] for dtype in ("float32", "bfloat16")}
examples = split_heldout(load_dataset(args.dataset), args.heldout_fraction)[1][: args.limit]
sums = {"argmax_agreement": 0.0, "one_minus_tv": 0.0, "feature_cosine": 0.0, "tokens": 0}
with torch.no_grad():
    for ex in examples:
        out = {}
        for dtype, target in targets.items():
            features, last = OnlineFeatures(target, args.layers)([ex])
            answer = slice(ex.answer_start - 1, len(ex.input_ids) - 1)  # positions that predict answer tokens
            probs = torch.softmax(target_logits(target, last[0, answer]).float(), -1)
            out[dtype] = (features[0, answer].float(), probs)
        (f32, p32), (f16, p16) = out["float32"], out["bfloat16"]
        sums["argmax_agreement"] += float((p32.argmax(-1) == p16.argmax(-1)).sum())
        sums["one_minus_tv"] += float((1 - 0.5 * (p32 - p16).abs().sum(-1)).sum())
        sums["feature_cosine"] += float(torch.nn.functional.cosine_similarity(f32, f16, dim=-1).sum())
        sums["tokens"] += p32.shape[0]
report = {k: v / sums["tokens"] for k, v in sums.items() if k != "tokens"}
report.update(tokens=sums["tokens"], sequences=len(examples), layers=args.layers, dataset=args.dataset)
print(json.dumps(report, indent=2))
if args.output:
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
