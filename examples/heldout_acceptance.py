"""Teacher-forced acceptance of a draft on a dataset: 1 - TV (sampling) and argmax agreement (greedy) per position.

    python examples/heldout_acceptance.py DRAFT DATASET [--all] [--heldout-fraction F] [--feature-cache DIR]
                                          [--lag L] [--output FILE.json]

By default only the held-out split of DATASET (by hashed prompt id, as `dspark train` chooses it, at the share the
draft's train_config.json records, else 5%) is measured, so a draft trained on DATASET is measured on sequences it
never saw; --all measures every sequence, for a dataset the draft was not trained on. The figures are what `dspark
train` writes to heldout.json, on the embedded target, per domain where the dataset names them; --feature-cache reads
the target's features from a cache that holds them; --lag L measures blocks that see their last L context tokens
without target features (SSD's lagged context).
"""

import argparse
import json
import sys

import torch

from dspark_hf import DSparkDraftModel, default_target
from dspark_hf.training.data import heldout_fraction_of, load_dataset, split_heldout
from dspark_hf.training.features import CachedFeatures, OnlineFeatures
from dspark_hf.training.losses import LossWeights
from dspark_hf.training.heldout import evaluate_heldout

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("draft")
parser.add_argument("dataset")
parser.add_argument("--all", action="store_true", help="measure every sequence, not only the held-out split")
parser.add_argument("--heldout-fraction", type=float,
                    help="at most what the draft's training held out (default: its train_config.json, else 0.05)")
parser.add_argument("--feature-cache", help="a `dspark train --feature-cache` folder holding these sequences")
parser.add_argument("--lag", type=int, default=0, help="context tokens before each anchor seen without features")
parser.add_argument("--output", help="write the report here as JSON")
args = parser.parse_args()

try:  # the held-out split is known before any model loads: an empty one is refused at once
    examples = load_dataset(args.dataset)
except ValueError as error:
    sys.exit(f"heldout_acceptance.py: error: {error}")
if not args.all:
    try:  # a share larger than the training's would measure sequences the draft was trained on
        fraction = heldout_fraction_of(args.draft, args.heldout_fraction)
    except ValueError as error:
        sys.exit(f"heldout_acceptance.py: error: {error}")
    everything, examples = examples, split_heldout(examples, fraction)[1]
    if not examples:
        sys.exit(f"heldout_acceptance.py: error: the held-out split of {args.dataset} ({fraction:g} of "
                 f"its {len(everything)} sequences, by hashed prompt id) is empty: pass --all to measure every "
                 "sequence, or a larger --heldout-fraction.")
target, _ = default_target()
try:  # read again now that the target's vocabulary is known: load_dataset checks every token id against it
    load_dataset(args.dataset, target.get_output_embeddings().weight.shape[0])
except ValueError as error:
    sys.exit(f"heldout_acceptance.py: error: {error}")
draft = DSparkDraftModel.from_pretrained(args.draft, dtype=torch.float32).eval()
draft.bind_target(target)
layers = draft.config.target_layer_ids
features = (CachedFeatures(args.feature_cache, target, layers, examples) if args.feature_cache
            else OnlineFeatures(target, layers))
report = evaluate_heldout(draft, target, examples, features, 48, LossWeights(), lag=args.lag)
report.update(draft=args.draft, dataset=args.dataset, split="all" if args.all else "held-out", lag=args.lag)
print(f"{args.dataset} ({report['split']}, {report['sequences']} sequences)")
for name, rates, tau in (("1 - TV", "acceptance_per_position", "expected_tau_from_acceptance"),
                         ("greedy agreement", "greedy_agreement_per_position", "expected_greedy_tau")):
    print(f"  {name:17s} {' '.join(f'{a:.3f}' for a in report[rates])}   expected tau {report[tau]:.3f}")
for domain, figures in report.get("domains", {}).items():
    print(f"  {domain:17s} greedy agreement at position 1 {figures['greedy_agreement_per_position'][0]:.3f}, "
          f"expected greedy tau {figures['expected_greedy_tau']:.3f}")
if args.output:
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
