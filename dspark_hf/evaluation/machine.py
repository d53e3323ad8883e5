"""What a figure was measured on and with: the machine, the software, the code and the command.

Every result file carries this under "machine", so that a figure can be traced back to the run that made it without
anything written down beside the file.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

import torch

from ..devices import cpu_model

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def code_version(folder: Path = PACKAGE_DIR) -> str | None:
    """`git describe --always --dirty` of the checkout the package runs from; None where it is not one (an installed
    wheel, no git). Never raises: a result is worth more than its provenance."""
    def git(*args):
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        # a wheel installed inside some other repository (a virtual environment in a project) is not that project
        if Path(git("rev-parse", "--show-toplevel")).resolve() != folder.parent:
            return None
        return git("describe", "--always", "--dirty")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(model=None, draft=None) -> dict:
    """The machine, software and code of a run; with `model` (the target) and `draft`, their names, device and dtype.
    "command" is None here: the command line fills it in (a call from Python has none)."""
    import transformers

    now = datetime.datetime.now(datetime.timezone.utc)
    on_gpu = model is not None and model.device.type == "cuda"
    info = {
        "date": now.strftime("%Y-%m-%d"),  # what describe() and older readers print
        "time": now.isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "code": code_version(),
        "command": None,
        # the GPU the models ran on, not merely one the machine has: a --device cpu run on a GPU box is a CPU figure
        "gpu": torch.cuda.get_device_name(model.device) if on_gpu else None,
    }
    if model is not None:
        info["target"] = getattr(model.config, "_name_or_path", None) or None
        info["device"] = str(model.device)
        info["dtype"] = str(model.dtype).replace("torch.", "")
    if draft is not None:
        info["draft"] = getattr(draft.config, "_name_or_path", None) or None
        info["draft_dtype"] = str(draft.dtype).replace("torch.", "")
    return info


def describe(info: dict) -> str:
    where = info["gpu"] or f"{info['cpu']}, {info['torch_threads']} threads"
    dtype = info.get("dtype", "?")
    if info.get("draft_dtype", dtype) != dtype:
        dtype = f"{dtype} (draft {info['draft_dtype']})"
    return f"{where}, {dtype}, torch {info['torch']}, {info['date']}"
