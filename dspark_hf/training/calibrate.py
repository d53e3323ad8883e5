"""`dspark calibrate`'s work: held-out rollouts with the full block, then Sequential Temperature Scaling of the
confidence head (the math is calibration.py's; the reliability diagram is drawn by the caller)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..options import NONZERO_SHARE, POSITIVE, option
from ..scheduling import FullBlock
from .calibration import calibration_report, sequential_temperature_scaling
from .data import load_dataset, split_heldout


@dataclass
class CalibrationOptions:
    """Where `dspark calibrate` finds its held-out prompts, and where it saves the calibrated draft."""

    dataset: str = option(help="the training JSONL; its held-out split is used")
    heldout_fraction: float | None = option(None, "the share of the dataset held out in training (default: the "
                                            "draft's train_config.json, else 0.05); never more than training held "
                                            "out", type=NONZERO_SHARE)
    limit: int | None = option(None, "at most this many held-out prompts", type=POSITIVE)
    output: str = option(help="directory for the calibrated draft, calibration.json and reliability.png")


@dataclass
class Calibration:
    """STS fitted on R drafted full-block rounds of a draft with block size gamma.

    logits: (R, gamma) float64, the raw confidence logits of each round; verified, accepted: (R,) int64, how many
    positions each round verified and how many drafts it accepted; temperatures: the gamma per-position
    temperatures; report: what calibration.json holds (ECE and ROC-AUC before and after, the temperatures, and the
    rollouts' prompts, rounds, max_new_tokens and temperature).
    """

    logits: torch.Tensor
    verified: torch.Tensor
    accepted: torch.Tensor
    temperatures: list[float]
    report: dict

    def save(self, draft, folder: str | Path) -> Path:
        """Save `draft` (as [`calibrate`] left it, with these temperatures) and calibration.json into `folder`,
        created if missing; returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        draft.save_pretrained(folder)
        (folder / "calibration.json").write_text(json.dumps(self.report, indent=2))
        return folder


def calibrate(draft, target, tokenizer, dataset: str | Path, fraction: float, limit: int | None = None,
              batch_size: int = 8, max_new_tokens: int = 128, temperature: float = 0.0,
              draft_name: str | None = None, progress: bool = True) -> Calibration:
    """Fit the confidence head's per-position temperatures (STS) on the held-out split of `dataset` and set them on
    `draft`.

    Each held-out prompt (the first of its answers, in file order; at most `limit` of them) is decoded with
    `draft` by `target.generate` in batches of `batch_size`, `max_new_tokens` new tokens at `temperature` (0:
    greedy), verifying the full block every round, as STS fits. `fraction`: the held-out share (see
    `training.data.heldout_fraction_of`). `draft_name`: how errors name the draft (default its name_or_path).
    A draft without a confidence head, an empty held-out split, or rollouts that drafted no block are refused in
    one line, the first before any rollout. If the rollouts fail, the draft keeps the temperatures it had.
    """
    from tqdm.auto import tqdm

    if not draft.config.confidence_head:  # its rounds carry no confidences
        raise ValueError(f"{draft_name or draft.name_or_path} has no confidence head (confidence_head=False): STS "
                         "calibrates that head, so there is nothing to calibrate; train a draft with one.")
    _, heldout = split_heldout(load_dataset(dataset, target.get_output_embeddings().weight.shape[0]), fraction)
    if not heldout:
        raise ValueError(f"the held-out split of {dataset} at fraction {fraction:g} is empty: use a larger dataset.")
    first_answers = {}  # one rollout per prompt (several answers share one prompt)
    for e in heldout:
        first_answers.setdefault(e.prompt_id, e)
    texts = [tokenizer.decode(e.input_ids[: e.answer_start]) for e in first_answers.values()][:limit]
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    logits, verified, accepted = [], [], []
    raw = draft.config.confidence_temperatures
    draft.set_confidence_temperatures(None)  # STS fits raw ones
    try:
        for i in tqdm(range(0, len(texts), batch_size), desc="held-out rollouts", disable=not progress):
            inputs = tokenizer(texts[i: i + batch_size], return_tensors="pt", padding=True,
                               add_special_tokens=False).to(target.device)
            out = target.generate(**inputs, max_new_tokens=max_new_tokens, **sampling, assistant_model=draft,
                                  return_dict_in_generate=True, verification_policy=FullBlock())
            for r in (r for rows in out.rounds for r in rows if r.drafted):  # a last round drafts nothing
                logits.append(torch.logit(torch.tensor(r.confidences, dtype=torch.double), eps=1e-12))
                verified.append(r.verified)
                accepted.append(r.accepted)
    finally:
        draft.set_confidence_temperatures(raw)
    if not logits:
        raise ValueError(f"no held-out rollout drafted a block in {max_new_tokens} new tokens: raise "
                         "--max-new-tokens.")
    logits, verified, accepted = torch.stack(logits), torch.tensor(verified), torch.tensor(accepted)
    temps = sequential_temperature_scaling(logits, verified, accepted)
    report = {"before": calibration_report(logits, verified, accepted, [1.0] * draft.config.block_size),
              "after": calibration_report(logits, verified, accepted, temps), "temperatures": temps,
              "prompts": len(texts), "rounds": len(accepted), "max_new_tokens": max_new_tokens,
              "temperature": temperature}
    draft.set_confidence_temperatures(temps)
    return Calibration(logits, verified, accepted, temps, report)
