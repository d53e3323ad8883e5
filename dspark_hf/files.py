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
