"""Is a reduced draft vocabulary of 8,192 tokens (`dspark train`'s default) worth leaving SGLang out? (issue "Train
here, serve anywhere").

Two things it trades, measured on the SmolLM2 answers the shipped draft was trained on:
- coverage: the share of answer tokens inside the V most frequent ones (chosen, as `dspark train` chooses, from the
  training split; counted on the held-out split, by hashed prompt id as training splits). A token outside the draft
  vocabulary can never be drafted, so coverage bounds per-token acceptance from above;
- cost: the time of one draft pass (a block of 7 at batch 1 and 8) with the shipped draft's shape and a head of V
  rows, on this machine, median of interleaved repeats.

    python experiments/draft-vocab/measure.py [--output experiments/draft-vocab/results/draft_vocab.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SIZES = (2048, 4096, 8192, 16384, 32768, None)  # None: the full vocabulary


def coverage(order: torch.Tensor, heldout, vocab_size: int) -> dict:
    """order: the target's tokens by training frequency, most frequent first."""
    from dspark_hf.training.data import token_frequencies

    held = token_frequencies(heldout, vocab_size)
    return {str(v or vocab_size): round(held[order[:v or vocab_size]].sum().item() / held.sum().item(), 5)
            for v in SIZES}


@torch.inference_mode()
def draft_seconds(target, order: torch.Tensor, repeats: int, batch: int) -> dict:
    """Median seconds of one draft pass per vocabulary size, the sizes interleaved in every repeat."""
    from dspark_hf import DSparkDraftModel
    from dspark_hf.defaults import SHIPPED_DRAFT_DIR

    shape = DSparkDraftModel.config_class.from_pretrained(SHIPPED_DRAFT_DIR).to_dict()
    keep = {k: shape[k] for k in ("num_hidden_layers", "markov_rank", "block_size", "intermediate_size")}
    drafts = {v: DSparkDraftModel.from_target(target, **keep, **({"draft_vocab": order[:v].sort().values}
                                                                   if v else {})).eval() for v in SIZES}
    g, T = keep["block_size"], 256
    ids = torch.randint(0, target.config.vocab_size, (batch, T))
    features = next(iter(drafts.values())).target_features(target(ids, output_hidden_states=True).hidden_states)
    inputs = dict(anchor_ids=ids[:, -1:], anchor_positions=torch.full((batch, 1), T),
                  context_features=features, context_positions=torch.arange(T).expand(batch, T),
                  context_valid=torch.ones(batch, T, dtype=torch.bool),
                  block_tokens=ids[:, -g:].unsqueeze(1))
    times = {v: [] for v in SIZES}
    for _ in range(repeats):
        for v, draft in drafts.items():
            t0 = time.perf_counter()
            draft(**inputs)
            times[v].append(time.perf_counter() - t0)
    return {str(v or target.config.vocab_size): round(statistics.median(t[1:] or t), 5) for v, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default=str(ROOT / "experiments" / "smollm2-answers" / "part-001.jsonl.gz"))
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "draft_vocab.json"))
    args = parser.parse_args()

    from dspark_hf.defaults import default_target
    from dspark_hf.training.data import load_dataset, split_heldout, token_frequencies

    target, _ = default_target(device="cpu")
    train, heldout = split_heldout(load_dataset(args.dataset), 0.05)
    order = token_frequencies(train, target.config.vocab_size).argsort(descending=True)  # as dspark train chooses
    record = {
        "command": "python experiments/draft-vocab/measure.py", "dataset": args.dataset,
        "examples": {"train": len(train), "heldout": len(heldout)},
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "code": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip(),
        "utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "coverage": coverage(order, heldout, target.config.vocab_size),
        "draft_seconds": {f"batch {b}": draft_seconds(target, order, args.repeats, b) for b in (1, 8)},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("coverage", "draft_seconds")}, indent=2))


if __name__ == "__main__":
    main()
