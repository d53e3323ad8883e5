"""The recipe study's table (experiments/recipe-study/recipe_study.sh) from its held-out reports, as markdown.

    python experiments/recipe-study/recipe_table.py experiments/recipe-study/results

One row per arm: what it changes, its steps and training minutes, greedy agreement at draft position 1, the expected
greedy tau per domain and their macro, and the macro's change against the base recipe (the mean of its seeds, where
base-seed1 ran); the spread between the base recipe's seeds is the noise such a change has to clear.
"""

import json
import sys
from pathlib import Path

CHANGES = {  # what each arm of recipe_study.sh changes in the base recipe
    "base": "the shipped draft's recipe: target layers 1/14/27, 0.1 CE + 0.9 L1, 48 anchors, lr 3e-3, mixed data",
    "base-seed1": "the base recipe from another seed (the noise)",
    "layers5": "five target layers by the reference rule, 1/7/14/20/27",
    "kl": "+ forward KL(p_t || p_d), weight 1.0",
    "anchors96": "96 anchors per sequence",
    "lr6e-4": "lr 6e-4 (published recipes)",
    "chat-only": "ShareGPT prompts only (no code or math sources)",
    "block1": "block size 1 (single-token draft, MTP-1 style)",
    "dflash": "no Markov head (DFlash-style ablation)",
}


def main(folder: Path) -> None:
    reports = {p.stem.removeprefix("heldout_"): json.loads(p.read_text()) for p in sorted(folder.glob("heldout_*.json"))}
    if "base" not in reports:
        sys.exit(f"{folder}: no heldout_base.json; run experiments/recipe-study/recipe_study.sh first")
    domains = sorted(reports["base"]["domains"])
    seeds = [reports[a]["macro_expected_greedy_tau"] for a in ("base", "base-seed1") if a in reports]
    base = sum(seeds) / len(seeds)
    print(f"| arm | change | steps | minutes | agreement @1 | {' | '.join(domains)} | macro tau | vs base |")
    print("|---|---|---:|---:|---:|" + "---:|" * len(domains) + "---:|---:|")
    for arm in [a for a in CHANGES if a in reports] + sorted(set(reports) - set(CHANGES)):
        r = reports[arm]
        per_domain = " | ".join(f"{r['domains'][d]['expected_greedy_tau']:.3f}" for d in domains)
        macro = r["macro_expected_greedy_tau"]
        training = r.get("training", {})
        print(f"| {arm} | {CHANGES.get(arm, '')} | {training.get('steps', '')} | {training.get('minutes', '')} | "
              f"{r['greedy_agreement_per_position'][0]:.3f} | {per_domain} | {macro:.3f} | "
              f"{100 * (macro / base - 1):+.1f}% |")
    if len(seeds) == 2:
        print(f"\nnoise: the base recipe's two seeds give macro tau {seeds[0]:.3f} and {seeds[1]:.3f}, "
              f"{100 * abs(seeds[0] - seeds[1]) / base:.1f}% apart")
    sequences = {d: reports["base"]["domains"][d]["sequences"] for d in domains}
    print(f"\nheld-out prompts: {', '.join(f'{d} {n}' for d, n in sequences.items())}; teacher-forced, greedy "
          "agreement of draft and target argmax at every position of 48 random blocks per sequence")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/recipe-study/results"))
