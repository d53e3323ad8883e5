"""Command-line flags generated from dataclasses, PEFT style.

A field made by [`option`] is a setting and its flag at once: its default, its help, and how argparse reads it
(add_argument's keywords) live in one place, in the dataclass beside the code it configures. `dspark`'s parser adds
each command's dataclasses with [`add_config_flags`] and reads them back with [`config_from`].
"""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, Field, field, fields
from typing import Any


def option(default: Any = MISSING, help: str = "", **parsing) -> Any:
    """A dataclass field that is also a flag: `default` (none: a required flag; a list is copied for each instance),
    its `help`, and add_argument's keywords for it (`type`, `choices`, `metavar`, `action`, ...; `flag`: a name
    other than ``--field-name``)."""
    metadata = {"help": help, **parsing}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), kw_only=True, metadata=metadata)
    return field(default=default, kw_only=True, metadata=metadata)


def add_config_flags(parser, config_class, skip=(), only=None, show_defaults: bool = False) -> None:
    """One flag per field of the dataclass `config_class` (those of `only` if given, less those of `skip`), as the
    field says: see [`flag_keywords`]. show_defaults: end each help with the field's default."""
    for f in fields(config_class):
        if f.name not in skip and (only is None or f.name in only):
            parser.add_argument(f.metadata.get("flag", "--" + f.name.replace("_", "-")),
                                **flag_keywords(f, show_defaults))


def flag_keywords(f: Field, show_defaults: bool = False) -> dict:
    """add_argument's keywords for the field `f`: a field without a default is a required flag, a bool one a switch,
    a list one takes one value or more (or one per use, with ``action="append"``), and an int or float one is read
    as such; its metadata's keywords (all but `help` and `flag`) come last and win."""
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    kind = str(f.type).split(" | ")[0]  # the annotation as written: the dataclasses' modules postpone annotations
    keywords = {"dest": f.name, "help": f.metadata.get("help", "").replace("%", "%%")}
    if default is MISSING:
        keywords["required"] = True
    elif kind == "bool":  # a switch: --name, or for a setting on by default --name / --no-name
        return {**keywords, "action": "store_true"} if not default else \
            {**keywords, "action": argparse.BooleanOptionalAction, "default": True}
    else:
        keywords["default"] = default
        if show_defaults and default is not None:
            keywords["help"] += f" (default: {default})"
    if kind.startswith("list["):
        kind = kind[5:-1]
        if f.metadata.get("action") != "append":
            keywords["nargs"] = "+"
    if kind in _TYPES:
        keywords["type"] = _TYPES[kind]
    return {**keywords, **{k: v for k, v in f.metadata.items() if k not in ("help", "flag")}}


_TYPES = {"int": int, "float": float}  # a str field takes argparse's own strings


def config_values(args, config_class, skip=()) -> dict:
    """The fields of `config_class` that the parsed `args` hold (a flag a command lacks leaves its field's default)."""
    return {f.name: getattr(args, f.name) for f in fields(config_class)
            if f.name not in skip and hasattr(args, f.name)}


def config_from(args, config_class):
    """A `config_class` as the parsed `args` set it ([`config_values`])."""
    return config_class(**config_values(args, config_class))


def whole_at_least(low: int):
    """argparse type: an int >= low (argparse turns the refusal into one line naming the flag)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"give a whole number >= {low}, got {text}")
        return value
    parse.__name__ = "whole number"  # argparse's word for a value that is not one at all
    return parse


def real_in(low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False):
    """argparse type: a finite float in [low, high] (either end open)."""
    def parse(text: str) -> float:
        value = float(text)
        inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
        if not (math.isfinite(value) and inside):
            span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"
            raise argparse.ArgumentTypeError(f"give a finite number in {span}, got {text}")
        return value
    parse.__name__ = "number"
    return parse


POSITIVE, COUNT = whole_at_least(1), whole_at_least(0)
TEMPERATURE = real_in(0.0)  # 0: greedy
SHARE = real_in(0.0, 1.0)
NONZERO_SHARE = real_in(0.0, 1.0, low_open=True)
MINUTES = real_in(0.0, low_open=True)


# -- flags several commands share, each with its own default ---------------------------------------------------------
def max_new_tokens_option(default: int) -> Any:
    """`--max-new-tokens`: a generation's length."""
    return option(default, "new tokens per prompt (as generate()'s max_new_tokens)", type=POSITIVE)


def max_prompt_tokens_option(default: int) -> Any:
    """`--max-prompt-tokens`: the longest prompt a training data command keeps."""
    return option(default, "skip prompts longer than this many tokens with the chat template", type=POSITIVE)


def repeats_option(default: int) -> Any:
    """`--repeats`: a measurement's timed runs."""
    return option(default, "timed runs of each setting; the median is reported", type=POSITIVE)


def report_option(default: str) -> Any:
    """`--output` of a command that writes a JSON report."""
    return option(default, "JSON report to write")


def batch_sizes_option(default: list[int]) -> Any:
    """`--batch-sizes` of a benchmark that measures several concurrencies."""
    return option(default, "concurrent requests (rows) to measure", type=POSITIVE)


def plan_profile_option() -> Any:
    """`--profile` of a benchmark whose policies plan against measured costs."""
    return option(None, "a `dspark profile` JSON for auto, scheduled and async to plan against")

