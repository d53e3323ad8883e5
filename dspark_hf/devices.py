"""Where models and tensors run: choosing the device, naming it, and reading the clock on it.

CUDA runs asynchronously: a wall-clock reading taken while kernels are still queued times their launch, not their
work, so every timing in dspark-hf reads [`clock`], which waits for it first.
"""

from __future__ import annotations

import platform
import time

import torch


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` (or None): the CUDA GPU when torch sees one, else the CPU; anything else as ``torch.device``.
    Raises ValueError, saying what to pass instead, for a device torch cannot use here."""
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={str(device)!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'.") from error
    if device.type not in ("cpu", "cuda"):  # what dspark-hf is built and tested for
        raise ValueError(f"device={str(device)!r} is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N'.")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but torch sees no CUDA GPU here (a CPU-only build, or no driver): "
                         "use 'cpu', or 'auto' to take a GPU only when there is one.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device={str(device)!r}, but torch sees {torch.cuda.device_count()} CUDA GPU(s): use an "
                         f"index below {torch.cuda.device_count()}.")
    if device.type == "cuda" and device.index is None:  # what model.device will report, so devices compare equal
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def clock(device: torch.device | str, stream: torch.cuda.Stream | None = None) -> float:
    """time.perf_counter() once the work queued on `device` is done (only that on `stream`, a CUDA stream of it,
    where given): differences of two readings time that work."""
    if stream is not None:
        stream.synchronize()
    else:
        synchronize(device)
    return time.perf_counter()
