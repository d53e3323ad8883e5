"""Sharing DSpark drafts on the Hugging Face Hub: a model card on every save, `push_to_hub`, `push_draft` (what
`dspark push` runs) and `export_draft` (what `dspark export` runs for the transformers format).

`DSparkDraftModel.save_pretrained` and `push_to_hub` hand over to [`save_pretrained`] and [`push_to_hub`] here
(and `from_pretrained` to [`offline_load_error`]) wherever this module is loaded, which `import dspark_hf` does: the
model looks it up by name (`dspark_hf.model.binding.sharing`); nothing sets it on the model. They live here, not in
model/, because the model's files are copied next to saved weights for ``trust_remote_code`` loading where dspark_hf
may not be installed: there it saves and pushes as plain transformers does (no card). The model never imports this
module; this module imports the model. Downloading needs nothing from us:
``DSparkDraftModel.from_pretrained(repo_id, revision=..., token=..., cache_dir=...)`` is transformers' own, with the
Hub cache, ``HF_HUB_OFFLINE=1`` and private repos.

transformers' own `push_to_hub` would replace our card with its generic one (it writes README.md after
`save_pretrained`), so ours saves into a temporary folder and commits exactly what `save_pretrained` wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from .cards import GENERATED_MARK, CardData, is_hub_model_id, render_card_data, render_model_card, training_recipe
from .model.modeling_dspark import DSparkDraftModel
from .options import option
from .version import __version__

README = "README.md"
DEFAULT_COMMIT_MESSAGE = "Upload DSpark draft"
# save_pretrained(push_to_hub=True, ...) arguments that belong to the push, not to the save
_PUSH_ARGS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")
# the folders `dspark push` takes, for its messages
_DRAFT_FOLDERS = "the --output-dir of `dspark train` or the --output of `dspark calibrate`"


def card_data_for(draft, card_data: CardData | dict | None = None) -> CardData:
    """`card_data` if given, else the draft's ``card_data`` attribute (set it once to feed every later save)."""
    return CardData.coerce(card_data if card_data is not None else getattr(draft, "card_data", None))


def write_model_card(draft, folder: str | Path, card_data: CardData | dict | None = None, *,
                     card: str | None = None) -> Path | None:
    """Write the rendered card (or `card`, the text already rendered) to ``folder/README.md`` and return its path,
    unless the folder holds a README.md that dspark-hf did not generate (one without the generated-card line): that
    one is kept and None returned."""
    readme = Path(folder) / README
    if readme.exists() and GENERATED_MARK not in readme.read_text(errors="replace"):
        return None
    readme.write_text(card if card is not None else render_card_data(draft.config, card_data_for(draft, card_data)))
    return readme


def connection_errors() -> tuple[type[BaseException], ...]:
    """The transport errors of the HTTP client huggingface_hub uses (httpx2, httpx or requests, by its version)."""
    import importlib

    found = []
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def unreachable_hub_error(error: BaseException) -> ConnectionError:
    """What to raise for a Hub call that failed in transport (`error`, one of [`connection_errors`])."""
    return ConnectionError(f"could not reach the Hub ({error}): check the network or HF_ENDPOINT (HF_HUB_OFFLINE=1 "
                           "loads from the local cache)")


@contextlib.contextmanager
def _reaching_the_hub():
    """Turn the HTTP client's bare transport error ("ConnectError [Errno -2]") into one that says what failed."""
    try:
        yield
    except connection_errors() as error:
        raise unreachable_hub_error(error) from error


@_reaching_the_hub()
def save_pretrained(draft, base_save, save_directory: str | Path, *args, model_card: bool = True,
                    card_data: CardData | dict | None = None, push_to_hub: bool = False, **kwargs):
    """`base_save` (transformers' `save_pretrained`), then the model card (see [`write_model_card`]); with
    ``push_to_hub=True`` the files this save wrote are then committed to ``repo_id`` (default: the folder's name),
    as in transformers but with our card."""
    folder = Path(save_directory)
    is_main_process = kwargs.get("is_main_process", args[0] if args else True)
    data = card_data_for(draft, card_data)
    if push_to_hub and is_main_process:
        push = {k: kwargs.pop(k) for k in _PUSH_ARGS if k in kwargs}
        data = dataclasses.replace(data, tags=[*data.tags, *(getattr(draft, "model_tags", None) or []),
                                               *push.pop("tags", [])])
        if model_card:
            _check_pushable(draft, data)  # before anything reaches the Hub
        api = _api()
        repo_id = api.create_repo(push.pop("repo_id", folder.name), private=push.pop("private", None),
                                  token=kwargs.get("token"), exist_ok=True).repo_id
        data = dataclasses.replace(data, repo_id=data.repo_id or repo_id)
        before = _timestamps(folder)
    # rendering checks the result files against the draft: refused, it must leave the folder as it was
    card = render_card_data(draft.config, data) if model_card and is_main_process else None
    with _target_recorded_as(draft, data.base_model if push_to_hub else None):
        if not is_main_process:
            return base_save(save_directory, *args, **kwargs)
        result = _saved_whole(base_save, folder, *args, **kwargs)
    if model_card and write_model_card(draft, folder, card=card) is None and card_data is not None:
        warnings.warn(f"{folder / README} was not generated by dspark-hf and is kept: card_data was not used. "
                      "Delete it to get a generated card.", stacklevel=3)
    if push_to_hub:
        changed = [p for p in sorted(folder.rglob("*")) if p.is_file() and before.get(p) != p.stat().st_mtime_ns]
        return _commit(api, folder, changed, repo_id, token=kwargs.get("token"), **push)
    return result


def _saved_whole(base_save, folder: Path, *args, **kwargs):
    """`base_save` into a new folder beside `folder`, whose files are then moved into `folder`: a save that fails
    (out of disk space, over a file-size limit) leaves `folder` as it was, not with a config and no weights."""
    from safetensors import SafetensorError

    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=folder.parent))
    try:
        try:
            result = base_save(partial, *args, **kwargs)
        except (OSError, SafetensorError) as error:
            said = " ".join(str(error).split())[:200]
            raise OSError(f"could not save the draft to {folder} ({type(error).__name__}: {said}): is the disk full, "
                          f"or a file-size limit lower than the weights? Nothing was written to {folder}.") from error
        written = {p.relative_to(partial) for p in partial.rglob("*") if p.is_file()}
        folder.mkdir(exist_ok=True)
        for stale in folder.glob("model*.safetensors*"):  # shards of an earlier save, as transformers removes them
            if stale.relative_to(folder) not in written:
                stale.unlink()
        for name in sorted(written, key=lambda n: n.name == "config.json"):  # the config last: it names the weights
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (partial / name).replace(folder / name)
        return result
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@_reaching_the_hub()
def push_to_hub(draft, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                private: bool | None = None, token: bool | str | None = None, revision: str | None = None,
                create_pr: bool = False, max_shard_size: int | str = "50GB", tags: list[str] | None = None,
                model_card: bool = True, card_data: CardData | dict | None = None):
    """Commit the draft (weights, config, the code for ``trust_remote_code``) and its card to `repo_id`.

    Arguments are transformers' `push_to_hub` ones: the repo is created if missing (`private` applies then),
    `revision` is a branch (created from main if missing), `token` as in huggingface_hub. With
    ``model_card=False`` no README.md is sent, so a card already on the Hub stays; so does, with a warning, a README.md
    at `revision` that dspark-hf did not generate (one without the generated-card line). Returns the
    `huggingface_hub.CommitInfo` (``.oid`` is the new commit's hash, usable as ``revision=`` to load it).
    """
    data = card_data_for(draft, card_data)
    data = dataclasses.replace(data, tags=[*data.tags, *(getattr(draft, "model_tags", None) or []), *(tags or [])])
    if model_card:
        _check_pushable(draft, data)  # before anything reaches the Hub
    api = _api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    data = dataclasses.replace(data, repo_id=data.repo_id or repo_id)
    with tempfile.TemporaryDirectory() as tmp, _target_recorded_as(draft, data.base_model):
        draft.save_pretrained(tmp, max_shard_size=max_shard_size, model_card=model_card, card_data=data)
        files = sorted(p for p in Path(tmp).rglob("*") if p.is_file())
        return _commit(api, Path(tmp), files, repo_id, token=token, revision=revision, create_pr=create_pr,
                       commit_message=commit_message, commit_description=commit_description)


# -- flags of the commands that write a card (`dspark export`, `dspark push`) -------------------------------------
def card_results_option():
    """`--eval`: the results the card shows."""
    return option(None, "results.json from `dspark eval`, for the card's results")


def card_license_option():
    """`--license`: the card's licence."""
    return option(None, "the card's Hub licence id, e.g. apache-2.0 (default: none; a draft learns from its target's "
                        "outputs, so check the target's terms)")


def weights_dtype_option(written: str):
    """`--dtype` of the weights a command writes (`written`: "exported", "pushed")."""
    return option("bfloat16", f"dtype of the {written} weights", choices=["bfloat16", "float16", "float32"])


@dataclasses.dataclass
class PushOptions:
    """What `dspark push` sends ([`push_draft`]), and where."""

    base_model: str | None = option(None, "the target's hub id (default: the one the draft records, if a hub id); "
                                    "the pushed config records it as the target")
    dtype: str = weights_dtype_option("pushed")
    eval: str | None = card_results_option()
    calibration: str | None = option(None, "calibration.json from `dspark calibrate` (default: "
                                     "DRAFT/calibration.json)")
    recipe: str | None = option(None, "markdown file with the training recipe (default: from DRAFT/train_config.json)")
    license: str | None = card_license_option()
    private: bool = option(False, "create the repository as private")
    token: str | None = option(None, "Hub token (default: the stored login or HF_TOKEN)")
    revision: str | None = option(None, "branch to push to (created if missing)")
    commit_message: str | None = option(None, "the Hub commit's message (default: one naming the draft)")


@dataclasses.dataclass
class ExportOptions:
    """How `dspark export` saves a draft for sharing, and what its card says."""

    output: str = option(help="folder to write the exported draft to (new or empty, or an earlier export)")
    dtype: str = weights_dtype_option("exported")
    format: str = option("transformers", "transformers: a DSparkDraftModel folder with a model card; deepspec: "
                         "DeepSpec's Qwen3DSparkModel layout (vLLM, SGLang, llama.cpp; full vocabulary only); "
                         "speculators: speculators' dspark layout (vLLM, llama.cpp; a reduced vocabulary too); "
                         "both engine layouts need --target", choices=["transformers", "deepspec", "speculators"])
    target: str | None = option(None, "the target's path or hub id (--format deepspec or speculators)")
    base_model: str | None = option(None, "hub id of the target, for the card (--format transformers)")
    repo_id: str = option("<your-repo/draft>", "where the draft will live, for the card")
    eval: str | None = card_results_option()
    calibration: str | None = option(None, "calibration.json from `dspark calibrate`, for the card (default: "
                                     "DRAFT/calibration.json if present)")
    recipe: str | None = option(None, "a markdown file describing the training recipe, for the card")
    license: str | None = card_license_option()


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
    from . import defaults
    from .files import check_output_folder
    from .loading import _check_name

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
    from .loading import refuse_adapter

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


def offline_load_error(name_or_path, kwargs: dict) -> OSError | None:
    """For a failed `from_pretrained(name_or_path, **kwargs)`: the error to raise instead when offline mode or
    ``local_files_only=True`` forbids downloading and `name_or_path` is a Hub id whose config or weights are not
    cached (transformers' own says it could not connect, or that the repo has no weights file), else None."""
    from huggingface_hub import constants, is_offline_mode, try_to_load_from_cache

    causes = [cause for cause, on in (("HF_HUB_OFFLINE=1", is_offline_mode()),
                                      ("local_files_only=True", kwargs.get("local_files_only"))) if on]
    if not causes or Path(name_or_path).exists() or not is_hub_model_id(str(name_or_path)):
        return None
    cache, revision = kwargs.get("cache_dir") or constants.HF_HUB_CACHE, kwargs.get("revision")

    # the files transformers asks for: under `subfolder`, and weights named after `variant` (model.v.safetensors)
    folder = f"{kwargs['subfolder']}/" if kwargs.get("subfolder") else ""
    variant = f".{kwargs['variant']}" if kwargs.get("variant") else ""
    config, weights, index = (f"{folder}config.json", f"{folder}model{variant}.safetensors",
                              f"{folder}model.safetensors.index{variant}.json")

    def cached(filename: str) -> bool:
        return isinstance(try_to_load_from_cache(str(name_or_path), filename, cache, revision), str)

    if not cached(config):
        state = "is not in"
    elif not (cached(weights) or cached(index)):
        state = f"has its {config} but not its weights ({weights}) in"
    else:
        return None  # the draft is cached: transformers' error is about something else
    fixes = {"HF_HUB_OFFLINE=1": "unset HF_HUB_OFFLINE", "local_files_only=True": "drop local_files_only=True"}
    return OSError(f"{name_or_path} (revision {revision or 'main'}) {state} the Hugging Face cache at {cache}, and "
                   f"{' and '.join(causes)} forbid{'s' if len(causes) == 1 else ''} downloading it. Load it once with "
                   "network access (it is then cached), pass the cache_dir that holds it, or "
                   f"{' and '.join(fixes[c] for c in causes)}.")


# ---------------------------------------------------------------------------------------------------------------
def _api():
    from huggingface_hub import HfApi

    return HfApi(library_name="dspark-hf", library_version=__version__)


def _check_pushable(draft, data: CardData) -> None:
    """A card on the Hub needs the target's hub id (its `base_model` links the draft to the target), and results
    that belong to this draft (rendering checks them)."""
    base = data.base_model or draft.config.target_name_or_path
    if not is_hub_model_id(base):
        where = f"recorded as {base!r}, which is not a Hub id" if base else "not recorded in the draft's config"
        raise ValueError(f"The card's base_model (the target's Hub id) is {where}. Pass it: "
                         "card_data={'base_model': 'ORG/NAME'} (`dspark push --base-model ORG/NAME`), or push "
                         "without a card (model_card=False).")
    render_card_data(draft.config, data)


@contextlib.contextmanager
def _target_recorded_as(draft, base_model: str | None):
    """The config records `base_model` as the target while it is saved: what goes to the Hub names the target's Hub
    id given for the card, not the local path the draft was trained from (the draft itself is left unchanged)."""
    recorded = draft.config.target_name_or_path
    if base_model is not None:
        draft.config.target_name_or_path = base_model
    try:
        yield
    finally:
        draft.config.target_name_or_path = recorded


def _commit(api, folder: Path, files: list[Path], repo_id: str, *, token=None, revision: str | None = None,
            create_pr: bool = False, commit_message: str | None = None, commit_description: str | None = None):
    from huggingface_hub import CommitOperationAdd

    if revision is not None and not revision.startswith("refs/pr/"):
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    card = folder / README
    # the card tells its author to delete the generated-card line to keep their edits: a card edited on the Hub is
    # kept as save_pretrained keeps one edited in the folder
    if card in files and GENERATED_MARK in card.read_text(errors="replace"):
        on_hub = _hub_readme(api, repo_id, revision, token)
        if on_hub is not None and GENERATED_MARK not in on_hub:
            files = [p for p in files if p != card]
            warnings.warn(f"README.md of {repo_id} (revision {revision or 'main'}) on the Hub was not generated by "
                          "dspark-hf and is kept: the generated card was not pushed. Delete it on the Hub to get a "
                          "generated card.", stacklevel=4)
    operations = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
                  for p in files]
    return api.create_commit(repo_id, operations, commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
                             commit_description=commit_description, token=token, revision=revision,
                             create_pr=create_pr)


def _hub_readme(api, repo_id: str, revision: str | None, token) -> str | None:
    """The README.md of `repo_id` at `revision` on the Hub, or None when there is none."""
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = api.hf_hub_download(repo_id, README, revision=revision, token=token, cache_dir=tmp)
        except (RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError):
            return None
        return Path(path).read_text(errors="replace")


def _timestamps(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else {}


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

