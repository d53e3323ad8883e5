"""Writing result files whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0o022)  # read once (os.umask only sets it): mkstemp makes private files, results are not
os.umask(_UMASK)


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, renamed over it: a reader (or a later run after an
    interruption) sees the earlier file or the new one, never half of one. The file gets the user's usual mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(partial, 0o666 & ~_UMASK)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def written_by_dspark(folder: str | Path) -> str | None:
    """What dspark-hf wrote in `folder`, judged by its config.json: "draft" (a DSparkDraftModel checkpoint),
    "deepspec" (a DeepSpec-layout export, marked dspark_hf_export), or None (anything else, or nothing)."""
    import json

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(config, dict):
        return None
    if "dspark_hf_export" in config:
        return "deepspec"
    # SpecForge's early DSparkConfig also says model_type "dspark"; its settings sit in a dflash_config we never write
    if config.get("model_type") == "dspark" and "dflash_config" not in config:
        return "draft"
    return None


def check_output_folder(path: str | Path, what: str, ours: tuple[str, ...]) -> None:
    """Refuse to write `what` into `path` unless it is a new or empty folder, or holds an earlier output of dspark-hf
    of a kind in `ours` (see [`written_by_dspark`]) whose README.md, if any, dspark-hf generated: writing replaces
    its files, and a downloaded checkpoint or a card someone wrote must not be lost that way."""
    from .cards import GENERATED_MARK

    folder = Path(path)
    if folder.is_file():
        raise ValueError(f"The output folder {path} is a file: give a folder.")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    card = folder / "README.md"
    if written_by_dspark(folder) not in ours or (card.is_file() and GENERATED_MARK not in card.read_text()):
        raise ValueError(f"The output folder {path} already holds files that are not an earlier {what} (another "
                         "model or checkpoint, or a README.md you wrote), which writing would replace: give a new or "
                         "empty folder.")
