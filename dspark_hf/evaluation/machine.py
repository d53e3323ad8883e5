"""A description of the machine a figure was measured on."""

from __future__ import annotations

import datetime
import os
import platform

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(model=None, draft=None) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if model is not None:
        info["device"] = str(model.device)
        info["dtype"] = str(model.dtype).replace("torch.", "")
    if draft is not None:
        info["draft_dtype"] = str(draft.dtype).replace("torch.", "")
    return info


def describe(info: dict) -> str:
    where = info["gpu"] or f"{info['cpu']}, {info['torch_threads']} threads"
    dtype = info.get("dtype", "?")
    if info.get("draft_dtype", dtype) != dtype:
        dtype = f"{dtype} (draft {info['draft_dtype']})"
    return f"{where}, {dtype}, torch {info['torch']}, {info['date']}"
