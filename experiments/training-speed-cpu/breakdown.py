"""Where a training step's time goes on this CPU (issue 58, "measure first"): the default recipe of `dspark train`
(a fresh draft of DSparkConfig's shape, batch 4, 48 anchors, float32) on the first answers of a dataset, each part of
`train_step` and of the trainer's step timed apart, and the share of padded positions in its batches.

    python experiments/training-speed-cpu/breakdown.py --dataset ../shared/gpu-run-2026-11-26/data.jsonl.gz \
        --examples 800 --steps 12 --output experiments/training-speed-cpu/results/breakdown.json

Runs on whatever dspark_hf is importable (a git worktree of the code before the change, on PYTHONPATH, serves the
old step). The parts are timed by wrapping the functions a step calls; the wrapping adds a few microseconds a call.
"""

import argparse
import functools
import json
import statistics
import time
from collections import defaultdict

import torch

import dspark_hf
from dspark_hf.evaluation.machine import machine_info
from dspark_hf.training import features as features_mod
from dspark_hf.training import objective
from dspark_hf.training.config import TrainConfig
from dspark_hf.training.data import load_dataset, split_heldout
from dspark_hf.training.drafts import make_draft
from dspark_hf.training.losses import LossWeights

PARTS = {"target forward (features)": (features_mod.OnlineFeatures, "__call__"),
         "draft forward": (dspark_hf.DSparkDraftModel, "forward"),
         "teacher: LM head + softmax": (objective, "target_distribution_at"),
         "losses": (objective, "losses_against"),
         "data: padding, anchors": (objective, "pad_batch")}


def timed(spent: dict):
    """Wrap each part so that its seconds add up in `spent`."""
    for name, (owner, attr) in PARTS.items():
        original = getattr(owner, attr)

        @functools.wraps(original)
        def wrapper(*args, __original=original, __name=name, **kwargs):
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                spent[__name] += time.perf_counter() - start

        setattr(owner, attr, wrapper)


def padded_share(batches: list[list]) -> dict:
    """Of the positions the target's forward computes (B x L_max a batch), the share that is padding; the draft's
    attention reads the same padded context."""
    real = sum(len(e.input_ids) for b in batches for e in b)
    computed = sum(len(b) * max(len(e.input_ids) for e in b) for b in batches)
    return {"target_tokens_padded_share": round(1 - real / computed, 4)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--examples", type=int, default=800)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--output", required=True)
    parser.add_argument("--group-by-length", action="store_true", help="batches as the new trainer groups them "
                        "(training.trainer.grouped_by_length; the code before has no such function)")
    args = parser.parse_args()

    target, _ = dspark_hf.default_target()
    target.requires_grad_(False).eval()
    examples = load_dataset(args.dataset, target.get_output_embeddings().weight.shape[0])[: args.examples]
    config = TrainConfig(dataset=args.dataset, output_dir="unused")
    train_set, _ = split_heldout(examples, config.heldout_fraction)
    for e in train_set:
        e.input_ids = e.input_ids[: config.max_length]
    draft = make_draft(target, config, train_set).train()
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=config.learning_rate)
    online = features_mod.OnlineFeatures(target, draft.config.target_layer_ids)
    weights = LossWeights()
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0)).tolist()
    if args.group_by_length:
        import random

        from dspark_hf.training.trainer import grouped_by_length
        order = grouped_by_length(order, [len(e.input_ids) for e in train_set], config.batch_size, random.Random(0))
    B = config.batch_size
    batches = [[train_set[i] for i in order[s * B:(s + 1) * B]] for s in range(args.steps + 2)]

    spent = defaultdict(float)
    timed(spent)
    steps = []
    for s, batch in enumerate(batches):
        spent.clear()
        start = time.perf_counter()
        losses, valid = objective.train_step(draft, target, batch, online, config.anchors_per_sequence, weights,
                                             generator)
        forward_done = time.perf_counter()
        losses["total"].backward()
        backward_done = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer_done = time.perf_counter()
        float(losses["total"])  # the trainer's host read and running averages, once a step
        {k: float(v.detach()) for k, v in losses.items() if k not in ("acceptance", "agreement")}
        read_done = time.perf_counter()
        if s < 2:  # warm-up
            continue
        forward = forward_done - start
        parts = dict(spent)
        parts["other forward work"] = forward - sum(parts.values())
        parts.update({"backward": backward_done - forward_done, "clip + optimizer": optimizer_done - backward_done,
                      "host reads": read_done - optimizer_done})
        steps.append({"seconds": read_done - start, "parts": parts})

    total = statistics.median(s["seconds"] for s in steps)
    names = list(steps[0]["parts"])
    medians = {n: statistics.median(s["parts"][n] for s in steps) for n in names}
    answers = len(batches[0])
    report = {"machine": machine_info(target, draft), "settings": {
        "dataset": args.dataset, "examples": args.examples, "steps": args.steps, "batch_size": B,
        "anchors": config.anchors_per_sequence, "draft_layers": draft.config.num_hidden_layers,
        "draft_vocab_size": draft.config.draft_vocab_size, "block_size": draft.config.block_size},
        "step_seconds_median": round(total, 4), "answers_per_second": round(answers / total, 3),
        "parts_seconds_median": {n: round(v, 4) for n, v in medians.items()},
        "parts_share": {n: round(v / total, 4) for n, v in medians.items()},
        **padded_share(batches[2:]),
        "steps_measured": steps}
    for n, v in medians.items():
        print(f"{n:32s} {v * 1e3:9.1f} ms  {v / total:6.1%}")
    print(f"step {total:.2f} s, {answers / total:.2f} answers/s, padded share of the target's tokens "
          f"{report['target_tokens_padded_share']:.1%}")
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
