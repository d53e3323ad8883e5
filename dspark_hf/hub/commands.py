"""What `dspark push` and `dspark export` run on a draft folder: [`push_draft`] (a card rendered from the folder's
result files) and [`export_draft`] (the transformers format, with its card); and reading the result files a card is
rendered from ([`read_json`], [`folder_calibration`])."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from ..cards import CardData, render_model_card, training_recipe
from ..model.modeling_dspark import DSparkDraftModel
from .sharing import README, push_to_hub

# the folders `dspark push` takes, for its messages
_DRAFT_FOLDERS = "the --output-dir of `dspark train` or the --output of `dspark calibrate`"


def push_draft(folder: str | Path, repo_id: str, base_model: str | None = None,
               eval_results: str | Path | dict | None = None, calibration: str | Path | dict | None = None,
               recipe: str | Path | None = None, private: bool = False, token: str | None = None,
               revision: str | None = None, commit_message: str | None = None,
               dtype: torch.dtype | str = torch.bfloat16, license: str | None = None):
    """Push a draft folder written by `dspark train` (its --output-dir) or `dspark calibrate` (its --output), with
    a card rendered from its results, in `dtype` (default bfloat16, as `dspark export` writes it).

    base_model: the target's hub id (default: the draft config's ``target_name_or_path``, which must then be one).
    eval_results: the results.json of `dspark eval` (path or dict). calibration: the calibration.json of
    `dspark calibrate`; default ``folder/calibration.json`` if present. recipe: markdown text or a .md file; default
    rendered from ``folder/train_config.json`` (and ``heldout.json``) if present. license: the card's Hub licence id
    (none by default). The rest as in [`push_to_hub`].
    Only the draft's own files are sent (not checkpoints, training state or result files).
    """
    folder = Path(folder)
    if not folder.is_dir():  # (else refuse_adapter would look it up as a Hub id)
        raise FileNotFoundError(f"{folder}: no such folder: pass {_DRAFT_FOLDERS}.")
    draft = _whole_draft(folder, "dspark push", dtype, saved_by=_DRAFT_FOLDERS)
    data = CardData(base_model=base_model, eval_results=read_json(eval_results),
                    calibration=folder_calibration(folder, calibration),
                    recipe=_recipe(recipe, folder), license=license)
    return push_to_hub(draft, repo_id, commit_message=commit_message, private=private, token=token,
                       revision=revision, card_data=data)


def export_draft(draft: str | Path, output: str | Path, base_model: str | None,
                 dtype: torch.dtype | str = torch.bfloat16, repo_id: str = "<your-repo/draft>",
                 eval_results: str | Path | dict | None = None, recipe: str | None = None,
                 calibration: str | Path | dict | None = None, license: str | None = None) -> Path:
    """Save the draft `draft` (a folder or Hub id) into the folder `output` for sharing (what `dspark export` runs):
    its weights in `dtype`, the code for ``trust_remote_code``, and a model card (README.md); returns `output`.

    base_model: the target's Hub id, which the saved config records as the target and the card links to (required).
    repo_id: where the draft will live, for the card's usage snippet. eval_results: the results.json of `dspark eval`
    (path or dict). recipe: markdown for the card's Training section. calibration: the calibration.json of
    `dspark calibrate`; default ``draft/calibration.json`` if present. license: the card's Hub licence id.
    `output` must be new, empty, or an earlier export; the links it holds are kept (the shipped draft's folder links
    its code files to the package's modules). Nothing is written unless the card renders.
    """
    from .. import defaults
    from ..files import check_output_folder
    from ..loading import _check_name

    _check_name(str(draft), "the draft")
    check_output_folder(output, "export", ours=("draft", "deepspec", "speculators"))
    model = _whole_draft(draft, "dspark export", dtype)  # first: a folder that holds no draft is what to say
    if not base_model:
        raise ValueError("--base-model is needed for the model card: the target's Hub id, e.g. "
                         "HuggingFaceTB/SmolLM2-135M-Instruct.")
    model.config.target_name_or_path = base_model  # not the path the target was trained from on some machine
    output = Path(output)
    shipped = output.resolve() == defaults.SHIPPED_DRAFT_DIR.resolve()  # the card of the draft the package ships
    # the card checks the result files against the draft: render it before anything is written
    card = render_model_card(model.config, base_model, repo_id, read_json(eval_results), recipe, license,
                             calibration=folder_calibration(draft, calibration), shipped=shipped)
    _save_beside_links(model, output)
    (output / README).write_text(card)
    return output


def _whole_draft(draft: str | Path, command: str, dtype: torch.dtype | str, *,
                 saved_by: str | None = None) -> DSparkDraftModel:
    """The draft `draft` (a folder or Hub id) in `dtype` for `command` to share, which a LoRA adapter is not (it would
    go out under a whole draft's card). With `saved_by` (what writes a draft folder, for the message), a folder
    without config.json is refused rather than left to transformers' vaguer error, but after the adapter check,
    whose message says how to merge one."""
    from ..loading import refuse_adapter

    refuse_adapter(str(draft), command)
    if saved_by is not None and not (Path(draft) / "config.json").is_file():
        raise FileNotFoundError(f"{draft} holds no saved draft (no config.json): pass {saved_by}.")
    return DSparkDraftModel.from_pretrained(draft).to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)


def _save_beside_links(draft, folder: Path) -> None:
    """save_pretrained into `folder` (without a card), keeping the links it holds: the package's own draft folder
    links its code files to the package's modules (so it loads with trust_remote_code and never drifts from them),
    and transformers would copy each module onto its own link."""
    links = [p.name for p in folder.iterdir() if p.is_symlink()] if folder.is_dir() else []
    # no card here: export_draft writes the one it rendered from the results, which would replace a default one
    if not links:
        draft.save_pretrained(folder, model_card=False)
        return
    with tempfile.TemporaryDirectory() as tmp:
        draft.save_pretrained(tmp, model_card=False)
        for written in Path(tmp).iterdir():
            if written.name not in links:
                shutil.move(str(written), folder / written.name)


def folder_calibration(folder: str | Path, calibration: str | Path | dict | None = None) -> dict | None:
    """The calibration report for a draft's card: `calibration` (a path or dict) if given, else the
    calibration.json that `dspark calibrate` wrote into `folder`, if any."""
    if calibration is None and (Path(folder) / "calibration.json").is_file():
        calibration = Path(folder) / "calibration.json"
    return read_json(calibration)


def read_json(value: str | Path | dict | None) -> dict | None:
    """A result file (`dspark eval`, `dspark calibrate`, ...) by path, or the dict itself; a ValueError names a file
    that is not JSON."""
    if value is None or isinstance(value, dict):
        return value
    try:
        return json.loads(Path(value).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{value} is not a JSON file ({error}).") from error


def _recipe(recipe: str | Path | None, folder: Path) -> str | None:
    if recipe is not None:
        return Path(recipe).read_text() if isinstance(recipe, Path) or _is_file(recipe) else recipe
    if (folder / "train_config.json").is_file():
        heldout = folder / "heldout.json"
        return training_recipe(read_json(folder / "train_config.json"),
                               read_json(heldout) if heldout.is_file() else None)
    return None


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:  # markdown too long to be a file name
        return False
