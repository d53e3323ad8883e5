"""Model cards for DSpark drafts, rendered from `model_cards/`'s template and from result files.

Figures come only from the eval / calibration JSON passed in; nothing is typed by hand.
"""

from __future__ import annotations

from pathlib import Path

_TEMPLATE_NAME = "dspark_draft.md"


def _template() -> str:
    # dspark_hf/assets/dspark_draft.md links to model_cards/dspark_draft.md (the one copy in the repo)
    return (Path(__file__).parent / "assets" / _TEMPLATE_NAME).read_text()


def results_table(eval_results: dict | None) -> str:
    if not eval_results:
        return "No evaluation results were given when this card was written."
    s, m = eval_results["settings"], eval_results["machine"]
    lines = [f"Acceptance length tau (accepted drafts + 1 per round), greedy={s['temperature'] == 0}, "
             f"{s['prompts']} prompts, max_new_tokens={s['max_new_tokens']}, block size {s['block_size']}; "
             f"measured {m['date']} on {m.get('gpu') or m['cpu']}.", "",
             "| domain | tau | conditional acceptance by position |", "|---|---:|---|"]
    for name, d in [*eval_results["domains"].items(), ("overall", eval_results["overall"])]:
        ca = " ".join("-" if v is None else f"{v:.2f}" for v in d["conditional_acceptance"])
        lines.append(f"| {name} | {d['acceptance_length']:.2f} | {ca} |")
    lines.append(f"| macro | {eval_results['macro_acceptance_length']:.2f} | |")
    return "\n".join(lines)


def render_model_card(config, base_model: str, repo_id: str = "<your-repo/draft>", eval_results: dict | None = None,
                      recipe: str | None = None, license: str = "apache-2.0", name: str | None = None) -> str:
    """The README.md of a draft checkpoint: YAML front matter, what it is, usage, training recipe, results."""
    vocab = (f"{config.draft_vocab_size} most frequent answer tokens of {config.target_vocab_size}"
             if config.draft_vocab_size else f"all {config.target_vocab_size} target tokens")
    return _template().format(
        base_model=base_model, license=license, name=name or f"DSpark draft for {base_model}", repo_id=repo_id,
        head_type=config.head_type, markov_rank=config.markov_rank, num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size, block_size=config.block_size, target_layer_ids=config.target_layer_ids,
        draft_vocab=vocab, confidence="calibrated (STS)" if config.confidence_temperatures else
        ("yes (uncalibrated)" if config.confidence_head else "no"),
        recipe=recipe or "Not recorded.", results=results_table(eval_results))
