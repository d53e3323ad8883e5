"""What a draft's `save_pretrained`, `push_to_hub` and `from_pretrained` hand over to (see the package): a model card
on every save, `push_to_hub` that commits exactly what was saved, and a clear error for a draft an offline load
cannot find.

transformers' own `push_to_hub` would replace our card with its generic one (it writes README.md after
`save_pretrained`), so ours saves into a temporary folder and commits exactly what `save_pretrained` wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import warnings
from pathlib import Path

from ..cards import GENERATED_MARK, CardData, is_hub_model_id, render_card_data
from ..version import __version__

README = "README.md"
DEFAULT_COMMIT_MESSAGE = "Upload DSpark draft"
# transformers' push_to_hub arguments that save_pretrained(push_to_hub=True) passes on
_PUSH_ARGS = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")


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
