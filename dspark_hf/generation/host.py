"""What the host learns from the device each round, in one transfer.

On a GPU every read of a device value (`.item()`, `.tolist()`, `bool(t)`, a boolean index, `.cpu()`) waits for all
the work queued before it: the device idles while Python catches up, once per read. A round needs a few values on
the host (how many tokens each row accepted and committed, where a row stopped, the next block's confidences,
whether the draft stayed finite), so [`HostRead`] packs them into one tensor, moves it once and hands them back as
Python numbers. Values go the other way with [`to_device`], which never waits.

The state the host decides on (each row's end in the decoding state, its output length, where it stopped) lives
on the device, and the host keeps a copy of it: a [`Mirrored`] state object adds its device values to the round's
read (`ask`) and takes its copy from what the read found (`mirror`), so that the copy is the device's, never a
second formula beside it.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class HostRead:
    """Device tensors gathered under names and read in one transfer: `add` them, then `read()` once."""

    def __init__(self):
        self._parts: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str, tensor: torch.Tensor | None) -> "HostRead":
        """Read `tensor` (integers below 2^53, booleans or floats, any shape) as `name`; None reads as None."""
        self._parts.append((name, tensor))
        return self

    def read(self) -> dict:
        """name -> the tensor's values as (nested) Python lists of ints, bools or floats, read in one transfer."""
        tensors = [t for _, t in self._parts if t is not None]
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).tolist() if tensors else []
        out, at = {}, 0
        for name, t in self._parts:
            if t is None:
                out[name] = None
                continue
            values = flat[at: at + t.numel()]
            at += t.numel()
            cast = bool if t.dtype == torch.bool else float if t.is_floating_point() else int
            out[name] = _shaped([cast(v) for v in values], list(t.shape))
        return out


class Mirrored(Protocol):
    """Device state the host keeps a copy of, learnt only from the round's one read."""

    def ask(self, read: "HostRead") -> "HostRead":
        """Add the device values the copy mirrors to `read` (and return it)."""

    def mirror(self, values: dict) -> None:
        """Take the host's copy from the values `read()` found."""


def _shaped(values: list, shape: list[int]):
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = math.prod(shape[1:])
    return [_shaped(values[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (nested lists of numbers) as a tensor on `device`, copied without waiting for the device (from
    pinned memory on a GPU)."""
    tensor = torch.tensor(values, dtype=dtype, device="cpu")
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
