"""The held-out report of each tau run's draft, all measured alike: by this checkout's `evaluate_heldout`, on every
held-out sequence of the run's split, with the float32 target (the one greedy decoding is lossless against). Each
run's own heldout.json measured it with the target in its training dtype (bfloat16 for the bf16 arm) and on as many
held-out batches as its time allowed.

    python experiments/training-speed-cpu/heldout_fp32.py --dataset DATA --output results/heldout_fp32.json \
        old=/tmp/dspark-train-speed/tau-old new=... bf16=...
"""

import argparse
import json

import dspark_hf
from dspark_hf import DSparkDraftModel
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.data import load_dataset, split_heldout
from dspark_hf.training.features import OnlineFeatures
from dspark_hf.training.heldout import evaluate_heldout
from dspark_hf.training.losses import LossWeights


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("drafts", nargs="+", help="name=folder of a trained draft")
    args = parser.parse_args()
    target, _ = dspark_hf.default_target()
    target.requires_grad_(False).eval()
    config = TrainConfig(dataset=args.dataset, output_dir="unused")
    _, heldout = split_heldout(load_dataset(args.dataset, target.get_output_embeddings().weight.shape[0]),
                               config.heldout_fraction)
    for e in heldout:
        e.input_ids = e.input_ids[: config.max_length]
    out = {"heldout_sequences": len(heldout), "target_dtype": str(target.dtype), "drafts": {}}
    for name, folder in (d.split("=", 1) for d in args.drafts):
        draft = DSparkDraftModel.from_pretrained(folder).bind_target(target).eval()
        report = evaluate_heldout(draft, target, heldout, OnlineFeatures(target, draft.config.target_layer_ids),
                                  config.anchors_per_sequence, LossWeights())
        out["drafts"][name] = {"folder": folder, "expected_greedy_tau": round(report["expected_greedy_tau"], 4),
                               "expected_tau_from_acceptance": round(report["expected_tau_from_acceptance"], 4)}
        print(name, out["drafts"][name])
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
