"""Verification policies by name, as the benchmarks and the CLI take them."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .auto import AutoScheduled
from .policies import FixedLength, FullBlock, Policy
from .scheduler import AsyncScheduled, Scheduled, ThresholdPolicy

POLICY_NAMES = ("auto", "full block", "fixed N", "threshold T", "scheduled", "async")


def named_policy(name: str, profile: str | None = None) -> Callable[[], Policy]:
    """A factory of fresh policies (they keep per-call state) for `name`: "auto" (the default, planning against
    `profile` when given, else this machine's cached costs), "full block", "fixed N", "threshold T", "scheduled" or
    "async" (Algorithm 1 against a `dspark profile` file, synchronous or two rounds behind; they need `profile`)."""
    kind, _, value = name.partition(" ")
    if profile is not None and not Path(profile).is_file():  # the factories read it later, after models load
        raise ValueError(f"--profile {profile}: no such file; make one with `dspark profile --output {profile}`.")
    if name == "auto":
        return lambda: AutoScheduled(profile=profile)
    if name == "full block":
        return FullBlock
    if kind in ("fixed", "threshold") and value:
        try:
            number = int(value) if kind == "fixed" else float(value)
        except ValueError:
            number = None
        if number is not None:
            make = (lambda: FixedLength(number)) if kind == "fixed" else (lambda: ThresholdPolicy(number))
            try:  # found now, not after the models load and a baseline is timed
                make()
            except ValueError as error:
                raise ValueError(f"--policy {name!r}: {error}") from None
            return make
    if name in ("scheduled", "async"):
        if profile is None:
            raise ValueError(f"the {name} policy plans against a profile: pass --profile FILE from `dspark profile`.")
        return lambda: (Scheduled if name == "scheduled" else AsyncScheduled).from_profile(profile)
    raise ValueError(f"unknown verification policy {name!r}: choose from {', '.join(POLICY_NAMES)} (e.g. 'fixed 2', "
                     "'threshold 0.5').")
