"""What a GPU lease can train, and what a larger target costs: estimates from the trainer's own FLOP count
(`dspark_hf.training.throughput.StepFlops`, the figure every run now records) and the one measured GPU run.

    python experiments/training-speed-cpu/estimates.py --output experiments/training-speed-cpu/results/estimates.json

Models are built on the meta device (shapes only, no weights, no download): SmolLM2-135M-Instruct, SmolLM2-1.7B and
Qwen3-4B as their published configs give them, each with the first GPU run's draft recipe (3 layers, Markov rank
128, an 8,192-token draft vocabulary, blocks of 7, 48 anchors, 64 answers a step) and the first run's answers
(193.2 tokens a sequence, 140.5 of them answer, `data.manifest.json`), grouped by length (1% padding, as measured
on this CPU). The measured anchor: 675 steps of 64 answers in about 107 s of steps on an H200, two trainers side by
side (../shared/gpu-run-2026-11-26). Every other figure is an estimate until a GPU run measures it.
"""

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dspark_hf import DSparkConfig, DSparkDraftModel
from dspark_hf.training.throughput import GPU_PEAKS, Shapes, StepFlops

TARGETS = {  # the published configs' shapes
    "SmolLM2-135M-Instruct": (LlamaForCausalLM, LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True, pad_token_id=2)),
    "SmolLM2-1.7B": (LlamaForCausalLM, LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
        vocab_size=49152, tie_word_embeddings=True, pad_token_id=2)),
    "Qwen3-4B": (Qwen3ForCausalLM, Qwen3Config(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, pad_token_id=151643)),
}
BATCH, ANCHORS, BLOCK, SEQUENCE, ANSWER, PADDED = 64, 48, 7, 193.2, 140.5, 0.01
FIRST_RUN = {"steps": 675, "answers_per_step": 64, "step_seconds": 107.0, "trainers_side_by_side": 2}
LEASE_TRAINING_SECONDS = 8 * 60  # of a 15-minute lease: ~1 min smoke call, start and transfers, ~9 min long call
MFU_ASSUMED = 0.30  # what a well-fed bf16 trainer of this size reaches; an assumption, not a measurement
ANSWERS = 100_000  # a user's training set, one epoch


def step_flops(name: str) -> float:
    cls, config = TARGETS[name]
    with torch.device("meta"):
        target = cls(config)
        # the draft's shape as from_target gives it (which reads the target's weights: none here)
        draft = DSparkDraftModel(DSparkConfig(
            hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_hidden_layers=3,
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            target_layer_ids=[1, config.num_hidden_layers // 2, config.num_hidden_layers - 3],
            target_vocab_size=config.vocab_size, target_hidden_size=config.hidden_size,
            target_num_hidden_layers=config.num_hidden_layers, markov_rank=128, block_size=BLOCK,
            draft_vocab_size=8192, mask_token_id=config.pad_token_id))
    length = round(SEQUENCE / (1 - PADDED))
    parts = StepFlops(target, draft)(Shapes(BATCH, length, ANCHORS * BLOCK, round(BATCH * ANSWER)))
    return sum(parts.values()), parts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    peak = GPU_PEAKS["H200"]["bfloat16"] * 1e12
    small, _ = step_flops("SmolLM2-135M-Instruct")
    # the first run: its steps' FLOPs (counted as today's step would count them) over its seconds, both trainers
    first_mfu = small * FIRST_RUN["steps"] * FIRST_RUN["trainers_side_by_side"] / FIRST_RUN["step_seconds"] / peak
    out = {"first_run_mfu_h200_bf16": round(first_mfu, 4), "assumed_mfu": MFU_ASSUMED,
           "lease_training_seconds": LEASE_TRAINING_SECONDS, "answers": ANSWERS, "targets": {}}
    for name in TARGETS:
        total, parts = step_flops(name)
        per_answer = total / BATCH
        row = {"tflop_per_step": round(total / 1e12, 2),
               "tflop_per_step_by_part": {k: round(v / 1e12, 2) for k, v in parts.items()},
               "gflop_per_answer": round(per_answer / 1e9, 1)}
        for label, mfu in (("at_first_run_mfu", first_mfu / FIRST_RUN["trainers_side_by_side"]),
                           ("at_assumed_mfu", MFU_ASSUMED)):
            rate = mfu * peak / per_answer  # answers a second, one trainer on one H200
            row[label] = {"answers_per_second": round(rate, 1),
                          "answers_in_a_lease": round(rate * LEASE_TRAINING_SECONDS),
                          "hours_per_epoch_of_answers": round(ANSWERS / rate / 3600, 2)}
        cls, config = TARGETS[name]
        feature_layers = 3 + 1  # the draft's feature layers and the last hidden state, bf16
        row["offline_feature_cache_gb"] = round(ANSWERS * SEQUENCE * feature_layers * config.hidden_size * 2 / 1e9, 1)
        out["targets"][name] = row
    print(json.dumps(out, indent=1))
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
