"""The GPU campaign's long call, sized from what its smoke call measured (`gpu_campaign.sh`, issue 58): how many of
its minutes go to regenerating answers and how many to training.

The smoke call runs the long call's commands at the real shapes (a random-weight target of the real one's shape):
`dspark prepare-data` records its answer tokens/s in its manifest, `dspark train` its answers/s in heldout.json.
With those rates the long call splits the minutes it has for data and training, B = D + T, so that training sees
its data about EPOCHS times: it trains on A x 60 T answers, and wants N0 + new = A x 60 T / EPOCHS of them, where
new = R x 60 (D - LOADING) / tokens per answer. Solved for D, then kept within [MIN_DATA, B x MAX_DATA_SHARE]:
a fast trainer with few answers gets regeneration time; one that cannot even see the answers it has gets the least.

    python3 examples/campaign_plan.py --smoke STATE/smoke --minutes B --answers N0 --tokens-per-answer K
    # prints the regeneration minutes, then one line on stderr saying why
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

EPOCHS = 2.0  # passes over the data a run aims for (the first GPU run made about 4.4, on 9,728 answers)
LOADING = 0.4  # minutes of prepare-data not spent decoding: loading, the first compile (the first run: ~0.3)
MIN_DATA = 0.5  # regeneration always adds some answers: each lease adds to what the next one trains on
MAX_DATA_SHARE = 0.5  # and never takes more than half of the minutes


@dataclass(frozen=True)
class Rates:
    """What the smoke call measured at the real shapes."""

    answers_per_second: float  # training
    answer_tokens_per_second: float  # regeneration


def regeneration_minutes(rates: Rates, minutes: float, answers: int, tokens_per_answer: float) -> float:
    """The minutes of `minutes` (data and training together) to give regeneration, by the rule of the module."""
    a, r = rates.answers_per_second * 60, rates.answer_tokens_per_second * 60 / tokens_per_answer  # per minute
    # N0 + r (D - LOADING) = a (B - D) / EPOCHS
    data = (a * minutes / EPOCHS - answers + r * LOADING) / (r + a / EPOCHS)
    return round(min(max(data, MIN_DATA), minutes * MAX_DATA_SHARE), 2)


def smoke_rates(smoke: Path) -> Rates | None:
    """The rates in a smoke call's folder: its draft's heldout.json and its regeneration manifests (the fastest
    engine's); None when either is missing (a smoke call cut short)."""
    try:
        trained = json.loads((smoke / "draft" / "heldout.json").read_text())["training"]["throughput"]
        answers = trained["answers_per_second"]
    except (OSError, KeyError, TypeError, ValueError):
        return None
    made = []
    for manifest in smoke.glob("*.manifest.json"):
        try:
            made.append(json.loads(manifest.read_text())["this_call"]["answer_tokens_per_second"])
        except (OSError, KeyError, TypeError, ValueError):
            continue
    made = [m for m in made if m]
    if not answers or not made:
        return None
    return Rates(answers, max(made))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", type=Path, required=True, help="the smoke call's folder ($STATE/smoke)")
    parser.add_argument("--minutes", type=float, required=True, help="minutes for regeneration and training")
    parser.add_argument("--answers", type=int, required=True, help="answers the run already trains on")
    parser.add_argument("--tokens-per-answer", type=float, required=True)
    parser.add_argument("--default", type=float, default=1.5, help="minutes when the smoke call measured nothing")
    args = parser.parse_args(argv)
    rates = smoke_rates(args.smoke)
    if rates is None:
        print(args.default)
        print(f"plan: the smoke call measured no rates ({args.smoke}): regeneration gets the default "
              f"{args.default} min", file=sys.stderr)
        return 0
    data = regeneration_minutes(rates, args.minutes, args.answers, args.tokens_per_answer)
    print(data)
    print(f"plan: training {rates.answers_per_second:g} answers/s, regeneration {rates.answer_tokens_per_second:g} "
          f"answer tokens/s (the smoke call's); {args.answers} answers so far: {data} of {args.minutes:g} min "
          f"regenerate, the rest trains (about {EPOCHS:g} passes over the data)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
